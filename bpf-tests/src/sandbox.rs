//! A throwaway node: a cgroup, a "node" network namespace with the listener addresses, a "pod"
//! namespace behind a veth, an "upstream" namespace with two DNS servers, and a private bpffs.
//! Everything is removed when the sandbox is dropped, also when a test fails.
//!
//! Here the sandbox itself, its parts and its pins; in the modules below its network (`network`),
//! the helper binaries (`tools`), the servers and caches it runs (`servers`), the clients that
//! query through it (`clients`), the agent configurations it writes (`config`) and its scratch
//! files (`files`).

use std::{
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::Context as _;

use crate::{bpffs::BpfFs, cgroup::TestCgroup, command::TestProcess, netns::NetNs};

mod clients;
mod config;
mod files;
mod network;
mod servers;
mod tools;

pub use clients::{DigOutcome, HeldClient, Query, Transport};
pub use config::UNMANAGED_INTERFACE;
pub use servers::CacheSpec;
pub use tools::{Tools, redirector_bin};

/// Prefix of every cgroup, namespace, link and mount a sandbox creates (`cargo xtask test`
/// sweeps leftovers with it after a crash).
pub const PREFIX: &str = "rdt";

/// Which namespace a process runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ns {
    /// The node ("host network"): listener addresses and the cache.
    Node,
    /// A pod behind a veth.
    Pod,
    /// The upstream servers' namespace.
    Upstream,
}

/// A sandbox. Fields drop in order: processes, cgroups (child first), namespaces, bpffs.
#[derive(Debug)]
pub struct Sandbox {
    servers: Vec<(String, TestProcess)>,
    skipped: TestCgroup,
    cgroup: TestCgroup,
    pod: NetNs,
    upstream: NetNs,
    node: NetNs,
    bpffs: BpfFs,
    scratch: ScratchDir,
    tools: Tools,
    tag: String,
}

/// A directory for the test's files (configurations), removed on drop.
#[derive(Debug)]
struct ScratchDir(PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

static SANDBOXES: AtomicU32 = AtomicU32::new(0);

/// Fails loudly unless the process can do what the sandbox needs.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "bpf-tests load eBPF programs, create cgroups and network namespaces: they must run as \
         root. Run `sudo cargo xtask test` (or `cargo xtask test` as root)."
    );
}

impl Sandbox {
    /// Builds the sandbox: cgroups, namespaces, links, addresses, routes, bpffs.
    pub fn new(tools: Tools) -> anyhow::Result<Self> {
        require_root();
        let serial = SANDBOXES.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|since| since.subsec_nanos())
            .unwrap_or_default();
        let tag = format!(
            "{:06x}",
            (std::process::id().wrapping_mul(0x9E37_79B9)
                ^ serial.wrapping_mul(0x85EB_CA6B)
                ^ nanos)
                & 0x00ff_ffff
        );
        let root = redirector::sys::cgroup::default_attach_cgroup()
            .context("finding the cgroup v2 hierarchy")?;
        let scratch = ScratchDir(std::env::temp_dir().join(format!("{PREFIX}-{tag}-files")));
        std::fs::create_dir_all(&scratch.0)
            .with_context(|| format!("creating {}", scratch.0.display()))?;
        // `cargo xtask sweep` removes a sandbox only once this process is gone.
        std::fs::write(scratch.0.join("owner"), std::process::id().to_string())
            .context("recording the sandbox owner")?;
        let bpffs = BpfFs::mount(&std::env::temp_dir().join(format!("{PREFIX}-{tag}-bpffs")))?;
        let node = NetNs::create(&format!("{PREFIX}-{tag}-node"))?;
        let upstream = NetNs::create(&format!("{PREFIX}-{tag}-up"))?;
        let pod = NetNs::create(&format!("{PREFIX}-{tag}-pod"))?;
        let cgroup = TestCgroup::create(&root, &format!("{PREFIX}-{tag}"))?;
        let skipped = cgroup.child("cache")?;
        let sandbox = Self {
            servers: Vec::new(),
            skipped,
            cgroup,
            pod,
            upstream,
            node,
            bpffs,
            scratch,
            tools,
            tag,
        };
        sandbox.wire().context("wiring the sandbox network")?;
        Ok(sandbox)
    }

    /// The namespace `ns`.
    #[must_use]
    pub fn netns(&self, ns: Ns) -> &NetNs {
        match ns {
            Ns::Node => &self.node,
            Ns::Pod => &self.pod,
            Ns::Upstream => &self.upstream,
        }
    }

    /// The cgroup the programs attach to; clients run in it.
    #[must_use]
    pub fn cgroup(&self) -> &TestCgroup {
        &self.cgroup
    }

    /// A child cgroup for "the cache's own queries", to configure as skipped.
    #[must_use]
    pub fn skipped_cgroup(&self) -> &TestCgroup {
        &self.skipped
    }

    /// The bpffs directory for the agent's pins.
    #[must_use]
    pub fn pin_dir(&self) -> PathBuf {
        self.bpffs.path().join("redirector")
    }

    /// The pinned array map `name` (of `names`), opened for a test to read or set by hand what
    /// the programs or an earlier agent would have left there.
    pub fn pinned_array<V: aya::Pod>(
        &self,
        name: &str,
    ) -> anyhow::Result<aya::maps::Array<aya::maps::MapData, V>> {
        use aya::maps::{Array, Map, MapData};
        let path = self.pin_dir().join("maps").join(name);
        let data =
            MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
        Ok(Array::try_from(Map::from_map_data(data)?)?)
    }

    /// The layout version the pinned maps record (`DATAPATH_CONFIG`).
    pub fn pinned_layout(&self) -> anyhow::Result<u32> {
        Ok(redirector::datapath::Maps::open_pinned(&self.pin_dir())?
            .datapath_config()?
            .layout_version)
    }

    /// The helper binaries.
    #[must_use]
    pub fn tools(&self) -> &Tools {
        &self.tools
    }

    /// The node namespace's file, for `cache_netns`.
    #[must_use]
    pub fn node_netns_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(self.node.name())
    }

    /// The sandbox's unique tag.
    #[must_use]
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// What `bpftool cgroup show` lists on the sandbox's cgroup (empty: nothing attached).
    pub fn attached_programs(&self) -> anyhow::Result<String> {
        crate::command::run(
            "bpftool",
            ["cgroup", "show", &self.cgroup.path().display().to_string()],
        )
    }
}
