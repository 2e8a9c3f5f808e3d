//! The agent against a real kube-apiserver and etcd (`bpf-tests/go/kube`) with RBAC on: the
//! shipped `deploy/kubernetes` manifests applied with kubectl (`overlays/kube-system`: the
//! ServiceAccount, the EndpointSlice Role and RoleBinding, the pods ClusterRole and
//! ClusterRoleBinding, the node-events Role and RoleBinding), and the agent on a token of that
//! ServiceAccount. Every request it makes is audited: it uses exactly the verbs the Roles and the
//! ClusterRole grant, and a verb taken away is reported, not retried silently.
//! The fake API server (`kubernetes.rs`) keeps the faults a real one cannot be made to produce.

use std::{collections::BTreeSet, net::IpAddr, path::Path, time::Duration};

use bpf_tests::{
    cgroup::KubeletCgroups,
    cli::{redirector, start_agent, stop_agent, uninstall},
    fake_kube::endpoint_slice,
    harness::{CLUSTER_ID, Harness, kube_dns_config},
    kube_apiserver::{AuditedRequest, KubeApiserver, manifests},
    pace::wait_until,
    sandbox::{Ns, Query, Sandbox, Transport},
    tools,
    topology::{NODE_LISTENER, dns},
};
use redirector_common::addr::port_from_be;

/// The kernel pool of the cluster listener as (address, UDP port), sorted.
fn cluster_pool(harness: &Harness) -> anyhow::Result<Vec<(IpAddr, u16)>> {
    let mut pool: Vec<_> = harness
        .maps
        .pool(CLUSTER_ID)?
        .targets()
        .iter()
        .map(|target| (IpAddr::from(target.addr), port_from_be(target.udp_port_be)))
        .collect();
    pool.sort_unstable();
    Ok(pool)
}

fn expect(addresses: &[&str], port: u16) -> anyhow::Result<Vec<(IpAddr, u16)>> {
    let mut pool = addresses
        .iter()
        .map(|address| Ok((address.parse()?, port)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    pool.sort_unstable();
    Ok(pool)
}

fn wait_for_pool(harness: &Harness, expected: &[(IpAddr, u16)], step: &str) -> anyhow::Result<()> {
    harness
        .wait_until(step, Duration::from_secs(20), |harness| {
            Ok(cluster_pool(harness)? == expected)
        })
        .map_err(|error| {
            let now = cluster_pool(harness).unwrap_or_default();
            error.context(format!("the kernel pool is {now:?}, expected {expected:?}"))
        })
}

/// kube-dns's IPv4 slice with `endpoints` ready, on `port`: upstream A and B of the sandbox
/// (its own namespaces' addresses: a failover's queries and the upstream checks stay inside).
fn apply_slice(kube: &KubeApiserver, endpoints: &[&str], port: u16) -> anyhow::Result<()> {
    let endpoints: Vec<(&str, bool, bool)> = endpoints
        .iter()
        .map(|address| (*address, true, false))
        .collect();
    kube.apply(&endpoint_slice("kube-dns-v4", "kube-dns", "IPv4", port, &endpoints).to_string())?;
    Ok(())
}

/// The API server with the shipped manifests applied, and kube-dns's slice with upstream A.
fn cluster(sandbox: &Sandbox) -> anyhow::Result<KubeApiserver> {
    let kube = KubeApiserver::start(sandbox.scratch_dir())?;
    let overlay = manifests().join("overlays/kube-system");
    kube.kubectl(&["apply", "-k", &overlay.display().to_string()])?;
    apply_slice(&kube, &["198.18.2.2"], 53)?;
    Ok(kube)
}

/// The agent's configuration: the cluster listener follows kube-system/kube-dns through the
/// real API server, with the ServiceAccount's token.
fn config_text(sandbox: &Sandbox, kube: &KubeApiserver) -> anyhow::Result<String> {
    let kubeconfig = sandbox.write_file("kubeconfig", &kube.agent_kubeconfig()?)?;
    // The workloads read every second, for the test of their names.
    Ok(format!(
        "{}\n[workloads]\ninterval_ms = 1000\n",
        kube_dns_config(sandbox, &kubeconfig, false)
    ))
}

/// What the shipped Roles and ClusterRole grant: (verb, API group, resource, namespace). The
/// ClusterRole's pods are every namespace's: the agent lists and watches them across all
/// namespaces (its node's, by field selector), which the audit log writes with no namespace.
fn granted() -> BTreeSet<(&'static str, &'static str, &'static str, &'static str)> {
    [
        ("get", "discovery.k8s.io", "endpointslices", "kube-system"),
        ("list", "discovery.k8s.io", "endpointslices", "kube-system"),
        ("watch", "discovery.k8s.io", "endpointslices", "kube-system"),
        ("list", "", "pods", ""),
        ("watch", "", "pods", ""),
        ("create", "events.k8s.io", "events", "default"),
        ("patch", "events.k8s.io", "events", "default"),
    ]
    .into_iter()
    .collect()
}

/// Asserts that the agent made requests, every one of them one the Roles and the ClusterRole
/// grant, and that none was refused.
fn assert_only_granted(requests: &[AuditedRequest]) {
    assert!(
        !requests.is_empty(),
        "the audit log has no request of the agent here"
    );
    let granted = granted();
    for request in requests {
        let object = request
            .object
            .clone()
            .unwrap_or_else(|| panic!("a request of the agent's with no object: {request:?}"));
        assert!(
            granted.contains(&(
                request.verb.as_str(),
                object.group.as_str(),
                object.resource.as_str(),
                object.namespace.as_str()
            )),
            "the agent asked for what the Roles and the ClusterRole do not grant: {request:?}"
        );
        assert_ne!(
            request.status.as_ref().map(|status| status.code),
            Some(403),
            "refused: {request:?}"
        );
    }
}

/// The verbs the agent used, as (verb, resource).
fn verbs(requests: &[AuditedRequest]) -> BTreeSet<(String, String)> {
    requests
        .iter()
        .map(|request| {
            (
                request.verb.clone(),
                request
                    .object
                    .as_ref()
                    .map(|object| object.resource.clone())
                    .unwrap_or_default(),
            )
        })
        .collect()
}

/// With the shipped RBAC only: the pool follows kube-dns's slice through an endpoint added, a
/// port change and the slice's deletion; the API server restarts (the watch is cut) and the pool
/// comes back true, following a change made once it is back; a failover and a failback are
/// Events on the Node. Every request the agent made is one the Roles and the ClusterRole grant.
#[test]
fn the_agent_follows_a_real_api_server_on_exactly_the_shipped_rbac() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let mut kube = cluster(&sandbox)?;
    let text = config_text(&sandbox, &kube)?;
    let config = sandbox.write_file("agent.toml", &text)?;
    let harness = Harness::with_config(sandbox, &text)?;
    wait_for_pool(&harness, &expect(&["198.18.2.2"], 53)?, "initial list")?;
    a_pod_of_this_node_is_named_by_namespace_and_name(&kube, &harness, &config)?;

    apply_slice(&kube, &["198.18.2.2", "198.18.2.3"], 53)?;
    wait_for_pool(
        &harness,
        &expect(&["198.18.2.2", "198.18.2.3"], 53)?,
        "scaled up",
    )?;
    apply_slice(&kube, &["198.18.2.2", "198.18.2.3"], 5353)?;
    wait_for_pool(
        &harness,
        &expect(&["198.18.2.2", "198.18.2.3"], 5353)?,
        "port changed",
    )?;
    kube.kubectl(&[
        "delete",
        "endpointslices.discovery.k8s.io",
        "kube-dns-v4",
        "--namespace",
        "kube-system",
    ])?;
    wait_for_pool(&harness, &[], "slice deleted")?;
    apply_slice(&kube, &["198.18.2.2"], 53)?;
    wait_for_pool(&harness, &expect(&["198.18.2.2"], 53)?, "slice created")?;

    // The API server goes away (its watches cut) and comes back; the pool follows what changed
    // once it is back, and nothing stale is left.
    let before_restart = kube.agent_requests()?.len();
    kube.stop();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        cluster_pool(&harness)?,
        expect(&["198.18.2.2"], 53)?,
        "the pool was kept while the API server was away"
    );
    kube.start_again()?;
    apply_slice(&kube, &["198.18.2.3"], 53)?;
    wait_for_pool(
        &harness,
        &expect(&["198.18.2.3"], 53)?,
        "changed after the API server came back",
    )?;

    // A failover and a failback: Events on the Node, through the node-events Role.
    let mut harness = harness;
    harness.sandbox.stop_server("cache")?;
    let node = redirector::sources::node_name();
    let events = |reason: &str| -> anyhow::Result<usize> {
        let listed = kube.kubectl(&[
            "get",
            "events.events.k8s.io",
            "--namespace",
            "default",
            "--output",
            "json",
        ])?;
        let listed: serde_json::Value = serde_json::from_str(&listed)?;
        Ok(listed["items"].as_array().map_or(0, |items| {
            items
                .iter()
                .filter(|event| {
                    event["reason"] == reason && event["regarding"]["name"] == node.as_str()
                })
                .count()
        }))
    };
    wait_until(
        "a DNSFailover Event on the Node",
        Duration::from_secs(20),
        Duration::from_millis(200),
        || Ok(events("DNSFailover")? > 0),
    )?;
    harness
        .sandbox
        .start_cache("cache", &bpf_tests::sandbox::CacheSpec::standard())?;
    wait_until(
        "a DNSFailback Event on the Node",
        Duration::from_secs(20),
        Duration::from_millis(200),
        || Ok(events("DNSFailback")? > 0),
    )?;

    let requests = kube.agent_requests()?;
    println!("the agent's requests: {:?}", verbs(&requests));
    let codes = |requests: &[AuditedRequest]| -> Vec<u16> {
        requests
            .iter()
            .map(|request| request.status.as_ref().map_or(0, |status| status.code))
            .collect()
    };
    println!(
        "answers before the restart {:?}, after it {:?}",
        codes(&requests[..before_restart]),
        codes(&requests[before_restart..])
    );
    assert_only_granted(&requests[..before_restart]);
    // A restarted API server refuses requests until its RBAC authorizer has read the Roles
    // (its readiness does not wait for that): refusals then, none once one was granted.
    let restarted = &requests[before_restart..];
    let first_granted = restarted
        .iter()
        .position(|request| {
            request
                .status
                .as_ref()
                .is_some_and(|status| status.code != 403)
        })
        .unwrap_or(restarted.len());
    assert_only_granted(&restarted[first_granted..]);
    assert!(
        requests
            .iter()
            .filter(|request| request.verb == "watch")
            .count()
            >= 2,
        "the watch was not resumed after the API server came back: {:?}",
        verbs(&requests)
    );
    Ok(())
}

/// A Pod bound to this node (no scheduler or kubelet runs here: `spec.nodeName` is set by hand),
/// and DNS from a cgroup named as the kubelet names its container's: the agent names the workload
/// `pod/NAMESPACE/NAME`, from its watch of this node's pods through the ClusterRole, and so does
/// `redirector status` of its configuration `config`, from the names the agent recorded.
fn a_pod_of_this_node_is_named_by_namespace_and_name(
    kube: &KubeApiserver,
    harness: &Harness,
    config: &Path,
) -> anyhow::Result<()> {
    let node = redirector::sources::node_name();
    // The ServiceAccount admission wants the Pod's account to exist; no controller makes it here.
    kube.apply(
        &serde_json::json!({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "default", "namespace": "default"},
        })
        .to_string(),
    )?;
    kube.apply(
        &serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "web-0", "namespace": "default"},
            "spec": {
                "nodeName": node,
                "automountServiceAccountToken": false,
                "containers": [{"name": "web", "image": "registry.invalid/web:1"}],
            },
        })
        .to_string(),
    )?;
    let uid = kube.kubectl(&[
        "get",
        "pod",
        "web-0",
        "--namespace",
        "default",
        "--output",
        "jsonpath={.metadata.uid}",
    ])?;
    let pod = KubeletCgroups::systemd(harness.sandbox.cgroup(), uid.trim())?;
    let query = Query::new(dns(NODE_LISTENER), Transport::Udp);
    wait_until(
        "the agent names the pod by its namespace and name",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            harness
                .sandbox
                .queries_in(Ns::Pod, pod.container(), query, 3)?;
            Ok(harness.agent.stats.workloads().is_some_and(|view| {
                view.names.values().any(|name| {
                    name.workload == "pod/default/web-0"
                        && name.namespace == "default"
                        && name.pod == "web-0"
                })
            }))
        },
    )
    .map_err(|error| {
        let names: Vec<String> = harness
            .agent
            .stats
            .workloads()
            .map(|view| view.names.into_values().map(|name| name.workload).collect())
            .unwrap_or_default();
        error.context(format!(
            "the agent's names: {names:?} (the pod's UID {uid})"
        ))
    })?;
    // The record is written at the agent's next reading (every second here).
    let mut status = String::new();
    wait_until(
        "redirector status names the pod by its namespace and name",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || {
            status = redirector(&["status", "--config", &config.display().to_string()])?.stdout;
            Ok(status
                .lines()
                .any(|line| line.starts_with("pod/default/web-0 ")))
        },
    )
    .map_err(|error| error.context(format!("status printed:\n{status}")))
}

/// The EndpointSlice Role without `watch`: the agent's watch is refused (403 in the audit log),
/// and the agent says so in words that name the verb and the manifest to apply, at each retry;
/// given the verb back, it follows the slices again.
#[test]
fn a_verb_the_role_lacks_is_reported_and_retried_until_granted() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let kube = cluster(&sandbox)?;
    let role = std::fs::read_to_string(manifests().join("base/role.yaml"))?;
    let narrowed = role.replace(
        r#"verbs: ["get", "list", "watch"]"#,
        r#"verbs: ["get", "list"]"#,
    );
    anyhow::ensure!(narrowed != role, "role.yaml's verbs changed shape: {role}");
    kube.kubectl(&[
        "apply",
        "--namespace",
        "kube-system",
        "-f",
        &sandbox
            .write_file("narrowed-role.yaml", &narrowed)?
            .display()
            .to_string(),
    ])?;
    let config = sandbox.write_file("config.toml", &config_text(&sandbox, &kube)?)?;
    let mut agent = start_agent(&config)?;
    wait_until(
        "the agent reports the refused watch",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            Ok(agent.printed().iter().any(|line| {
                line.contains("refused the agent's ServiceAccount a verb it needs")
                    && line.contains("cannot watch resource")
            }))
        },
    )?;
    let refused: Vec<AuditedRequest> = kube
        .agent_requests()?
        .into_iter()
        .filter(|request| {
            request
                .status
                .as_ref()
                .is_some_and(|status| status.code == 403)
        })
        .collect();
    assert!(
        refused.iter().all(|request| request.verb == "watch") && !refused.is_empty(),
        "{refused:?}"
    );
    // The verb given back: the watch goes on, and a change is followed.
    kube.kubectl(&[
        "apply",
        "--namespace",
        "kube-system",
        "-f",
        &manifests().join("base/role.yaml").display().to_string(),
    ])?;
    let refusals_then = refused.len();
    std::thread::sleep(Duration::from_secs(1));
    apply_slice(&kube, &["198.18.2.3"], 53)?;
    let maps = redirector::datapath::Maps::open_pinned(&sandbox.pin_dir())?;
    wait_until(
        "the pool follows once watch is granted",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || {
            let pool: Vec<IpAddr> = maps
                .pool(CLUSTER_ID)?
                .targets()
                .iter()
                .map(|target| IpAddr::from(target.addr))
                .collect();
            Ok(pool == ["198.18.2.3".parse::<IpAddr>()?])
        },
    )?;
    println!(
        "{refusals_then} refused watches, then granted: {:?}",
        verbs(&kube.agent_requests()?)
    );
    stop_agent(&mut agent)?;
    uninstall(&config)?;
    Ok(())
}
