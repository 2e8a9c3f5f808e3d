//! DNS per workload: the kernel's counts per cgroup turned into rates and the busiest workloads
//! (`rates`), and what the agent publishes of them (`View`).

use std::{collections::HashMap, time::Duration};

use redirector_common::workloads::{
    RCODE_CLASSES, RCODE_NOERROR, RCODE_NXDOMAIN, RCODE_OTHER, RCODE_REFUSED, RCODE_SERVFAIL,
    ROUTE_CACHE, ROUTE_DIRECT, ROUTE_REFUSED, ROUTE_UPSTREAM, ROUTES,
};

pub mod naming;
pub mod rates;

/// Each route's name, as metrics, `status` and `top` write it, by `ROUTE_*`.
pub const ROUTE_LABELS: [&str; ROUTES] = {
    let mut labels = [""; ROUTES];
    labels[ROUTE_CACHE] = "cache";
    labels[ROUTE_UPSTREAM] = "upstream";
    labels[ROUTE_REFUSED] = "refused";
    labels[ROUTE_DIRECT] = "direct";
    labels
};

/// Each rcode class's name, by `RCODE_*`.
pub const RCODE_LABELS: [&str; RCODE_CLASSES] = {
    let mut labels = [""; RCODE_CLASSES];
    labels[RCODE_NOERROR] = "noerror";
    labels[RCODE_NXDOMAIN] = "nxdomain";
    labels[RCODE_SERVFAIL] = "servfail";
    labels[RCODE_REFUSED] = "refused";
    labels[RCODE_OTHER] = "other";
    labels
};

/// How a workload is named in metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Name {
    /// What it is, in one label: `pod/NAMESPACE/NAME`, `pod/UID` (the API not asked),
    /// `unit/NAME.service`, or the cgroup's path.
    pub workload: String,
    /// A pod's namespace (empty otherwise, or when not known).
    pub namespace: String,
    /// A pod's name (empty otherwise, or when not known).
    pub pod: String,
}

/// What the agent last read of the workloads, for the metrics.
#[derive(Clone, Debug, Default)]
pub struct View {
    /// The busiest workloads over the last window, and the rest summed.
    pub top: rates::Top,
    /// The names of the busiest, by cgroup id.
    pub names: HashMap<u64, Name>,
    /// Every query counted since the agent started, by route.
    pub queries_total: [u64; ROUTES],
    /// Every reply counted since the agent started, by rcode class.
    pub replies_total: [u64; RCODE_CLASSES],
    /// Cgroups the kernel tracks now.
    pub tracked: usize,
    /// The window the rates are over.
    pub window: Duration,
}
