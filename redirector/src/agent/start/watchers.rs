//! The watchers of the upstream sources, started once the agent steers: the Kubernetes client
//! (when a listener follows kube-dns) and one task per dynamic source.

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    path::PathBuf,
};

use tokio::{sync::mpsc, task::JoinHandle};

use crate::{
    agent::AgentError,
    config::{Config, UpstreamSource},
    sources::{self, FedListener, SourceEvent},
};

/// A Kubernetes client when some listener follows kube-dns.
pub(super) async fn kube_client(config: &Config) -> Result<Option<kube::Client>, AgentError> {
    let needed = config
        .listeners
        .iter()
        .any(|listener| matches!(listener.source, UpstreamSource::Kubernetes { .. }));
    if !needed {
        return Ok(None);
    }
    let kube_config = match &config.kubernetes.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(|source| {
                AgentError::Kubeconfig {
                    path: path.clone(),
                    source,
                }
            })?;
            kube::Config::from_custom_kubeconfig(
                kubeconfig,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(|source| AgentError::Kubeconfig {
                path: path.clone(),
                source,
            })?
        }
        None => kube::Config::infer()
            .await
            .map_err(|error| AgentError::KubeConfig(kube::Error::InferConfig(error)))?,
    };
    let mut kube_config = kube_config;
    // The watcher retries with its own backoff and reports each failure, so an outage shows in
    // the log and the metrics at once; the client's own retries (up to 15, for minutes) would
    // hide it.
    kube_config.default_retry = false;
    kube::Client::try_from(kube_config)
        .map(Some)
        .map_err(AgentError::KubeConfig)
}

/// Starts one task per dynamic source (one watcher per Service, one per resolv.conf), each
/// feeding every listener that names it.
pub(super) fn start_sources(
    config: &Config,
    ids: &[u32],
    kube_client: Option<kube::Client>,
) -> (mpsc::Receiver<SourceEvent>, Vec<JoinHandle<()>>) {
    let (sender, events) = mpsc::channel(1024);
    let listener_addresses: HashSet<IpAddr> = config
        .listeners
        .iter()
        .map(|listener| listener.address)
        .collect();
    let mut services: HashMap<(String, String), Vec<FedListener>> = HashMap::new();
    let mut files: HashMap<PathBuf, Vec<FedListener>> = HashMap::new();
    for (listener, id) in config.listeners.iter().zip(ids) {
        let fed = FedListener {
            id: *id,
            address: listener.address,
        };
        match &listener.source {
            UpstreamSource::Static => {}
            UpstreamSource::Kubernetes { namespace, service } => services
                .entry((namespace.clone(), service.clone()))
                .or_default()
                .push(fed),
            UpstreamSource::ResolvConf(path) => files.entry(path.clone()).or_default().push(fed),
        }
    }
    let mut tasks = Vec::new();
    if let Some(client) = kube_client {
        for ((namespace, service), fed) in services {
            tasks.push(tokio::spawn(sources::kubernetes::watch(
                client.clone(),
                namespace,
                service,
                fed,
                listener_addresses.clone(),
                config.kubernetes.resync_interval,
                sender.clone(),
            )));
        }
    }
    for (path, fed) in files {
        tasks.push(tokio::spawn(sources::resolv_conf::watch(
            path,
            fed,
            listener_addresses.clone(),
            sender.clone(),
        )));
    }
    (events, tasks)
}
