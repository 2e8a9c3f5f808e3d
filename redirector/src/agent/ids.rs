//! Listener ids that survive restarts: a listener keeps the id (and with it the operator's mode,
//! its pool, its socket counts) of the pinned listener of the same name; new listeners take the
//! lowest free ids; pinned listeners no longer configured give theirs back.

use std::collections::HashSet;

use redirector_common::listener::MAX_LISTENERS;

/// The id of each configured listener (in configuration order), and the ids of pinned listeners
/// that are no longer configured.
#[must_use]
pub fn assign(configured: &[&str], pinned: &[(u32, String)]) -> (Vec<u32>, Vec<u32>) {
    let mut ids: Vec<Option<u32>> = configured
        .iter()
        .map(|name| {
            pinned
                .iter()
                .find(|(_, pinned_name)| pinned_name == name)
                .map(|(id, _)| *id)
        })
        .collect();
    let removed: Vec<u32> = pinned
        .iter()
        .filter(|(_, name)| !configured.contains(&name.as_str()))
        .map(|(id, _)| *id)
        .collect();
    // Ids of removed listeners are reused last, so their leftovers meet a new listener only when
    // nothing else is free.
    let taken: HashSet<u32> = ids.iter().flatten().copied().collect();
    let mut free = (0..MAX_LISTENERS as u32)
        .filter(|id| !taken.contains(id) && !removed.contains(id))
        .chain(removed.iter().copied());
    for id in ids.iter_mut().filter(|id| id.is_none()) {
        // The configuration holds at most MAX_LISTENERS listeners, so a free id always exists.
        *id = free.next();
    }
    (
        ids.into_iter().map(Option::unwrap_or_default).collect(),
        removed,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pinned(entries: &[(u32, &str)]) -> Vec<(u32, String)> {
        entries
            .iter()
            .map(|(id, name)| (*id, (*name).to_owned()))
            .collect()
    }

    #[test]
    fn a_first_start_numbers_in_order() {
        assert_eq!(assign(&["node", "cluster"], &[]), (vec![0, 1], vec![]));
    }

    #[test]
    fn known_names_keep_their_ids_whatever_the_order() {
        let (ids, removed) = assign(
            &["cluster", "node"],
            &pinned(&[(0, "node"), (1, "cluster")]),
        );
        assert_eq!(ids, vec![1, 0]);
        assert!(removed.is_empty());
    }

    #[test]
    fn new_listeners_take_free_ids_and_removed_ones_are_reported() {
        let (ids, removed) = assign(&["node", "v6"], &pinned(&[(0, "node"), (1, "cluster")]));
        // `cluster` is gone; `v6` takes an id nobody used rather than its leftovers.
        assert_eq!(ids, vec![0, 2]);
        assert_eq!(removed, vec![1]);
    }
}
