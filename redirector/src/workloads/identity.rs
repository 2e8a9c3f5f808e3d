//! What a cgroup's path says about what runs in it: a pod's container (the kubelet's layout, for
//! either cgroup driver), a systemd unit of the host, or neither. Pure text: no file is read.
//!
//! The kubelet's layouts below its cgroup root (`kubepods`), for a pod of UID `U`:
//!
//! | driver | Guaranteed | Burstable (BestEffort alike) |
//! | --- | --- | --- |
//! | systemd | `kubepods.slice/kubepods-podU'.slice/RT-ID.scope` | `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podU'.slice/RT-ID.scope` |
//! | cgroupfs | `kubepods/podU/ID` | `kubepods/burstable/podU/ID` |
//!
//! `U'` is the UID with `_` for `-` (a dash in a slice's name separates its parents), `RT` the
//! runtime's prefix (`cri-containerd`, `crio`, `docker`), `ID` the container's id (crun adds a
//! `container` child below it, which is still that container). A kubelet given another cgroup
//! root (`--cgroup-root`, or a node that is itself a container, as kind's) puts all of this below
//! a prefix, and systemd's names then carry the prefix too (`kubelet.slice/kubelet-kubepods.slice/
//! kubelet-kubepods-burstable.slice/...`): the kubepods component is searched for anywhere.

use std::fmt;

/// What owns a cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Workload {
    /// A pod's container (or the pod's own cgroup).
    Pod {
        /// The pod's UID, with dashes, as the API writes it. For a static pod, the kubelet names
        /// the cgroup after the pod's configuration hash (the annotation
        /// `kubernetes.io/config.hash` of its mirror pod), not after the mirror pod's UID: this is
        /// the id as the cgroup writes it, either way.
        uid: String,
        /// The pod's QoS class, from the level of the hierarchy the kubelet put it in.
        qos: Qos,
        /// The container's id, as its runtime gives it; `None` for the pod's own cgroup.
        container_id: Option<String>,
    },
    /// A systemd unit on the host (`system.slice/NAME.service`, `NAME.scope`, user slices...).
    Unit {
        /// The unit's name, with its suffix (`containerd.service`, `session-3.scope`).
        name: String,
    },
    /// Anything else: the cgroup path relative to the hierarchy's root, without leading or
    /// trailing slash (empty for the root itself).
    Other {
        /// The path.
        path: String,
    },
}

/// A pod's Quality of Service class, which the kubelet's hierarchy mirrors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Qos {
    /// Requests equal limits for every resource: the pod sits right below `kubepods`.
    Guaranteed,
    /// Some requests: below `kubepods/burstable`.
    Burstable,
    /// No requests nor limits: below `kubepods/besteffort`.
    BestEffort,
}

impl Qos {
    /// The class as the API writes it in `status.qosClass`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Guaranteed => "Guaranteed",
            Self::Burstable => "Burstable",
            Self::BestEffort => "BestEffort",
        }
    }
}

impl fmt::Display for Qos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A short label: `pod/UID`, `unit/NAME`, or the path with a leading slash (`/` for the root).
/// A pod's container is left out: containers come and go with new ids while the pod stays, and a
/// label is for the workload.
impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pod { uid, .. } => write!(f, "pod/{uid}"),
            Self::Unit { name } => write!(f, "unit/{name}"),
            Self::Other { path } => write!(f, "/{path}"),
        }
    }
}

/// What owns the cgroup at `path`, relative to the cgroup v2 hierarchy's root (as
/// `/proc/PID/cgroup` writes it; a leading slash is optional).
#[must_use]
pub fn parse(path: &str) -> Workload {
    let components: Vec<&str> = path
        .split('/')
        .filter(|component| !component.is_empty())
        .collect();
    if let Some(pod) = pod(&components) {
        return pod;
    }
    // The innermost unit: a unit that delegates its subtree (a user's manager, `user@1000.service`)
    // starts units of its own below it, and those say what runs.
    if let Some(unit) = components.iter().rev().find(|component| is_unit(component)) {
        return Workload::Unit {
            name: (*unit).to_owned(),
        };
    }
    Workload::Other {
        path: components.join("/"),
    }
}

/// The pod below the outermost kubepods component, if any. The outermost: a pod that runs a
/// kubelet of its own (a kind node in a pod) has its nested pods below it, which this node's API
/// server does not know.
fn pod(components: &[&str]) -> Option<Workload> {
    let root = components
        .iter()
        .position(|component| is_kubepods(component))?;
    let below = &components[root + 1..];
    let (at, uid) = below
        .iter()
        .enumerate()
        .find_map(|(at, component)| pod_uid(component).map(|uid| (at, uid)))?;
    let qos = below[..at]
        .iter()
        .find_map(|component| qos_level(component))
        .unwrap_or(Qos::Guaranteed);
    let container_id = below
        .get(at + 1)
        .and_then(|component| container_id(component));
    Some(Workload::Pod {
        uid,
        qos,
        container_id,
    })
}

/// The kubelet's root: `kubepods` (cgroupfs), `kubepods.slice`, or a slice that ends in it
/// (`kubelet-kubepods.slice` when the kubelet's cgroup root is `kubelet.slice`).
fn is_kubepods(component: &str) -> bool {
    component == "kubepods"
        || component == "kubepods.slice"
        || component.ends_with("-kubepods.slice")
}

/// The last dash-separated word of a systemd unit's name without its suffix: a slice's own
/// level (`kubepods-burstable.slice` → `burstable`), a scope's id (`crio-ID.scope` → `ID`).
fn last_word(stem: &str) -> &str {
    stem.rsplit('-').next().unwrap_or(stem)
}

/// The QoS level a component between kubepods and the pod stands for, if it is one.
fn qos_level(component: &str) -> Option<Qos> {
    let level = component
        .strip_suffix(".slice")
        .map_or(component, last_word);
    match level {
        "burstable" => Some(Qos::Burstable),
        "besteffort" => Some(Qos::BestEffort),
        _ => None,
    }
}

/// The UID of a pod's cgroup: `podUID` (cgroupfs), `...-podUID'.slice` (systemd, with `_` for
/// `-`). A UID is hex digits and dashes (a UUID, or a static pod's hash), which keeps a stray
/// directory that merely starts with "pod" from passing for a pod.
fn pod_uid(component: &str) -> Option<String> {
    let written = match component.strip_suffix(".slice") {
        Some(stem) => last_word(stem).strip_prefix("pod")?.replace('_', "-"),
        None => component.strip_prefix("pod")?.to_owned(),
    };
    let plausible = !written.is_empty()
        && written
            .chars()
            .all(|character| character.is_ascii_hexdigit() || character == '-');
    plausible.then_some(written)
}

/// The container id of a cgroup right below a pod's: `RT-ID.scope` (systemd; CRI-O's
/// `crio-conmon-ID.scope`, the container's monitor, gives its container's id), else the
/// directory's name, or its last dash-separated word (CRI-O under cgroupfs writes `crio-ID`).
fn container_id(component: &str) -> Option<String> {
    let id = last_word(component.strip_suffix(".scope").unwrap_or(component));
    (!id.is_empty()).then(|| id.to_owned())
}

/// Whether `component` names a systemd unit that holds processes (slices only hold other units).
fn is_unit(component: &str) -> bool {
    [".service", ".scope", ".socket", ".mount", ".swap"]
        .iter()
        .any(|suffix| {
            component
                .strip_suffix(suffix)
                .is_some_and(|stem| !stem.is_empty())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod's UID as the API writes it, and as a systemd slice name writes it.
    const UID: &str = "5f3c8b2a-1d4e-4f6a-9b7c-0e2d1a3b4c5d";
    const UID_SLICE: &str = "5f3c8b2a_1d4e_4f6a_9b7c_0e2d1a3b4c5d";
    const CONTAINER: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn pod(qos: Qos, container: Option<&str>) -> Workload {
        Workload::Pod {
            uid: UID.to_owned(),
            qos,
            container_id: container.map(ToOwned::to_owned),
        }
    }

    #[test]
    fn systemd_containerd_burstable_container() {
        let path = format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SLICE}.slice/\
             cri-containerd-{CONTAINER}.scope"
        );
        assert_eq!(parse(&path), pod(Qos::Burstable, Some(CONTAINER)));
        // As /proc/PID/cgroup writes it, with a leading slash.
        assert_eq!(
            parse(&format!("/{path}")),
            pod(Qos::Burstable, Some(CONTAINER))
        );
    }

    #[test]
    fn systemd_crio_container() {
        let path = format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SLICE}.slice/\
             crio-{CONTAINER}.scope"
        );
        assert_eq!(parse(&path), pod(Qos::Burstable, Some(CONTAINER)));
    }

    #[test]
    fn systemd_crio_conmon_is_named_after_its_container() {
        let path = format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SLICE}.slice/\
             crio-conmon-{CONTAINER}.scope"
        );
        assert_eq!(parse(&path), pod(Qos::Burstable, Some(CONTAINER)));
    }

    #[test]
    fn systemd_docker_container() {
        let path = format!(
            "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_SLICE}.slice/\
             docker-{CONTAINER}.scope"
        );
        assert_eq!(parse(&path), pod(Qos::BestEffort, Some(CONTAINER)));
    }

    #[test]
    fn crun_container_child_is_still_the_container() {
        let path = format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SLICE}.slice/\
             crio-{CONTAINER}.scope/container"
        );
        assert_eq!(parse(&path), pod(Qos::Burstable, Some(CONTAINER)));
    }

    #[test]
    fn systemd_guaranteed_pod_has_no_qos_level() {
        let path = format!(
            "kubepods.slice/kubepods-pod{UID_SLICE}.slice/cri-containerd-{CONTAINER}.scope"
        );
        assert_eq!(parse(&path), pod(Qos::Guaranteed, Some(CONTAINER)));
    }

    #[test]
    fn systemd_pod_slice_itself_has_no_container() {
        let path = format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SLICE}.slice"
        );
        assert_eq!(parse(&path), pod(Qos::Burstable, None));
    }

    #[test]
    fn systemd_besteffort_pod() {
        let path = format!(
            "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_SLICE}.slice"
        );
        assert_eq!(parse(&path), pod(Qos::BestEffort, None));
    }

    #[test]
    fn cgroupfs_burstable_container() {
        let path = format!("kubepods/burstable/pod{UID}/{CONTAINER}");
        assert_eq!(parse(&path), pod(Qos::Burstable, Some(CONTAINER)));
    }

    #[test]
    fn cgroupfs_guaranteed_container() {
        let path = format!("kubepods/pod{UID}/{CONTAINER}");
        assert_eq!(parse(&path), pod(Qos::Guaranteed, Some(CONTAINER)));
    }

    #[test]
    fn cgroupfs_besteffort_pod_itself() {
        let path = format!("kubepods/besteffort/pod{UID}");
        assert_eq!(parse(&path), pod(Qos::BestEffort, None));
    }

    #[test]
    fn cgroupfs_crio_container() {
        let path = format!("kubepods/burstable/pod{UID}/crio-{CONTAINER}");
        assert_eq!(parse(&path), pod(Qos::Burstable, Some(CONTAINER)));
    }

    #[test]
    fn systemd_below_the_kubelets_own_cgroup_root() {
        let path = format!(
            "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/\
             kubelet-kubepods-burstable-pod{UID_SLICE}.slice/cri-containerd-{CONTAINER}.scope"
        );
        assert_eq!(parse(&path), pod(Qos::Burstable, Some(CONTAINER)));
        let guaranteed = format!(
            "kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{UID_SLICE}.slice/\
             cri-containerd-{CONTAINER}.scope"
        );
        assert_eq!(parse(&guaranteed), pod(Qos::Guaranteed, Some(CONTAINER)));
    }

    #[test]
    fn cgroupfs_below_a_parent() {
        // A kind node: the node is a container, and its kubelet's hierarchy is below it.
        let path = format!(
            "system.slice/docker-{CONTAINER}.scope/kubepods/besteffort/pod{UID}/{CONTAINER}"
        );
        assert_eq!(parse(&path), pod(Qos::BestEffort, Some(CONTAINER)));
    }

    #[test]
    fn the_outermost_pod_is_this_nodes() {
        let inner = "0f0f0f0f_0000_4000_8000_000000000000";
        let path = format!(
            "kubepods/pod{UID}/{CONTAINER}/kubelet.slice/kubelet-kubepods.slice/\
             kubelet-kubepods-pod{inner}.slice"
        );
        assert_eq!(parse(&path), pod(Qos::Guaranteed, Some(CONTAINER)));
    }

    #[test]
    fn a_static_pod_is_named_by_its_config_hash() {
        let hash = "d41d8cd98f00b204e9800998ecf8427e";
        let path = format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{hash}.slice/\
             cri-containerd-{CONTAINER}.scope"
        );
        assert_eq!(
            parse(&path),
            Workload::Pod {
                uid: hash.to_owned(),
                qos: Qos::Burstable,
                container_id: Some(CONTAINER.to_owned()),
            }
        );
    }

    #[test]
    fn the_kubelets_own_levels_are_no_pod() {
        for path in [
            "kubepods.slice",
            "kubepods.slice/kubepods-burstable.slice",
            "kubepods/besteffort",
        ] {
            assert_eq!(
                parse(path),
                Workload::Other {
                    path: path.to_owned()
                },
                "{path}"
            );
        }
        // A directory that only starts with "pod".
        assert_eq!(
            parse("kubepods/podman"),
            Workload::Other {
                path: "kubepods/podman".to_owned()
            }
        );
    }

    #[test]
    fn a_host_service() {
        assert_eq!(
            parse("system.slice/containerd.service"),
            Workload::Unit {
                name: "containerd.service".to_owned()
            }
        );
    }

    #[test]
    fn a_templated_service_in_its_slice() {
        assert_eq!(
            parse("/system.slice/system-getty.slice/getty@tty1.service"),
            Workload::Unit {
                name: "getty@tty1.service".to_owned()
            }
        );
    }

    #[test]
    fn a_user_session() {
        assert_eq!(
            parse("user.slice/user-1000.slice/session-3.scope"),
            Workload::Unit {
                name: "session-3.scope".to_owned()
            }
        );
    }

    #[test]
    fn a_user_managers_own_units_are_the_innermost() {
        assert_eq!(
            parse("user.slice/user-1000.slice/user@1000.service/app.slice/dbus.service"),
            Workload::Unit {
                name: "dbus.service".to_owned()
            }
        );
        // A delegated subtree with no unit of its own is its service's.
        assert_eq!(
            parse("system.slice/containerd.service/sandbox"),
            Workload::Unit {
                name: "containerd.service".to_owned()
            }
        );
        assert_eq!(
            parse("init.scope"),
            Workload::Unit {
                name: "init.scope".to_owned()
            }
        );
    }

    #[test]
    fn a_path_without_a_unit_is_other() {
        assert_eq!(
            parse("/user.slice/user-1000.slice/"),
            Workload::Other {
                path: "user.slice/user-1000.slice".to_owned()
            }
        );
        assert_eq!(
            parse("/"),
            Workload::Other {
                path: String::new()
            }
        );
        assert_eq!(
            parse("machine/qemu-1"),
            Workload::Other {
                path: "machine/qemu-1".to_owned()
            }
        );
        // A suffix alone names no unit.
        assert_eq!(
            parse("odd/.service"),
            Workload::Other {
                path: "odd/.service".to_owned()
            }
        );
    }

    #[test]
    fn labels_are_short() {
        assert_eq!(
            pod(Qos::Burstable, Some(CONTAINER)).to_string(),
            format!("pod/{UID}")
        );
        assert_eq!(
            parse("system.slice/containerd.service").to_string(),
            "unit/containerd.service"
        );
        assert_eq!(parse("machine/qemu-1").to_string(), "/machine/qemu-1");
        assert_eq!(parse("").to_string(), "/");
        assert_eq!(Qos::BestEffort.to_string(), "BestEffort");
    }
}
