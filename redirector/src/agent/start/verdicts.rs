//! The caches' first probes, before anything is written, and the first verdicts they give each
//! listener as the commit writes them.

use redirector_common::{
    listener::{Reason, Route},
    settings::Liveness,
};

use crate::{
    agent::{AgentError, ListenerRuntime},
    config::{Config, Listener, UpstreamSource},
    datapath::Maps,
    liveness::{
        health::{self, HealthTracker, Hysteresis, Probe},
        probe::Prober,
    },
    sources::{self, Upstream},
    sys::netns::NetnsWorker,
};

/// Makes each listener's prober (refusing a probe name that is no DNS name) and probes every
/// cache once, concurrently: whether each answered. Writes nothing.
pub(super) async fn probe_caches(
    config: &Config,
    worker: &NetnsWorker,
) -> Result<(Vec<Prober>, Vec<bool>), AgentError> {
    let mut probers = Vec::with_capacity(config.listeners.len());
    for (position, listener) in config.listeners.iter().enumerate() {
        let prober = Prober::new(
            listener.cache,
            &listener.probe_name,
            config.probe.timeout,
            worker.clone(),
        )
        .map_err(|source| AgentError::ProbeName {
            key: format!("listener[{position}] ({:?}).probe_name", listener.name),
            name: listener.probe_name.clone(),
            source,
        })?;
        probers.push(prober);
    }
    let mut first_probes = tokio::task::JoinSet::new();
    for (index, prober) in probers.iter().enumerate() {
        let prober = prober.clone();
        first_probes.spawn(async move { (index, prober.probe().await) });
    }
    let mut alive = vec![false; probers.len()];
    while let Some(Ok((index, outcome))) = first_probes.join_next().await {
        alive[index] = outcome.is_alive();
    }
    Ok((probers, alive))
}

/// Sets the first verdicts from the first probes (`alive`, in the configuration's order): a
/// cache is up when it answered (and, when its sockets are tracked, has some).
pub(super) fn first_verdicts(
    config: &Config,
    ids: &[u32],
    probers: Vec<Prober>,
    alive: &[bool],
    maps: &mut Maps,
) -> Result<Vec<ListenerRuntime>, AgentError> {
    let hysteresis = Hysteresis {
        failures_to_fail_over: config.probe.failures_to_fail_over,
        successes_to_fail_back: config.probe.successes_to_fail_back,
    };
    let mut listeners = Vec::with_capacity(config.listeners.len());
    for (((listener, id), prober), alive) in
        config.listeners.iter().zip(ids).zip(probers).zip(alive)
    {
        let counts = maps.socket_counts(*id)?;
        let held = health::held(
            &maps.cache_activity(*id)?,
            counts.down_epoch,
            health::monotonic_ns(),
            config.probe.signal_hold,
        );
        // A verdict an earlier agent pinned stands; a first one is up while the cache's sockets
        // exist (until it is written the listener gets no DNS to its cache). Either way this
        // probe is one more in the streak, never a verdict of its own.
        let tracker = HealthTracker::first(
            hysteresis,
            maps.health(*id)?,
            counts.down_epoch,
            listener.liveness == Liveness::Probes || counts.udp > 0,
            Probe::new(*alive, held),
        );
        maps.set_health(*id, tracker.health())?;
        listeners.push(ListenerRuntime {
            id: *id,
            name: listener.name.clone(),
            liveness: listener.liveness,
            prober,
            tracker,
            observed: (Route::Cache, Reason::Healthy),
            desired: static_pool(listener),
            source: source_name(&listener.source),
            synced: listener.source == UpstreamSource::Static,
        });
    }
    Ok(listeners)
}

/// The name of a pool source in logs and metrics.
fn source_name(source: &UpstreamSource) -> &'static str {
    match source {
        UpstreamSource::Static => sources::STATIC_SOURCE,
        UpstreamSource::Kubernetes { .. } => sources::SourceKind::Kubernetes.name(),
        UpstreamSource::ResolvConf(_) => sources::SourceKind::ResolvConf.name(),
    }
}

/// The configured pool of a static listener (`None` for dynamic sources).
pub(super) fn static_pool(listener: &Listener) -> Option<Vec<Upstream>> {
    (listener.source == UpstreamSource::Static).then(|| {
        listener
            .upstreams
            .iter()
            .copied()
            .map(Upstream::from)
            .collect()
    })
}
