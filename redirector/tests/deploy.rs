//! The deployment files (issue 7): the systemd unit, the example configurations, the Kubernetes
//! manifests and the Containerfile, checked against what the agent needs.
//!
//! Every manifest is parsed into its k8s-openapi type and serialized back: the types ignore
//! fields they do not know, so a typo or a field at the wrong level would vanish silently; the
//! round trip makes it a difference, and the typed checks below see what the API server would.
//! Tools these checks need (`systemd-analyze`, `kubectl`) are not optional: a missing one fails
//! its test with what to install, never skips it.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
};

use common::{read, repo};
use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, PodSpec, Probe, ServiceAccount, Volume},
        rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use redirector::config::{Config, UpstreamSource};
use serde::{Deserialize as _, Serialize, de::DeserializeOwned};

mod common;
mod served;

/// The Kustomize base, relative to the repository.
const BASE: &str = "deploy/kubernetes/base";
/// The overlay that deploys it in kube-system.
const OVERLAY: &str = "deploy/kubernetes/overlays/kube-system";
/// The agent's container in the DaemonSet.
const AGENT: &str = "redirector";
/// The init container that mounts bpffs when the node has none.
const PREPARE_NODE: &str = "prepare-node";

/// Where `a` and `b` differ, as JSON pointers (`/spec/template/...`).
fn differences(a: &serde_json::Value, b: &serde_json::Value, at: &str, out: &mut Vec<String>) {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                let path = format!("{at}/{key}");
                match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => differences(x, y, &path, out),
                    _ => out.push(path),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (index, (x, y)) in a.iter().zip(b).enumerate() {
                differences(x, y, &format!("{at}/{index}"), out);
            }
        }
        _ if a != b => out.push(at.to_owned()),
        _ => {}
    }
}

/// Parses `text` as a `T` and checks that the type keeps the whole document.
fn typed_from<T: DeserializeOwned + Serialize>(name: &str, text: &str) -> Result<T, String> {
    let kind = std::any::type_name::<T>();
    let written: serde_json::Value =
        serde_yaml::from_str(text).map_err(|error| format!("{name}: not YAML: {error}"))?;
    let object: T =
        serde_yaml::from_str(text).map_err(|error| format!("{name}: not a {kind}: {error}"))?;
    let parsed = serde_json::to_value(&object).map_err(|error| format!("{name}: {error}"))?;
    let mut differ = Vec::new();
    differences(&written, &parsed, "", &mut differ);
    if differ.is_empty() {
        Ok(object)
    } else {
        Err(format!(
            "{name}: {kind} does not keep these fields as written (unknown or misplaced?): {}",
            differ.join(", ")
        ))
    }
}

/// A manifest of the base, parsed into its type.
fn manifest<T: DeserializeOwned + Serialize>(file: &str) -> T {
    typed_from(file, &read(&format!("{BASE}/{file}"))).unwrap_or_else(|error| panic!("{error}"))
}

fn daemonset() -> DaemonSet {
    manifest("daemonset.yaml")
}

fn pod(daemonset: &DaemonSet) -> &PodSpec {
    daemonset
        .spec
        .as_ref()
        .and_then(|spec| spec.template.spec.as_ref())
        .expect("the DaemonSet has a pod template")
}

fn all_containers(pod: &PodSpec) -> impl Iterator<Item = &Container> {
    pod.init_containers.iter().flatten().chain(&pod.containers)
}

fn container<'a>(pod: &'a PodSpec, name: &str) -> &'a Container {
    all_containers(pod)
        .find(|container| container.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn volume<'a>(pod: &'a PodSpec, name: &str) -> &'a Volume {
    pod.volumes
        .iter()
        .flatten()
        .find(|volume| volume.name == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

fn added_capabilities(container: &Container) -> BTreeSet<&str> {
    container
        .security_context
        .as_ref()
        .and_then(|context| context.capabilities.as_ref())
        .and_then(|capabilities| capabilities.add.as_ref())
        .into_iter()
        .flatten()
        .map(String::as_str)
        .collect()
}

/// The configuration the DaemonSet runs with: the file the base's `configMapGenerator` makes
/// its ConfigMap from.
fn configmap_config() -> String {
    read(&format!("{BASE}/config.toml"))
}

/// The ConfigMap a kustomize build generated, and the one its DaemonSet's `config` volume names.
fn generated_config(objects: &[serde_json::Value]) -> (ConfigMap, String) {
    let configmap: ConfigMap =
        serde_json::from_value(find(objects, "ConfigMap").clone()).expect("a ConfigMap");
    let daemonset: DaemonSet =
        serde_json::from_value(find(objects, "DaemonSet").clone()).expect("a DaemonSet");
    let named = volume(pod(&daemonset), "config")
        .config_map
        .as_ref()
        .map(|source| source.name.clone())
        .expect("the config volume is a ConfigMap");
    (configmap, named)
}

fn parse_config(name: &str, text: &str) -> Config {
    Config::parse(text)
        .unwrap_or_else(|error| panic!("{name}: {}", redirector::error_chain(&error)))
}

/// The host directory a path of the agent's container comes from, when a hostPath volume
/// mounted at the same path covers it (so that the path means the same in the pod and on the
/// host), with the mount.
fn host_mount_covering<'a>(
    pod: &'a PodSpec,
    agent: &'a Container,
    path: &Path,
) -> Option<&'a k8s_openapi::api::core::v1::VolumeMount> {
    agent.volume_mounts.iter().flatten().find(|mount| {
        let host = volume(pod, &mount.name)
            .host_path
            .as_ref()
            .map(|host| host.path.as_str());
        host == Some(mount.mount_path.as_str()) && path.starts_with(&mount.mount_path)
    })
}

/// Asserts that `subjects` are the base's ServiceAccount alone, with no namespace (the overlay
/// sets it).
fn binds_the_service_account(subjects: &[k8s_openapi::api::rbac::v1::Subject]) {
    let service_account: ServiceAccount = manifest("serviceaccount.yaml");
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(
        Some(&subjects[0].name),
        service_account.metadata.name.as_ref()
    );
    assert_eq!(
        subjects[0].namespace, None,
        "the overlay sets the subject's namespace"
    );
}
#[test]
fn every_manifest_keeps_its_fields_through_its_type() {
    let _: DaemonSet = manifest("daemonset.yaml");
    let _: ServiceAccount = manifest("serviceaccount.yaml");
    let _: Role = manifest("role.yaml");
    let _: RoleBinding = manifest("rolebinding.yaml");
    let _: ClusterRole = manifest("clusterrole.yaml");
    let _: ClusterRoleBinding = manifest("clusterrolebinding.yaml");
}

#[test]
fn the_round_trip_catches_a_misspelled_field() {
    let text = read(&format!("{BASE}/daemonset.yaml"));
    assert!(text.contains("      hostNetwork: true\n"));
    let broken = text.replace("      hostNetwork: true\n", "      hostNetwrok: true\n");
    let error = typed_from::<DaemonSet>("daemonset.yaml", &broken)
        .expect_err("a misspelled field must be caught");
    assert!(error.contains("/spec/template/spec/hostNetwrok"), "{error}");
}

#[test]
fn the_kustomization_lists_exactly_the_base_files_and_no_namespace() {
    let kustomization: serde_json::Value =
        serde_yaml::from_str(&read(&format!("{BASE}/kustomization.yaml"))).expect("YAML");
    assert_eq!(kustomization["kind"], "Kustomization");
    assert!(
        kustomization.get("namespace").is_none(),
        "the base is namespace-agnostic"
    );
    let resources: BTreeSet<String> = kustomization["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|resource| resource.as_str().expect("a file name").to_owned())
        .collect();
    // The generator's inputs are files of the base too.
    let generated: BTreeSet<String> = kustomization["configMapGenerator"]
        .as_array()
        .expect("a configMapGenerator")
        .iter()
        .flat_map(|generator| generator["files"].as_array().expect("files").clone())
        .map(|file| file.as_str().expect("a file name").to_owned())
        .collect();
    assert_eq!(generated, BTreeSet::from(["config.toml".to_owned()]));
    let listed: BTreeSet<String> = resources.union(&generated).cloned().collect();
    let present: BTreeSet<String> = std::fs::read_dir(repo().join(BASE))
        .expect("the base directory")
        .map(|entry| {
            entry
                .expect("a directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name != "kustomization.yaml")
        .collect();
    assert_eq!(listed, present);
    for file in &resources {
        let document: serde_json::Value =
            serde_yaml::from_str(&read(&format!("{BASE}/{file}"))).expect("YAML");
        assert!(
            document["metadata"].get("namespace").is_none(),
            "{file} names a namespace; the overlay chooses it"
        );
    }
}

#[test]
fn no_container_is_privileged_and_each_has_only_its_capabilities() {
    let daemonset = daemonset();
    let pod = pod(&daemonset);
    assert_eq!(pod.host_pid, None, "the pod does not share the host's PIDs");
    assert_eq!(pod.host_ipc, None);
    for container in all_containers(pod) {
        let name = &container.name;
        let context = container
            .security_context
            .as_ref()
            .unwrap_or_else(|| panic!("{name}: no securityContext"));
        assert_eq!(context.privileged, Some(false), "{name}");
        assert_eq!(context.read_only_root_filesystem, Some(true), "{name}");
        assert_eq!(
            context.run_as_user,
            Some(0),
            "{name}: the agent must be root"
        );
        let drop: Vec<&str> = context
            .capabilities
            .as_ref()
            .and_then(|capabilities| capabilities.drop.as_ref())
            .into_iter()
            .flatten()
            .map(String::as_str)
            .collect();
        assert_eq!(drop, ["ALL"], "{name}");
        for mount in container.volume_mounts.iter().flatten() {
            assert_ne!(
                mount.mount_propagation.as_deref(),
                Some("Bidirectional"),
                "{name}: Bidirectional propagation needs a privileged container"
            );
        }
    }
    // Justified in daemonset.yaml and deploy/systemd/redirector.service.
    assert_eq!(
        added_capabilities(container(pod, AGENT)),
        BTreeSet::from(["BPF", "NET_ADMIN", "PERFMON"])
    );
    assert_eq!(
        container(pod, AGENT)
            .security_context
            .as_ref()
            .and_then(|context| context.allow_privilege_escalation),
        Some(false),
        "no_new_privs for the agent"
    );
    assert_eq!(
        added_capabilities(container(pod, PREPARE_NODE)),
        BTreeSet::from(["SYS_ADMIN", "SYS_CHROOT", "SYS_PTRACE"])
    );
}

#[test]
fn the_pod_is_a_node_critical_host_network_agent() {
    let daemonset = daemonset();
    let pod = pod(&daemonset);
    assert_eq!(pod.host_network, Some(true));
    // The node's name picks its subset of a large kube-dns pool (`sources::subset`).
    let node_name = container(pod, AGENT)
        .env
        .iter()
        .flatten()
        .find(|variable| variable.name == "NODE_NAME")
        .and_then(|variable| variable.value_from.as_ref())
        .and_then(|source| source.field_ref.as_ref())
        .map(|field| field.field_path.as_str());
    assert_eq!(node_name, Some("spec.nodeName"));
    assert_eq!(pod.dns_policy.as_deref(), Some("Default"));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let service_account: ServiceAccount = manifest("serviceaccount.yaml");
    assert_eq!(
        pod.service_account_name.as_deref(),
        service_account.metadata.name.as_deref()
    );

    let tolerations = pod.tolerations.as_deref().unwrap_or_default();
    for toleration in tolerations {
        assert!(
            toleration.key.as_deref().is_some_and(|key| !key.is_empty()),
            "a toleration without a key tolerates every taint: {toleration:?}"
        );
    }
    let tolerated: BTreeSet<(&str, Option<&str>)> = tolerations
        .iter()
        .map(|toleration| {
            (
                toleration.key.as_deref().unwrap_or_default(),
                toleration.effect.as_deref(),
            )
        })
        .collect();
    for wanted in [
        ("CriticalAddonsOnly", None),
        ("node.kubernetes.io/not-ready", Some("NoExecute")),
        ("node.kubernetes.io/not-ready", Some("NoSchedule")),
        ("node.kubernetes.io/unreachable", Some("NoExecute")),
        ("node.kubernetes.io/unreachable", Some("NoSchedule")),
        ("node.kubernetes.io/disk-pressure", Some("NoSchedule")),
        ("node.kubernetes.io/memory-pressure", Some("NoSchedule")),
        ("node.kubernetes.io/pid-pressure", Some("NoSchedule")),
        ("node.kubernetes.io/unschedulable", Some("NoSchedule")),
        ("node.kubernetes.io/network-unavailable", Some("NoSchedule")),
    ] {
        assert!(tolerated.contains(&wanted), "not tolerated: {wanted:?}");
    }

    let strategy = daemonset
        .spec
        .as_ref()
        .and_then(|spec| spec.update_strategy.as_ref())
        .expect("an update strategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.as_ref().expect("rollingUpdate");
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(1)));
    assert_eq!(
        rolling.max_surge,
        Some(IntOrString::Int(0)),
        "two agents on one node would fight over the lock"
    );

    let agent = container(pod, AGENT);
    let resources = agent.resources.as_ref().expect("resources");
    let requests = resources.requests.as_ref().expect("requests");
    assert!(requests.contains_key("cpu") && requests.contains_key("memory"));
    assert!(
        resources.limits.is_none(),
        "no limits: BPF map memory is charged to the pod, and CPU throttling delays probes"
    );
}

#[test]
fn probes_reach_the_endpoint_the_configuration_opens() {
    let daemonset = daemonset();
    let pod = pod(&daemonset);
    let agent = container(pod, AGENT);
    let text = configmap_config();
    let config = parse_config("config.toml", &text);
    assert!(config.metrics.enabled);
    // kubelet probes a hostNetwork pod at the node's address: loopback would not answer.
    assert!(
        config.metrics.address.ip().is_unspecified(),
        "metrics.address {} is not reachable at the node's address",
        config.metrics.address
    );
    let port = |name: &str| -> i32 {
        agent
            .ports
            .iter()
            .flatten()
            .find(|port| port.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no container port {name}"))
            .container_port
    };
    assert_eq!(
        port("metrics"),
        i32::from(config.metrics.address.port()),
        "the container port is the metrics port"
    );
    let check = |probe: Option<&Probe>, what: &str, path: &str| {
        let get = probe
            .and_then(|probe| probe.http_get.as_ref())
            .unwrap_or_else(|| panic!("no {what} httpGet"));
        assert_eq!(get.path.as_deref(), Some(path), "{what}");
        let number = match &get.port {
            IntOrString::Int(number) => *number,
            IntOrString::String(name) => port(name),
        };
        assert_eq!(
            number,
            i32::from(config.metrics.address.port()),
            "{what} port"
        );
        assert_eq!(
            get.host, None,
            "{what}: kubelet must probe the pod's address"
        );
    };
    check(agent.liveness_probe.as_ref(), "livenessProbe", "/healthz");
    check(agent.startup_probe.as_ref(), "startupProbe", "/healthz");
    check(agent.readiness_probe.as_ref(), "readinessProbe", "/readyz");

    let annotations = daemonset
        .spec
        .as_ref()
        .and_then(|spec| spec.template.metadata.as_ref())
        .and_then(|metadata| metadata.annotations.as_ref())
        .expect("pod annotations");
    assert_eq!(
        annotations.get("prometheus.io/port").map(String::as_str),
        Some(config.metrics.address.port().to_string().as_str())
    );
    assert_eq!(
        annotations.get("prometheus.io/path").map(String::as_str),
        Some("/metrics")
    );
}

#[test]
fn the_configmap_configuration_is_valid_and_its_paths_are_the_hosts() {
    let daemonset = daemonset();
    let pod = pod(&daemonset);
    let agent = container(pod, AGENT);
    let text = configmap_config();
    let config = parse_config("config.toml", &text);

    // The agent reads the ConfigMap's config.toml.
    let command: Vec<&str> = agent
        .command
        .iter()
        .flatten()
        .chain(agent.args.iter().flatten())
        .map(String::as_str)
        .collect();
    let config_path = command
        .windows(2)
        .find(|pair| pair[0] == "--config")
        .map(|pair| pair[1])
        .expect("run --config PATH");
    let (directory, file) = config_path.rsplit_once('/').expect("an absolute path");
    assert_eq!(file, "config.toml");
    let mount = agent
        .volume_mounts
        .iter()
        .flatten()
        .find(|mount| mount.mount_path == directory)
        .expect("the configuration directory is mounted");
    assert_eq!(
        volume(pod, &mount.name)
            .config_map
            .as_ref()
            .map(|source| source.name.as_str()),
        Some("redirector-config"),
        "the name the base's configMapGenerator makes (a_changed_configuration_rolls_out_like_an_image)"
    );
    // The agent runs directly (it finds its own cgroup inside a cgroup namespace itself).
    assert_eq!(&command[..2], ["/usr/local/bin/redirector", "run"]);
    assert!(
        !agent
            .volume_mounts
            .iter()
            .flatten()
            .any(|mount| mount.mount_path == "/host/proc"),
        "the agent needs no host /proc"
    );

    // Pins and the lock on the host, so they outlive the pod and `uninstall` on the node finds
    // them; resolv.conf files from the host.
    let pins = host_mount_covering(pod, agent, &config.pin_dir)
        .unwrap_or_else(|| panic!("pin_dir {} is not a host path", config.pin_dir.display()));
    assert_eq!(pins.mount_propagation.as_deref(), Some("HostToContainer"));
    assert_ne!(pins.read_only, Some(true));
    let lock = host_mount_covering(pod, agent, &config.lock_file).unwrap_or_else(|| {
        panic!(
            "lock_file {} is not a host path",
            config.lock_file.display()
        )
    });
    assert_ne!(lock.read_only, Some(true));
    let cgroup = host_mount_covering(pod, agent, Path::new("/sys/fs/cgroup"))
        .expect("the cgroup v2 hierarchy is mounted");
    assert_eq!(cgroup.read_only, Some(true));
    assert_eq!(
        config.cgroup, None,
        "the cgroup v2 root, found in mountinfo"
    );
    for listener in &config.listeners {
        if let UpstreamSource::ResolvConf(path) = &listener.source {
            assert!(
                host_mount_covering(pod, agent, path).is_some(),
                "{}: {} is not mounted from the host",
                listener.name,
                path.display()
            );
        }
    }
    assert_eq!(config.cache_netns, None, "hostNetwork: the agent's own");

    // AKS layout: the node and cluster listeners, the cluster pool from kube-dns in the
    // namespace the Role must be created in.
    let sources: BTreeMap<IpAddr, &UpstreamSource> = config
        .listeners
        .iter()
        .map(|listener| (listener.address, &listener.source))
        .collect();
    assert_eq!(
        sources.get(&IpAddr::from([169, 254, 10, 10])),
        Some(&&UpstreamSource::ResolvConf(PathBuf::from(
            "/run/systemd/resolve/resolv.conf"
        )))
    );
    assert_eq!(
        sources.get(&IpAddr::from([169, 254, 10, 11])),
        Some(&&UpstreamSource::Kubernetes {
            namespace: "kube-system".to_owned(),
            service: "kube-dns".to_owned()
        })
    );
}

#[test]
fn rbac_grants_only_reading_endpointslices() {
    let role: Role = manifest("role.yaml");
    let rules = role.rules.as_deref().unwrap_or_default();
    assert_eq!(rules.len(), 1, "{rules:?}");
    let rule = &rules[0];
    assert_eq!(
        rule.api_groups.as_deref(),
        Some(&["discovery.k8s.io".to_owned()][..])
    );
    assert_eq!(
        rule.resources.as_deref(),
        Some(&["endpointslices".to_owned()][..])
    );
    let verbs: BTreeSet<&str> = rule.verbs.iter().map(String::as_str).collect();
    assert_eq!(verbs, BTreeSet::from(["get", "list", "watch"]));
    assert_eq!(rule.resource_names, None);
    assert_eq!(rule.non_resource_urls, None);

    let binding: RoleBinding = manifest("rolebinding.yaml");
    assert_eq!(binding.role_ref.kind, "Role");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    binds_the_service_account(binding.subjects.as_deref().unwrap_or_default());

    // Nothing cluster-wide anywhere under deploy/kubernetes but reading pods (the next test).
    let mut files = vec![repo().join("deploy/kubernetes")];
    let mut kinds = Vec::new();
    while let Some(path) = files.pop() {
        if path.is_dir() {
            for entry in std::fs::read_dir(&path).expect("a directory") {
                files.push(entry.expect("an entry").path());
            }
        } else if path
            .extension()
            .is_some_and(|extension| extension == "yaml")
        {
            let text = std::fs::read_to_string(&path).expect("readable");
            for document in serde_yaml::Deserializer::from_str(&text) {
                let value = serde_json::Value::deserialize(document).expect("YAML");
                kinds.push((path.clone(), value["kind"].as_str().map(str::to_owned)));
            }
        }
    }
    assert!(kinds.len() >= 10, "{kinds:?}");
    let base = repo().join(BASE);
    for (path, kind) in kinds {
        let pods = [
            base.join("clusterrole.yaml"),
            base.join("clusterrolebinding.yaml"),
        ];
        assert!(
            !matches!(kind.as_deref(), Some("ClusterRole" | "ClusterRoleBinding"))
                || pods.contains(&path),
            "{}: {kind:?}",
            path.display()
        );
    }
}

/// The one cluster-wide grant: reading pods, which RBAC cannot narrow to one node's (the agent
/// narrows its requests with a field selector instead).
#[test]
fn the_cluster_role_grants_only_reading_pods() {
    let role: ClusterRole = manifest("clusterrole.yaml");
    assert_eq!(role.metadata.name.as_deref(), Some("redirector-pods"));
    assert_eq!(role.aggregation_rule, None);
    let rules = role.rules.as_deref().unwrap_or_default();
    assert_eq!(rules.len(), 1, "{rules:?}");
    let rule = &rules[0];
    assert_eq!(rule.api_groups.as_deref(), Some(&[String::new()][..]));
    assert_eq!(rule.resources.as_deref(), Some(&["pods".to_owned()][..]));
    let verbs: BTreeSet<&str> = rule.verbs.iter().map(String::as_str).collect();
    assert_eq!(verbs, BTreeSet::from(["list", "watch"]));
    assert_eq!(rule.resource_names, None);
    assert_eq!(rule.non_resource_urls, None);

    let binding: ClusterRoleBinding = manifest("clusterrolebinding.yaml");
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    binds_the_service_account(binding.subjects.as_deref().unwrap_or_default());
    // The agent's refusal names the files to apply.
    let pods = read("redirector/src/workloads/pods.rs");
    assert!(
        pods.contains("clusterrole.yaml, clusterrolebinding.yaml"),
        "redirector/src/workloads/pods.rs names the ClusterRole's files"
    );
}

#[test]
fn the_node_events_rbac_grants_only_creating_and_patching_events_in_default() {
    let dir = "deploy/kubernetes/node-events";
    let kustomization: serde_json::Value =
        serde_yaml::from_str(&read(&format!("{dir}/kustomization.yaml"))).expect("YAML");
    assert!(
        kustomization.get("namespace").is_none(),
        "each file names default itself"
    );
    let role: Role = serde_yaml::from_str(&read(&format!("{dir}/role.yaml"))).expect("a Role");
    assert_eq!(role.metadata.namespace.as_deref(), Some("default"));
    let rules = role.rules.as_deref().unwrap_or_default();
    assert_eq!(rules.len(), 1, "{rules:?}");
    assert_eq!(
        rules[0].api_groups.as_deref(),
        Some(&["events.k8s.io".to_owned()][..])
    );
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(&["events".to_owned()][..])
    );
    let verbs: BTreeSet<&str> = rules[0].verbs.iter().map(String::as_str).collect();
    assert_eq!(verbs, BTreeSet::from(["create", "patch"]));
    let binding: RoleBinding =
        serde_yaml::from_str(&read(&format!("{dir}/rolebinding.yaml"))).expect("a RoleBinding");
    assert_eq!(binding.metadata.namespace.as_deref(), Some("default"));
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let service_account: ServiceAccount = manifest("serviceaccount.yaml");
    let subjects = binding.subjects.as_deref().unwrap_or_default();
    assert_eq!(subjects.len(), 1);
    assert_eq!(
        Some(&subjects[0].name),
        service_account.metadata.name.as_ref()
    );
    assert_eq!(subjects[0].namespace.as_deref(), Some("kube-system"));
    // The overlay includes it, and the agent's warning names it.
    let overlay: serde_json::Value =
        serde_yaml::from_str(&read(&format!("{OVERLAY}/kustomization.yaml"))).expect("YAML");
    assert!(
        overlay["resources"]
            .as_array()
            .is_some_and(|resources| resources.iter().any(|r| r == "../../node-events")),
        "{overlay}"
    );
    assert!(overlay.get("namespace").is_none(), "{overlay}");
    assert!(
        read("redirector/src/telemetry/node_events.rs").contains("deploy/kubernetes/node-events")
    );
}

#[test]
fn the_podmonitor_component_scrapes_the_agent_pods() {
    let monitor: serde_json::Value = serde_yaml::from_str(&read(
        "deploy/kubernetes/components/podmonitor/podmonitor.yaml",
    ))
    .expect("YAML");
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(monitor["kind"], "PodMonitor");
    let daemonset = daemonset();
    let labels = daemonset
        .spec
        .as_ref()
        .and_then(|spec| spec.template.metadata.as_ref())
        .and_then(|metadata| metadata.labels.as_ref())
        .expect("pod labels");
    let selector = monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels");
    assert!(!selector.is_empty());
    for (key, value) in selector {
        assert_eq!(labels.get(key).map(String::as_str), value.as_str(), "{key}");
    }
    let endpoints = monitor["spec"]["podMetricsEndpoints"]
        .as_array()
        .expect("endpoints");
    assert_eq!(endpoints.len(), 1);
    assert_eq!(endpoints[0]["port"], "metrics");
    assert_eq!(endpoints[0]["path"], "/metrics");
    let component: serde_json::Value = serde_yaml::from_str(&read(
        "deploy/kubernetes/components/podmonitor/kustomization.yaml",
    ))
    .expect("YAML");
    assert_eq!(component["kind"], "Component");
    assert_eq!(component["resources"][0], "podmonitor.yaml");
}

/// Runs the binary the tests build: `redirector check-config --config PATH`.
fn check_config(path: &Path) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_redirector"))
        .args(["check-config", "--config"])
        .arg(path)
        .output()
        .expect("the redirector binary runs");
    (
        output.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    )
}

/// A fresh scratch directory for one test.
fn scratch(tag: &str) -> PathBuf {
    common::scratch("deploy", tag)
}

#[test]
fn the_example_configurations_are_valid() {
    // What `Config::parse` (and `check-config`) validates is everything that needs no host:
    // whether skip_cgroups exist, the pin directory is on bpffs and cache_netns opens is
    // checked by the agent when it starts, on the node. So the NodeLocal example's placeholder
    // cgroup (a cache unit that does not exist here) parses once its line is uncommented, with no
    // substitution of the path.
    let aks = parse_config("aks.toml", &read("deploy/examples/aks.toml"));
    let node = aks.listener("node").expect("node listener").1;
    assert_eq!(node.address, IpAddr::from([169, 254, 10, 10]));
    assert_eq!(
        node.source,
        UpstreamSource::ResolvConf(PathBuf::from("/run/systemd/resolve/resolv.conf"))
    );
    let cluster = aks.listener("cluster").expect("cluster listener").1;
    assert_eq!(cluster.address, IpAddr::from([169, 254, 10, 11]));
    assert_eq!(
        cluster.source,
        UpstreamSource::Kubernetes {
            namespace: "kube-system".to_owned(),
            service: "kube-dns".to_owned()
        }
    );
    assert!(aks.interface.manage);
    assert!(
        aks.kubernetes.kubeconfig.is_some(),
        "a node has no in-cluster credentials"
    );
    assert!(aks.metrics.address.ip().is_loopback());

    let nodelocal = parse_config(
        "nodelocal-dnscache.toml",
        &read("deploy/examples/nodelocal-dnscache.toml"),
    );
    assert!(
        !nodelocal.interface.manage,
        "node-local-dns owns its interface and addresses"
    );
    let cache: SocketAddr = "169.254.20.10:53".parse().expect("an address");
    let local = nodelocal
        .listeners
        .iter()
        .find(|listener| listener.address == IpAddr::from([169, 254, 20, 10]))
        .expect("the link-local listener");
    assert_eq!(local.cache, cache);
    let cluster_ip = nodelocal
        .listeners
        .iter()
        .find(|listener| listener.address == IpAddr::from([10, 96, 0, 10]))
        .expect("the kube-dns ClusterIP listener");
    assert_eq!(
        cluster_ip.cache, cache,
        "the ClusterIP is steered to the cache"
    );
    for listener in &nodelocal.listeners {
        assert!(
            matches!(listener.source, UpstreamSource::Kubernetes { .. }),
            "{}: the upstreams are the kube-dns endpoints",
            listener.name
        );
    }
    assert!(
        cluster_ip.skip_cgroups.is_empty(),
        "the stock manifest's cache needs no skipped cgroup"
    );
    // The documented skip_cgroups line, uncommented: it parses, placeholder and all.
    let commented = "# skip_cgroups = [\"/sys/fs/cgroup/system.slice/node-local-dns.service\"]\n";
    let text = read("deploy/examples/nodelocal-dnscache.toml");
    assert_eq!(text.matches(commented).count(), 1);
    let uncommented = text.replace(commented, &commented[2..]);
    let with_skip = parse_config("nodelocal-dnscache.toml, uncommented", &uncommented);
    let cluster_ip = with_skip
        .listeners
        .iter()
        .find(|listener| listener.address == IpAddr::from([10, 96, 0, 10]))
        .expect("the kube-dns ClusterIP listener");
    assert_eq!(
        cluster_ip.skip_cgroups,
        [PathBuf::from(
            "/sys/fs/cgroup/system.slice/node-local-dns.service"
        )]
    );

    // The same files through the binary's own check.
    for path in [
        repo().join("deploy/examples/aks.toml"),
        repo().join("deploy/examples/nodelocal-dnscache.toml"),
        repo().join(BASE).join("config.toml"),
    ] {
        let (ok, said) = check_config(&path);
        assert!(ok, "{}: {said}", path.display());
        assert!(said.contains("valid"), "{said}");
    }
}

/// `(section, key)` → values, in file order, of a systemd unit (comments and blank lines out).
fn unit_settings(text: &str) -> BTreeMap<(String, String), Vec<String>> {
    let mut settings: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    let mut section = String::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line
            .strip_prefix('[')
            .and_then(|rest| rest.strip_suffix(']'))
        {
            name.clone_into(&mut section);
            continue;
        }
        let (key, value) = line.split_once('=').expect("key=value");
        settings
            .entry((section.clone(), key.trim().to_owned()))
            .or_default()
            .push(value.trim().to_owned());
    }
    settings
}

/// The runtime's default seccomp profile with bpf(2) allowed for CAP_BPF instead of only for
/// CAP_SYS_ADMIN: what deploy/seccomp/redirector.json must be.
fn least_privilege_profile(mut default: serde_json::Value) -> serde_json::Value {
    let syscalls = default["syscalls"]
        .as_array_mut()
        .expect("a profile lists syscalls");
    for rule in syscalls.iter_mut() {
        if let Some(names) = rule["names"].as_array_mut() {
            names.retain(|name| name != "bpf");
        }
    }
    syscalls.push(serde_json::json!({
        "names": ["bpf"],
        "action": "SCMP_ACT_ALLOW",
        "includes": { "caps": ["CAP_BPF"] },
    }));
    default
}

#[test]
fn the_agent_runs_under_the_shipped_seccomp_profile_the_init_container_installs() {
    // The shipped profile is podman's default (containers-common) with the one change.
    let default = "/usr/share/containers/seccomp.json";
    let default: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(default).unwrap_or_else(|error| {
            panic!("{default} (install podman; `cargo xtask test` does): {error}")
        }))
        .expect("the runtime's default profile");
    let shipped: serde_json::Value =
        serde_json::from_str(&read("deploy/seccomp/redirector.json")).expect("the shipped profile");
    let expected = least_privilege_profile(default.clone());
    let mut found = Vec::new();
    differences(&expected, &shipped, "", &mut found);
    assert!(
        found.is_empty(),
        "deploy/seccomp/redirector.json is not the runtime's default plus bpf(2) for CAP_BPF; \
         write it again from /usr/share/containers/seccomp.json: {found:?}"
    );
    assert_ne!(default, shipped, "the check sees the change");

    let daemonset = daemonset();
    let pod = pod(&daemonset);
    let agent = container(pod, AGENT);
    let profile = agent
        .security_context
        .as_ref()
        .and_then(|context| context.seccomp_profile.as_ref())
        .expect("the agent's seccompProfile");
    assert_eq!(profile.type_, "Localhost");
    assert_eq!(
        profile.localhost_profile.as_deref(),
        Some("redirector.json")
    );
    // prepare-node writes it where the kubelet reads it (its root directory's seccomp/).
    let prepare = container(pod, PREPARE_NODE);
    assert_eq!(
        prepare.command.as_deref(),
        Some(&["/usr/local/bin/prepare-node".to_owned()][..])
    );
    let script = read("deploy/container/prepare-node.sh");
    assert!(
        script.contains("profile=/host/seccomp/redirector.json"),
        "{script}"
    );
    let mount = prepare
        .volume_mounts
        .iter()
        .flatten()
        .find(|mount| mount.mount_path == "/host/seccomp")
        .expect("prepare-node mounts the kubelet's seccomp directory");
    let host = volume(pod, &mount.name)
        .host_path
        .as_ref()
        .expect("a hostPath");
    assert_eq!(host.path, "/var/lib/kubelet/seccomp");
    // The image carries what prepare-node copies.
    let containerfile = read("Containerfile");
    assert!(containerfile.contains("/usr/share/redirector/seccomp.json"));
    assert!(script.contains("/usr/share/redirector/seccomp.json"));
}

#[test]
fn the_systemd_unit_has_the_documented_settings() {
    let settings = unit_settings(&read("deploy/systemd/redirector.service"));
    let one = |section: &str, key: &str| -> String {
        let values = settings
            .get(&(section.to_owned(), key.to_owned()))
            .unwrap_or_else(|| panic!("[{section}] {key} is not set"));
        assert_eq!(values.len(), 1, "[{section}] {key} is set twice");
        values[0].clone()
    };
    let words = |section: &str, key: &str| -> BTreeSet<String> {
        settings
            .get(&(section.to_owned(), key.to_owned()))
            .into_iter()
            .flatten()
            .flat_map(|value| value.split_whitespace().map(str::to_owned))
            .collect()
    };
    assert_eq!(one("Service", "Type"), "notify");
    assert_eq!(
        one("Service", "ExecStart"),
        "/usr/local/bin/redirector run --config /etc/redirector/config.toml"
    );
    assert_eq!(one("Service", "Restart"), "always");
    let timeout = one("Service", "TimeoutStartSec");
    assert!(
        timeout != "infinity" && timeout != "0",
        "TimeoutStartSec must be bounded: {timeout}"
    );
    // The bpffs the pins need, mounted by the unit shipped beside it where none is.
    assert!(words("Unit", "Wants").contains("redirector-bpffs.service"));
    assert!(words("Unit", "After").contains("redirector-bpffs.service"));
    assert!(words("Unit", "Before").contains("kubelet.service"));
    assert!(words("Unit", "Before").contains("node-local-dns.service"));
    assert_eq!(one("Install", "WantedBy"), "multi-user.target");
    let capabilities: BTreeSet<String> = ["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"]
        .map(str::to_owned)
        .into();
    assert_eq!(words("Service", "CapabilityBoundingSet"), capabilities);
    assert_eq!(words("Service", "AmbientCapabilities"), capabilities);
    assert_eq!(one("Service", "ProtectSystem"), "strict");
    let writable = words("Service", "ReadWritePaths");
    assert!(writable.contains("/sys/fs/bpf") && writable.contains("/run/redirector"));
    assert_eq!(one("Service", "ProtectHome"), "yes");
    assert_eq!(one("Service", "NoNewPrivileges"), "yes");
    assert_eq!(one("Service", "PrivateTmp"), "yes");
    // What would break the agent: another network namespace, user namespace or no cgroups.
    for key in ["PrivateNetwork", "PrivateUsers", "User", "DynamicUser"] {
        assert!(
            !settings.contains_key(&("Service".to_owned(), key.to_owned())),
            "{key} would break the agent"
        );
    }
    // The paths the agent writes by default are the writable ones.
    let defaults = Config::parse("[[listener]]\nname = \"n\"\naddress = \"169.254.10.10\"\n")
        .expect("a minimal configuration");
    assert!(
        writable
            .iter()
            .any(|path| defaults.pin_dir.starts_with(path))
    );
    assert!(
        writable
            .iter()
            .any(|path| defaults.lock_file.starts_with(path))
    );
}

/// `systemd-analyze verify` on `unit`, written as redirector.service in a scratch directory.
/// `Ok(false)`: systemd-analyze is not installed. It exits 0 after warnings (an unknown key, a
/// bad value), so anything it prints is a failure too.
fn verify_unit(unit: &str, tag: &str) -> Result<(), String> {
    let dir = scratch(tag);
    let path = dir.join("redirector.service");
    std::fs::write(&path, unit).expect("written");
    // The unit it requires, shipped beside it, is verified with it.
    let bpffs = dir.join("redirector-bpffs.service");
    std::fs::write(&bpffs, read("deploy/systemd/redirector-bpffs.service")).expect("written");
    let output = match Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .arg(&bpffs)
        .output()
    {
        Ok(output) => output,
        Err(error) => {
            panic!("running systemd-analyze (install systemd; `cargo xtask test` does): {error}")
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if output.status.success() && said.trim().is_empty() {
        Ok(())
    } else {
        Err(format!(
            "systemd-analyze verify ({}): {said}",
            output.status
        ))
    }
}

#[test]
fn systemd_analyze_verifies_the_unit() {
    // verify refuses a unit whose ExecStart binary does not exist: point it at the binary these
    // tests build (the same program /usr/local/bin/redirector is on a node).
    let unit = read("deploy/systemd/redirector.service");
    let binary = env!("CARGO_BIN_EXE_redirector");
    let installed = "ExecStart=/usr/local/bin/redirector ";
    assert!(unit.contains(installed));
    let here = unit.replace(installed, &format!("ExecStart={binary} "));
    if let Err(error) = verify_unit(&here, "unit") {
        panic!("{error}");
    }
    // The check can fail: a misspelled option is only a warning to systemd-analyze.
    let misspelled = here.replace("ProtectHome=yes", "ProtectHomme=yes");
    let error = verify_unit(&misspelled, "misspelled").expect_err("a warning must fail");
    assert!(error.contains("ProtectHomme"), "{error}");
    // And without the binary in place, as on a machine where it is not installed.
    let error = verify_unit(
        &unit.replace(installed, "ExecStart=/nonexistent/redirector "),
        "nobin",
    )
    .expect_err("a missing binary must fail");
    assert!(error.contains("/nonexistent/redirector"), "{error}");
}

/// The kubectl `cargo xtask setup` builds from `bpf-tests/go/kube` (`target/go/bin`, beside
/// this test's `target/<profile>/deps`), else the PATH's.
fn kubectl() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.ancestors().nth(3)?.join("go/bin/kubectl")))
        .filter(|built| built.exists())
        .unwrap_or_else(|| "kubectl".into())
}

/// `kubectl kustomize DIR`, parsed. Without kubectl the test fails: the overlays are what
/// operators apply, and only kustomize itself shows what they build.
fn kustomize(dir: &Path) -> Vec<serde_json::Value> {
    let output = match Command::new(kubectl()).arg("kustomize").arg(dir).output() {
        Ok(output) => output,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => panic!(
            "kubectl is not built, so the Kustomize overlays cannot be built: run `cargo xtask \
             setup` (it builds kubectl into target/go/bin), or put a kubectl of 1.21 or later on \
             the PATH (its built-in kustomize must know `components` and `patches`)"
        ),
        Err(error) => panic!("running kubectl: {error}"),
    };
    assert!(
        output.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).expect("UTF-8");
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| serde_json::Value::deserialize(document).expect("YAML"))
        .collect()
}

fn find<'a>(objects: &'a [serde_json::Value], kind: &str) -> &'a serde_json::Value {
    objects
        .iter()
        .find(|object| object["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// The base, relative to an overlay `depth` levels below `dir` (kustomize refuses absolute
/// paths).
fn base_from(dir: &Path, depth: usize) -> String {
    let up = "../".repeat(depth + dir.components().count() - 1);
    format!(
        "{up}{}",
        repo()
            .join(BASE)
            .display()
            .to_string()
            .trim_start_matches('/')
    )
}

/// The ConfigMap's name carries a hash of config.toml, and the DaemonSet names it: a changed
/// configuration is a changed pod template, which the DaemonSet rolls out one node at a time,
/// never read at once by every pod that restarts. An overlay that replaces config.toml (the way
/// config.toml says) gets a name of its own.
#[test]
fn a_changed_configuration_rolls_out_like_an_image() {
    let (configmap, named) = generated_config(&kustomize(&repo().join(BASE)));
    let name = configmap.metadata.name.clone().expect("a name");
    assert!(name.starts_with("redirector-config-"), "{name}");
    assert_eq!(named, name, "the DaemonSet names the generated ConfigMap");
    assert_eq!(
        configmap
            .data
            .as_ref()
            .and_then(|data| data.get("config.toml")),
        Some(&configmap_config())
    );

    let dir = scratch("changed-config");
    let base = base_from(&dir, 0);
    std::fs::write(
        dir.join("config.toml"),
        format!(
            "{}\nsocket_reconcile_interval_ms = 4000\n",
            configmap_config()
        ),
    )
    .expect("written");
    std::fs::write(
        dir.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - \
             {base}\nconfigMapGenerator:\n  - name: redirector-config\n    behavior: replace\n    \
             files:\n      - config.toml\n"
        ),
    )
    .expect("written");
    let (changed, changed_named) = generated_config(&kustomize(&dir));
    let changed_name = changed.metadata.name.expect("a name");
    assert_ne!(
        changed_name, name,
        "a changed configuration kept the ConfigMap's name"
    );
    assert_eq!(changed_named, changed_name);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_overlays_put_the_rbac_next_to_kube_dns() {
    let objects = kustomize(&repo().join(OVERLAY));
    assert_eq!(objects.len(), 9);
    // The node-events RBAC stays in default, where Events about Nodes live; the ClusterRole and
    // its binding have no namespace; the rest is in kube-system, and every binding's subject is
    // the agent's ServiceAccount there.
    for object in &objects {
        let events = object["metadata"]["name"] == "redirector-node-events";
        let cluster = matches!(
            object["kind"].as_str(),
            Some("ClusterRole" | "ClusterRoleBinding")
        );
        let expected = match (events, cluster) {
            (true, _) => serde_json::json!("default"),
            (false, true) => serde_json::Value::Null,
            (false, false) => serde_json::json!("kube-system"),
        };
        assert_eq!(
            object["metadata"]["namespace"], expected,
            "{}",
            object["kind"]
        );
        if matches!(
            object["kind"].as_str(),
            Some("RoleBinding" | "ClusterRoleBinding")
        ) {
            assert_eq!(
                object["subjects"][0]["namespace"], "kube-system",
                "{object}"
            );
        }
    }
    let daemonset: DaemonSet =
        serde_json::from_value(find(&objects, "DaemonSet").clone()).expect("a DaemonSet");
    // The shipped overlay names this release's image.
    let image = format!(
        "registry.example.com/redirector:{}",
        redirector::release::VERSION
    );
    for container in all_containers(pod(&daemonset)) {
        assert_eq!(container.image.as_deref(), Some(image.as_str()));
    }

    // docs/operations.md's procedure for running the agent in another namespace: a first
    // overlay chooses the namespace, a second puts the Role and RoleBinding back in kube-system
    // and names the subject's namespace (kustomize drops it when the binding moves).
    let dir = scratch("other-namespace");
    let base_from = |depth: usize| base_from(&dir, depth);
    std::fs::create_dir_all(dir.join("namespace")).expect("a directory");
    std::fs::create_dir_all(dir.join("rbac")).expect("a directory");
    std::fs::write(
        dir.join("namespace/kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
             namespace: dns-system\nresources:\n  - {}\n",
            base_from(1)
        ),
    )
    .expect("written");
    std::fs::write(dir.join("rbac/kustomization.yaml"), OTHER_NAMESPACE_RBAC).expect("written");
    let objects = kustomize(&dir.join("rbac"));
    let _ = std::fs::remove_dir_all(&dir);
    for object in &objects {
        let expected = match object["kind"].as_str() {
            Some("Role" | "RoleBinding") => serde_json::json!("kube-system"),
            Some("ClusterRole" | "ClusterRoleBinding") => serde_json::Value::Null,
            _ => serde_json::json!("dns-system"),
        };
        assert_eq!(
            object["metadata"]["namespace"], expected,
            "{}",
            object["kind"]
        );
    }
    assert_eq!(
        find(&objects, "RoleBinding")["subjects"][0]["namespace"],
        "dns-system"
    );
    // The ClusterRoleBinding's subject follows the first overlay's namespace by itself.
    assert_eq!(
        find(&objects, "ClusterRoleBinding")["subjects"][0]["namespace"],
        "dns-system"
    );
}

/// The second-level overlay of docs/operations.md, verbatim.
const OTHER_NAMESPACE_RBAC: &str = "\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../namespace
patches:
  - target:
      kind: Role
      name: redirector-kube-dns-endpointslices
    patch: |-
      - op: replace
        path: /metadata/namespace
        value: kube-system
  - target:
      kind: RoleBinding
      name: redirector-kube-dns-endpointslices
    patch: |-
      - op: replace
        path: /metadata/namespace
        value: kube-system
      - op: add
        path: /subjects/0/namespace
        value: dns-system
";

#[test]
fn the_containerfile_ships_the_tested_binary_with_nft() {
    let containerfile = read("Containerfile");
    let stages: Vec<&str> = containerfile
        .lines()
        .filter(|line| line.starts_with("FROM "))
        .collect();
    assert_eq!(stages.len(), 3, "{stages:?}");
    assert!(stages[0].contains("rust:1.95.0-bookworm"), "{}", stages[0]);
    assert!(
        stages[1].contains("debian:12-slim AS rootfs"),
        "{}",
        stages[1]
    );
    assert_eq!(stages[2], "FROM scratch");
    assert!(containerfile.contains("cargo build --release --locked --package redirector --target"));
    // The agent's production build leaves the embedded cache (`embedded-cache`, a tool for dev
    // boxes, the demo and the tests) out.
    let agent_build = containerfile
        .lines()
        .find(|line| line.contains("cargo build"))
        .expect("the agent's build");
    assert!(
        !agent_build.contains("--features") && !agent_build.contains("--all-features"),
        "the image's build asks for features: {agent_build}"
    );
    assert!(containerfile.contains("\"target/$target/release/redirector\" /out/redirector"));
    assert!(containerfile.contains("llvm-22-dev"));
    let runtime = &containerfile[containerfile.rfind("FROM ").expect("a runtime stage")..];
    let build = &containerfile[..containerfile.rfind("FROM ").expect("a runtime stage")];
    // The runtime stage takes only /out from the build stage (so a build context named `build`
    // can stand in for it, as bpf-tests/src/container.rs does), and the build stage installs
    // each file it takes.
    let taken: Vec<&str> = runtime
        .lines()
        .filter_map(|line| line.strip_prefix("COPY --from=build "))
        .flat_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            words[..words.len() - 1].to_vec()
        })
        .collect();
    assert_eq!(
        taken,
        ["/out/redirector", "/out/prepare-node", "/out/seccomp.json"],
        "{runtime}"
    );
    for file in taken {
        assert!(
            build.contains(&format!(" {file}")),
            "the build stage installs {file}"
        );
    }
    assert!(
        runtime.contains("COPY --from=build /out/redirector /out/prepare-node /usr/local/bin/")
    );
    // The rest of the runtime's root is the `rootfs` stage's Debian: with nftables and
    // ca-certificates, and what prepare-node runs (sh, stat, cp, chmod, mv, nsenter, mount).
    assert!(
        runtime.contains("COPY --from=rootfs /rootfs/ /"),
        "{runtime}"
    );
    let rootfs = read("deploy/container/rootfs.sh");
    let packages: Vec<&str> = rootfs
        .lines()
        .find_map(|line| line.strip_prefix("packages="))
        .expect("rootfs.sh names its packages")
        .split(',')
        .collect();
    for package in [
        "nftables",
        "ca-certificates",
        "dash",
        "coreutils",
        "util-linux",
        "mount",
    ] {
        assert!(
            packages.contains(&package),
            "rootfs.sh lacks {package}: {packages:?}"
        );
    }
    // The configuration's nft is the Debian package's.
    let text = configmap_config();
    assert_eq!(
        parse_config("config.toml", &text).conntrack.nft,
        PathBuf::from("/usr/sbin/nft")
    );
}

/// Runs `promtool ARGS` in deploy/prometheus.
fn promtool(args: &[&str]) -> String {
    common::promtool(&repo().join("deploy/prometheus"), args)
}

#[test]
fn the_alert_rules_are_valid_and_fire_as_their_tests_say() {
    let checked = promtool(&["check", "rules", "redirector.rules.yml"]);
    assert!(checked.contains("SUCCESS: 16 rules found"), "{checked}");
    promtool(&["test", "rules", "redirector.rules.test.yml"]);
    // Every alert has a unit test, and every metric an alert reads is one the agent serves.
    let rules = read("deploy/prometheus/redirector.rules.yml");
    let tests = read("deploy/prometheus/redirector.rules.test.yml");
    let observability = read("docs/observability.md");
    let served = served::metrics_text();
    for alert in rules
        .lines()
        .filter_map(|line| line.trim().strip_prefix("- alert: "))
    {
        assert!(
            tests.contains(&format!("alertname: {alert}")),
            "{alert} has no test"
        );
    }
    for metric in [
        "redirector_listener_route",
        "redirector_listener_reason",
        "redirector_probe_servfails_total",
        "redirector_kernel_flips_total",
        "redirector_pool_backends",
        "redirector_conntrack_bypass_active",
        "redirector_ready",
        "redirector_workload_reply_rate",
        "redirector_workload_queries_total",
    ] {
        assert!(rules.contains(metric), "{metric}");
        let family = metric.trim_end_matches("_total");
        assert!(
            served.contains(&format!("# TYPE {family} ")),
            "the agent serves no {family}: {served}"
        );
        assert!(
            observability.contains(&format!("`{metric}`")),
            "{metric} is not in docs/observability.md's table"
        );
    }
}

/// The metric families a PromQL text reads (`redirector_...`, without the suffixes Prometheus
/// adds to counters and histograms).
fn families(promql: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = promql;
    while let Some(start) = rest.find("redirector_") {
        let name: String = rest[start..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        rest = &rest[start + name.len()..];
        let family = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(&name)
            .to_owned();
        found.push(family);
    }
    found
}

#[test]
fn the_dashboard_reads_only_metrics_the_agent_serves() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/redirector.json")).expect("JSON");
    let served = served::metrics_text();
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "{} panels", panels.len());
    let mut read_any = 0;
    for panel in panels {
        let title = panel["title"].as_str().expect("a title");
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            let expr = target["expr"].as_str().expect("an expr");
            let families = families(expr);
            assert!(
                !families.is_empty(),
                "{title}: {expr} reads no redirector metric"
            );
            for family in families {
                assert!(
                    served.contains(&format!("# TYPE {family} ")),
                    "{title}: {expr} reads {family}, which the agent does not serve"
                );
                read_any += 1;
            }
        }
    }
    assert!(read_any >= 15);
    let ids: BTreeSet<u64> = panels
        .iter()
        .map(|panel| panel["id"].as_u64().expect("an id"))
        .collect();
    assert_eq!(ids.len(), panels.len(), "panel ids are unique");
}

/// Every dashboard variable that lists a label's values (`label_values(METRIC, LABEL)`) reads a
/// label the agent serves on that metric: the Node variable lists node names, not addresses.
#[test]
fn the_dashboard_variables_read_labels_the_agent_serves() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/redirector.json")).expect("JSON");
    let served = served::metrics_text();
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("variables");
    let mut checked = 0;
    for variable in variables {
        let Some(query) = variable["query"].as_str() else {
            continue;
        };
        let Some(arguments) = query
            .strip_prefix("label_values(")
            .and_then(|rest| rest.strip_suffix(')'))
        else {
            continue;
        };
        let (selector, label) = arguments.rsplit_once(',').expect("METRIC, LABEL");
        let metric = selector.split('{').next().expect("a metric").trim();
        let label = label.trim();
        checked += 1;
        if ["instance", "job"].contains(&label) {
            // Prometheus adds these to every series it scrapes.
            continue;
        }
        let series: Vec<&str> = served
            .lines()
            .filter(|line| line.starts_with(&format!("{metric}{{")))
            .collect();
        assert!(!series.is_empty(), "{query}: the agent serves no {metric}");
        for line in series {
            assert!(
                line.contains(&format!("{label}=\"")),
                "{query}: {line} has no {label} label"
            );
        }
    }
    assert!(checked >= 2, "{checked} label_values variables");
    let node = variables
        .iter()
        .find(|variable| variable["label"] == "Node")
        .expect("a Node variable");
    assert_eq!(node["query"], "label_values(redirector_build_info, node)");
    assert!(
        served.contains("node=\"node-a\""),
        "redirector_build_info carries the node's name"
    );
}

/// The cache-drain examples run the drain the CLI has: the DaemonSet patch keeps its fields as a
/// DaemonSet, its drain container mounts the agent's default drain socket's directory and only
/// that, the cache's `preStop` sleeps longer than the drain may take, and `redirector drain`
/// accepts the container's arguments and the systemd drop-in's (each fails only for want of an
/// agent here, never as a usage error).
#[test]
fn the_cache_drain_examples_run_the_drain_the_cli_has() {
    let dir = "deploy/examples/cache-drain";
    let daemonset: DaemonSet = typed_from(
        "node-local-dns.yaml",
        &read(&format!("{dir}/node-local-dns.yaml")),
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let spec = daemonset
        .spec
        .and_then(|spec| spec.template.spec)
        .expect("a pod spec");
    let drain = spec
        .containers
        .iter()
        .find(|container| container.name == "redirector-drain")
        .expect("the drain container");
    let args = drain.args.clone().expect("its arguments");
    let value = |flag: &str| -> String {
        let at = args.iter().position(|arg| arg == flag).expect(flag);
        args[at + 1].clone()
    };
    let socket = value("--socket");
    assert_eq!(socket, redirector::config::DEFAULT_DRAIN_SOCKET);
    let mounts = drain.volume_mounts.clone().unwrap_or_default();
    assert_eq!(
        mounts.len(),
        1,
        "the drain container is given one directory"
    );
    assert_eq!(
        Some(mounts[0].mount_path.as_str()),
        Path::new(&socket).parent().and_then(|dir| dir.to_str())
    );
    let waits_ms: u64 = value("--timeout-ms").parse::<u64>().expect("ms")
        + redirector::liveness::drain::DEFAULT_SETTLE_MS;
    let cache = spec
        .containers
        .iter()
        .find(|container| container.name == "node-cache")
        .expect("the cache container");
    let sleep_s = cache
        .lifecycle
        .as_ref()
        .and_then(|lifecycle| lifecycle.pre_stop.as_ref())
        .and_then(|pre_stop| pre_stop.sleep.as_ref())
        .map(|sleep| sleep.seconds)
        .expect("the cache's preStop sleep");
    assert!(
        u64::try_from(sleep_s).expect("seconds") * 1000 > waits_ms,
        "the cache's preStop ({sleep_s} s) ends before the drain may ({waits_ms} ms)"
    );

    let nobody = std::env::temp_dir().join(format!("redirector-no-agent-{}", std::process::id()));
    let run = |args: &[String]| {
        let output = Command::new(env!("CARGO_BIN_EXE_redirector"))
            .args(args)
            .output()
            .expect("running redirector");
        let said = String::from_utf8_lossy(&output.stderr).into_owned();
        assert_ne!(output.status.code(), Some(2), "a usage error: {said}");
        assert!(!output.status.success(), "drained with no agent: {said}");
        said
    };
    let container_args: Vec<String> = args
        .iter()
        .filter(|arg| *arg != "--on-sigterm")
        .map(|arg| {
            if *arg == socket {
                nobody.join("drain.sock").display().to_string()
            } else {
                arg.clone()
            }
        })
        .collect();
    let said = run(&container_args);
    assert!(
        said.contains("cannot reach the agent's drain socket"),
        "{said}"
    );

    let mut unit_args = cache_drain_unit_args();
    unit_args.extend(["--pin-dir".to_owned(), nobody.display().to_string()]);
    run(&unit_args);
}

/// The arguments of the cache-drain example's drain container (node-local-dns.yaml).
fn cache_drain_container_args() -> Vec<String> {
    let daemonset: DaemonSet = typed_from(
        "node-local-dns.yaml",
        &read("deploy/examples/cache-drain/node-local-dns.yaml"),
    )
    .unwrap_or_else(|error| panic!("{error}"));
    daemonset
        .spec
        .and_then(|spec| spec.template.spec)
        .and_then(|spec| {
            spec.containers
                .into_iter()
                .find(|container| container.name == "redirector-drain")
        })
        .and_then(|container| container.args)
        .expect("the drain container's arguments")
}

/// The arguments of the cache-drain systemd drop-in's `ExecStop` (after the program).
fn cache_drain_unit_args() -> Vec<String> {
    let unit = read("deploy/examples/cache-drain/systemd-drop-in.conf");
    let exec_stop = unit
        .lines()
        .find_map(|line| line.strip_prefix("ExecStop="))
        .expect("an ExecStop line");
    let mut words = exec_stop.trim_start_matches(['-', '+']).split_whitespace();
    assert_eq!(words.next(), Some("/usr/local/bin/redirector"));
    words.map(str::to_owned).collect()
}

/// A drain covers the cache, not one of its listeners (issue 39): each cache-drain example goes
/// with an example configuration, which it names, whose listeners one cache serves (NodeLocal
/// DNSCache: `local` and `cluster-ip`, one cache address; AKS LocalDNS: `node` and `cluster`,
/// one process on two cache addresses). Every `--listener` the example passes is a listener of
/// that configuration, and what it drains, grouped by cache address alone (as a drain groups
/// when it cannot see the cache's processes, and as `--dry-run` does), is every listener that
/// shares a cache address with one named, and so every listener of the configuration. The CLI's
/// `--dry-run` on the example's arguments and configuration says the same.
#[test]
fn each_cache_drain_example_drains_every_listener_its_configuration_gives_the_cache() {
    let examples = [
        (
            "deploy/examples/cache-drain/node-local-dns.yaml",
            cache_drain_container_args(),
            "deploy/examples/nodelocal-dnscache.toml",
        ),
        (
            "deploy/examples/cache-drain/systemd-drop-in.conf",
            cache_drain_unit_args(),
            "deploy/examples/aks.toml",
        ),
    ];
    for (example, args, paired) in examples {
        assert!(
            read(example).contains(paired),
            "{example} does not say which configuration it goes with ({paired})"
        );
        let config = parse_config(paired, &read(paired));
        let defined: Vec<&str> = config
            .listeners
            .iter()
            .map(|listener| listener.name.as_str())
            .collect();
        let named: Vec<String> = args
            .windows(2)
            .filter(|pair| pair[0] == "--listener")
            .map(|pair| pair[1].clone())
            .collect();
        let all = args.iter().any(|arg| arg == "--all");
        assert!(
            all || !named.is_empty(),
            "{example} names no listener and not --all: {args:?}"
        );
        for name in &named {
            assert!(
                defined.contains(&name.as_str()),
                "{example} drains --listener {name}, which {paired} does not define (it defines \
                 {defined:?})"
            );
        }
        // Every listener sharing a cache address with one named, by hand.
        let cache_of = |name: &str| {
            config
                .listeners
                .iter()
                .find(|listener| listener.name == name)
                .map(|listener| {
                    SocketAddr::new(listener.cache.ip().to_canonical(), listener.cache.port())
                })
        };
        let sharing: BTreeSet<&str> = config
            .listeners
            .iter()
            .filter(|listener| {
                let cache =
                    SocketAddr::new(listener.cache.ip().to_canonical(), listener.cache.port());
                all || named.iter().any(|name| cache_of(name) == Some(cache))
            })
            .map(|listener| listener.name.as_str())
            .collect();
        // The drain's own grouping, by address alone.
        let members: Vec<redirector::liveness::drain::Member> = config
            .listeners
            .iter()
            .zip(0..)
            .map(|(listener, id)| redirector::liveness::drain::Member {
                id,
                name: listener.name.clone(),
                cache: listener.cache,
            })
            .collect();
        let selection = redirector::liveness::drain::Selection {
            listeners: named.clone(),
            all,
        };
        let drained: BTreeSet<&str> = selection
            .resolve(&members, &[])
            .unwrap_or_else(|error| panic!("{example}: {error}"))
            .iter()
            .flat_map(|cache| &cache.listeners)
            .filter_map(|member| defined.iter().copied().find(|name| *name == member.name))
            .collect();
        assert_eq!(
            drained, sharing,
            "{example}: the drain and the shared addresses differ"
        );
        let every: BTreeSet<&str> = defined.iter().copied().collect();
        assert_eq!(
            drained, every,
            "{example} leaves listeners of {paired}'s one cache on it when the cache stops"
        );

        let mut dry_run: Vec<String> = args
            .iter()
            .filter(|arg| *arg != "--on-sigterm")
            .cloned()
            .collect();
        dry_run.extend([
            "--dry-run".to_owned(),
            "--config".to_owned(),
            repo().join(paired).display().to_string(),
        ]);
        let output = Command::new(env!("CARGO_BIN_EXE_redirector"))
            .args(&dry_run)
            .output()
            .expect("running redirector");
        let said = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{example}: `redirector {}` failed: {}{said}",
            dry_run.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
        let would: Vec<&str> = said
            .lines()
            .filter_map(|line| line.strip_prefix("would drain "))
            .collect();
        for name in &every {
            assert!(
                would.iter().any(|line| {
                    line.split_once(": ").is_some_and(|(_, listeners)| {
                        listeners
                            .trim_start_matches("listeners ")
                            .trim_start_matches("listener ")
                            .split(", ")
                            .any(|listener| listener == *name)
                    })
                }),
                "{example}: the dry run does not drain {name}: {said}"
            );
        }
    }
}

/// The setting of a line that shows one commented out (`# key = value`).
fn commented_setting(line: &str) -> Option<&str> {
    let setting = line.strip_prefix("# ")?;
    let (key, _) = setting.split_once(" = ")?;
    (!key.contains(' ')).then_some(setting)
}

/// The sample in docs/configuration.md: a copy starts under the shipped unit. It parses; every
/// setting shown commented out parses when uncommented (with the commented settings right above
/// it, which it needs: `rate_limit_burst` under `rate_limit_qps`); the sections show their
/// defaults; and what it needs (no `cache_netns`: CAP_SYS_ADMIN) is in the unit's bounding set.
#[test]
fn the_documented_sample_configuration_starts_under_the_unit() {
    let page = read("docs/configuration.md");
    let sample = page
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("docs/configuration.md's first toml block");
    let config = parse_config("the sample", sample);
    let unit = unit_settings(&read("deploy/systemd/redirector.service"));
    let granted: BTreeSet<String> = unit
        .get(&("Service".to_owned(), "CapabilityBoundingSet".to_owned()))
        .into_iter()
        .flatten()
        .flat_map(|value| value.split_whitespace().map(str::to_owned))
        .collect();
    for need in redirector::sys::capabilities::needs(config.cache_netns.is_some()) {
        assert!(
            granted.contains(need.capability.name),
            "the sample needs {} ({}), which the unit does not grant",
            need.capability.name,
            need.why
        );
    }
    assert!(
        config.kubernetes.kubeconfig.is_none(),
        "the sample names a kubeconfig"
    );

    let lines: Vec<&str> = sample.lines().collect();
    let mut commented = 0;
    for (index, line) in lines.iter().enumerate() {
        let Some(setting) = commented_setting(line) else {
            continue;
        };
        let key = setting.split_once(" = ").map_or(setting, |(key, _)| key);
        let mut uncommented = lines.clone();
        uncommented[index] = setting;
        for above in (0..index).rev() {
            let Some(needed) = commented_setting(lines[above]) else {
                break;
            };
            uncommented[above] = needed;
        }
        let text = uncommented.join("\n");
        if key == "cache_netns" {
            // Entering a namespace needs CAP_SYS_ADMIN: the line says so.
            assert!(Config::parse(&text).expect("parses").cache_netns.is_some());
        } else {
            parse_config(&format!("the sample with {key} uncommented"), &text);
        }
        commented += 1;
    }
    assert!(commented >= 10, "{commented} commented settings");

    // The sections' values are the defaults: the sample without them parses alike.
    let mut section = "";
    let bare: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|line| {
            if line.starts_with('[') {
                section = line;
                return true;
            }
            let in_section = !section.is_empty() && !section.starts_with("[[");
            !(in_section && line.contains(" = ") && !line.starts_with('#'))
        })
        .collect();
    let defaults = parse_config("the sample without its sections' values", &bare.join("\n"));
    assert_eq!(
        format!("{defaults:?}"),
        format!("{config:?}"),
        "a section of the sample shows a value that is not the default"
    );
}
