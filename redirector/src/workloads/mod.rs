//! Which workload a cgroup id stands for: the kernel programs count per cgroup v2 id, and
//! operators read pods and units. Three parts, joined by [`Resolver`]: the id's path in the
//! hierarchy ([`cgroups`], a bounded walk of the mount), what the path says ([`identity`], the
//! kubelet's and systemd's naming), and the pod's namespace and name ([`pods`], a watch of this
//! node's pods on the API server, which the agent records for the CLI in [`names_file`]). The
//! kernel's counts become rates and the busiest workloads in [`rates`]; [`View`] is what the
//! agent publishes of them.

pub mod cgroups;
pub mod counts;
pub mod identity;
pub mod judged;
pub mod names_file;
pub mod pods;
pub mod rates;

use std::{
    collections::HashMap,
    fmt,
    path::Path,
    time::{Duration, Instant},
};

use redirector_common::workloads::{
    RCODE_CLASSES, RCODE_NOERROR, RCODE_NXDOMAIN, RCODE_OTHER, RCODE_REFUSED, RCODE_SERVFAIL,
    ROUTE_CACHE, ROUTE_DIRECT, ROUTE_LIMITED, ROUTE_REFUSED, ROUTE_UPSTREAM, ROUTES,
};

use tracing::warn;

use self::{
    cgroups::CgroupNames,
    identity::{Qos, Workload},
    pods::PodNames,
};

/// What kind of workload a cgroup is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkloadKind {
    /// A pod (one of its containers, or its own cgroup).
    Pod,
    /// A systemd unit of the host.
    Unit,
    /// A cgroup that is neither.
    Other,
    /// A cgroup the walk did not find (gone before it was seen, beyond the walk's limits, or
    /// the hierarchy could not be read).
    Unknown,
}

impl WorkloadKind {
    /// The kind's name in labels and logs.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pod => "pod",
            Self::Unit => "unit",
            Self::Other => "other",
            Self::Unknown => "unknown",
        }
    }
}

impl fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A cgroup, named for labels: each field that applies to its kind is set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadName {
    /// The cgroup's id.
    pub cgroup_id: u64,
    /// What it is.
    pub kind: WorkloadKind,
    /// A pod's namespace, when the API server named it.
    pub namespace: Option<String>,
    /// A pod's name, when the API server named it.
    pub name: Option<String>,
    /// A pod's UID as its cgroup writes it (a static pod's configuration hash).
    pub uid: Option<String>,
    /// A pod's QoS class.
    pub qos: Option<Qos>,
    /// A pod's container id (`None` for the pod's own cgroup).
    pub container_id: Option<String>,
    /// A unit's name.
    pub unit: Option<String>,
    /// The cgroup's path relative to the hierarchy's root (`None` when unknown).
    pub cgroup_path: Option<String>,
}

impl WorkloadName {
    fn unknown(cgroup_id: u64) -> Self {
        Self {
            cgroup_id,
            kind: WorkloadKind::Unknown,
            namespace: None,
            name: None,
            uid: None,
            qos: None,
            container_id: None,
            unit: None,
            cgroup_path: None,
        }
    }
}

/// A short label: `pod/NAMESPACE/NAME` for a pod the API server named, else `pod/UID`;
/// `unit/NAME`; the path (with a leading slash) of another cgroup; `cgroup/ID` of an unknown one.
impl fmt::Display for WorkloadName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let (Some(namespace), Some(name)) = (&self.namespace, &self.name) {
            return write!(f, "pod/{namespace}/{name}");
        }
        if let Some(uid) = &self.uid {
            return write!(f, "pod/{uid}");
        }
        if let Some(unit) = &self.unit {
            return write!(f, "unit/{unit}");
        }
        match &self.cgroup_path {
            Some(path) => write!(f, "/{path}"),
            None => write!(f, "cgroup/{}", self.cgroup_id),
        }
    }
}

/// Names cgroup ids: their paths from the hierarchy, their pods' names from the API server when
/// it is followed ([`PodNames::follow`]). A pod the API server has not named (no API, or not
/// yet seen) is named by its UID alone.
#[derive(Debug)]
pub struct Resolver {
    cgroups: CgroupNames,
    pods: Option<PodNames>,
    /// Whether a failed walk has been told (told again only after a walk succeeds).
    failure_told: bool,
    /// Whether a truncated walk has been told (once: the limits do not change).
    truncation_told: bool,
}

impl Resolver {
    /// Names cgroups from `cgroups`, and pods from `pods` if the API server is followed.
    #[must_use]
    pub fn new(cgroups: CgroupNames, pods: Option<PodNames>) -> Self {
        Self {
            cgroups,
            pods,
            failure_told: false,
            truncation_told: false,
        }
    }

    /// The same resolver, naming pods from `pods` too.
    #[must_use]
    pub fn with_pods(self, pods: PodNames) -> Self {
        Self {
            pods: Some(pods),
            ..self
        }
    }

    /// Names pods from `pods` from now on (a newer record of them).
    pub fn set_pods(&mut self, pods: PodNames) {
        self.pods = Some(pods);
    }

    /// The name of cgroup `cgroup_id`.
    pub fn describe(&mut self, cgroup_id: u64) -> WorkloadName {
        self.describe_at(cgroup_id, Instant::now())
    }

    /// [`Self::describe`], at time `now` (when an unknown id may walk the hierarchy again).
    pub fn describe_at(&mut self, cgroup_id: u64, now: Instant) -> WorkloadName {
        let path = match self.cgroups.path_at(cgroup_id, now) {
            Ok(path) => path.map(ToOwned::to_owned),
            Err(error) => {
                if !std::mem::replace(&mut self.failure_told, true) {
                    warn!(error = %crate::error_chain(&error), "cgroups stay unnamed until the hierarchy can be read");
                }
                None
            }
        };
        if !self.cgroups.failing() {
            self.failure_told = false;
        }
        if self.cgroups.truncated() && !std::mem::replace(&mut self.truncation_told, true) {
            warn!(
                cgroups = self.cgroups.len(),
                "the cgroup hierarchy is larger than the walk's limits; some cgroups stay unnamed"
            );
        }
        let Some(path) = path else {
            return WorkloadName::unknown(cgroup_id);
        };
        let mut named = WorkloadName::unknown(cgroup_id);
        match identity::parse(&path) {
            Workload::Pod {
                uid,
                qos,
                container_id,
            } => {
                if let Some((namespace, name)) = self.pods.as_ref().and_then(|pods| pods.name(&uid))
                {
                    named.namespace = Some(namespace);
                    named.name = Some(name);
                }
                named.kind = WorkloadKind::Pod;
                named.uid = Some(uid);
                named.qos = Some(qos);
                named.container_id = container_id;
            }
            Workload::Unit { name } => {
                named.kind = WorkloadKind::Unit;
                named.unit = Some(name);
            }
            Workload::Other { .. } => named.kind = WorkloadKind::Other,
        }
        named.cgroup_path = Some(path);
        named
    }
}

/// Each route's name, as metrics, `status` and `top` write it, by `ROUTE_*`.
pub const ROUTE_LABELS: [&str; ROUTES] = {
    let mut labels = [""; ROUTES];
    labels[ROUTE_CACHE] = "cache";
    labels[ROUTE_UPSTREAM] = "upstream";
    labels[ROUTE_REFUSED] = "refused";
    labels[ROUTE_DIRECT] = "direct";
    labels[ROUTE_LIMITED] = "limited";
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

/// How a workload is named in metrics: its [`WorkloadName`] in three labels.
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

impl From<&WorkloadName> for Name {
    fn from(name: &WorkloadName) -> Self {
        Self {
            workload: name.to_string(),
            namespace: name.namespace.clone().unwrap_or_default(),
            pod: name.name.clone().unwrap_or_default(),
        }
    }
}

/// A name for cgroup `cgroup` from `resolver`, or its id where there is none (the hierarchy
/// could not be found).
pub fn name_of(resolver: Option<&mut Resolver>, cgroup: u64) -> Name {
    resolver.map_or_else(
        || Name {
            workload: format!("cgroup/{cgroup}"),
            ..Name::default()
        },
        |resolver| Name::from(&resolver.describe(cgroup)),
    )
}

/// A resolver of this host's cgroups, without the API server (pods named by UID), walking the
/// hierarchy again at most once `rescan_after` for an id not seen yet; `None` (logged) where the
/// hierarchy cannot be found.
#[must_use]
pub fn host_resolver(rescan_after: Duration) -> Option<Resolver> {
    match CgroupNames::open(cgroups::ScanLimits::default(), rescan_after) {
        Ok(cgroups) => Some(Resolver::new(cgroups, None)),
        Err(error) => {
            warn!(error = %crate::error_chain(&error), "cannot find the cgroup hierarchy; workloads are named by their cgroup ids");
            None
        }
    }
}

/// The CLI's resolver: [`host_resolver`], naming pods from the names the agent recorded beside
/// `lock_file` ([`names_file`]), if it did.
#[must_use]
pub fn cli_resolver(rescan_after: Duration, lock_file: &Path) -> Option<Resolver> {
    let resolver = host_resolver(rescan_after)?;
    match names_file::read(&names_file::path(lock_file)) {
        Ok(Some(pods)) => Some(resolver.with_pods(pods)),
        Ok(None) => Some(resolver),
        Err(error) => {
            warn!(error = %crate::error_chain(&error), "pods are named by their UIDs");
            Some(resolver)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{os::unix::fs::MetadataExt as _, path::PathBuf, time::Duration};

    use kube::runtime::watcher;

    use super::{cgroups::ScanLimits, pods::PodRecord, *};

    const UID: &str = "5f3c8b2a-1d4e-4f6a-9b7c-0e2d1a3b4c5d";
    const POD: &str = "kubepods.slice/kubepods-burstable.slice/\
                       kubepods-burstable-pod5f3c8b2a_1d4e_4f6a_9b7c_0e2d1a3b4c5d.slice";
    const CONTAINER: &str = "cri-containerd-0123456789abcdef.scope";

    /// A fake hierarchy with one pod's container, one service and one bare slice.
    struct Tree(PathBuf);

    impl Tree {
        fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("redirector-workloads-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            for path in [
                format!("{POD}/{CONTAINER}"),
                "system.slice/containerd.service".to_owned(),
                "machine.slice".to_owned(),
            ] {
                std::fs::create_dir_all(dir.join(path)).expect("a directory");
            }
            Self(dir)
        }

        fn id(&self, relative: &str) -> u64 {
            std::fs::metadata(self.0.join(relative))
                .expect("exists")
                .ino()
        }

        fn resolver(&self, pods: Option<PodNames>) -> Resolver {
            Resolver::new(
                CgroupNames::new(&self.0, ScanLimits::default(), Duration::from_secs(60)),
                pods,
            )
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_pod_the_api_named_has_its_namespace_and_name() {
        let tree = Tree::new("named");
        let pods = PodNames::new();
        pods.handle(watcher::Event::Apply(PodRecord {
            uid: UID.to_owned(),
            namespace: "shop".to_owned(),
            name: "checkout-7d9f".to_owned(),
            config_hash: None,
        }));
        let mut resolver = tree.resolver(Some(pods));
        let named = resolver.describe(tree.id(&format!("{POD}/{CONTAINER}")));
        assert_eq!(
            named,
            WorkloadName {
                cgroup_id: tree.id(&format!("{POD}/{CONTAINER}")),
                kind: WorkloadKind::Pod,
                namespace: Some("shop".to_owned()),
                name: Some("checkout-7d9f".to_owned()),
                uid: Some(UID.to_owned()),
                qos: Some(Qos::Burstable),
                container_id: Some("0123456789abcdef".to_owned()),
                unit: None,
                cgroup_path: Some(format!("{POD}/{CONTAINER}")),
            }
        );
        assert_eq!(named.to_string(), "pod/shop/checkout-7d9f");
        // The pod's own cgroup too.
        let own = resolver.describe(tree.id(POD));
        assert_eq!(own.name.as_deref(), Some("checkout-7d9f"));
        assert_eq!(own.container_id, None);
    }

    #[test]
    fn a_pod_without_the_api_is_named_by_its_uid() {
        let tree = Tree::new("unnamed");
        for pods in [None, Some(PodNames::new())] {
            let named = tree
                .resolver(pods)
                .describe(tree.id(&format!("{POD}/{CONTAINER}")));
            assert_eq!(named.kind, WorkloadKind::Pod);
            assert_eq!((named.namespace, named.name), (None, None));
            assert_eq!(named.uid.as_deref(), Some(UID));
            assert_eq!(
                tree.resolver(None)
                    .describe(tree.id(&format!("{POD}/{CONTAINER}")))
                    .to_string(),
                format!("pod/{UID}")
            );
        }
    }

    #[test]
    fn units_other_cgroups_and_unknown_ids() {
        let tree = Tree::new("kinds");
        let mut resolver = tree.resolver(None);
        let unit = resolver.describe(tree.id("system.slice/containerd.service"));
        assert_eq!(unit.kind, WorkloadKind::Unit);
        assert_eq!(unit.unit.as_deref(), Some("containerd.service"));
        assert_eq!(unit.to_string(), "unit/containerd.service");
        let other = resolver.describe(tree.id("machine.slice"));
        assert_eq!(other.kind, WorkloadKind::Other);
        assert_eq!(other.cgroup_path.as_deref(), Some("machine.slice"));
        assert_eq!(other.to_string(), "/machine.slice");
        let root = resolver.describe(tree.id(""));
        assert_eq!(
            (root.kind, root.to_string()),
            (WorkloadKind::Other, "/".to_owned())
        );
        let unknown = resolver.describe(u64::MAX);
        assert_eq!(unknown, WorkloadName::unknown(u64::MAX));
        assert_eq!(unknown.to_string(), format!("cgroup/{}", u64::MAX));
        assert_eq!(WorkloadKind::Unknown.to_string(), "unknown");
    }

    #[test]
    fn an_unreadable_hierarchy_names_nothing_and_does_not_fail() {
        let mut resolver = Resolver::new(
            CgroupNames::new("/nonexistent/cgroup", ScanLimits::default(), Duration::ZERO),
            None,
        );
        assert_eq!(resolver.describe(1).kind, WorkloadKind::Unknown);
        assert_eq!(resolver.describe(1).kind, WorkloadKind::Unknown);
    }
}
