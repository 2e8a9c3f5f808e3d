//! Keeping the kernel's count of cache sockets true. The programs count a socket when it binds
//! and uncount it when it closes, by cookie (`CACHE_SOCKETS`). Here the agent compares that table
//! with the kernel's socket tables (sock_diag): it counts sockets the programs never saw bind
//! (the cache started before the agent), and uncounts sockets gone without the programs seeing
//! them close, but only once absent on two passes in a row, never on a single observation.

use std::collections::{HashMap, HashSet};

use redirector_common::{
    addr::port_be,
    binds::{BindKey, CacheSocket},
};
use tracing::{info, warn};

use super::sockdiag::{SockDiagError, SocketTable};
use crate::datapath::{DatapathError, Maps};

/// Why a reconcile pass failed.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The socket tables could not be read.
    #[error(transparent)]
    SocketTable(#[from] SockDiagError),
    /// The maps could not be read or corrected.
    #[error(transparent)]
    Datapath(#[from] DatapathError),
}

/// What one pass changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Sockets counted here (alive, not counted by the programs).
    pub counted: usize,
    /// Sockets uncounted here (counted, gone).
    pub uncounted: usize,
}

/// Compares and corrects the counted cache sockets.
#[derive(Debug)]
pub struct Reconciler {
    table: SocketTable,
    binds: HashMap<BindKey, u64>,
    missing_once: HashSet<u64>,
}

impl Reconciler {
    /// A reconciler for the caches `binds` describes.
    #[must_use]
    pub fn new(table: SocketTable, binds: HashMap<BindKey, u64>) -> Self {
        Self {
            table,
            binds,
            missing_once: HashSet::new(),
        }
    }

    /// One pass. With `seed` (start-up, nothing counted yet by anyone else), a counted socket
    /// that is gone is uncounted at once.
    pub fn reconcile(
        &mut self,
        maps: &mut Maps,
        seed: bool,
    ) -> Result<ReconcileReport, ReconcileError> {
        let counted: HashMap<u64, CacheSocket> = maps.cache_sockets().into_iter().collect();
        let live: HashMap<u64, CacheSocket> = self
            .table
            .bound_sockets()?
            .into_iter()
            .filter_map(|socket| {
                let key = BindKey::new(socket.addr, port_be(socket.port), socket.protocol);
                let listeners = *self.binds.get(&key)?;
                Some((
                    socket.cookie,
                    CacheSocket {
                        listeners,
                        protocol: socket.protocol,
                        _padding: 0,
                    },
                ))
            })
            .collect();

        let mut report = ReconcileReport::default();
        for (cookie, entry) in &live {
            if !counted.contains_key(cookie) && maps.count_cache_socket(*cookie, *entry)? {
                report.counted += 1;
            }
        }
        let gone: Vec<u64> = counted
            .keys()
            .filter(|cookie| !live.contains_key(cookie))
            .copied()
            .collect();
        let mut still_missing = HashSet::new();
        for cookie in gone {
            if seed || self.missing_once.contains(&cookie) {
                if maps.uncount_cache_socket(cookie)? {
                    report.uncounted += 1;
                }
            } else {
                still_missing.insert(cookie);
            }
        }
        self.missing_once = still_missing;

        if !seed && (report.counted > 0 || report.uncounted > 0) {
            warn!(
                counted = report.counted,
                uncounted = report.uncounted,
                "corrected the count of cache sockets (the programs did not see these bind or close)"
            );
        } else if seed && report.counted > 0 {
            info!(
                sockets = report.counted,
                "counted cache sockets that existed before the agent"
            );
        }
        Ok(report)
    }
}
