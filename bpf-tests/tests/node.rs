//! The suite's node (`cargo xtask test`, or `vm-test --kernel 6.12 --tests node` alone;
//! xtask/src/vm/node-boot.sh): a VM booted
//! with systemd, running containerd, runc and a kubelet (cgroup v2, the systemd cgroup driver),
//! registered to a control plane on the host (`bpf_tests::node`). These tests install
//! node-local-dns as NodeLocal DNSCache's manifest does (a hostNetwork DaemonSet on
//! 169.254.20.10 with its Corefile; here CoreDNS itself, on an address the node's boot puts on a
//! `nodelocaldns` dummy link as node-cache would), then redirector as users do
//! (`kubectl apply -k` of the shipped overlay, the NodeLocal DNSCache example as its
//! configuration), and count what a pod asking every millisecond loses at each event.
//!
//! Only such a guest can run them (`test = false`); they run one after the other, each taking
//! the node from where the last left it. The last asks for a reboot: the host boots the node
//! again with its disk, and [`after_the_node_reboots_dns_is_back_with_the_agent_or_the_cache`]
//! measures what the client pod saw until the agent or node-local-dns was back.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use bpf_tests::{
    dns::{StreamRecord, now_ms},
    kube_apiserver::{self, manifests},
    node::{NodeDir, images},
    pace::{paced_ms, pause, wait_until},
    vm_notes::{ask_reboot, note},
};
use redirector::{config::DEFAULT_PIN_DIR, datapath::Maps, telemetry::snapshot};

/// The node-local-dns address (NodeLocal DNSCache's default).
const LOCAL_DNS: &str = "169.254.20.10";
/// How long a query waits for its answer before the client counts it lost.
const QUERY_TIMEOUT_MS: u64 = 1000;
/// Quiet time after an event's pods are back, in which late losses are still counted.
const SETTLE_MS: u64 = 1000;

/// kubectl as the administrator, at the host's API server.
struct Cluster {
    kubeconfig: PathBuf,
}

impl Cluster {
    fn new() -> anyhow::Result<Self> {
        let node = NodeDir::from_env()?;
        Ok(Self {
            kubeconfig: node.guest_kubeconfig(),
        })
    }

    fn kubectl_with_input(&self, args: &[&str], input: Option<&str>) -> anyhow::Result<String> {
        kube_apiserver::kubectl(&self.kubeconfig, args, input)
    }

    fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        self.kubectl_with_input(args, None)
    }

    fn apply(&self, manifest: &str) -> anyhow::Result<String> {
        self.kubectl_with_input(&["apply", "-f", "-"], Some(manifest))
    }

    /// `kubectl get -o jsonpath=PATH` of `what`.
    fn jsonpath(&self, what: &[&str], path: &str) -> anyhow::Result<String> {
        let mut args = vec!["get"];
        args.extend(what);
        let output = format!("-o=jsonpath={path}");
        args.push(&output);
        Ok(self.kubectl(&args)?.trim().to_owned())
    }

    /// Waits until the pods of `selector` in `namespace` are exactly one, Ready, and not
    /// `other_than` (a pod's UID); its UID.
    fn one_ready_pod(
        &self,
        namespace: &str,
        selector: &str,
        other_than: Option<&str>,
        limit: Duration,
    ) -> anyhow::Result<String> {
        let mut uid = String::new();
        wait_until(
            &format!("one Ready pod of {selector} in {namespace}"),
            limit,
            Duration::from_millis(500),
            || {
                let pods = self.jsonpath(
                    &["pods", "-n", namespace, "-l", selector],
                    r#"{range .items[*]}{.metadata.uid}{" "}{.metadata.deletionTimestamp}{" "}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}"#,
                )?;
                // A pod that cannot start never will: say why now.
                let waiting = self.jsonpath(
                    &["pods", "-n", namespace, "-l", selector],
                    "{.items[*].status.initContainerStatuses[*].state.waiting.reason} \
                     {.items[*].status.containerStatuses[*].state.waiting.reason}",
                )?;
                if let Some(reason) = waiting.split_whitespace().find(|reason| {
                    [
                        "CreateContainerError",
                        "CreateContainerConfigError",
                        "ErrImagePull",
                        "ImagePullBackOff",
                        "InvalidImageName",
                        "RunContainerError",
                    ]
                    .contains(reason)
                }) {
                    let events = self.kubectl(&[
                        "get",
                        "events",
                        "-n",
                        namespace,
                        "--field-selector=type=Warning",
                        "-o=jsonpath={range .items[*]}{.message}{\"\\n\"}{end}",
                    ])?;
                    bail!("a pod of {selector} cannot start ({reason}): {events}");
                }
                let lines: Vec<&str> = pods.lines().filter(|line| !line.is_empty()).collect();
                let [line] = lines[..] else {
                    return Ok(false);
                };
                let fields: Vec<&str> = line.split(' ').collect();
                let ready = fields.len() == 3 && fields[1].is_empty() && fields[2] == "True";
                if ready && Some(fields[0]) != other_than {
                    uid = fields[0].to_owned();
                    return Ok(true);
                }
                Ok(false)
            },
        )?;
        Ok(uid)
    }
}

/// The node-local-dns ConfigMap and DaemonSet, as NodeLocal DNSCache's manifest has them
/// (hostNetwork, 169.254.20.10, its Corefile's shape, its liveness probe on the health port),
/// with CoreDNS as the container and the upstream as the kube-dns endpoint (this node has no
/// kube-proxy to translate the manifest's kube-dns-upstream Service).
fn node_local_dns(image: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: ConfigMap
metadata:
  name: node-local-dns
  namespace: kube-system
data:
  Corefile: |
    cluster.local:53 {{
        errors
        cache {{
            success 9984 30
            denial 9984 5
        }}
        reload
        loop
        bind {LOCAL_DNS}
        forward . 10.53.0.1 {{
            force_tcp
        }}
        prometheus :9253
        health {LOCAL_DNS}:8080
    }}
    .:53 {{
        errors
        cache 30
        reload
        loop
        bind {LOCAL_DNS}
        forward . 10.53.0.1
        prometheus :9253
    }}
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: node-local-dns
  namespace: kube-system
  labels:
    k8s-app: node-local-dns
spec:
  updateStrategy:
    rollingUpdate:
      maxUnavailable: 10%
  selector:
    matchLabels:
      k8s-app: node-local-dns
  template:
    metadata:
      labels:
        k8s-app: node-local-dns
    spec:
      priorityClassName: system-node-critical
      hostNetwork: true
      dnsPolicy: Default
      tolerations:
        - key: CriticalAddonsOnly
          operator: Exists
        - effect: NoExecute
          operator: Exists
        - effect: NoSchedule
          operator: Exists
      containers:
        - name: node-cache
          image: {image}
          imagePullPolicy: IfNotPresent
          args: ["-conf", "/etc/coredns/Corefile"]
          securityContext:
            capabilities:
              add: ["NET_ADMIN"]
          ports:
            - containerPort: 53
              name: dns
              protocol: UDP
            - containerPort: 53
              name: dns-tcp
              protocol: TCP
            - containerPort: 9253
              name: metrics
              protocol: TCP
          livenessProbe:
            httpGet:
              host: {LOCAL_DNS}
              path: /health
              port: 8080
            initialDelaySeconds: 60
            timeoutSeconds: 5
          volumeMounts:
            - name: config-volume
              mountPath: /etc/coredns
      volumes:
        - name: config-volume
          configMap:
            name: node-local-dns
            items:
              - key: Corefile
                path: Corefile
"#
    )
}

/// kube-dns as the agent's pools see it: the Service and one EndpointSlice naming the node's
/// stand-in upstream (10.53.0.1), ready.
const KUBE_DNS: &str = r#"apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels:
    k8s-app: kube-dns
spec:
  clusterIP: 10.96.0.10
  ports:
    - name: dns
      port: 53
      protocol: UDP
    - name: dns-tcp
      port: 53
      protocol: TCP
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-node
  namespace: kube-system
  labels:
    kubernetes.io/service-name: kube-dns
    endpointslice.kubernetes.io/managed-by: node-test
addressType: IPv4
endpoints:
  - addresses: ["10.53.0.1"]
    conditions:
      ready: true
ports:
  - name: dns
    port: 53
    protocol: UDP
  - name: dns-tcp
    port: 53
    protocol: TCP
"#;

/// The client pod: `dns-stream` asking node-local-dns every millisecond from a fresh socket per
/// query (as glibc does) and from one kept socket, printing every failure and every
/// [`ANSWERED_EVERY`]th answer.
fn client() -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: dns-client
  namespace: default
  labels:
    app: dns-client
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: client
      image: {client}
      imagePullPolicy: IfNotPresent
      args: ["--server", "{LOCAL_DNS}:53", "--duration-ms", "86400000", "--interval-ms", "1",
             "--timeout-ms", "{QUERY_TIMEOUT_MS}", "--kinds", "fresh,long",
             "--answered-every", "{ANSWERED_EVERY}"]
"#,
        client = images::CLIENT
    )
}

/// A kustomization over the shipped overlay, as an operator writes one: this build's image, and
/// the NodeLocal DNSCache example as the configuration (with the metrics address the DaemonSet's
/// probes reach).
fn redirector_overlay(dir: &Path) -> anyhow::Result<PathBuf> {
    let overlay = dir.join("redirector-overlay");
    std::fs::create_dir_all(&overlay)?;
    let shipped = manifests()
        .join("overlays/kube-system")
        .canonicalize()
        .context("finding the shipped overlay")?;
    let example = std::fs::read_to_string(manifests().join("../examples/nodelocal-dnscache.toml"))
        .context("reading the NodeLocal DNSCache example")?;
    std::fs::write(overlay.join("config.toml"), node_config(&example))?;
    // kustomize takes resources by relative paths only.
    let up = "../".repeat(overlay.components().count() - 1);
    let shipped = format!(
        "{up}{}",
        shipped
            .strip_prefix("/")
            .context("canonical paths are absolute")?
            .display()
    );
    let (name, tag) = images::AGENT
        .rsplit_once(':')
        .context("the agent's image has a tag")?;
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {shipped}\nimages:\n  - name: registry.example.com/redirector\n    newName: {name}\n    newTag: {tag}\nconfigMapGenerator:\n  - name: redirector-config\n    namespace: kube-system\n    behavior: replace\n    files:\n      - config.toml\n"
        ),
    )?;
    Ok(overlay)
}

/// The agent's configuration on this node: the NodeLocal DNSCache example, with the metrics
/// address the DaemonSet's probes reach, and the probes' timings stretched to TCG's pace as
/// every VM test stretches them (`REDIRECTOR_TEST_SLOWDOWN`): with the defaults a guest this slow
/// leaves queries unread past `stall_after_ms` while it is healthy.
fn node_config(example: &str) -> String {
    format!(
        "[metrics]\naddress = \"0.0.0.0:9353\"\n\n{example}\n[probe]\ninterval_ms = {}\n\
         timeout_ms = {}\nstall_after_ms = {}\n",
        paced_ms(100),
        paced_ms(250),
        paced_ms(80)
    )
}

/// The client's records from its container's log (the kubelet's CRI log files).
fn client_records(pod_uid: &str) -> anyhow::Result<Vec<StreamRecord>> {
    let dir = PathBuf::from(format!("/var/log/pods/default_dns-client_{pod_uid}/client"));
    let mut records = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .collect();
    files.sort();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for line in text.lines() {
            // TIMESTAMP STREAM P|F MESSAGE
            let Some(message) = line.splitn(4, ' ').nth(3) else {
                continue;
            };
            if let Ok(record) = serde_json::from_str::<StreamRecord>(message) {
                records.push(record);
            }
        }
    }
    Ok(records)
}

/// What one event cost the client.
#[derive(Debug)]
struct Loss {
    event: String,
    /// Why a loss after the event's instant is expected, when it is.
    expected: Option<&'static str>,
    /// Failed queries begun at or after the event's instant (the signal, the kill, the API
    /// call), by socket kind.
    after: BTreeMap<String, usize>,
    /// Failed queries begun from the event's start (before its API calls or process lookups)
    /// until it settled, by socket kind: also those in flight at its instant.
    in_all: BTreeMap<String, usize>,
    /// The first errors, for the table.
    errors: Vec<String>,
    /// Queries asked in the window, from the numbers of the records seen (every
    /// [`ANSWERED_EVERY`]th answered and every failed one).
    asked: u64,
    /// From the event's start to its pods being back, ms.
    took_ms: u64,
    /// The kernel's stall moves since the event before ended (the pinned `stalled` counts);
    /// `None` when the pins were the previous release's at the event's end (its maps lack this
    /// release's: the next event that reads them counts its moves).
    stalled: Option<u64>,
    /// The previous release's programs ran in the event (a rollback to it, a rollout from it):
    /// their stall moves are that release's.
    previous_programs: bool,
}

impl Loss {
    fn lost_after(&self) -> usize {
        self.after.values().sum()
    }

    fn lost_in_all(&self) -> usize {
        self.in_all.values().sum()
    }
}

/// The kernel's stall moves so far, to give each event those made since the one before.
struct Stalls {
    last: u64,
}

impl Stalls {
    /// The stall moves since the last call that read them (or since the pins were made); `None`
    /// while the pins are the previous release's.
    fn since_last(&mut self) -> anyhow::Result<Option<u64>> {
        let Some(now) = stall_moves()? else {
            return Ok(None);
        };
        let since = now.saturating_sub(self.last);
        self.last = now;
        Ok(Some(since))
    }
}

/// Every listener's stall moves, from the pinned maps: the kernel's own count, since the maps
/// were made (the first install; they stay through an uninstall of the chart), 0 before. `None`
/// while the pins are the previous release's, which this release's maps cannot open (0.2.0's
/// agent runs after the rollback).
fn stall_moves() -> anyhow::Result<Option<u64>> {
    let pins = Path::new(DEFAULT_PIN_DIR);
    if !pins.exists() {
        return Ok(Some(0));
    }
    let Ok(maps) = Maps::open_pinned(pins) else {
        return Ok(None);
    };
    Ok(Some(
        snapshot::listeners(&maps)?
            .iter()
            .map(|listener| listener.flips.stalled)
            .sum(),
    ))
}

/// The client prints every this many answered queries of each kind.
const ANSWERED_EVERY: u64 = 100;

/// Runs `event`, which returns its instant (ms since the epoch: when it signalled, killed or
/// asked the API server) once its pods are back, then counts the client's failures from the
/// event's start until [`SETTLE_MS`] after it is back.
fn measure(
    stalls: &mut Stalls,
    client_uid: &str,
    name: &str,
    expected: Option<&'static str>,
    event: impl FnOnce() -> anyhow::Result<u64>,
) -> anyhow::Result<Loss> {
    let start_ms = now_ms();
    let started = Instant::now();
    let instant_ms = event().with_context(|| format!("the event {name}"))?;
    let took_ms = u64::try_from(started.elapsed().as_millis())?;
    pause(SETTLE_MS);
    // A query begun before the end is done within its timeout.
    std::thread::sleep(Duration::from_millis(QUERY_TIMEOUT_MS + 500));
    let end_ms = start_ms + took_ms + SETTLE_MS;
    let mut loss = Loss {
        event: name.to_owned(),
        expected,
        after: BTreeMap::new(),
        in_all: BTreeMap::new(),
        errors: Vec::new(),
        asked: 0,
        took_ms,
        stalled: stalls.since_last()?,
        previous_programs: false,
    };
    let mut seqs: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for record in client_records(client_uid)? {
        if record.begun_ms < start_ms || record.begun_ms > end_ms {
            continue;
        }
        let range = seqs
            .entry(record.kind.clone())
            .or_insert((record.seq, record.seq));
        range.0 = range.0.min(record.seq);
        range.1 = range.1.max(record.seq);
        if let Some(error) = &record.error {
            *loss.in_all.entry(record.kind.clone()).or_default() += 1;
            if record.begun_ms >= instant_ms {
                *loss.after.entry(record.kind.clone()).or_default() += 1;
            }
            if loss.errors.len() < 3 {
                loss.errors.push(format!("{} {error}", record.kind));
            }
        }
    }
    loss.asked = seqs.values().map(|(first, last)| last - first + 1).sum();
    eprintln!("node: {name}: {loss:?}");
    Ok(loss)
}

/// The pid of the process running `program` in the pod `pod_uid` (its cgroup names the pod).
fn pod_process(pod_uid: &str, program: &str) -> anyhow::Result<i32> {
    let pod = pod_uid.replace('-', "_");
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cgroup = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if cgroup.contains(&pod) && comm.trim() == program {
            return Ok(pid);
        }
    }
    bail!("no {program} process in pod {pod_uid}")
}

/// `redirector ARGS` in the agent's container of the pod `agent_uid`, as `kubectl exec` runs it:
/// in every namespace of the container (its mounts, and its pid namespace, whose /proc the
/// container mounts; nsenter forks into it). The API server cannot reach this kubelet, so nsenter
/// on the node does it. What it printed.
fn in_agent_pod(agent_uid: &str, args: &[&str]) -> anyhow::Result<String> {
    let pid = pod_process(agent_uid, "redirector")?.to_string();
    let output = Command::new("nsenter")
        .args(["--all", "--target", &pid, "--", "/usr/local/bin/redirector"])
        .args(args)
        .output()
        .context("running nsenter")?;
    anyhow::ensure!(
        output.status.success(),
        "redirector {} in the agent's pod failed ({}): {}",
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The restart count of the pod `name`'s first container.
fn restarts(cluster: &Cluster, namespace: &str, pod: &str) -> anyhow::Result<u32> {
    Ok(cluster
        .jsonpath(
            &["pod", "-n", namespace, pod],
            "{.status.containerStatuses[0].restartCount}",
        )?
        .parse()?)
}

fn pod_name(cluster: &Cluster, namespace: &str, selector: &str) -> anyhow::Result<String> {
    cluster.jsonpath(
        &["pods", "-n", namespace, "-l", selector],
        "{.items[0].metadata.name}",
    )
}

const NODE_LOCAL_DNS: &str = "k8s-app=node-local-dns";
const AGENT: &str = "app.kubernetes.io/name=redirector";

#[test]
fn node_local_dns_events_lose_no_query_beside_redirector_installed_as_shipped() {
    if let Err(error) = run() {
        diagnose();
        panic!("{error:?}");
    }
    // Then the node's reboot, with everything installed (the next boot's test).
    ask_reboot();
}

/// The node's reboot (`systemctl reboot`, asked by the test above): every pod's processes stop
/// with the node, the bpf file system and every pin go, and at the next boot the kubelet starts
/// the pods again in whatever order. Until node-local-dns serves or the agent steers, nothing
/// answers on 169.254.20.10 (its address is the node's own, as node-cache leaves it): what the
/// client pod sees then is measured, and no query begun after either is back may fail.
#[test]
fn after_the_node_reboots_dns_is_back_with_the_agent_or_the_cache() {
    if let Err(error) = after_reboot() {
        diagnose();
        panic!("{error:?}");
    }
}

/// When the kernel booted, ms since the epoch (`/proc/stat`'s btime: whole seconds).
fn boot_ms() -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let seconds: u64 = stat
        .lines()
        .find_map(|line| line.strip_prefix("btime "))
        .context("/proc/stat has no btime")?
        .trim()
        .parse()?;
    Ok(seconds * 1000)
}

/// Whether a UDP socket is bound to node-local-dns's address and port 53 (`/proc/net/udp` gives
/// them in hex, the address in the kernel's byte order): CoreDNS serves.
fn local_dns_listens() -> anyhow::Result<bool> {
    let address: std::net::Ipv4Addr = LOCAL_DNS.parse()?;
    let local = format!("{:08X}:0035", u32::from_le_bytes(address.octets()));
    Ok(std::fs::read_to_string("/proc/net/udp")?
        .lines()
        .skip(1)
        .any(|line| line.split_whitespace().nth(1) == Some(local.as_str())))
}

/// Whether the agent is ready (its `/readyz`: programs attached, every pool known): it steers.
fn agent_ready() -> bool {
    "127.0.0.1:9353"
        .parse()
        .ok()
        .and_then(|address| bpf_tests::http::get(address, "/readyz").ok())
        .is_some_and(|response| response.status == 200)
}

fn after_reboot() -> anyhow::Result<()> {
    let booted_ms = boot_ms()?;
    let began_ms = now_ms();
    let since_boot = |ms: u64| format!("{:.1} s", (ms.saturating_sub(booted_ms)) as f64 / 1000.0);
    // Each instant is the first poll (every 100 ms) that saw it: the test starts with the
    // kubelet, before the pods are back (else it says so).
    let (mut agent_back, mut cache_back) = (None, None);
    wait_until(
        "the agent and node-local-dns are back after the reboot",
        Duration::from_secs(300),
        Duration::from_millis(100),
        || {
            let now = now_ms();
            if agent_back.is_none() && agent_ready() {
                agent_back = Some(now);
            }
            if cache_back.is_none() && local_dns_listens()? {
                cache_back = Some(now);
            }
            Ok(agent_back.is_some() && cache_back.is_some())
        },
    )?;
    let (agent_back, cache_back) = (
        agent_back.context("the agent is back")?,
        cache_back.context("node-local-dns is back")?,
    );
    let dns_back = agent_back.min(cache_back);
    let cluster = Cluster::new()?;
    let client_uid =
        cluster.jsonpath(&["pod", "-n", "default", "dns-client"], "{.metadata.uid}")?;
    // The client's container after the reboot: its first query, then a settled window.
    let mut first_ms = None;
    wait_until(
        "the client pod asks again after the reboot",
        Duration::from_secs(300),
        Duration::from_secs(1),
        || {
            first_ms = client_records(&client_uid)?
                .iter()
                .filter(|record| record.begun_ms >= booted_ms)
                .map(|record| record.begun_ms)
                .min();
            Ok(first_ms.is_some())
        },
    )?;
    let first_ms = first_ms.context("the client's first query after the reboot")?;
    pause(SETTLE_MS);
    std::thread::sleep(Duration::from_millis(QUERY_TIMEOUT_MS + 500));
    let (mut before, mut after) = (0_usize, Vec::new());
    let mut last_failed = None;
    // The restarted client numbers each kind's queries from 0 again.
    let mut asked: BTreeMap<String, u64> = BTreeMap::new();
    for record in client_records(&client_uid)? {
        if record.begun_ms < booted_ms {
            continue;
        }
        let count = asked.entry(record.kind.clone()).or_default();
        *count = (*count).max(record.seq + 1);
        if let Some(error) = &record.error {
            last_failed = last_failed.max(Some(record.begun_ms));
            if record.begun_ms >= dns_back {
                after.push(format!(
                    "{} at {}: {error}",
                    record.kind,
                    since_boot(record.begun_ms)
                ));
            } else {
                before += 1;
            }
        }
    }
    let already = if dns_back <= began_ms + 100 {
        " (already so when the test began)"
    } else {
        ""
    };
    let lines = [
        format!(
            "node: after a reboot (systemctl reboot), from the kernel's boot: the client's first \
             query at {}, the agent ready at {}, node-local-dns listening at {}{already}",
            since_boot(first_ms),
            since_boot(agent_back),
            since_boot(cache_back)
        ),
        format!(
            "  {:<58} {:>5} {:>7} {:>7}   lost: begun after the agent or node-local-dns was \
             back; the last failure begun at {}",
            "the node rebooted (systemctl reboot)",
            after.len(),
            before + after.len(),
            asked.values().sum::<u64>(),
            last_failed.map_or_else(|| "-".to_owned(), since_boot)
        ),
    ];
    for line in &lines {
        eprintln!("{line}");
        note(line);
    }
    assert!(
        after.is_empty(),
        "queries begun after the agent or node-local-dns was back ({}) failed: {after:?}",
        since_boot(dns_back)
    );
    Ok(())
}

/// What the node's units and pods said, for a failure's log.
fn diagnose() {
    for unit in ["vm-node", "containerd", "kubelet"] {
        if let Ok(output) = Command::new("journalctl")
            .args(["--boot", "--no-pager", "--lines", "60", "--unit", unit])
            .output()
        {
            eprintln!(
                "node: journal of {unit}:\n{}",
                String::from_utf8_lossy(&output.stdout)
            );
        }
    }
    if let Ok(cluster) = Cluster::new() {
        for args in [
            &["get", "nodes,pods", "-A", "-o", "wide"][..],
            &["get", "events", "-A", "--sort-by=.lastTimestamp"][..],
        ] {
            match cluster.kubectl(args) {
                Ok(output) => eprintln!("node: kubectl {}:\n{output}", args.join(" ")),
                Err(error) => eprintln!("node: {error:#}"),
            }
        }
    }
}

fn run() -> anyhow::Result<()> {
    let cluster = Cluster::new()?;
    let began = Instant::now();
    let stage = |what: &str| eprintln!("node: {what} at {} s", began.elapsed().as_secs());
    wait_until(
        "the node is Ready",
        Duration::from_secs(300),
        Duration::from_secs(1),
        || {
            // Started before this test: a unit that is not (or no longer) running fails it now.
            for unit in ["vm-node.service", "containerd.service", "kubelet.service"] {
                let state = Command::new("systemctl")
                    .args(["is-active", unit])
                    .output()?;
                let state = String::from_utf8_lossy(&state.stdout).trim().to_owned();
                anyhow::ensure!(
                    state == "active" || state == "activating",
                    "{unit} is {state}"
                );
            }
            Ok(cluster
                .jsonpath(
                    &["node", bpf_tests::node::NODE_NAME],
                    r#"{.status.conditions[?(@.type=="Ready")].status}"#,
                )
                .is_ok_and(|ready| ready == "True"))
        },
    )?;
    stage("node Ready");
    cluster.apply(KUBE_DNS)?;
    cluster.apply(&node_local_dns(images::NODE_LOCAL_DNS))?;
    let mut local_dns = cluster.one_ready_pod(
        "kube-system",
        NODE_LOCAL_DNS,
        None,
        Duration::from_secs(300),
    )?;
    stage("node-local-dns Ready");
    cluster.apply(&client())?;
    let client_uid =
        cluster.one_ready_pod("default", "app=dns-client", None, Duration::from_secs(300))?;
    stage("client Ready");

    let mut table: Vec<Loss> = Vec::new();
    let mut stalls = Stalls { last: 0 };
    // redirector, installed as users do, beside a node-local-dns that was there first.
    let scratch = std::env::temp_dir().join("node-test");
    std::fs::create_dir_all(&scratch)?;
    let overlay = redirector_overlay(&scratch)?;
    let mut agent = String::new();
    table.push(measure(
        &mut stalls,
        &client_uid,
        "redirector installed (kubectl apply -k)",
        None,
        || {
            let instant = now_ms();
            cluster.kubectl(&["apply", "-k", &overlay.display().to_string()])?;
            agent = cluster.one_ready_pod("kube-system", AGENT, None, Duration::from_secs(300))?;
            Ok(instant)
        },
    )?);
    stage("redirector Ready");

    // node-local-dns's own events, with redirector beside it.
    table.push(measure(
        &mut stalls,
        &client_uid,
        "node-local-dns pod deleted",
        None,
        || {
            when_dns_moves_off_local_dns(|| {
                replace_pod(&cluster, NODE_LOCAL_DNS, &mut local_dns, || {
                    delete_pod(&cluster, NODE_LOCAL_DNS)
                })
            })
        },
    )?);
    table.push(measure(
        &mut stalls,
        &client_uid,
        "node-local-dns rolled to a new image tag",
        None,
        || {
            when_dns_moves_off_local_dns(|| {
                replace_pod(&cluster, NODE_LOCAL_DNS, &mut local_dns, || {
                    set_image(
                        &cluster,
                        "node-local-dns",
                        &[("node-cache", images::NODE_LOCAL_DNS_NEXT)],
                    )
                })
            })
        },
    )?);
    let local_dns_uid = local_dns.clone();
    table.push(measure(
        &mut stalls,
        &client_uid,
        "node-local-dns killed (kill -9), restarted by the kubelet",
        None,
        || {
            when_dns_moves_off_local_dns(|| {
                kill_and_wait_restart(&cluster, NODE_LOCAL_DNS, &local_dns_uid, "coredns")
            })
        },
    )?);

    // The agent's own events: DNS stays in the kernel's hands meanwhile.
    let agent_uid = agent.clone();
    table.push(measure(
        &mut stalls,
        &client_uid,
        "redirector killed (kill -9), restarted by the kubelet",
        None,
        || kill_and_wait_restart(&cluster, AGENT, &agent_uid, "redirector"),
    )?);

    // Between the previous release and this build, both ways, as a fleet's rollback and its
    // rollout again; each pod asked which agent it runs.
    let previous = std::fs::read_to_string(NodeDir::from_env()?.previous_release())
        .context("reading the previous release's version")?;
    let (previous_version, previous_commit) = previous
        .trim()
        .split_once(' ')
        .context("the previous release's version and commit")?;
    // `--version` says `redirector VERSION (commit COMMIT, layout N)`.
    let previous_line = format!("{previous_version} (commit {previous_commit},");
    for (event, image, runs_previous) in [
        (
            format!("redirector rolled back to {previous_version} (its image)"),
            images::PREVIOUS,
            true,
        ),
        // Under the next tag, which the Helm chart below takes over as it is.
        (
            format!("redirector rolled from {previous_version} to this build"),
            images::AGENT_NEXT,
            false,
        ),
    ] {
        let mut loss = measure(&mut stalls, &client_uid, &event, None, || {
            replace_pod(&cluster, AGENT, &mut agent, || {
                set_image(
                    &cluster,
                    "redirector",
                    &[("redirector", image), ("prepare-node", image)],
                )
            })
        })?;
        loss.previous_programs = true;
        table.push(loss);
        let version = in_agent_pod(&agent, &["--version"])?;
        eprintln!(
            "node: after \"{event}\" the agent's pod runs {}",
            version.trim()
        );
        assert_eq!(
            version.contains(&previous_line),
            runs_previous,
            "after \"{event}\" the agent's pod runs `{}` (the previous release is {previous})",
            version.trim()
        );
    }

    // The same install taken over by the Helm chart, as an operator moving to it does: the same
    // image and configuration, so no pod restarts.
    table.push(measure(
        &mut stalls,
        &client_uid,
        "redirector taken over by its Helm chart",
        None,
        || {
            let instant = now_ms();
            helm(
                &cluster,
                &["upgrade", "--install"],
                // Helm 4 applies server-side: the fields `kubectl apply` set are its
                // manager's, and taking them over conflicts ("Apply failed with 1 conflict:
                // conflict with kubectl-client-side-apply") unless forced.
                &["--take-ownership", "--force-conflicts"],
                &overlay.join("config.toml"),
            )?;
            agent = cluster.one_ready_pod("kube-system", AGENT, None, Duration::from_secs(300))?;
            Ok(instant)
        },
    )?);
    // Server-side apply leaves what kubectl set and the chart does not: the chart's NodeLocal
    // DNSCache layout has no systemd-resolved volume, the overlay's DaemonSet had one.
    let volumes = cluster.jsonpath(
        &["daemonset", "-n", "kube-system", "redirector"],
        "{.spec.template.spec.volumes[*].name}",
    )?;
    eprintln!("node: the DaemonSet's volumes after the Helm takeover: {volumes}");

    // Helm as a node's first install: the chart's release removed (the pins stay: the kernel
    // steers without an agent) and installed anew.
    table.push(measure(
        &mut stalls,
        &client_uid,
        "redirector removed (helm uninstall)",
        None,
        || {
            let instant = now_ms();
            helm(
                &cluster,
                &["uninstall", "--wait"],
                &[],
                &overlay.join("config.toml"),
            )?;
            wait_until(
                "the agent's pod is gone",
                Duration::from_secs(300),
                Duration::from_secs(1),
                || {
                    Ok(cluster
                        .kubectl(&[
                            "get",
                            "pods",
                            "-n",
                            "kube-system",
                            "-l",
                            AGENT,
                            "-o",
                            "name",
                        ])?
                        .trim()
                        .is_empty())
                },
            )?;
            Ok(instant)
        },
    )?);
    table.push(measure(
        &mut stalls,
        &client_uid,
        "redirector installed by its Helm chart (helm install)",
        None,
        || {
            let instant = now_ms();
            helm(&cluster, &["install"], &[], &overlay.join("config.toml"))?;
            agent = cluster.one_ready_pod(
                "kube-system",
                AGENT,
                Some(&agent),
                Duration::from_secs(300),
            )?;
            Ok(instant)
        },
    )?);

    // Who the agent names: the client's pod, never the cache.
    let metrics = names_the_client_not_the_cache(&agent, &client_uid, &local_dns)?;
    // node-local-dns served throughout: the kernel never took it for stalled (the metrics' count
    // is the pinned maps', since the first install; the table gives each event its part).
    let stalled: Vec<&str> = metrics
        .lines()
        .filter(|line| {
            line.starts_with("redirector_kernel_flips_total{")
                && line.contains(r#"reason="stalled""#)
        })
        .collect();
    eprintln!("node: stall moves: {stalled:?}");
    anyhow::ensure!(
        !stalled.is_empty(),
        "the metrics have no redirector_kernel_flips_total{{reason=\"stalled\"}}:\n{metrics}"
    );
    let stall_moves = stalled
        .iter()
        .map(|line| {
            line.rsplit(' ')
                .next()
                .and_then(|value| value.parse::<f64>().ok())
                .with_context(|| format!("a counter without a value: {line}"))
        })
        .sum::<anyhow::Result<f64>>()?;
    // Those after the last event's end.
    let after_the_events = stalls
        .since_last()?
        .context("this release's agent runs, yet its maps cannot be read")?;

    // The table, in the VM report (and in this test's output when it fails).
    let mut lines = vec![
        "node: queries lost per event, a query every ms from a fresh and a kept socket (lost: \
         begun at or after the event's instant; in all: from its start, in flight too)"
            .to_owned(),
        format!(
            "  {:<58} {:>5} {:>7} {:>7} {:>8} {:>7}",
            "event", "lost", "in all", "asked", "took ms", "stalled"
        ),
    ];
    for loss in &table {
        lines.push(format!(
            "  {:<58} {:>5} {:>7} {:>7} {:>8} {:>7} {:?}",
            loss.event,
            loss.lost_after(),
            loss.lost_in_all(),
            loss.asked,
            loss.took_ms,
            loss.stalled
                .map_or_else(|| "-".to_owned(), |stalled| stalled.to_string()),
            loss.errors
        ));
        if let Some(why) = loss.expected {
            lines.push(format!("    {why}"));
        }
        match loss.stalled {
            None => lines.push(
                "    stalled: the previous release's pins, which this release cannot open; the \
                 next event counts their moves"
                    .to_owned(),
            ),
            Some(moves) if moves > 0 && loss.previous_programs => lines.push(
                "    the previous release's programs ran: their stall detection could lose a \
                 cache's read under load and move a serving cache (fixed since; CHANGELOG, \
                 \"The kernel's stall detection loses no cache read\")"
                    .to_owned(),
            ),
            Some(_) => {}
        }
    }
    lines.push(format!(
        "node: the kernel's stall moves off a serving node-local-dns: {stall_moves} in all, \
         {after_the_events} after the last event"
    ));
    for line in &lines {
        eprintln!("{line}");
        note(line);
    }
    assert_eq!(
        after_the_events, 0,
        "the kernel moved DNS off a serving node-local-dns as stalled after the last event"
    );
    for loss in &table {
        assert!(
            loss.previous_programs || loss.stalled == Some(0),
            "the kernel moved DNS off a serving node-local-dns as stalled during {}: {loss:?}",
            loss.event
        );
        assert!(
            loss.asked > 0,
            "the client asked nothing during {}",
            loss.event
        );
        if loss.expected.is_none() {
            assert_eq!(
                loss.lost_after(),
                0,
                "{} lost queries: {loss:?}",
                loss.event
            );
        }
    }
    Ok(())
}

/// Runs `action` (API calls that replace the pod of `selector` in kube-system), then waits
/// until one pod of it is Ready and it is not `uid`, which becomes that pod's; the instant
/// `action` began.
fn replace_pod(
    cluster: &Cluster,
    selector: &str,
    uid: &mut String,
    action: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<u64> {
    let instant = now_ms();
    action()?;
    *uid = cluster.one_ready_pod("kube-system", selector, Some(uid), Duration::from_secs(300))?;
    Ok(instant)
}

/// Runs `event`, an event that stops node-local-dns (returning its own instant: the API call,
/// the kill), and returns the instant DNS moved off it: a query the old CoreDNS had read or queued
/// before is lost with the process whatever steers DNS, and the move comes after the API call by
/// seconds (the kubelet's SIGTERM; NodeLocal DNSCache's Corefile has no lameduck) or after the
/// kill by the time its sockets take to close. It is seen where it takes effect: the end of the
/// first poll (every 5 ms) of the pinned maps that finds a listener routed away from the cache
/// (the move came during that read or before it: a read takes about 15 ms under TCG, and a query
/// begun within it, counted in all, may have been queued to the dying cache); `event`'s own
/// instant where no poll saw it.
fn when_dns_moves_off_local_dns(
    event: impl FnOnce() -> anyhow::Result<u64>,
) -> anyhow::Result<u64> {
    let stop = Arc::new(AtomicBool::new(false));
    let watching = Arc::clone(&stop);
    let watch = std::thread::spawn(move || -> anyhow::Result<Option<u64>> {
        let maps = Maps::open_pinned(Path::new(DEFAULT_PIN_DIR))?;
        while !watching.load(Ordering::Relaxed) {
            if snapshot::listeners(&maps)?
                .iter()
                .any(|listener| listener.route != "cache")
            {
                // The move came before the read ended: when within it, no read tells.
                return Ok(Some(now_ms()));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(None)
    });
    let instant = event();
    stop.store(true, Ordering::Relaxed);
    let moved = watch
        .join()
        .map_err(|_| anyhow::anyhow!("the watch of the listeners' routes panicked"))??;
    let instant = instant?;
    match moved {
        Some(moved) => eprintln!(
            "node: DNS moved off node-local-dns {} ms after the event's own instant",
            i128::from(moved) - i128::from(instant)
        ),
        None => eprintln!("node: no poll saw DNS move off node-local-dns"),
    }
    // The move never comes before its cause: the instant is never before the event's own.
    Ok(moved.map_or(instant, |moved| moved.max(instant)))
}

/// Deletes the pod of `selector` in kube-system, as an operator does (its DaemonSet makes
/// another).
fn delete_pod(cluster: &Cluster, selector: &str) -> anyhow::Result<()> {
    let name = pod_name(cluster, "kube-system", selector)?;
    cluster.kubectl(&["delete", "pod", "-n", "kube-system", &name, "--wait=false"])?;
    Ok(())
}

/// `kubectl set image` of the DaemonSet `name` in kube-system: a rollout.
fn set_image(cluster: &Cluster, name: &str, images: &[(&str, &str)]) -> anyhow::Result<()> {
    let daemonset = format!("daemonset/{name}");
    let images: Vec<String> = images
        .iter()
        .map(|(container, image)| format!("{container}={image}"))
        .collect();
    let mut args = vec!["set", "image", "-n", "kube-system", &daemonset];
    args.extend(images.iter().map(String::as_str));
    cluster.kubectl(&args)?;
    Ok(())
}

/// Kills (SIGKILL) the process `program` of the pod `uid` of `selector` in kube-system, waits
/// until the kubelet restarted it and the pod is Ready again; the kill's instant.
fn kill_and_wait_restart(
    cluster: &Cluster,
    selector: &str,
    uid: &str,
    program: &str,
) -> anyhow::Result<u64> {
    let name = pod_name(cluster, "kube-system", selector)?;
    let before = restarts(cluster, "kube-system", &name)?;
    let pid = pod_process(uid, program)?;
    let instant = now_ms();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    wait_until(
        &format!("the kubelet restarts {program}"),
        Duration::from_secs(300),
        Duration::from_millis(500),
        || Ok(restarts(cluster, "kube-system", &name)? > before),
    )?;
    cluster.one_ready_pod("kube-system", selector, None, Duration::from_secs(300))?;
    Ok(instant)
}

/// `helm VERB redirector FLAGS [CHART]` in kube-system: the chart (for every verb but
/// `uninstall`) with the NodeLocal DNSCache layout, the agent's next image (the one in use: a
/// takeover restarts no pod) and the configuration `config`, as docs/operations.md installs it.
fn helm(cluster: &Cluster, verb: &[&str], flags: &[&str], config: &Path) -> anyhow::Result<()> {
    let mut helm = Command::new(bpf_tests::go_peers::binary("helm")?);
    helm.args(verb)
        .arg("redirector")
        .args(flags)
        .args(["--namespace", "kube-system"])
        .arg(format!("--kubeconfig={}", cluster.kubeconfig.display()));
    if verb.first() != Some(&"uninstall") {
        let (name, tag) = images::AGENT_NEXT
            .rsplit_once(':')
            .context("the agent's image has a tag")?;
        helm.arg(manifests().join("../helm/redirector"))
            .args([
                "--set",
                "layout=nodeLocalDNSCache",
                "--set",
                "nodeLocalDNSCache.clusterIP=10.96.0.10",
                "--set",
                &format!("image.repository={name}"),
                "--set",
                &format!("image.tag={tag}"),
            ])
            .arg(format!("--set-file=config={}", config.display()));
    }
    let output = helm.output().context("running helm")?;
    anyhow::ensure!(
        output.status.success(),
        "helm {} failed: {}{}",
        verb.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// `redirector status` (on the node, and in the agent's pod `agent_uid`), `redirector top` and the
/// agent's metrics name the client `pod/default/dns-client`, and never node-local-dns (a cache is
/// no workload); the metrics.
fn names_the_client_not_the_cache(
    agent_uid: &str,
    client_uid: &str,
    local_dns_uid: &str,
) -> anyhow::Result<String> {
    let on_node = |args: &[&str]| -> anyhow::Result<String> {
        let output = Command::new("redirector")
            .args(args)
            .output()
            .with_context(|| format!("running redirector {}", args.join(" ")))?;
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    };
    let status = on_node(&["status", "--config", "/nonexistent"])?;
    let in_pod = in_agent_pod(agent_uid, &["status"])?;
    // The client asks every millisecond: it is in every frame.
    let top = on_node(&[
        "top",
        "--config",
        "/nonexistent",
        "--count",
        "1",
        "--interval-ms",
        "2000",
    ])?;
    for (what, shown) in [
        ("status on the node", &status),
        ("status in the agent's pod", &in_pod),
        ("top on the node", &top),
    ] {
        eprintln!("node: redirector {what}:\n{shown}");
        assert!(
            shown
                .lines()
                .any(|line| line.starts_with("pod/default/dns-client ")),
            "{what} names the client pod/default/dns-client (its UID {client_uid}):\n{shown}"
        );
        assert!(
            !shown.contains(local_dns_uid) && !shown.contains("node-local-dns"),
            "{what} names node-local-dns, a cache:\n{shown}"
        );
    }
    let mut metrics = String::new();
    wait_until(
        "the metrics name the client's pod",
        Duration::from_secs(60),
        Duration::from_secs(2),
        || {
            metrics = bpf_tests::http::get("127.0.0.1:9353".parse()?, "/metrics")?.body;
            Ok(metrics.contains(r#"workload="pod/default/dns-client""#))
        },
    )?;
    assert!(
        !metrics.contains("node-local-dns"),
        "the metrics name node-local-dns, a cache:\n{metrics}"
    );
    Ok(metrics)
}
