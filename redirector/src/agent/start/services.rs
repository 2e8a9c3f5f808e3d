//! What runs beside the steering, set up by the start: the conntrack bypass on a task of its own,
//! the telemetry endpoint, the forwarding of the programs' log; a task ends with a start that
//! fails (`TaskGuard`).

use std::{net::SocketAddr, path::Path, sync::Arc};

use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::{
    agent::AgentError,
    config::Config,
    conntrack_bypass::{self, BypassStatus, ConntrackBypass, nft::Nft, ruleset::Ruleset},
    datapath::Maps,
    sys::netns::NetnsWorker,
    telemetry::{
        self,
        stats::{AgentStats, ErrorKind},
    },
};

/// A task that ends with the start that spawned it, unless the start completes and keeps it.
#[derive(Debug)]
pub(super) struct TaskGuard(pub(super) Option<JoinHandle<()>>);

impl TaskGuard {
    pub(super) fn keep(mut self) -> Option<JoinHandle<()>> {
        self.0.take()
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// Installs the conntrack bypass table when configured (its failure is reported, never fatal)
/// and keeps it on a task of its own, so that a slow or hung nft never delays the control loop;
/// when not configured, removes one an earlier configuration left.
pub(super) async fn start_conntrack_bypass(
    config: &Config,
    netns: Option<&Path>,
    stats: &Arc<AgentStats>,
) -> Result<Option<JoinHandle<()>>, AgentError> {
    let worker = NetnsWorker::start(netns).map_err(AgentError::CacheNetns)?;
    let nft = Nft::new(&config.conntrack.nft, worker);
    if !config.conntrack.bypass {
        if let Err(error) = conntrack_bypass::remove(&nft).await
            && !error.is_unavailable()
        {
            warn!(error = %crate::error_chain(&error), "conntrack.bypass is off, but removing an earlier bypass table failed");
        }
        stats.record_conntrack_bypass(BypassStatus::Disabled, 0);
        return Ok(None);
    }
    let desired = Ruleset {
        local: conntrack_bypass::local_endpoints(config),
    };
    let mut bypass = ConntrackBypass::new(nft, desired);
    let mut reported = None;
    let mut report = move |bypass: &ConntrackBypass, stats: &AgentStats| {
        let status = bypass.status().clone();
        // A failure is counted when it starts, not at every check of a node without nftables.
        if status != BypassStatus::Active && reported.as_ref() != Some(&status) {
            stats.record_error(ErrorKind::Nftables);
        }
        stats.record_conntrack_bypass(status.clone(), bypass.restorations());
        reported = Some(status);
    };
    bypass.check().await;
    report(&bypass, stats);
    let stats = Arc::clone(stats);
    let interval = config.conntrack.check_interval;
    Ok(Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            bypass.check().await;
            report(&bypass, &stats);
        }
    })))
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener`, from the maps now pinned.
pub(super) fn serve_telemetry(
    listener: std::net::TcpListener,
    config: &Config,
    stats: &Arc<AgentStats>,
) -> Result<(SocketAddr, telemetry::http::Server), AgentError> {
    let address = listener.local_addr().unwrap_or(config.metrics.address);
    let endpoint = telemetry::http::Endpoint {
        maps: std::sync::Mutex::new(Maps::open_pinned(&config.pin_dir)?),
        stats: Arc::clone(stats),
        health_window: health_window(config),
    };
    let server = telemetry::http::serve(listener, endpoint)
        .map_err(|source| telemetry::http::BindError { address, source })?;
    info!(address = %address, "serving /metrics, /healthz and /readyz");
    Ok((address, server))
}

/// How long the control loop may go without a turn before `/healthz` fails: it turns at least
/// at every probe interval; allow three, and never less than ten seconds (a slow socket-table
/// dump or nft run is no stall).
fn health_window(config: &Config) -> std::time::Duration {
    (config.probe.interval * 3).max(std::time::Duration::from_secs(10))
}

/// Forwards the programs' log records into the agent's log, on a task of their own.
pub(super) fn forward_kernel_log(
    logger: aya_log::EbpfLogger<&'static dyn log::Log>,
) -> Result<(), AgentError> {
    // SAFETY: the logger owns its ring buffer's fd for its whole life, and the AsyncFd owns the
    // logger, so the fd stays open and the same until the AsyncFd is dropped.
    let mut logger = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    }
    .map_err(|error| AgentError::KernelLog {
        source: std::io::Error::from(error),
    })?;
    warn!(
        "kernel_log is on: the programs log their decisions (debugging only; it costs every logged syscall a ring buffer write)"
    );
    tokio::spawn(async move {
        loop {
            let Ok(mut ready) = logger.readable_mut().await else {
                return;
            };
            ready.get_inner_mut().flush();
            ready.clear_ready();
        }
    });
    Ok(())
}
