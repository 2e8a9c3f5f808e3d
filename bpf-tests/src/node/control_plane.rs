//! The node's control plane on the host: etcd and kube-apiserver ([`KubeApiserver`], advertising
//! [`super::API_HOST`]), kube-controller-manager (the DaemonSet, ReplicaSet, EndpointSlice and
//! garbage collector controllers, and the `kube-root-ca.crt` ConfigMap every pod's token volume
//! mounts) and kube-scheduler (DaemonSet pods are bound by it). All built from the pinned
//! k8s.io/kubernetes (`go_peers`), stopped by pid when dropped.

use std::{process::Command, time::Duration};

use anyhow::Context as _;

use super::{API_HOST, NodeDir};
use crate::{command::TestProcess, go_peers, kube_apiserver::KubeApiserver};

/// The running control plane.
#[derive(Debug)]
pub struct ControlPlane {
    // Dropped in this order: the clients before the server, the server before etcd.
    _scheduler: TestProcess,
    _controller_manager: TestProcess,
    apiserver: KubeApiserver,
}

impl ControlPlane {
    /// Starts it in `node`'s control-plane folder and writes the guest's kubeconfig and the
    /// API server's port there.
    ///
    /// # Errors
    /// When a component does not start, with what it printed.
    pub fn start(node: &NodeDir) -> anyhow::Result<Self> {
        let dir = node.control_plane();
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let apiserver = KubeApiserver::start_advertising(&dir, Some(API_HOST))?;
        let local = dir.join("local.kubeconfig");
        std::fs::write(
            &local,
            apiserver.admin_kubeconfig_at(std::net::Ipv4Addr::LOCALHOST),
        )
        .with_context(|| format!("writing {}", local.display()))?;
        let kubeconfig = format!("--kubeconfig={}", local.display());
        let ca = apiserver.ca();

        let mut controller_manager = Command::new(go_peers::binary("kube-controller-manager")?);
        controller_manager.args([
            kubeconfig.as_str(),
            "--leader-elect=false",
            // No serving port: nothing scrapes it, and none is free to be sure of.
            "--secure-port=0",
            // Published as every namespace's kube-root-ca.crt, the CA of pods' API clients.
            &format!("--root-ca-file={}", ca.display()),
            "--use-service-account-credentials=false",
            // Pods' IPs come from the node's CNI configuration, not from a node CIDR.
            "--allocate-node-cidrs=false",
            "--controllers=*,-bootstrapsigner,-tokencleaner,-nodeipam,-csrsigning",
        ]);
        let controller_manager = TestProcess::start(
            "kube-controller-manager",
            controller_manager,
            "Starting daemon sets controller",
            Duration::from_secs(120),
        )?;
        let mut scheduler = Command::new(go_peers::binary("kube-scheduler")?);
        scheduler.args([
            kubeconfig.as_str(),
            &format!("--authentication-kubeconfig={}", local.display()),
            &format!("--authorization-kubeconfig={}", local.display()),
            "--leader-elect=false",
            "--secure-port=0",
        ]);
        let scheduler = TestProcess::start(
            "kube-scheduler",
            scheduler,
            "Starting Kubernetes Scheduler",
            Duration::from_secs(120),
        )?;
        std::fs::write(
            node.guest_kubeconfig(),
            apiserver.admin_kubeconfig_at(API_HOST),
        )
        .context("writing the guest's kubeconfig")?;
        std::fs::write(node.api_port(), apiserver.port().to_string())
            .context("writing the API server's port")?;
        Ok(Self {
            _scheduler: scheduler,
            _controller_manager: controller_manager,
            apiserver,
        })
    }

    /// The API server.
    #[must_use]
    pub const fn apiserver(&self) -> &KubeApiserver {
        &self.apiserver
    }
}
