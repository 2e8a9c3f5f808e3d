//! The file as serde reads it, before validation: every key optional, unknown keys refused.

use std::path::PathBuf;

use redirector_common::settings::{EmptyPoolPolicy, Liveness};
use serde::Deserialize;

use super::InterfaceKind;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) cgroup: Option<PathBuf>,
    pub(super) pin_dir: Option<PathBuf>,
    pub(super) log_level: Option<String>,
    pub(super) reverse_nat_entries: Option<u32>,
    #[serde(default)]
    pub(super) kernel_log: bool,
    pub(super) cache_netns: Option<PathBuf>,
    pub(super) socket_reconcile_interval_ms: Option<u64>,
    pub(super) lock_file: Option<PathBuf>,
    pub(super) drain_socket: Option<PathBuf>,
    #[serde(default)]
    pub(super) probe: RawProbe,
    #[serde(default)]
    pub(super) interface: RawInterface,
    #[serde(default)]
    pub(super) kubernetes: RawKubernetes,
    #[serde(default)]
    pub(super) conntrack: RawConntrack,
    #[serde(default)]
    pub(super) metrics: RawMetrics,
    #[serde(default)]
    pub(super) workloads: RawWorkloads,
    #[serde(default, rename = "listener")]
    pub(super) listeners: Vec<RawListener>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawInterface {
    pub(super) manage: Option<bool>,
    pub(super) name: Option<String>,
    pub(super) kind: Option<InterfaceKind>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKubernetes {
    pub(super) kubeconfig: Option<PathBuf>,
    pub(super) resync_interval_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetrics {
    pub(super) enabled: Option<bool>,
    pub(super) address: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWorkloads {
    pub(super) accounting: Option<bool>,
    pub(super) tracked: Option<u32>,
    pub(super) top: Option<usize>,
    pub(super) interval_ms: Option<u64>,
    #[serde(default)]
    pub(super) exempt_cgroups: Vec<PathBuf>,
    pub(super) rate_limit_qps: Option<u32>,
    pub(super) rate_limit_burst: Option<u32>,
    #[serde(default)]
    pub(super) rate_limit_exempt_cgroups: Vec<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConntrack {
    pub(super) bypass: Option<bool>,
    pub(super) nft: Option<PathBuf>,
    pub(super) check_interval_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProbe {
    pub(super) name: Option<String>,
    pub(super) interval_ms: Option<u64>,
    pub(super) timeout_ms: Option<u64>,
    pub(super) failures_to_fail_over: Option<u32>,
    pub(super) successes_to_fail_back: Option<u32>,
    pub(super) stall_after_ms: Option<u64>,
    pub(super) signal_hold_ms: Option<u64>,
    pub(super) upstream_interval_ms: Option<u64>,
    pub(super) upstream_timeout_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawListener {
    pub(super) name: String,
    pub(super) address: String,
    pub(super) cache: Option<String>,
    #[serde(default)]
    pub(super) upstreams: Vec<String>,
    pub(super) kube_dns: Option<String>,
    pub(super) resolv_conf: Option<PathBuf>,
    #[serde(default)]
    pub(super) empty_pool: EmptyPoolPolicy,
    #[serde(default)]
    pub(super) skip_cgroups: Vec<PathBuf>,
    #[serde(default)]
    pub(super) liveness: Liveness,
    pub(super) probe_name: Option<String>,
}
