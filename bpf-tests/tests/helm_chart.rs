//! The Helm chart (`deploy/helm/redirector`) against the kustomize overlay it mirrors
//! (`deploy/kubernetes/overlays/kube-system`): `helm lint --strict`, then `helm template` with
//! the default values, object by object, against `kubectl kustomize` of the overlay, and
//! non-default values against the overlay patched the way docs/operations.md says to patch it
//! (written in a scratch directory): other listener addresses, image, resources, tolerations and
//! kubelet root; the NodeLocal DNSCache layout; the switches (Node Events, the pods
//! ClusterRole, prepare-node, the PodMonitor); another namespace.
//!
//! Both sides are parsed into YAML values and compared as values (order of keys and style do
//! not count, types do). The one difference allowed is Helm's own two labels, `helm.sh/chart`
//! and `app.kubernetes.io/managed-by`, which the chart adds to every object's
//! `metadata.labels` (never to the pods' labels or the selector): they are checked and removed
//! before the comparison.
//!
//! helm and kubectl are built by `cargo xtask setup` (`bpf-tests/go/helm`, `bpf-tests/go/kube`)
//! into target/go/bin; without them every test fails and says so. No root, no BPF.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, ensure};
use bpf_tests::go_peers;
use redirector::config::Config;
use serde::Deserialize as _;
use serde_json::Value;

const CHART: &str = "deploy/helm/redirector";
const OVERLAY: &str = "deploy/kubernetes/overlays/kube-system";

/// The labels Helm charts add by convention, and the values the chart gives them.
fn helm_labels() -> [(&'static str, String); 2] {
    [
        (
            "helm.sh/chart",
            format!("redirector-{}", env!("CARGO_PKG_VERSION")),
        ),
        ("app.kubernetes.io/managed-by", "Helm".to_owned()),
    ]
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("the repository's root")
}

/// A Go peer, or a failure that says how to build it: these tests never skip.
fn go_binary(name: &str) -> PathBuf {
    go_peers::binary(name).unwrap_or_else(|error| panic!("{error:#}"))
}

/// Runs `command`, and returns its standard output when it succeeds.
fn run(command: &mut Command) -> anyhow::Result<String> {
    let described = format!("{command:?}");
    let output = command
        .output()
        .with_context(|| format!("running {described}"))?;
    ensure!(
        output.status.success(),
        "{described} failed ({}): {}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).with_context(|| format!("the output of {described}"))
}

/// The objects of a YAML stream, as JSON values (so that the comparison names paths); empty
/// documents (Helm's for a template that renders nothing) left out.
fn objects(stream: &str) -> anyhow::Result<Vec<Value>> {
    let mut objects = Vec::new();
    for document in serde_yaml::Deserializer::from_str(stream) {
        let value = serde_yaml::Value::deserialize(document).context("parsing a YAML document")?;
        if !value.is_null() {
            objects.push(serde_json::to_value(value).context("a YAML object as JSON")?);
        }
    }
    Ok(objects)
}

/// `helm template redirector CHART --namespace NAMESPACE ARGS...`, parsed.
fn helm_template(namespace: &str, args: &[&str]) -> anyhow::Result<Vec<Value>> {
    objects(&run(Command::new(go_binary("helm"))
        .args(["template", "redirector"])
        .arg(repo().join(CHART))
        .args(["--namespace", namespace])
        .args(args))?)
}

/// `kubectl kustomize DIR`, parsed.
fn kustomize(dir: &Path) -> anyhow::Result<Vec<Value>> {
    objects(&run(Command::new(go_binary("kubectl"))
        .arg("kustomize")
        .arg(dir))?)
}

/// A scratch directory for one test, removed when dropped.
#[derive(Debug)]
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> anyhow::Result<Self> {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join("helm_chart")
            .join(format!("{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let dir = dir.canonicalize()?;
        Ok(Self(dir))
    }

    /// Writes `text` to `name` in the scratch directory, and returns its path.
    fn write(&self, name: &str, text: &str) -> anyhow::Result<PathBuf> {
        let path = self.0.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    /// `path` of the repository, relative to `dir` of the scratch directory (kustomize refuses
    /// absolute paths in `resources` and `components`).
    fn repo_path_from(&self, dir: &str, path: &str) -> String {
        let from = self.0.join(dir);
        let up = "../".repeat(from.components().count() - 1);
        format!(
            "{up}{}",
            repo()
                .join(path)
                .display()
                .to_string()
                .trim_start_matches('/')
        )
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Where `a` and `b` differ, as JSON pointers with both values.
fn differences(a: &Value, b: &Value, at: &str, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for key in a.keys().chain(b.keys().filter(|key| !a.contains_key(*key))) {
                let path = format!("{at}/{}", key.replace('~', "~0").replace('/', "~1"));
                match (a.get(key), b.get(key)) {
                    (Some(a), Some(b)) => differences(a, b, &path, out),
                    (a, b) => out.push(format!("{path}: helm {a:?}, kustomize {b:?}")),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (index, (a, b)) in a.iter().zip(b).enumerate() {
                differences(a, b, &format!("{at}/{index}"), out);
            }
        }
        // Texts (config.toml): the first line that differs.
        (Value::String(a), Value::String(b)) if a != b && a.contains('\n') => {
            let (line, (a, b)) = a
                .split('\n')
                .map(Some)
                .chain(std::iter::repeat(None))
                .zip(b.split('\n').map(Some).chain(std::iter::repeat(None)))
                .enumerate()
                .find(|(_, (a, b))| a != b)
                .expect("two different texts differ in a line");
            out.push(format!(
                "{at}, line {}: helm {a:?}, kustomize {b:?}",
                line + 1
            ));
        }
        (a, b) if a != b => out.push(format!("{at}: helm {a}, kustomize {b}")),
        _ => {}
    }
}

/// An object's kind, namespace and name; the configuration's ConfigMap without the hash its name
/// ends in, so that a changed configuration shows as a changed name and text, not as two
/// unrelated objects.
fn identity(object: &Value) -> String {
    let kind = object["kind"].as_str().unwrap_or("?");
    let mut name = object["metadata"]["name"].as_str().unwrap_or("?");
    if kind == "ConfigMap" && name.starts_with("redirector-config-") {
        name = "redirector-config-<hash>";
    }
    format!(
        "{kind} {}/{name}",
        object["metadata"]["namespace"].as_str().unwrap_or("-"),
    )
}

/// Checks and removes Helm's own labels from every object the chart rendered.
fn without_helm_labels(mut objects: Vec<Value>) -> Vec<Value> {
    for object in &mut objects {
        let who = identity(object);
        let labels = object["metadata"]["labels"]
            .as_object_mut()
            .unwrap_or_else(|| panic!("{who} has no labels"));
        for (label, value) in helm_labels() {
            assert_eq!(
                labels.remove(label),
                Some(Value::String(value)),
                "{who}: label {label}"
            );
        }
    }
    objects
}

/// The chart's objects (Helm's own labels removed) are kustomize's, object by object.
fn assert_same_objects(helm: Vec<Value>, kustomize: Vec<Value>) -> Vec<Value> {
    let helm = without_helm_labels(helm);
    let by_identity = |objects: &[Value]| -> BTreeMap<String, Value> {
        let map: BTreeMap<_, _> = objects
            .iter()
            .map(|object| (identity(object), object.clone()))
            .collect();
        assert_eq!(map.len(), objects.len(), "two objects with one identity");
        map
    };
    let (helm_map, kustomize_map) = (by_identity(&helm), by_identity(&kustomize));
    assert_eq!(
        helm_map.keys().collect::<Vec<_>>(),
        kustomize_map.keys().collect::<Vec<_>>(),
        "the chart's objects (left) are not the overlay's (right)"
    );
    let mut out = Vec::new();
    for (who, object) in &helm_map {
        differences(object, &kustomize_map[who], who, &mut out);
    }
    assert!(
        out.is_empty(),
        "the chart renders the overlay's objects otherwise:\n{}",
        out.join("\n")
    );
    helm
}

fn find<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    objects
        .iter()
        .find(|object| object["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// The config.toml of the rendered ConfigMap.
fn rendered_config(objects: &[Value]) -> String {
    find(objects, "ConfigMap")["data"]["config.toml"]
        .as_str()
        .expect("the ConfigMap has a config.toml")
        .to_owned()
}

/// A kustomization over the shipped overlay (`resources` relative to the scratch directory's
/// `dir`), with `rest` appended.
fn over_the_overlay(scratch: &Scratch, dir: &str, rest: &str) -> String {
    format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {}\n{rest}",
        scratch.repo_path_from(dir, OVERLAY)
    )
}

/// A configMapGenerator that replaces the overlay's config.toml with the file of that name.
const REPLACED_CONFIG: &str = "\
configMapGenerator:
  - name: redirector-config
    namespace: kube-system
    behavior: replace
    files:
      - config.toml
";

#[test]
fn the_chart_is_the_releases_and_passes_helm_lint_strict() -> anyhow::Result<()> {
    let chart: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(
        repo().join(CHART).join("Chart.yaml"),
    )?)?;
    for key in ["version", "appVersion"] {
        assert_eq!(
            chart[key].as_str(),
            Some(env!("CARGO_PKG_VERSION")),
            "Chart.yaml's {key} is the workspace's version"
        );
    }
    for values in [
        &[][..],
        &[
            "--set",
            "layout=nodeLocalDNSCache",
            "--set",
            "nodeLocalDNSCache.clusterIP=10.96.0.10",
        ],
        &[
            "--set",
            "podMonitor.enabled=true",
            "--set",
            "prepareNode.enabled=false",
        ],
    ] {
        let output = run(Command::new(go_binary("helm"))
            .args(["lint", "--strict"])
            .arg(repo().join(CHART))
            .args(values))?;
        println!("helm lint --strict {values:?}:\n{output}");
    }
    Ok(())
}

/// The defaults are the overlay: `kubectl apply -k` and `helm install` make the same objects.
#[test]
fn the_defaults_render_the_kube_system_overlay() -> anyhow::Result<()> {
    let helm = helm_template("kube-system", &[])?;
    let kustomize = kustomize(&repo().join(OVERLAY))?;
    assert_eq!(kustomize.len(), 9, "the overlay's objects");
    let helm = assert_same_objects(helm, kustomize);
    // The configuration is the base's, byte for byte (so is the ConfigMap's hashed name).
    assert_eq!(
        rendered_config(&helm),
        std::fs::read_to_string(repo().join("deploy/kubernetes/base/config.toml"))?
    );
    Ok(())
}

/// Other listener addresses, metrics port, image, resources, an extra toleration and node
/// selector, and another kubelet root: the values against the overlay patched for each, with
/// the base's config.toml edited for the addresses (so the ConfigMap's hashed name is checked
/// on another text too).
#[test]
fn aks_values_render_as_the_overlay_patched_alike() -> anyhow::Result<()> {
    let scratch = Scratch::new("aks-values")?;
    let values = scratch.write(
        "values.yaml",
        "\
aks:
  nodeListener: 169.254.10.20
  clusterListener: 169.254.10.21
metrics:
  port: 9400
image:
  repository: registry.example.com/mirror/redirector
  tag: 0.2.0-test
  pullPolicy: Always
resources:
  requests:
    cpu: 50m
    memory: 96Mi
extraTolerations:
  - key: dedicated
    operator: Equal
    value: dns
    effect: NoSchedule
nodeSelector:
  example.com/dns: redirector
kubeletRootDir: /var/lib/k0s/kubelet
",
    )?;
    let config = std::fs::read_to_string(repo().join("deploy/kubernetes/base/config.toml"))?
        .replace("169.254.10.10", "169.254.10.20")
        .replace("169.254.10.11", "169.254.10.21")
        .replace("9353", "9400");
    scratch.write("kustomize/config.toml", &config)?;
    scratch.write(
        "kustomize/kustomization.yaml",
        &over_the_overlay(
            &scratch,
            "kustomize",
            &format!(
                "{REPLACED_CONFIG}\
images:
  - name: registry.example.com/redirector
    newName: registry.example.com/mirror/redirector
    newTag: 0.2.0-test
patches:
  - target:
      kind: DaemonSet
      name: redirector
    patch: |-
      - op: add
        path: /spec/template/spec/initContainers/0/imagePullPolicy
        value: Always
      - op: add
        path: /spec/template/spec/containers/0/imagePullPolicy
        value: Always
      - op: replace
        path: /spec/template/spec/containers/0/ports/0/containerPort
        value: 9400
      - op: add
        path: /spec/template/spec/tolerations/-
        value: {{key: dedicated, operator: Equal, value: dns, effect: NoSchedule}}
      - op: test
        path: /spec/template/spec/volumes/6/name
        value: seccomp
      - op: replace
        path: /spec/template/spec/volumes/6/hostPath/path
        value: /var/lib/k0s/kubelet/seccomp
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata:
        name: redirector
        namespace: kube-system
      spec:
        template:
          metadata:
            annotations:
              prometheus.io/port: \"9400\"
          spec:
            nodeSelector:
              example.com/dns: redirector
            containers:
              - name: redirector
                resources:
                  requests:
                    cpu: 50m
                    memory: 96Mi
"
            ),
        ),
    )?;
    let values = values.display().to_string();
    let helm = helm_template("kube-system", &["--values", &values])?;
    let kustomize = kustomize(&scratch.0.join("kustomize"))?;
    let helm = assert_same_objects(helm, kustomize);
    assert_eq!(rendered_config(&helm), config);
    Ok(())
}

/// The NodeLocal DNSCache layout: the chart's configuration is the shipped example's
/// (deploy/examples/nodelocal-dnscache.toml) as a pod runs it, to the agent's own parser; and
/// the objects are the overlay's with that configuration and without the systemd-resolved
/// volume, which nothing in it reads.
#[test]
fn the_nodelocal_dnscache_layout_renders_the_example_configuration() -> anyhow::Result<()> {
    let cluster_ip = "10.0.0.10";
    let helm = helm_template(
        "kube-system",
        &[
            "--set",
            "layout=nodeLocalDNSCache",
            "--set",
            &format!("nodeLocalDNSCache.clusterIP={cluster_ip}"),
        ],
    )?;
    let config = rendered_config(&helm);
    let rendered = Config::parse(&config)
        .unwrap_or_else(|error| panic!("the rendered configuration: {error}\n{config}"));
    let example = std::fs::read_to_string(repo().join("deploy/examples/nodelocal-dnscache.toml"))?;
    assert!(example.contains("address = \"10.96.0.10\""));
    let mut expected = Config::parse(&example.replace("10.96.0.10", cluster_ip))
        .unwrap_or_else(|error| panic!("the example: {error}"));
    // What a pod differs in: kubelet's probes and Prometheus reach the node's address.
    expected.metrics.address = "0.0.0.0:9353".parse()?;
    assert_eq!(rendered, expected);

    let scratch = Scratch::new("nodelocal-dnscache")?;
    scratch.write("config.toml", &config)?;
    scratch.write(
        "kustomization.yaml",
        &over_the_overlay(
            &scratch,
            ".",
            &format!(
                "{REPLACED_CONFIG}\
patches:
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata:
        name: redirector
        namespace: kube-system
      spec:
        template:
          spec:
            containers:
              - name: redirector
                volumeMounts:
                  - mountPath: /run/systemd/resolve
                    $patch: delete
            volumes:
              - name: resolve
                $patch: delete
"
            ),
        ),
    )?;
    assert_same_objects(helm, kustomize(&scratch.0)?);

    // Without the ClusterIP, which is each cluster's own, the chart renders nothing.
    let missing = helm_template("kube-system", &["--set", "layout=nodeLocalDNSCache"])
        .expect_err("the NodeLocal DNSCache layout without a ClusterIP rendered");
    assert!(
        format!("{missing:#}").contains("needs nodeLocalDNSCache.clusterIP"),
        "{missing:#}"
    );
    Ok(())
}

/// The switches off (Node Events, the pods ClusterRole, prepare-node) and the PodMonitor on:
/// the overlay's agent part without node-events, with the podmonitor component, and the rest
/// deleted by patches.
#[test]
fn the_switches_render_as_the_overlay_without_those_parts() -> anyhow::Result<()> {
    let scratch = Scratch::new("switches")?;
    let helm = helm_template(
        "kube-system",
        &[
            "--set",
            "nodeEvents.enabled=false",
            "--set",
            "podsClusterRole.enabled=false",
            "--set",
            "prepareNode.enabled=false",
            "--set",
            "podMonitor.enabled=true",
        ],
    )?;
    scratch.write(
        "kustomization.yaml",
        &format!(
            "\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: kube-system
resources:
  - {agent}
components:
  - {podmonitor}
images:
  - name: redirector
    newName: registry.example.com/redirector
    newTag: {version}
patches:
  - patch: |-
      apiVersion: rbac.authorization.k8s.io/v1
      kind: ClusterRole
      metadata:
        name: redirector-pods
      $patch: delete
  - patch: |-
      apiVersion: rbac.authorization.k8s.io/v1
      kind: ClusterRoleBinding
      metadata:
        name: redirector-pods
      $patch: delete
  - target:
      kind: DaemonSet
      name: redirector
    patch: |-
      - op: remove
        path: /spec/template/spec/initContainers
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata:
        name: redirector
      spec:
        template:
          spec:
            volumes:
              - name: host-proc
                $patch: delete
              - name: seccomp
                $patch: delete
",
            agent = scratch.repo_path_from(".", &format!("{OVERLAY}/agent")),
            podmonitor = scratch.repo_path_from(".", "deploy/kubernetes/components/podmonitor"),
            version = env!("CARGO_PKG_VERSION"),
        ),
    )?;
    let helm = assert_same_objects(helm, kustomize(&scratch.0)?);
    let kinds: Vec<_> = helm
        .iter()
        .filter_map(|object| object["kind"].as_str())
        .collect();
    assert!(kinds.contains(&"PodMonitor"), "{kinds:?}");
    assert!(!kinds.contains(&"ClusterRole"), "{kinds:?}");
    Ok(())
}

/// In another namespace: the agent's objects there, the EndpointSlice Role and RoleBinding still
/// in kube-system and the node-events ones in default, every subject the agent's
/// ServiceAccount in its namespace. docs/operations.md's two-level overlay for it ("In a
/// namespace other than kube-system"), with node-events and its subject's namespace as that
/// section says.
#[test]
fn another_namespace_renders_as_the_documented_two_level_overlay() -> anyhow::Result<()> {
    let scratch = Scratch::new("other-namespace")?;
    scratch.write(
        "namespace/kustomization.yaml",
        &format!(
            "\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: dns-system
resources:
  - {}
",
            scratch.repo_path_from("namespace", "deploy/kubernetes/base")
        ),
    )?;
    scratch.write(
        "rbac/kustomization.yaml",
        &format!(
            "\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../namespace
  - {node_events}
images:
  - name: redirector
    newName: registry.example.com/redirector
    newTag: {version}
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
  - target:
      kind: RoleBinding
      name: redirector-node-events
    patch: |-
      - op: replace
        path: /subjects/0/namespace
        value: dns-system
",
            node_events = scratch.repo_path_from("rbac", "deploy/kubernetes/node-events"),
            version = env!("CARGO_PKG_VERSION"),
        ),
    )?;
    let helm = helm_template("dns-system", &[])?;
    let helm = assert_same_objects(helm, kustomize(&scratch.0.join("rbac"))?);
    assert_eq!(
        find(&helm, "DaemonSet")["metadata"]["namespace"],
        "dns-system"
    );
    Ok(())
}
