//! The configuration's parsing and every refusal.

use redirector_common::{
    listener::LISTENER_NAME_MAX,
    pool::MAX_POOL_TARGETS,
    settings::{EmptyPoolPolicy, Liveness},
};

use super::*;

fn refusal(text: &str) -> String {
    let error = Config::parse(text).expect_err("the configuration must be refused");
    crate::error_chain(&error)
}

const AKS: &str = r#"
    cgroup = "/sys/fs/cgroup"
    [[listener]]
    name = "node"
    address = "169.254.10.10"
    upstreams = ["168.63.129.16"]
    [[listener]]
    name = "cluster"
    address = "169.254.10.11"
    cache = "169.254.10.11:53"
    upstreams = ["10.244.0.5:53", "10.244.1.7:1053"]
    empty_pool = "fail"
    skip_cgroups = ["/sys/fs/cgroup/kubepods.slice/cache"]
"#;

#[test]
fn parses_a_full_configuration_with_defaults() {
    let config = Config::parse(AKS).unwrap();
    assert_eq!(config.cgroup, Some(PathBuf::from("/sys/fs/cgroup")));
    assert_eq!(config.pin_dir, PathBuf::from(DEFAULT_PIN_DIR));
    assert_eq!(
        config.reverse_nat_entries,
        REVERSE_NAT_DEFAULT_ENTRIES as u32
    );
    let node = &config.listeners[0];
    assert_eq!(node.cache, "169.254.10.10:53".parse().unwrap());
    assert_eq!(node.upstreams, vec!["168.63.129.16:53".parse().unwrap()]);
    assert_eq!(node.empty_pool, EmptyPoolPolicy::Pass);
    let (id, cluster) = config.listener("cluster").unwrap();
    assert_eq!(id, 1);
    assert_eq!(cluster.upstreams[1], "10.244.1.7:1053".parse().unwrap());
    assert_eq!(cluster.empty_pool, EmptyPoolPolicy::Fail);
    assert_eq!(cluster.skip_cgroups.len(), 1);
}

#[test]
fn parses_ipv6_listeners_and_targets() {
    let config = Config::parse(
        r#"
        [[listener]]
        name = "v6"
        address = "fd00:53::10"
        cache = "[fd00:53::20]:5353"
        upstreams = ["fd00:53::1", "[fd00:53::2]:53"]
        "#,
    )
    .unwrap();
    let listener = &config.listeners[0];
    assert_eq!(listener.cache, "[fd00:53::20]:5353".parse().unwrap());
    assert_eq!(listener.upstreams[0], "[fd00:53::1]:53".parse().unwrap());
}

#[test]
fn refuses_an_unparseable_address_naming_the_key() {
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.300"
        "#,
    );
    assert!(
        message.starts_with("listener[0] (\"node\").address: \"169.254.10.300\""),
        "{message}"
    );
}

#[test]
fn refuses_a_loopback_or_listener_upstream_as_the_sources_do() {
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        upstreams = ["10.0.0.1", "127.0.0.53"]
        "#,
    );
    assert!(
        message.starts_with("listener[0] (\"node\").upstreams[1]: 127.0.0.53:53 cannot be an upstream: a loopback address"),
        "{message}"
    );
    assert!(message.contains("resolv_conf"), "{message}");
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        upstreams = ["169.254.10.11"]
        [[listener]]
        name = "cluster"
        address = "169.254.10.11"
        upstreams = ["10.0.0.10"]
        "#,
    );
    assert!(
        message.starts_with("listener[0] (\"node\").upstreams[0]: 169.254.10.11:53 cannot be an upstream: it is a listener address"),
        "{message}"
    );
    // A cloud's link-local resolver is a node's nameserver like any other.
    Config::parse(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        upstreams = ["169.254.169.253"]
        "#,
    )
    .expect("a link-local nameserver is allowed");
}

#[test]
fn refuses_an_unparseable_upstream_naming_the_key() {
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        upstreams = ["10.0.0.1", "ten.0.0.2"]
        "#,
    );
    assert!(
        message.starts_with("listener[0] (\"node\").upstreams[1]: \"ten.0.0.2\""),
        "{message}"
    );
}

#[test]
fn refuses_port_zero() {
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        upstreams = ["10.0.0.1:0"]
        "#,
    );
    assert!(
        message.contains("upstreams[0]") && message.contains("port 0"),
        "{message}"
    );
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        cache = "169.254.20.10:0"
        "#,
    );
    assert!(
        message.contains(".cache") && message.contains("port 0"),
        "{message}"
    );
}

#[test]
fn refuses_a_duplicate_listener_name() {
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        [[listener]]
        name = "node"
        address = "169.254.10.11"
        "#,
    );
    assert!(
        message.starts_with("listener[1].name: the name \"node\" is already used by listener[0]"),
        "{message}"
    );
}

#[test]
fn refuses_a_duplicate_listener_address() {
    let message = refusal(
        r#"
        [[listener]]
        name = "a"
        address = "169.254.10.10"
        [[listener]]
        name = "b"
        address = "169.254.10.10"
        "#,
    );
    assert!(
        message.contains("listener[1].address") && message.contains("listener[0]"),
        "{message}"
    );
}

#[test]
fn refuses_a_v6_backend_in_a_v4_pool() {
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        upstreams = ["10.0.0.1", "[fd00::1]:53"]
        "#,
    );
    assert!(
        message.starts_with("listener[0] (\"node\").upstreams[1]: [fd00::1]:53 is IPv6"),
        "{message}"
    );
}

#[test]
fn refuses_a_cache_of_the_other_family() {
    let message = refusal(
        r#"
        [[listener]]
        name = "v6"
        address = "fd00::10"
        cache = "10.0.0.1:53"
        "#,
    );
    assert!(message.contains(".cache: 10.0.0.1:53 is IPv4"), "{message}");
}

#[test]
fn refuses_a_listener_address_with_a_port() {
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10:53"
        "#,
    );
    assert!(message.contains("has a port"), "{message}");
}

#[test]
fn refuses_unusable_listener_addresses() {
    for (address, why) in [
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.53", "multicast"),
        ("::ffff:169.254.10.10", "IPv4-mapped"),
    ] {
        let message = refusal(&format!(
            "[[listener]]\nname = \"x\"\naddress = \"{address}\"\n"
        ));
        assert!(message.contains(why), "{address}: {message}");
    }
}

#[test]
fn accepts_a_mapped_upstream_as_ipv4() {
    let config = Config::parse(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        upstreams = ["[::ffff:10.0.0.1]:53"]
        "#,
    )
    .unwrap();
    assert_eq!(
        config.listeners[0].upstreams[0],
        "10.0.0.1:53".parse().unwrap()
    );
}

#[test]
fn refuses_unknown_keys_naming_them() {
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        upstream = ["10.0.0.1"]
        "#,
    );
    assert!(message.contains("upstream"), "{message}");
    assert!(message.contains("unknown field"), "{message}");
}

#[test]
fn refuses_an_unknown_empty_pool_policy() {
    let message = refusal(
        r#"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        empty_pool = "drop"
        "#,
    );
    assert!(
        message.contains("empty_pool") || message.contains("drop"),
        "{message}"
    );
}

#[test]
fn refuses_no_listeners_and_too_many() {
    assert!(refusal("").contains("no listener"));
    let many: String = (0..=MAX_LISTENERS)
        .map(|i| {
            format!(
                "[[listener]]\nname = \"l{i}\"\naddress = \"10.1.{}.{}\"\n",
                i / 250,
                i % 250 + 1
            )
        })
        .collect();
    assert!(refusal(&many).contains("at most 64"));
}

#[test]
fn refuses_bad_names() {
    assert!(
        refusal("[[listener]]\nname = \"\"\naddress = \"10.0.0.1\"\n").contains("listener[0].name")
    );
    let long = "n".repeat(LISTENER_NAME_MAX + 1);
    assert!(
        refusal(&format!(
            "[[listener]]\nname = \"{long}\"\naddress = \"10.0.0.1\"\n"
        ))
        .contains("1 to 32 bytes")
    );
}

#[test]
fn refuses_too_many_upstreams() {
    let upstreams: Vec<String> = (1..=MAX_POOL_TARGETS + 1)
        .map(|i| format!("\"10.0.1.{i}\""))
        .collect();
    let message = refusal(&format!(
        "[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\nupstreams = [{}]\n",
        upstreams.join(", ")
    ));
    assert!(
        message.contains("upstreams: 33 upstreams given"),
        "{message}"
    );
}

#[test]
fn probe_settings_default_and_override() {
    let config = Config::parse("[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n").unwrap();
    assert_eq!(config.probe, ProbeSettings::default());
    assert_eq!(config.probe.interval, Duration::from_millis(100));
    assert_eq!(config.probe.timeout, Duration::from_millis(250));
    assert_eq!(config.probe.failures_to_fail_over, 2);
    assert_eq!(config.probe.successes_to_fail_back, 3);
    assert_eq!(config.listeners[0].probe_name, "localhost.");
    assert_eq!(config.listeners[0].liveness, Liveness::SocketsAndProbes);
    assert_eq!(
        config.socket_reconcile_interval,
        DEFAULT_SOCKET_RECONCILE_INTERVAL
    );

    let config = Config::parse(
        r#"
        cache_netns = "/run/netns/node"
        socket_reconcile_interval_ms = 1000
        [probe]
        name = "health.check.local"
        interval_ms = 200
        timeout_ms = 100
        failures_to_fail_over = 1
        successes_to_fail_back = 5
        [[listener]]
        name = "n"
        address = "10.0.0.1"
        liveness = "probes"
        probe_name = "other.local."
        "#,
    )
    .unwrap();
    assert_eq!(config.cache_netns, Some(PathBuf::from("/run/netns/node")));
    assert_eq!(config.probe.name, "health.check.local.");
    assert_eq!(config.probe.interval, Duration::from_millis(200));
    assert_eq!(config.listeners[0].liveness, Liveness::Probes);
    assert_eq!(config.listeners[0].probe_name, "other.local.");
}

#[test]
fn refuses_probe_settings_that_cannot_work() {
    let listener = "[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n";
    for (probe, expected) in [
        (
            "interval_ms = 20\ntimeout_ms = 300",
            "probe.timeout_ms: 300 ms would keep more than 10 probes of a cache in flight",
        ),
        (
            "interval_ms = 0",
            "probe.interval_ms: 0 would probe without pause",
        ),
        (
            "timeout_ms = 0",
            "probe.timeout_ms: 0 would fail every probe",
        ),
        (
            "failures_to_fail_over = 0",
            "probe.failures_to_fail_over: 0",
        ),
        (
            "successes_to_fail_back = 0",
            "probe.successes_to_fail_back: 0",
        ),
        (
            "name = \"bad name\"",
            "probe.name: \"bad name\" is not a DNS name",
        ),
        ("name = \"a..b\"", "probe.name: \"a..b\" is not a DNS name"),
    ] {
        let message = refusal(&format!("[probe]\n{probe}\n{listener}"));
        assert!(message.starts_with(expected), "{probe}: {message}");
    }
    let message = refusal(&format!("{listener}probe_name = \"x y\"\n"));
    assert!(
        message.starts_with("listener[0] (\"n\").probe_name"),
        "{message}"
    );
}

#[test]
fn upstream_sources_and_their_conflicts() {
    let config = Config::parse(
        r#"
        [[listener]]
        name = "cluster"
        address = "169.254.10.11"
        kube_dns = "kube-system/kube-dns"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        resolv_conf = "/run/systemd/resolve/resolv.conf"
        [[listener]]
        name = "static"
        address = "169.254.10.12"
        upstreams = ["10.0.0.1"]
        "#,
    )
    .unwrap();
    assert_eq!(
        config.listeners[0].source,
        UpstreamSource::Kubernetes {
            namespace: "kube-system".to_owned(),
            service: "kube-dns".to_owned()
        }
    );
    assert_eq!(
        config.listeners[1].source,
        UpstreamSource::ResolvConf(PathBuf::from("/run/systemd/resolve/resolv.conf"))
    );
    assert_eq!(config.listeners[2].source, UpstreamSource::Static);
    assert_eq!(config.kubernetes, KubernetesSettings::default());
    assert_eq!(config.interface, InterfaceSettings::default());
    assert_eq!(config.lock_file, PathBuf::from(DEFAULT_LOCK_FILE));
    assert_eq!(config.conntrack, ConntrackSettings::default());
    assert_eq!(config.metrics.address.to_string(), DEFAULT_METRICS_ADDRESS);
    assert!(config.metrics.enabled);
    assert!(config.conntrack.bypass);

    let message = refusal(
        "[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\nupstreams = [\"10.0.0.2\"]\nkube_dns = \"kube-system/kube-dns\"\n",
    );
    assert!(
        message.starts_with("listener[0] (\"n\"): give one of upstreams"),
        "{message}"
    );
    let message =
        refusal("[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\nkube_dns = \"kube-dns\"\n");
    assert!(
        message
            .starts_with("listener[0] (\"n\").kube_dns: \"kube-dns\" is not a Service reference"),
        "{message}"
    );
}

#[test]
fn interface_settings_and_their_refusals() {
    let config = Config::parse(
        "[interface]\nmanage = false\nname = \"veth-dns\"\nkind = \"existing\"\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
    )
    .unwrap();
    assert_eq!(
        config.interface,
        InterfaceSettings {
            manage: false,
            name: "veth-dns".to_owned(),
            kind: InterfaceKind::Existing
        }
    );
    for name in ["", "a/b", "this-name-is-too-long", "with space"] {
        let message = refusal(&format!(
            "[interface]\nname = {name:?}\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n"
        ));
        assert!(message.starts_with("interface.name"), "{name}: {message}");
    }
}

#[test]
fn conntrack_settings_and_their_refusals() {
    let config = Config::parse(
        "[conntrack]\nbypass = true\nnft = \"/usr/sbin/nft\"\ncheck_interval_ms = 1000\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
    )
    .unwrap();
    assert_eq!(
        config.conntrack,
        ConntrackSettings {
            bypass: true,
            nft: PathBuf::from("/usr/sbin/nft"),
            check_interval: Duration::from_secs(1),
        }
    );
    let message = refusal(
        "[conntrack]\ncheck_interval_ms = 0\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
    );
    assert!(
        message.starts_with("conntrack.check_interval_ms"),
        "{message}"
    );
    let message = refusal(
        "[conntrack]\nnotrack = true\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
    );
    assert!(message.contains("notrack"), "{message}");
    let message = refusal(
        "[metrics]\naddress = \"localhost\"\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
    );
    assert!(message.starts_with("metrics.address"), "{message}");
}

#[test]
fn refuses_a_tiny_reverse_map() {
    let message =
        refusal("reverse_nat_entries = 10\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n");
    assert!(message.contains("reverse_nat_entries"), "{message}");
}

#[test]
fn the_stall_limit_and_the_drain_socket_have_defaults_an_off_switch_and_a_floor() {
    let config = Config::parse(AKS).unwrap();
    assert_eq!(
        config.probe.stall_after,
        Some(Duration::from_millis(DEFAULT_STALL_AFTER_MS))
    );
    assert_eq!(config.probe.signal_hold, Duration::from_secs(6));
    assert_eq!(
        config.drain_socket,
        Some(PathBuf::from(DEFAULT_DRAIN_SOCKET))
    );
    let with = |top: &str, probe: &str| {
        let (head, listeners) = AKS.split_once("[[listener]]").unwrap();
        format!("{top}\n{head}\n[probe]\n{probe}\n[[listener]]{listeners}")
    };
    let off = Config::parse(&with("drain_socket = \"\"", "stall_after_ms = 0")).unwrap();
    assert_eq!((off.probe.stall_after, off.drain_socket), (None, None));
    let set = Config::parse(&with("", "stall_after_ms = 120\nsignal_hold_ms = 500")).unwrap();
    assert_eq!(set.probe.stall_after, Some(Duration::from_millis(120)));
    assert_eq!(set.probe.signal_hold, Duration::from_millis(500));
    let refused = refusal(&with("", "stall_after_ms = 10"));
    assert!(
        refused.contains("probe.stall_after_ms") && refused.contains("at least 20"),
        "{refused}"
    );
}

#[test]
fn upstream_checks_have_a_default_an_off_switch_and_a_floor() {
    let config = Config::parse(AKS).unwrap();
    assert_eq!(
        config.probe.upstream_interval,
        Some(Duration::from_millis(DEFAULT_UPSTREAM_INTERVAL_MS))
    );
    let with = |probe: &str| {
        let (head, listeners) = AKS.split_once("[[listener]]").unwrap();
        format!("{head}\n[probe]\n{probe}\n[[listener]]{listeners}")
    };
    let off = Config::parse(&with("upstream_interval_ms = 0")).unwrap();
    assert_eq!(off.probe.upstream_interval, None);
    let set = Config::parse(&with("upstream_interval_ms = 2000")).unwrap();
    assert_eq!(set.probe.upstream_interval, Some(Duration::from_secs(2)));
    let refused = refusal(&with("upstream_interval_ms = 20"));
    assert!(
        refused.contains("probe.upstream_interval_ms") && refused.contains("at least 100"),
        "{refused}"
    );
}

#[test]
fn upstream_checks_wait_for_slow_answers_on_their_own_timeout() {
    let config = Config::parse(AKS).unwrap();
    assert_eq!(
        config.probe.upstream_timeout,
        Duration::from_millis(DEFAULT_UPSTREAM_TIMEOUT_MS)
    );
    assert!(
        config.probe.upstream_timeout >= 4 * config.probe.timeout,
        "an upstream is given far longer than the local cache"
    );
    let with = |probe: &str| {
        let (head, listeners) = AKS.split_once("[[listener]]").unwrap();
        format!("{head}\n[probe]\n{probe}\n[[listener]]{listeners}")
    };
    let set = Config::parse(&with("upstream_timeout_ms = 1500\ntimeout_ms = 100")).unwrap();
    assert_eq!(
        (set.probe.upstream_timeout, set.probe.timeout),
        (Duration::from_millis(1500), Duration::from_millis(100)),
        "each has its own setting"
    );
    let zero = refusal(&with("upstream_timeout_ms = 0"));
    assert!(zero.contains("probe.upstream_timeout_ms"), "{zero}");
    let piled = refusal(&with(
        "upstream_interval_ms = 100\nupstream_timeout_ms = 1500",
    ));
    assert!(
        piled.contains("probe.upstream_timeout_ms") && piled.contains("more than 10 checks"),
        "{piled}"
    );
    // Checks off: their timeout is never used, so it is not held to their interval.
    let off = Config::parse(&with(
        "upstream_interval_ms = 0\nupstream_timeout_ms = 5000",
    ))
    .unwrap();
    assert_eq!(off.probe.upstream_interval, None);
}

const ONE_LISTENER: &str = "[[listener]]\nname = \"n\"\naddress = \"169.254.20.10\"\n";

#[test]
fn counts_per_workload_by_default_and_limits_nothing() {
    let config = Config::parse(ONE_LISTENER).expect("valid");
    assert!(config.workloads.accounting);
    assert_eq!(config.workloads.tracked, 4096);
    assert_eq!(config.workloads.top, 5);
    assert_eq!(config.workloads.interval, Duration::from_secs(10));
    assert_eq!(config.workloads.rate_limit, None);
}

#[test]
fn a_rate_limit_bursts_one_seconds_worth_unless_told() {
    let text = format!("[workloads]\nrate_limit_qps = 200\n{ONE_LISTENER}");
    let limit = Config::parse(&text).expect("valid").workloads.rate_limit;
    assert_eq!(
        limit,
        Some(RateLimit {
            qps: 200,
            burst: 200
        })
    );
    assert_eq!(
        limit.map(|limit| limit.schedule_ns()),
        Some((5_000_000, 199 * 5_000_000))
    );
    let text = format!("[workloads]\nrate_limit_qps = 10\nrate_limit_burst = 1\n{ONE_LISTENER}");
    let limit = Config::parse(&text).expect("valid").workloads.rate_limit;
    assert_eq!(
        limit.map(|limit| limit.schedule_ns()),
        Some((100_000_000, 0))
    );
}

#[test]
fn refuses_workload_settings_that_cannot_work_naming_the_key() {
    for (table, key) in [
        ("tracked = 10", "workloads.tracked"),
        ("top = 1000", "workloads.top"),
        ("interval_ms = 10", "workloads.interval_ms"),
        ("rate_limit_burst = 10", "workloads.rate_limit_burst"),
        (
            "rate_limit_qps = 10\nrate_limit_burst = 0",
            "workloads.rate_limit_burst",
        ),
        (
            "rate_limit_qps = 10\naccounting = false",
            "workloads.rate_limit_qps",
        ),
        ("rate_limit_qps = 2000000", "workloads.rate_limit_qps"),
    ] {
        let message = refusal(&format!("[workloads]\n{table}\n{ONE_LISTENER}"));
        assert!(message.starts_with(key), "{table}: {message}");
    }
    // 0 is no limit, without a burst.
    let text = format!("[workloads]\nrate_limit_qps = 0\n{ONE_LISTENER}");
    assert_eq!(
        Config::parse(&text).expect("valid").workloads.rate_limit,
        None
    );
}
