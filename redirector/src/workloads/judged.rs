//! Which counted cgroups a change of the exempt set concerns. The programs judge a cgroup's
//! exemption once, when they enter it in `WORKLOADS`, from its own and its ancestors' entries in
//! `WORKLOAD_EXEMPT`; a changed entry concerns that cgroup and every cgroup below it, and only
//! those are forgotten to be judged again: the others keep their counts and rate stamps.

use super::Resolver;

/// The cgroups of `counted` that the exempt entries `changed` concern: each changed cgroup, and
/// the counted cgroups below one (by their paths in the hierarchy). Without the hierarchy
/// (`resolver` `None`) no path says what is below what, and every counted cgroup is.
pub fn concerned(changed: &[u64], counted: &[u64], resolver: Option<&mut Resolver>) -> Vec<u64> {
    if changed.is_empty() {
        return Vec::new();
    }
    let Some(resolver) = resolver else {
        return counted.to_vec();
    };
    // A changed cgroup that is gone has no path: only its own entry concerns it (its
    // descendants went with it).
    let prefixes: Vec<String> = changed
        .iter()
        .filter_map(|id| resolver.describe(*id).cgroup_path)
        .map(|path| format!("{}/", path.trim_end_matches('/')))
        .collect();
    counted
        .iter()
        .copied()
        .filter(|id| {
            changed.contains(id)
                || resolver.describe(*id).cgroup_path.is_some_and(|path| {
                    prefixes
                        .iter()
                        .any(|prefix| path.starts_with(prefix.as_str()))
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::workloads::cgroups::{CgroupNames, ScanLimits, scratch::Tree};

    fn resolver(tree: &Tree) -> Resolver {
        Resolver::new(
            CgroupNames::new(tree.root(), ScanLimits::default(), Duration::ZERO),
            None,
        )
    }

    #[test]
    fn a_change_concerns_its_cgroup_and_those_below_it_only() {
        let tree = Tree::new("judged-below");
        let exempt = tree.add("system.slice/monitoring.service");
        let below = tree.add("system.slice/monitoring.service/worker");
        let sibling = tree.add("system.slice/monitoring.service-old");
        let pod = tree.add("kubepods.slice/kubepods-pod1.slice/cri-containerd-a.scope");
        let counted = [exempt, below, sibling, pod];
        let mut resolver = resolver(&tree);
        let mut concerned = concerned(&[exempt], &counted, Some(&mut resolver));
        concerned.sort_unstable();
        let mut expected = vec![exempt, below];
        expected.sort_unstable();
        assert_eq!(
            concerned, expected,
            "a sibling whose name begins alike is not below"
        );
    }

    #[test]
    fn a_gone_cgroup_concerns_its_own_entry_and_nothing_unchanged_concerns_any() {
        let tree = Tree::new("judged-gone");
        let pod = tree.add("kubepods.slice/kubepods-pod1.slice/cri-containerd-a.scope");
        let gone = u64::MAX - 1;
        let mut resolver = resolver(&tree);
        assert_eq!(
            concerned(&[gone], &[gone, pod], Some(&mut resolver)),
            vec![gone]
        );
        assert!(concerned(&[], &[pod], Some(&mut resolver)).is_empty());
    }

    #[test]
    fn without_the_hierarchy_every_counted_cgroup_is_concerned() {
        assert_eq!(concerned(&[7], &[1, 2, 3], None), vec![1, 2, 3]);
    }
}
