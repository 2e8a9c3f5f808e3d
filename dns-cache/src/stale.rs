//! Serve-stale (RFC 8767): the last good answer to each question, kept `stale_for` past its
//! expiry, for when every upstream fails. hickory-resolver's cache forgets an answer when it
//! expires, so this is ours. Bounded by `max_entries`: a full store forgets the answer that
//! expires first.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use hickory_proto::{
    op::ResponseCode,
    rr::{LowerName, Record, RecordType},
};

/// The TTL of every record of a stale answer (RFC 8767 section 4 suggests 30 seconds).
pub(crate) const STALE_TTL: u32 = 30;

/// An answer as it goes to a client: its code and records.
#[derive(Clone, Debug)]
pub(crate) struct Answer {
    /// NOERROR, or NXDOMAIN.
    pub(crate) code: ResponseCode,
    /// The answer section.
    pub(crate) answers: Vec<Record>,
    /// The authority section (the SOA of a negative answer).
    pub(crate) authority: Vec<Record>,
}

/// A question: the name (any case) and the type.
type Key = (LowerName, RecordType);

#[derive(Debug)]
struct Entry {
    answer: Answer,
    /// When the answer's TTL ran out.
    expires: Instant,
    /// Its place in [`StaleAnswers::by_expiry`].
    sequence: u64,
}

/// The store.
#[derive(Debug)]
pub(crate) struct StaleAnswers {
    stale_for: Duration,
    capacity: usize,
    entries: HashMap<Key, Entry>,
    /// Every entry by (expiry, insertion sequence): the first is the first to go.
    by_expiry: BTreeMap<(Instant, u64), Key>,
    next_sequence: u64,
}

impl StaleAnswers {
    /// An empty store for answers served up to `stale_for` after expiry, at most `capacity`.
    pub(crate) fn new(stale_for: Duration, capacity: usize) -> Self {
        Self {
            stale_for,
            capacity,
            entries: HashMap::new(),
            by_expiry: BTreeMap::new(),
            next_sequence: 0,
        }
    }

    /// Keeps `answer` to `key`, which expires at `expires`, in place of an older one.
    pub(crate) fn remember(&mut self, key: Key, answer: Answer, expires: Instant, now: Instant) {
        if self.stale_for.is_zero() || self.capacity == 0 {
            return;
        }
        // A hit in the resolver's cache brings the answer already kept.
        if self
            .entries
            .get(&key)
            .is_some_and(|entry| entry.expires == expires)
        {
            return;
        }
        self.forget(&key);
        self.purge(now);
        while self.entries.len() >= self.capacity {
            let Some((_, first)) = self.by_expiry.pop_first() else {
                break;
            };
            self.entries.remove(&first);
        }
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        self.by_expiry.insert((expires, sequence), key.clone());
        self.entries.insert(
            key,
            Entry {
                answer,
                expires,
                sequence,
            },
        );
    }

    /// The answer to `key` with every TTL at [`STALE_TTL`], if it expired less than `stale_for`
    /// before `now` (or has not expired: the resolver's cache may have made room).
    pub(crate) fn get(&self, key: &Key, now: Instant) -> Option<Answer> {
        let entry = self.entries.get(key)?;
        if now >= entry.expires + self.stale_for {
            return None;
        }
        let mut answer = entry.answer.clone();
        for record in answer.answers.iter_mut().chain(&mut answer.authority) {
            record.set_ttl(STALE_TTL);
        }
        Some(answer)
    }

    /// How many answers are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    fn forget(&mut self, key: &Key) {
        if let Some(entry) = self.entries.remove(key) {
            self.by_expiry.remove(&(entry.expires, entry.sequence));
        }
    }

    /// Drops the answers too old to serve even stale.
    fn purge(&mut self, now: Instant) {
        while let Some(entry) = self.by_expiry.first_entry() {
            if now < entry.key().0 + self.stale_for {
                break;
            }
            let key = entry.remove();
            self.entries.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use hickory_proto::rr::{Name, RData, rdata::A};

    use super::*;

    fn key(name: &str) -> Key {
        (
            LowerName::new(&Name::from_ascii(name).expect("a name")),
            RecordType::A,
        )
    }

    fn answer(ttl: u32) -> Answer {
        Answer {
            code: ResponseCode::NoError,
            answers: vec![Record::from_rdata(
                Name::from_ascii("a.example.").expect("a name"),
                ttl,
                RData::A(A(Ipv4Addr::new(192, 0, 2, 1))),
            )],
            authority: Vec::new(),
        }
    }

    #[test]
    fn served_with_the_stale_ttl_until_stale_for_has_passed() {
        let now = Instant::now();
        let mut store = StaleAnswers::new(Duration::from_secs(30), 10);
        store.remember(key("a.example."), answer(300), now, now);
        let stale = store
            .get(&key("A.Example."), now + Duration::from_secs(29))
            .expect("within stale_for, any case");
        assert_eq!(stale.answers[0].ttl(), STALE_TTL);
        assert!(
            store
                .get(&key("a.example."), now + Duration::from_secs(30))
                .is_none()
        );
        assert!(store.get(&key("b.example."), now).is_none());
    }

    #[test]
    fn a_full_store_forgets_the_first_to_expire() {
        let now = Instant::now();
        let mut store = StaleAnswers::new(Duration::from_secs(30), 2);
        store.remember(
            key("late.example."),
            answer(1),
            now + Duration::from_secs(20),
            now,
        );
        store.remember(
            key("early.example."),
            answer(1),
            now + Duration::from_secs(10),
            now,
        );
        store.remember(
            key("new.example."),
            answer(1),
            now + Duration::from_secs(30),
            now,
        );
        assert_eq!(store.len(), 2);
        assert!(store.get(&key("early.example."), now).is_none());
        assert!(store.get(&key("late.example."), now).is_some());
        // A newer answer to a question replaces the older one.
        store.remember(
            key("late.example."),
            answer(1),
            now + Duration::from_secs(40),
            now,
        );
        assert_eq!(store.len(), 2);
        assert!(store.get(&key("new.example."), now).is_some());
    }

    #[test]
    fn answers_past_stale_for_are_purged_and_zero_keeps_nothing() {
        let now = Instant::now();
        let mut store = StaleAnswers::new(Duration::from_secs(5), 10);
        store.remember(key("old.example."), answer(1), now, now);
        store.remember(
            key("new.example."),
            answer(1),
            now + Duration::from_secs(60),
            now + Duration::from_secs(10),
        );
        assert_eq!(store.len(), 1, "the old answer was purged");
        let mut never = StaleAnswers::new(Duration::ZERO, 10);
        never.remember(key("a.example."), answer(1), now, now);
        assert_eq!(never.len(), 0);
    }
}
