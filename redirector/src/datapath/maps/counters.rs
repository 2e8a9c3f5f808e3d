//! What the programs counted and translated, read for status and the tests: a listener's
//! counters summed over CPUs, the reverse translations.

use redirector_common::{
    counters::{ListenerCounters, PROTOCOL_TCP, PROTOCOL_UDP, counter_index},
    names,
    reverse::{ReverseKey, ReverseValue},
};

use super::{Maps, checked_id};
use crate::datapath::error::{DatapathError, read};

/// Counters of one listener, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ListenerTotals {
    /// UDP row.
    pub udp: ListenerCounters,
    /// TCP row.
    pub tcp: ListenerCounters,
}

impl ListenerTotals {
    /// Both protocols together.
    #[must_use]
    pub fn total(&self) -> ListenerCounters {
        self.udp.add(&self.tcp)
    }
}

impl Maps {
    /// A listener's counters since the maps were created, summed over CPUs.
    pub fn counters(&self, id: u32) -> Result<ListenerTotals, DatapathError> {
        let id = checked_id(id)?;
        let row = |protocol| -> Result<ListenerCounters, DatapathError> {
            let values = self
                .counters
                .get(&counter_index(id, protocol), 0)
                .map_err(read(names::MAP_COUNTERS))?;
            Ok(values
                .iter()
                .fold(ListenerCounters::default(), ListenerCounters::add))
        };
        Ok(ListenerTotals {
            udp: row(PROTOCOL_UDP)?,
            tcp: row(PROTOCOL_TCP)?,
        })
    }

    /// Entries in the reverse-translation map (walks the whole map: for tests and status).
    #[must_use]
    pub fn reverse_entries(&self) -> Vec<(ReverseKey, ReverseValue)> {
        self.reverse_nat.iter().filter_map(Result::ok).collect()
    }
}
