//! The protocol by which the programs and the agent count a cache's sockets, checked over every
//! interleaving of its steps.
//!
//! Two parties insert `CACHE_SOCKETS` entries: the programs at `post_bind`, and the agent for
//! sockets it finds in the socket tables unseen (bound before the programs, or racing their
//! attach). A socket found in the tables may still be inside `bind(2)`, before its `post_bind`
//! ran, so both can try at once. Each *counts, then inserts*, and the loser of the insert takes
//! its count back; releases remove the entry, then uncount. So an entry never exists for an
//! uncounted socket, the count reaching zero always means that no counted socket is left, and
//! every decrement that reaches zero (release, the agent's uncount, either side's take-back)
//! records the death by bumping `down_epoch`. Neither a false death (a bump while the socket
//! lives) nor a hidden one (its last socket gone, no bump) can happen through counting. (The
//! signal program bumps `down_epoch` on purpose while the sockets live: a cache told to stop is
//! treated as dead from the signal on, and its next life needs the probes' confirmation.)
//!
//! Until layout 5 the programs inserted before counting, and the agent's take-back recorded no
//! death: a release between the agent's count and its take-back then left the count at zero
//! with no new epoch, so a cache restarted later got DNS without the probes confirming it.
//! [`tests::the_old_protocol_could_hide_a_death`] finds that interleaving.

#[cfg(test)]
mod tests {
    /// The shared state of one cache socket that is the listener's last.
    #[derive(Clone, Copy, Debug, Default)]
    struct State {
        count: i64,
        entry: bool,
        epoch: u64,
        /// The socket has begun closing.
        released: bool,
        /// A death was recorded while the socket lived.
        false_death: bool,
    }

    impl State {
        /// An atomic add, recording a death when a decrement reaches zero and `record`.
        fn add(&mut self, delta: i64, record: bool) {
            self.count += delta;
            if record && delta < 0 && self.count <= 0 {
                self.epoch += 1;
                if !self.released {
                    self.false_death = true;
                }
            }
        }
    }

    /// One step of a party; `None` ends it.
    type Step = fn(&mut State, &mut Local) -> Option<usize>;

    /// A party's own memory between steps: whether its insert failed, and where it is.
    #[derive(Clone, Copy, Debug, Default)]
    struct Local {
        lost_insert: bool,
        found_entry: bool,
    }

    fn insert(state: &mut State, local: &mut Local) {
        if state.entry {
            local.lost_insert = true;
        } else {
            state.entry = true;
        }
    }

    fn count(state: &mut State, _: &mut Local) -> Option<usize> {
        state.add(1, false);
        Some(1)
    }

    fn try_insert(state: &mut State, local: &mut Local) -> Option<usize> {
        insert(state, local);
        Some(2)
    }

    /// The programs' `post_bind`: counts, inserts, takes the count back (recording a death at
    /// zero) when it lost.
    fn count_then_insert() -> Vec<Step> {
        vec![count, try_insert, |state, local| {
            if local.lost_insert {
                state.add(-1, true);
            }
            None
        }]
    }

    /// The agent: counts, inserts, takes the count back when it lost (recording a death at zero
    /// when `record`, as now; not, as until layout 5), then its next pass uncounts the entry of a
    /// socket gone from the tables.
    fn agent(record: bool) -> Vec<Step> {
        let take_back: Step = if record {
            |state, local| {
                if local.lost_insert {
                    state.add(-1, true);
                }
                Some(3)
            }
        } else {
            |state, local| {
                if local.lost_insert {
                    state.add(-1, false);
                }
                Some(3)
            }
        };
        vec![count, try_insert, take_back, |state, _| {
            if state.released && state.entry {
                state.entry = false;
                state.add(-1, true);
            }
            None
        }]
    }

    /// The old programs' `post_bind`: insert, then count if the insert won.
    fn insert_then_count() -> Vec<Step> {
        vec![
            |state, local| {
                insert(state, local);
                Some(1)
            },
            |state, local| {
                if !local.lost_insert {
                    state.add(1, false);
                }
                None
            },
        ]
    }

    /// `sock_release`, after `post_bind` returned (`bind(2)` holds the file): removes the
    /// entry, then uncounts.
    fn release() -> Vec<Step> {
        vec![
            |state, local| {
                state.released = true;
                local.found_entry = state.entry;
                state.entry = false;
                Some(1)
            },
            |state, local| {
                if local.found_entry {
                    state.add(-1, true);
                }
                None
            },
        ]
    }

    /// Every final state over all interleavings of the agent's and the bind's steps, with the
    /// release starting any time after the bind's steps ended.
    fn explore(agent: &[Step], bind: &[Step]) -> Vec<State> {
        let release = release();
        let mut finals = Vec::new();
        let mut stack = vec![(
            State::default(),
            [Some(0), Some(0), Some(0)],
            [Local::default(); 3],
        )];
        while let Some((state, positions, locals)) = stack.pop() {
            if positions.iter().all(Option::is_none) {
                finals.push(state);
                continue;
            }
            for party in 0..3 {
                let Some(position) = positions[party] else {
                    continue;
                };
                // The release waits for `bind(2)` to return.
                if party == 2 && positions[1].is_some() {
                    continue;
                }
                let steps = [agent, bind, release.as_slice()][party];
                let (mut state, mut positions, mut locals) = (state, positions, locals);
                positions[party] = steps[position](&mut state, &mut locals[party]);
                stack.push((state, positions, locals));
            }
        }
        finals
    }

    #[test]
    fn counting_before_inserting_neither_hides_nor_invents_a_death() {
        let finals = explore(&agent(true), &count_then_insert());
        assert!(finals.len() > 10, "{} interleavings", finals.len());
        for state in finals {
            assert_eq!((state.count, state.entry), (0, false), "{state:?}");
            assert!(state.epoch >= 1, "a hidden death: {state:?}");
            assert!(!state.false_death, "a false death: {state:?}");
        }
    }

    #[test]
    fn the_old_protocol_could_hide_a_death() {
        let finals = explore(&agent(false), &insert_then_count());
        assert!(
            finals
                .iter()
                .any(|state| state.count == 0 && state.epoch == 0),
            "no interleaving hid the death"
        );
    }
}
