//! The answer cache. Pure: every operation takes the time, so tests drive it with a fake clock.
//!
//! An entry lives for the smallest TTL of its answer records (a negative answer: its SOA's TTL and
//! minimum, RFC 2308), capped, and then `stale_for` longer as a stale fallback. Entries are kept
//! in wire format, so their size is known exactly: the cache holds at most `max_entries` of them
//! and at most `max_bytes` of messages, and when either is reached, the entries whose stale
//! windows end first make room. A response larger than [`MAX_CACHED_MESSAGE_BYTES`] is not
//! cached.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Message, MessageType, Query, ResponseCode},
    rr::{DNSClass, Name, RData, Record, RecordType},
};

use super::config::MAX_CACHED_MESSAGE_BYTES;

/// The TTL of a stale answer (RFC 8767 section 4 recommends 30 seconds).
pub(crate) const STALE_TTL: u32 = 30;

/// What an answer is cached under: the question, with the name lowercased.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct CacheKey {
    name: Name,
    record_type: RecordType,
    class: DNSClass,
}

impl CacheKey {
    /// The key of `query`.
    pub(crate) fn new(query: &Query) -> Self {
        Self {
            name: query.name().to_lowercase(),
            record_type: query.query_type(),
            class: query.query_class(),
        }
    }
}

/// How long answers are kept.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CachePolicy {
    /// Cap of a positive answer's lifetime.
    pub(crate) max_ttl: Duration,
    /// Cap of a negative answer's lifetime; zero: not cached.
    pub(crate) max_negative_ttl: Duration,
    /// How long after expiry an entry may be served stale.
    pub(crate) stale_for: Duration,
    /// Most entries.
    pub(crate) max_entries: usize,
    /// Most bytes of messages (wire format) held.
    pub(crate) max_bytes: usize,
}

#[derive(Debug)]
struct Entry {
    /// The upstream's response, record TTLs clamped to the entry's lifetime, in wire format.
    response: Vec<u8>,
    stored: Instant,
    expires: Instant,
    /// This entry's key in `Cache::by_deadline`: the end of its stale window and a sequence
    /// number.
    deadline: (Instant, u64),
}

/// Answers by question, bounded.
#[derive(Debug)]
pub(crate) struct Cache {
    policy: CachePolicy,
    entries: HashMap<CacheKey, Entry>,
    /// Every entry, by the end of its stale window: the front is the next to go.
    by_deadline: BTreeMap<(Instant, u64), CacheKey>,
    next_sequence: u64,
    /// The sum of the entries' message sizes.
    bytes: usize,
}

impl Cache {
    /// An empty cache.
    pub(crate) fn new(policy: CachePolicy) -> Self {
        Self {
            policy,
            entries: HashMap::new(),
            by_deadline: BTreeMap::new(),
            next_sequence: 0,
            bytes: 0,
        }
    }

    /// Entries held, stale ones included.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes of messages held, stale ones included.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        debug_assert_eq!(
            self.bytes,
            self.entries
                .values()
                .map(|entry| entry.response.len())
                .sum::<usize>()
        );
        self.bytes
    }

    /// The answer for `key` if it has not expired at `now`, its TTLs reduced by its age.
    pub(crate) fn get(&mut self, key: &CacheKey, now: Instant) -> Option<Message> {
        let entry = self.live_entry(key, now)?;
        if now >= entry.expires {
            return None;
        }
        let age = u32::try_from(now.duration_since(entry.stored).as_secs()).unwrap_or(u32::MAX);
        let mut response = self.decode(key)?;
        for_each_ttl(&mut response, |ttl| ttl.saturating_sub(age));
        Some(response)
    }

    /// The answer for `key` if it has expired at `now` but less than `stale_for` ago, every TTL
    /// set to [`STALE_TTL`].
    pub(crate) fn get_stale(&mut self, key: &CacheKey, now: Instant) -> Option<Message> {
        let entry = self.live_entry(key, now)?;
        if now < entry.expires {
            return None;
        }
        let mut response = self.decode(key)?;
        for_each_ttl(&mut response, |_| STALE_TTL);
        Some(response)
    }

    /// Caches `response` to `key` if it is cacheable; returns its lifetime then. A response that
    /// is not cacheable (an error, TTL 0, larger than [`MAX_CACHED_MESSAGE_BYTES`] or than the
    /// whole byte budget, ...) removes an older entry of `key`: it is no longer the upstream's
    /// answer.
    pub(crate) fn insert(
        &mut self,
        key: CacheKey,
        response: &Message,
        now: Instant,
    ) -> Option<Duration> {
        self.remove(&key);
        let ttl = cacheable_ttl(response, &self.policy)?;
        let ttl_secs = u32::try_from(ttl.as_secs()).unwrap_or(u32::MAX);
        let mut response = response.clone();
        for_each_ttl(&mut response, |record_ttl| record_ttl.min(ttl_secs));
        let response = match response.to_vec() {
            Ok(bytes) => bytes,
            Err(error) => {
                tracing::debug!(%error, "cannot encode an answer for the cache; not cached");
                return None;
            }
        };
        if response.len() > MAX_CACHED_MESSAGE_BYTES.min(self.policy.max_bytes) {
            return None;
        }

        self.purge(now);
        while self.entries.len() >= self.policy.max_entries
            || self.bytes + response.len() > self.policy.max_bytes
        {
            let Some((_, oldest)) = self.by_deadline.pop_first() else {
                break;
            };
            if let Some(entry) = self.entries.remove(&oldest) {
                self.bytes -= entry.response.len();
            }
        }

        let expires = now + ttl;
        let deadline = (expires + self.policy.stale_for, self.next_sequence);
        self.next_sequence += 1;
        self.by_deadline.insert(deadline, key.clone());
        self.bytes += response.len();
        self.entries.insert(
            key,
            Entry {
                response,
                stored: now,
                expires,
                deadline,
            },
        );
        Some(ttl)
    }

    /// The message of the entry of `key`, decoded. An entry that does not decode (it was encoded
    /// by hickory, so it should) is removed.
    fn decode(&mut self, key: &CacheKey) -> Option<Message> {
        let decoded = Message::from_vec(&self.entries.get(key)?.response);
        match decoded {
            Ok(message) => Some(message),
            Err(error) => {
                tracing::warn!(%error, "a cached answer does not decode; dropped");
                self.remove(key);
                None
            }
        }
    }

    /// The entry of `key` unless its stale window has ended at `now` (then it is removed).
    fn live_entry(&mut self, key: &CacheKey, now: Instant) -> Option<&Entry> {
        let deadline = self.entries.get(key)?.deadline;
        if now >= deadline.0 {
            self.remove(key);
            return None;
        }
        self.entries.get(key)
    }

    fn remove(&mut self, key: &CacheKey) {
        if let Some(entry) = self.entries.remove(key) {
            self.by_deadline.remove(&entry.deadline);
            self.bytes -= entry.response.len();
        }
    }

    /// Drops every entry whose stale window has ended at `now`.
    fn purge(&mut self, now: Instant) {
        while let Some(entry) = self.by_deadline.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let key = entry.remove();
            if let Some(entry) = self.entries.remove(&key) {
                self.bytes -= entry.response.len();
            }
        }
    }
}

/// How long `response` may be cached under `policy`, if at all: the smallest TTL of its answers,
/// and for a negative answer (NXDOMAIN, or NOERROR without answers) also its SOA's TTL and
/// minimum, capped. Errors, truncated responses, TTL 0 and negative answers without SOA are not
/// cached.
fn cacheable_ttl(response: &Message, policy: &CachePolicy) -> Option<Duration> {
    if response.message_type() != MessageType::Response || response.truncated() {
        return None;
    }
    let negative = match response.response_code() {
        ResponseCode::NXDomain => true,
        ResponseCode::NoError => response.answers().is_empty(),
        _ => return None,
    };
    let answers_ttl = response.answers().iter().map(Record::ttl).min();
    let (ttl, cap) = if negative {
        let soa_ttl = response
            .name_servers()
            .iter()
            .find_map(|record| match record.data() {
                RData::SOA(soa) => Some(record.ttl().min(soa.minimum())),
                _ => None,
            })?;
        (
            answers_ttl.map_or(soa_ttl, |ttl| ttl.min(soa_ttl)),
            policy.max_negative_ttl,
        )
    } else {
        (answers_ttl?, policy.max_ttl)
    };
    let ttl = Duration::from_secs(ttl.into()).min(cap);
    (!ttl.is_zero()).then_some(ttl)
}

/// Rewrites the TTL of every record of `message` (the OPT pseudo-record is kept apart by
/// hickory and is untouched).
fn for_each_ttl(message: &mut Message, mut rewrite: impl FnMut(u32) -> u32) {
    let mut rewrite_all = |records: &mut Vec<Record>| {
        for record in records {
            let ttl = rewrite(record.ttl());
            record.set_ttl(ttl);
        }
    };
    rewrite_all(message.answers_mut());
    rewrite_all(message.name_servers_mut());
    rewrite_all(message.additionals_mut());
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use hickory_proto::rr::rdata::{A, CNAME, SOA};

    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn policy() -> CachePolicy {
        CachePolicy {
            max_ttl: Duration::from_secs(3600),
            max_negative_ttl: Duration::from_secs(300),
            stale_for: Duration::from_secs(30),
            max_entries: 100,
            max_bytes: 1 << 20,
        }
    }

    fn name(text: &str) -> Name {
        Name::from_ascii(text).expect("a name")
    }

    fn key(text: &str) -> CacheKey {
        CacheKey::new(&Query::query(name(text), RecordType::A))
    }

    fn response(code: ResponseCode) -> Message {
        let mut message = Message::new();
        message
            .set_id(7)
            .set_message_type(MessageType::Response)
            .set_response_code(code);
        message
    }

    /// A positive answer with one A record per TTL.
    fn answer(owner: &str, ttls: &[u32]) -> Message {
        let mut message = response(ResponseCode::NoError);
        for (index, ttl) in ttls.iter().enumerate() {
            let offset = u32::try_from(index + 1).expect("few records");
            message.add_answer(Record::from_rdata(
                name(owner),
                *ttl,
                RData::A(A(Ipv4Addr::from(
                    u32::from(Ipv4Addr::new(192, 0, 2, 0)) + offset,
                ))),
            ));
        }
        message
    }

    fn soa_record(ttl: u32, minimum: u32) -> Record {
        Record::from_rdata(
            name("example.com."),
            ttl,
            RData::SOA(SOA::new(
                name("ns.example.com."),
                name("hostmaster.example.com."),
                1,
                7200,
                900,
                1_209_600,
                minimum,
            )),
        )
    }

    fn negative(code: ResponseCode, soa: Option<(u32, u32)>) -> Message {
        let mut message = response(code);
        if let Some((ttl, minimum)) = soa {
            message.add_name_server(soa_record(ttl, minimum));
        }
        message
    }

    fn ttls(message: &Message) -> Vec<u32> {
        message.all_sections().map(Record::ttl).collect()
    }

    #[test]
    fn ttls_count_down_until_expiry() {
        let mut cache = Cache::new(policy());
        let start = Instant::now();
        let lifetime = cache.insert(key("a.example."), &answer("a.example.", &[300, 60]), start);
        assert_eq!(lifetime, Some(Duration::from_secs(60)), "the smallest TTL");

        let fresh = cache.get(&key("a.example."), start).expect("cached");
        assert_eq!(
            ttls(&fresh),
            vec![60, 60],
            "clamped to the entry's lifetime"
        );
        assert_eq!(fresh.answers().len(), 2);

        let later = cache
            .get(
                &key("a.example."),
                start + 20 * SECOND + Duration::from_millis(900),
            )
            .expect("cached");
        assert_eq!(
            ttls(&later),
            vec![40, 40],
            "whole seconds elapsed are subtracted"
        );

        assert!(cache.get(&key("a.example."), start + 59 * SECOND).is_some());
        assert!(
            cache.get(&key("a.example."), start + 60 * SECOND).is_none(),
            "expired"
        );
    }

    #[test]
    fn keys_ignore_case_but_not_type() {
        let mut cache = Cache::new(policy());
        let now = Instant::now();
        cache.insert(
            key("WWW.Example.COM."),
            &answer("www.example.com.", &[60]),
            now,
        );
        assert!(cache.get(&key("www.example.com."), now).is_some());
        let aaaa = CacheKey::new(&Query::query(name("www.example.com."), RecordType::AAAA));
        assert!(cache.get(&aaaa, now).is_none());
    }

    #[test]
    fn max_ttl_caps_the_lifetime() {
        let mut cache = Cache::new(CachePolicy {
            max_ttl: Duration::from_secs(100),
            ..policy()
        });
        let now = Instant::now();
        let lifetime = cache.insert(key("a."), &answer("a.", &[86_400]), now);
        assert_eq!(lifetime, Some(Duration::from_secs(100)));
        assert_eq!(
            ttls(&cache.get(&key("a."), now).expect("cached")),
            vec![100]
        );
        assert!(cache.get(&key("a."), now + 100 * SECOND).is_none());
    }

    #[test]
    fn negative_answers_live_for_the_soa_minimum_bounded() {
        let mut cache = Cache::new(policy());
        let now = Instant::now();

        // NXDOMAIN: the smaller of the SOA record's TTL and its minimum.
        let nxdomain = negative(ResponseCode::NXDomain, Some((3600, 120)));
        assert_eq!(
            cache.insert(key("gone.example.com."), &nxdomain, now),
            Some(Duration::from_secs(120))
        );
        let cached = cache
            .get(&key("gone.example.com."), now + 20 * SECOND)
            .expect("cached");
        assert_eq!(cached.response_code(), ResponseCode::NXDomain);
        assert_eq!(ttls(&cached), vec![100]);

        // NODATA (NOERROR, no answer): likewise; the SOA's own TTL may be the smaller.
        let nodata = negative(ResponseCode::NoError, Some((45, 600)));
        assert_eq!(
            cache.insert(key("nodata.example.com."), &nodata, now),
            Some(Duration::from_secs(45))
        );

        // Bounded by max_negative_ttl.
        let long = negative(ResponseCode::NXDomain, Some((86_400, 86_400)));
        assert_eq!(
            cache.insert(key("long.example.com."), &long, now),
            Some(Duration::from_secs(300))
        );

        // Without a SOA there is nothing to bound it: not cached.
        let bare = negative(ResponseCode::NXDomain, None);
        assert_eq!(cache.insert(key("bare.example.com."), &bare, now), None);
        assert!(cache.get(&key("bare.example.com."), now).is_none());

        // max_negative_ttl 0: negative answers are not cached at all.
        let mut no_negative = Cache::new(CachePolicy {
            max_negative_ttl: Duration::ZERO,
            ..policy()
        });
        assert_eq!(
            no_negative.insert(key("gone.example.com."), &nxdomain, now),
            None
        );
    }

    #[test]
    fn nxdomain_after_a_cname_uses_both_ttls() {
        let mut message = negative(ResponseCode::NXDomain, Some((600, 600)));
        message.add_answer(Record::from_rdata(
            name("alias.example.com."),
            40,
            RData::CNAME(CNAME(name("gone.example.com."))),
        ));
        let mut cache = Cache::new(policy());
        assert_eq!(
            cache.insert(key("alias.example.com."), &message, Instant::now()),
            Some(Duration::from_secs(40))
        );
    }

    #[test]
    fn failures_truncation_and_ttl_zero_are_not_cached() {
        let mut cache = Cache::new(policy());
        let now = Instant::now();
        assert_eq!(
            cache.insert(key("a."), &response(ResponseCode::ServFail), now),
            None
        );
        assert_eq!(
            cache.insert(key("a."), &response(ResponseCode::Refused), now),
            None
        );
        let mut truncated = answer("a.", &[60]);
        truncated.set_truncated(true);
        assert_eq!(cache.insert(key("a."), &truncated, now), None);
        assert_eq!(cache.insert(key("a."), &answer("a.", &[60, 0]), now), None);
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn an_uncacheable_answer_replaces_the_old_one() {
        let mut cache = Cache::new(policy());
        let now = Instant::now();
        cache.insert(key("a."), &answer("a.", &[10]), now);
        assert_eq!(
            cache.insert(key("a."), &answer("a.", &[0]), now + 11 * SECOND),
            None
        );
        assert!(cache.get_stale(&key("a."), now + 12 * SECOND).is_none());
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn stale_answers_only_inside_the_window() {
        let mut cache = Cache::new(policy());
        let start = Instant::now();
        cache.insert(key("a."), &answer("a.", &[10]), start);
        cache.insert(
            key("gone."),
            &negative(ResponseCode::NXDomain, Some((10, 10))),
            start,
        );

        // Fresh: no stale answer, the fresh one is what counts.
        assert!(cache.get_stale(&key("a."), start + 9 * SECOND).is_none());

        let stale = cache
            .get_stale(&key("a."), start + 10 * SECOND)
            .expect("stale");
        assert_eq!(ttls(&stale), vec![STALE_TTL]);
        assert_eq!(stale.answers().len(), 1);
        let stale = cache
            .get_stale(&key("a."), start + 39 * SECOND)
            .expect("stale");
        assert_eq!(ttls(&stale), vec![STALE_TTL]);
        let stale_negative = cache
            .get_stale(&key("gone."), start + 20 * SECOND)
            .expect("stale");
        assert_eq!(stale_negative.response_code(), ResponseCode::NXDomain);
        assert_eq!(ttls(&stale_negative), vec![STALE_TTL]);

        // Expired 30 s ago (stale_for): gone, and removed.
        assert!(cache.get_stale(&key("a."), start + 40 * SECOND).is_none());
        assert!(cache.get(&key("a."), start + 40 * SECOND).is_none());
        assert_eq!(cache.len(), 1);

        let mut no_stale = Cache::new(CachePolicy {
            stale_for: Duration::ZERO,
            ..policy()
        });
        no_stale.insert(key("a."), &answer("a.", &[10]), start);
        assert!(
            no_stale
                .get_stale(&key("a."), start + 10 * SECOND)
                .is_none()
        );
    }

    #[test]
    fn a_full_cache_evicts_the_earliest_expiring() {
        let mut cache = Cache::new(CachePolicy {
            max_entries: 3,
            ..policy()
        });
        let now = Instant::now();
        cache.insert(key("long."), &answer("long.", &[300]), now);
        cache.insert(key("short."), &answer("short.", &[10]), now);
        cache.insert(key("middle."), &answer("middle.", &[100]), now);
        assert_eq!(cache.len(), 3);

        // Replacing an entry needs no room.
        cache.insert(key("middle."), &answer("middle.", &[200]), now);
        assert_eq!(cache.len(), 3);
        assert!(cache.get(&key("short."), now).is_some());

        cache.insert(key("new."), &answer("new.", &[50]), now);
        assert_eq!(cache.len(), 3);
        assert!(cache.get(&key("short."), now).is_none(), "evicted");
        for kept in ["long.", "middle.", "new."] {
            assert!(cache.get(&key(kept), now).is_some(), "{kept} kept");
        }

        cache.insert(key("newer."), &answer("newer.", &[500]), now);
        assert!(cache.get(&key("new."), now).is_none(), "evicted next");
        assert!(cache.get(&key("middle."), now).is_some());
    }

    #[test]
    fn dead_entries_go_before_live_ones() {
        let mut cache = Cache::new(CachePolicy {
            max_entries: 3,
            ..policy()
        });
        let start = Instant::now();
        cache.insert(key("dead."), &answer("dead.", &[5]), start);
        cache.insert(key("live."), &answer("live.", &[3600]), start);
        // Past its stale window (5 + 30 s), "dead." is dropped at the next insert even though the
        // cache has room; "live." stays.
        let later = start + 100 * SECOND;
        cache.insert(key("new."), &answer("new.", &[3600]), later);
        assert_eq!(cache.len(), 2);
        assert!(cache.get(&key("live."), later).is_some());
        assert!(cache.get(&key("new."), later).is_some());
    }

    /// The size `answer(owner, ttls)` takes in the cache.
    fn stored_size(owner: &str, ttls: &[u32]) -> usize {
        answer(owner, ttls).to_vec().expect("encode").len()
    }

    #[test]
    fn the_byte_budget_evicts_the_earliest_expiring() {
        // Same-length names: every entry has the same size.
        let size = stored_size("a1.", &[60]);
        let mut cache = Cache::new(CachePolicy {
            max_bytes: 2 * size + size / 2,
            ..policy()
        });
        let now = Instant::now();
        cache.insert(key("a1."), &answer("a1.", &[300]), now);
        cache.insert(key("a2."), &answer("a2.", &[100]), now);
        assert_eq!(cache.bytes(), 2 * size);

        // A third does not fit in 2.5 entries' bytes: the earliest expiring goes.
        assert!(
            cache
                .insert(key("a3."), &answer("a3.", &[200]), now)
                .is_some()
        );
        assert_eq!((cache.len(), cache.bytes()), (2, 2 * size));
        assert!(cache.get(&key("a2."), now).is_none(), "evicted");
        assert!(cache.get(&key("a1."), now).is_some());
        assert!(cache.get(&key("a3."), now).is_some());

        // A bigger answer needs the room of both.
        let bigger = answer("a4.", &[400, 400, 400]);
        assert!(cache.insert(key("a4."), &bigger, now).is_some());
        assert_eq!(cache.len(), 1, "both others made room");
        assert!(cache.get(&key("a4."), now).is_some());
        assert_eq!(cache.bytes(), stored_size("a4.", &[400, 400, 400]));
    }

    #[test]
    fn the_byte_count_follows_removals() {
        let mut cache = Cache::new(policy());
        let start = Instant::now();
        cache.insert(key("a."), &answer("a.", &[10]), start);
        cache.insert(key("b."), &answer("b.", &[3600, 3600, 3600]), start);
        let (a, b) = (stored_size("a.", &[10]), stored_size("b.", &[1, 1, 1]));
        assert_eq!(cache.bytes(), a + b);
        // Replaced by a bigger answer.
        cache.insert(key("a."), &answer("a.", &[10, 10]), start);
        assert_eq!(cache.bytes(), stored_size("a.", &[1, 1]) + b);
        // Replaced by an uncacheable one.
        cache.insert(key("a."), &answer("a.", &[0]), start);
        assert_eq!(cache.bytes(), b);
        // Past its stale window, purged at the next insert.
        cache.insert(key("c."), &answer("c.", &[10]), start);
        cache.insert(key("d."), &answer("d.", &[10]), start + 100 * SECOND);
        assert_eq!(cache.bytes(), b + stored_size("d.", &[10]));
        // Past its stale window, removed when asked for.
        assert!(cache.get_stale(&key("d."), start + 200 * SECOND).is_none());
        assert_eq!(cache.bytes(), b);
    }

    #[test]
    fn answers_over_the_size_limit_are_not_cached() {
        // 300 A records: about 4.8 KB, over MAX_CACHED_MESSAGE_BYTES.
        let big = answer("big.", &[60; 300]);
        assert!(big.to_vec().expect("encode").len() > MAX_CACHED_MESSAGE_BYTES);
        let mut cache = Cache::new(policy());
        let now = Instant::now();
        cache.insert(key("big."), &answer("big.", &[60]), now);
        assert_eq!(cache.insert(key("big."), &big, now), None);
        assert!(
            cache.get_stale(&key("big."), now + 70 * SECOND).is_none(),
            "the older, smaller answer is gone too"
        );
        assert_eq!((cache.len(), cache.bytes()), (0, 0));

        // 200 records (about 3.2 KB) fit the limit, but not a smaller budget.
        let fits = answer("big.", &[60; 200]);
        let size = fits.to_vec().expect("encode").len();
        assert!(size <= MAX_CACHED_MESSAGE_BYTES);
        assert!(cache.insert(key("big."), &fits, now).is_some());
        assert_eq!(cache.bytes(), size);
        let mut small = Cache::new(CachePolicy {
            max_bytes: size - 1,
            ..policy()
        });
        assert_eq!(small.insert(key("big."), &fits, now), None);
        assert_eq!(small.len(), 0);
    }
}
