//! Keeping the kernel's count of cache sockets true. The programs count a socket when it binds
//! and uncount it when it closes, by cookie (`CACHE_SOCKETS`). Here the agent compares that table
//! with the kernel's socket tables (sock_diag): it counts sockets the programs never saw bind
//! (the cache started before the agent), and uncounts sockets gone without the programs seeing
//! them close, but only once absent on two passes in a row, never on a single observation.
//!
//! One kind of TCP socket always closes unseen: an MPTCP listener's (Go 1.24 and later, hence
//! CoreDNS, listen with MPTCP where `net.mptcp.enabled` is 1). Its bind is the kernel's own TCP
//! subflow's, which `post_bind` counts; its close releases the MPTCP socket, which is not TCP,
//! and the subflow, a kernel socket, which runs no `sock_release` program. Only UDP counts move
//! DNS, so the TCP count catches up here, a pass or two later, without a warning.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    path::PathBuf,
};

use redirector_common::{
    addr::port_be,
    binds::{BindKey, CacheSocket, UNMARKED},
    counters::PROTOCOL_UDP,
};
use tracing::{debug, info, warn};

use super::sockdiag::{BoundSocket, SockDiagError, SocketTable};
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
    /// The blocking dump task died.
    #[error("the socket-table reader task failed")]
    Task(#[source] tokio::task::JoinError),
}

/// What one pass changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Sockets counted here (alive, not counted by the programs).
    pub counted: usize,
    /// UDP sockets uncounted here (counted, gone): closes the programs missed.
    pub uncounted: usize,
    /// TCP sockets uncounted here: MPTCP listeners, whose close no program sees (see above).
    pub uncounted_tcp: usize,
    /// Sockets moved to other listeners (the configuration changed).
    pub reassigned: usize,
}

/// Compares and corrects the counted cache sockets.
#[derive(Debug)]
pub struct Reconciler {
    /// `None` only while a dump runs on a blocking thread.
    table: Option<SocketTable>,
    binds: HashMap<BindKey, u64>,
    missing_once: HashSet<u64>,
    /// The caches' network namespace (`None`: the agent's), where their holders are looked for.
    netns: Option<PathBuf>,
    /// The inode of each live cache socket of the last dump, by cookie.
    inodes: HashMap<u64, u32>,
    /// The live cache sockets' cookies at the last two passes: holders are looked for while
    /// they change (a new life of a cache, which may daemonize or fork its workers just after).
    recent: [BTreeSet<u64>; 2],
    /// Passes since holders were last looked for.
    since_holders: u32,
}

/// Passes between two looks for the caches' holders while nothing changes (what the LRU may
/// have evicted): with the default 5 s pass, every 2.5 minutes.
const HOLDERS_EVERY: u32 = 30;

impl Reconciler {
    /// A reconciler for the caches `binds` describes.
    #[must_use]
    pub fn new(table: SocketTable, binds: HashMap<BindKey, u64>, netns: Option<PathBuf>) -> Self {
        Self {
            table: Some(table),
            binds,
            missing_once: HashSet::new(),
            netns,
            inodes: HashMap::new(),
            recent: [BTreeSet::new(), BTreeSet::new()],
            since_holders: 0,
        }
    }

    /// Counts by `binds` again (a start that failed puts back the binds it found): the next
    /// pass moves every counted socket to the listeners they give it.
    pub fn restore_binds(&mut self, binds: HashMap<BindKey, u64>) {
        self.binds = binds;
    }

    /// One pass. With `seed` (start-up), a counted socket that is gone is uncounted at once: the
    /// programs either never saw it (not attached yet) or already removed it, in which case the
    /// removal here finds nothing and changes nothing.
    pub async fn reconcile(
        &mut self,
        maps: &mut Maps,
        seed: bool,
    ) -> Result<ReconcileReport, ReconcileError> {
        let counted: HashMap<u64, CacheSocket> = maps.cache_sockets().into_iter().collect();
        let live = self.live_cache_sockets().await?;
        let tracked = self
            .binds
            .values()
            .fold(0, |bits, listeners| bits | listeners);

        let mut report = ReconcileReport::default();
        let mut inserted = Vec::new();
        for (cookie, entry) in &live {
            match counted.get(cookie) {
                None => {
                    if maps.count_cache_socket(*cookie, *entry)? {
                        inserted.push(*cookie);
                    }
                }
                // Counted for other listeners than the configuration now says (it changed).
                Some(old) if !old.counts_like(entry) => {
                    if maps.reassign_cache_socket(*cookie, *old, *entry, tracked)? {
                        report.reassigned += 1;
                    }
                }
                Some(_) => {}
            }
        }
        if !inserted.is_empty() {
            // A socket that closed between the dump and the insert was never seen closing by the
            // programs (there was no entry yet): a second look settles it.
            let still_live = self.live_cache_sockets().await?;
            for cookie in inserted {
                if still_live.contains_key(&cookie) {
                    report.counted += 1;
                } else {
                    maps.uncount_cache_socket(cookie, tracked)?;
                }
            }
        }

        let mut still_missing = HashSet::new();
        for (cookie, entry) in counted
            .iter()
            .filter(|(cookie, _)| !live.contains_key(cookie))
        {
            if seed || self.missing_once.contains(cookie) {
                if maps.uncount_cache_socket(*cookie, tracked)? {
                    if entry.protocol == PROTOCOL_UDP {
                        report.uncounted += 1;
                    } else {
                        report.uncounted_tcp += 1;
                    }
                }
            } else {
                still_missing.insert(*cookie);
            }
        }
        self.missing_once = still_missing;
        maps.settle_unmarked_cache_sockets()?;
        self.learn_holders(maps, &live, seed).await?;

        if report.reassigned > 0 {
            info!(
                sockets = report.reassigned,
                "moved counted cache sockets to the listeners the configuration now gives them"
            );
        }
        if report.uncounted_tcp > 0 {
            debug!(
                sockets = report.uncounted_tcp,
                "uncounted closed TCP cache sockets (MPTCP listeners close unseen by the programs)"
            );
        }
        if !seed && (report.counted > 0 || report.uncounted > 0) {
            warn!(
                counted = report.counted,
                uncounted = report.uncounted,
                "corrected the count of cache sockets (the programs did not see these bind or close)"
            );
        } else if seed && report.counted > 0 {
            info!(
                sockets = report.counted,
                "counted cache sockets that existed before the programs"
            );
        }
        Ok(report)
    }

    /// Records the processes that hold the live cache sockets as caches (`cache_tasks`), and
    /// forgets those whose cgroup is gone (`cache_tasks::forget_gone`): at a seed, while the
    /// sockets change (a cache's new life), and every `HOLDERS_EVERY` passes. The programs
    /// record the caches' binders and readers themselves; this adds the holders the agent can see
    /// in `/proc` (with the privilege to read other processes' descriptors).
    async fn learn_holders(
        &mut self,
        maps: &mut Maps,
        live: &HashMap<u64, CacheSocket>,
        seed: bool,
    ) -> Result<(), ReconcileError> {
        let cookies: BTreeSet<u64> = live.keys().copied().collect();
        let changing = self.recent.iter().any(|earlier| *earlier != cookies);
        self.recent = [self.recent[1].clone(), cookies];
        self.since_holders += 1;
        if !(seed || changing || self.since_holders >= HOLDERS_EVERY) {
            return Ok(());
        }
        self.since_holders = 0;
        let gone = super::cache_tasks::forget_gone(maps).await?;
        if gone > 0 {
            debug!(
                processes = gone,
                "forgot the processes known as caches whose cgroups are gone"
            );
        }
        let sockets: HashMap<u64, u64> = live
            .iter()
            .filter_map(|(cookie, entry)| {
                let inode = self.inodes.get(cookie)?;
                Some((u64::from(*inode), entry.listeners))
            })
            .collect();
        let netns = self.netns.clone();
        let holders = tokio::task::spawn_blocking(move || {
            super::cache_tasks::holders(&sockets, netns.as_deref())
        })
        .await
        .map_err(ReconcileError::Task)?;
        let mut learned = 0;
        for holder in holders {
            if maps.know_cache_task(holder.tgid, holder.cgroup_id, holder.listeners)? {
                learned += 1;
            }
        }
        if learned > 0 {
            info!(
                processes = learned,
                "learned processes that hold the caches' sockets (their stop signals move DNS)"
            );
        }
        Ok(())
    }

    /// The live sockets that are some listener's cache, by cookie. The dump runs on a blocking
    /// thread: a node has many sockets, and the control loop must keep probing meanwhile.
    async fn live_cache_sockets(&mut self) -> Result<HashMap<u64, CacheSocket>, ReconcileError> {
        let Some(mut table) = self.table.take() else {
            return Ok(HashMap::new());
        };
        let (table, sockets) = tokio::task::spawn_blocking(move || {
            let sockets = table.bound_sockets();
            (table, sockets)
        })
        .await
        .map_err(ReconcileError::Task)?;
        self.table = Some(table);
        let sockets = sockets?;
        let live: HashMap<u64, CacheSocket> = sockets
            .iter()
            .filter_map(|socket| self.cache_socket(socket))
            .collect();
        self.inodes = sockets
            .iter()
            .filter(|socket| live.contains_key(&socket.cookie))
            .map(|socket| (socket.cookie, socket.inode))
            .collect();
        Ok(live)
    }

    fn cache_socket(&self, socket: &BoundSocket) -> Option<(u64, CacheSocket)> {
        let key = BindKey::new(socket.addr, port_be(socket.port), socket.protocol);
        let listeners = *self.binds.get(&key)?;
        Some((
            socket.cookie,
            CacheSocket {
                listeners,
                protocol: socket.protocol,
                // Counted here, the socket carries no mark (see `DatapathConfig`).
                marked: UNMARKED,
            },
        ))
    }
}
