//! The suite's real node: a kubelet, containerd and runc in a VM booted with systemd
//! (`cargo xtask vm-test`'s `+node` boot, `tests/node.rs`), registered to a control plane on
//! the host.
//!
//! The host runs what the node needs from outside: etcd, kube-apiserver, kube-controller-manager
//! and kube-scheduler (natively: under TCG they would take the guest's two CPUs), and builds the
//! images the node runs (no registry is reachable: they are imported, never pulled). The guest
//! reaches the API server at [`API_HOST`]: qemu's user network, which lets the guest reach
//! nothing else (`restrict=on`), forwards that address's port to the host's loopback.
//!
//! The node's directory, written by the host before the guest boots and read by the guest
//! (which sees the host's root file system read-only), holds [`NodeDir`]'s files.

pub mod control_plane;
pub mod images;

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

/// The address the guest reaches the host's API server at (qemu's `guestfwd`).
pub const API_HOST: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 100);
/// The node's name, its kubelet's `--hostname-override`.
pub const NODE_NAME: &str = "node";
/// The environment variable that names the node's directory to the guest's test.
pub const DIR_ENV: &str = "REDIRECTOR_NODE_DIR";

/// The node's directory and the files in it.
#[derive(Clone, Debug)]
pub struct NodeDir(PathBuf);

impl NodeDir {
    /// The directory at `path`.
    #[must_use]
    pub fn new(path: &Path) -> Self {
        Self(path.to_owned())
    }

    /// The directory the guest's test is told of ([`DIR_ENV`]).
    ///
    /// # Errors
    /// When the variable is not set: the test runs only in the `+node` boot.
    pub fn from_env() -> anyhow::Result<Self> {
        let dir = std::env::var_os(DIR_ENV).ok_or_else(|| {
            anyhow::anyhow!(
                "{DIR_ENV} is not set: this test runs only on the suite's node (`cargo xtask \
                 vm-test --kernel 6.12 --tests node`, or `cargo xtask test`)"
            )
        })?;
        Ok(Self(PathBuf::from(dir)))
    }

    /// The directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The images the node imports, one `docker-archive` of them all.
    #[must_use]
    pub fn images(&self) -> PathBuf {
        self.0.join("images.tar")
    }

    /// The administrator's kubeconfig for the guest (server `https://API_HOST:PORT`).
    #[must_use]
    pub fn guest_kubeconfig(&self) -> PathBuf {
        self.0.join("guest.kubeconfig")
    }

    /// The API server's port, the same on the host's loopback and at [`API_HOST`].
    #[must_use]
    pub fn api_port(&self) -> PathBuf {
        self.0.join("api-port")
    }

    /// The previous release whose agent is in [`images::PREVIOUS`]: its version and commit, one
    /// space between.
    #[must_use]
    pub fn previous_release(&self) -> PathBuf {
        self.0.join("previous-release")
    }

    /// Written last, once everything above is.
    #[must_use]
    pub fn ready(&self) -> PathBuf {
        self.0.join("ready")
    }

    /// The control plane's scratch folder (etcd's data, certificates, logs).
    #[must_use]
    pub fn control_plane(&self) -> PathBuf {
        self.0.join("control-plane")
    }
}
