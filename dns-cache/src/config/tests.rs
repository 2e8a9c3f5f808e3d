use super::*;

fn parse_err(text: &str) -> String {
    match CacheConfig::parse(text) {
        Ok(config) => panic!("accepted: {config:?}"),
        // anyhow's alternate form is the error and its causes, joined by ": ".
        Err(error) => format!("{:#}", anyhow::Error::from(error)),
    }
}

fn name(text: &str) -> Name {
    Name::from_ascii(text).expect("a name")
}

#[test]
fn parses_a_full_configuration() {
    let config = CacheConfig::parse(
        r#"
        listen = ["127.0.0.1:5353", "::1"]
        default_servers = ["1.1.1.1", "[2606:4700::1111]:53"]
        max_ttl_secs = 600
        max_negative_ttl_secs = 0
        stale_for_secs = 45
        max_entries = 100
        upstream_timeout_ms = 750
        allow = ["10.0.0.0/8", "192.0.2.7", "fd00::/8", "0.0.0.0/0"]

        [[zone]]
        name = "Cluster.Local"
        servers = ["10.96.0.10:53", "10.96.0.11"]
        "#,
    )
    .expect("valid");
    assert_eq!(
        config.listen,
        vec![
            "127.0.0.1:5353".parse::<SocketAddr>().expect("address"),
            "[::1]:53".parse().expect("address"),
        ]
    );
    assert_eq!(
        config.default_servers,
        vec![
            "1.1.1.1:53".parse::<SocketAddr>().expect("address"),
            "[2606:4700::1111]:53".parse().expect("address"),
        ]
    );
    assert_eq!(config.zones.len(), 1);
    assert_eq!(config.zones[0].name.to_string(), "cluster.local.");
    assert!(config.zones[0].name.is_fqdn());
    assert_eq!(
        config.zones[0].servers,
        vec![
            "10.96.0.10:53".parse::<SocketAddr>().expect("address"),
            "10.96.0.11:53".parse().expect("address"),
        ]
    );
    assert_eq!(config.max_ttl, Duration::from_secs(600));
    assert_eq!(config.max_negative_ttl, Duration::ZERO);
    assert_eq!(config.stale_for, Duration::from_secs(45));
    assert_eq!(config.max_entries, 100);
    assert_eq!(config.upstream_timeout, Duration::from_millis(750));
    assert_eq!(
        config
            .allow
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["10.0.0.0/8", "192.0.2.7/32", "fd00::/8", "0.0.0.0/0"]
    );
}

#[test]
fn defaults_apply() {
    let config = CacheConfig::parse(
        r#"
        listen = ["127.0.0.1:53"]
        default_servers = ["9.9.9.9"]
        "#,
    )
    .expect("valid");
    assert!(config.zones.is_empty());
    assert_eq!(config.max_ttl, DEFAULT_MAX_TTL);
    assert_eq!(config.max_negative_ttl, DEFAULT_MAX_NEGATIVE_TTL);
    assert_eq!(config.stale_for, DEFAULT_STALE_FOR);
    assert_eq!(config.max_entries, DEFAULT_MAX_ENTRIES);
    assert_eq!(config.upstream_timeout, DEFAULT_UPSTREAM_TIMEOUT);
    assert_eq!(config.allow, DEFAULT_ALLOW);
}

#[test]
fn the_default_allow_is_loopback_link_local_and_private() {
    let is_allowed = |text: &str| {
        let address: IpAddr = text.parse().expect("address");
        allowed(&DEFAULT_ALLOW, address)
    };
    for inside in [
        "127.0.0.1",
        "127.255.255.254",
        "169.254.20.10",
        "10.0.0.1",
        "10.255.255.255",
        "172.16.0.0",
        "172.31.255.255",
        "192.168.1.1",
        "::1",
        "fe80::1",
        "febf:ffff::1",
        "fc00::1",
        "fd00:1::2",
        "::ffff:10.1.2.3",
    ] {
        assert!(is_allowed(inside), "{inside} is allowed");
    }
    for outside in [
        "8.8.8.8",
        "9.255.255.255",
        "11.0.0.0",
        "172.15.255.255",
        "172.32.0.0",
        "192.167.255.255",
        "192.169.0.0",
        "169.253.255.255",
        "198.18.1.2",
        "100.64.0.1",
        "0.0.0.0",
        "::",
        "::2",
        "fec0::1",
        "fe00::1",
        "2001:db8::1",
        "::ffff:8.8.8.8",
    ] {
        assert!(!is_allowed(outside), "{outside} is refused");
    }
    for network in DEFAULT_ALLOW {
        assert_eq!(network.trunc(), network, "{network} is a network address");
    }
}

#[test]
fn cidrs_parse_strictly() {
    const PREFIX: &str = "the prefix length is not a number from 0 to 32 (IPv4) or 128 (IPv6)";
    let cidr = parse_network;
    let contains = |network: &str, address: &str| {
        allowed(
            &[cidr(network).expect("CIDR")],
            address.parse().expect("address"),
        )
    };
    assert!(contains("0.0.0.0/0", "203.0.113.9"));
    assert!(!contains("0.0.0.0/0", "2001:db8::1"), "one family");
    assert!(contains("::/0", "2001:db8::1"));
    assert!(contains("192.0.2.7", "192.0.2.7"));
    assert!(!contains("192.0.2.7", "192.0.2.6"));
    assert!(contains("2001:db8::/127", "2001:db8::1"));
    assert!(!contains("2001:db8::/127", "2001:db8::2"));
    assert!(contains("10.0.0.0/8", "::ffff:10.9.9.9"), "IPv4-mapped");
    assert!(contains("::ffff:0:0/96", "::ffff:10.9.9.9"));
    assert_eq!(
        cidr("FD00::/8").expect("CIDR").to_string(),
        "fd00::/8",
        "displayed canonically"
    );
    for (text, expected) in [
        ("10.0.0.1/8", "write the network address, 10.0.0.0/8"),
        ("fd00::1/8", "write the network address, fd00::/8"),
        ("10.0.0.0/33", PREFIX),
        ("fd00::/129", PREFIX),
        ("10.0.0.0/999", PREFIX),
        ("10.0.0.0/", PREFIX),
        ("10.0.0.0/+8", PREFIX),
        ("10.0.0.0/ 8", PREFIX),
        ("10.0.0.0/0008", PREFIX),
        ("10.0.0.0/8/8", PREFIX),
        ("example.com/8", "is not an IPv4 or IPv6 address"),
        ("", "is not an IPv4 or IPv6 address"),
        ("10.0.0.0:53", "is not an IPv4 or IPv6 address"),
    ] {
        let error = cidr(text).expect_err(text).to_string();
        assert!(error.contains(expected), "{text:?}: {error:?}");
    }
}

#[test]
fn an_unspecified_listen_address_needs_an_explicit_allow() {
    for (listen, key) in [
        ("[\"0.0.0.0:53\"]", "listen[0]: 0.0.0.0:53"),
        ("[\"127.0.0.1:53\", \"::\"]", "listen[1]: [::]:53"),
    ] {
        let text = format!("listen = {listen}\ndefault_servers = [\"9.9.9.9\"]\n");
        let message = parse_err(&text);
        assert!(
            message.contains(&format!("{key} listens on every interface"))
                && message.contains("allow = ["),
            "{message:?}"
        );
        let config = CacheConfig::parse(&format!("{text}allow = [\"10.0.0.0/8\"]\n"))
            .expect("explicit allow");
        assert_eq!(config.allow.len(), 1);
    }
}

#[test]
fn refusals_name_the_key() {
    let base = "listen = [\"127.0.0.1:53\"]\ndefault_servers = [\"9.9.9.9\"]\n";
    let cases: &[(&str, &str)] = &[
        ("listen = [\"127.0.0.1:53\"]\nbogus = 1\n", "bogus"),
        ("default_servers = [\"9.9.9.9\"]\n", "listen: no address"),
        (
            "listen = [\"127.0.0.1:53\", \"localhost:53\"]\ndefault_servers = [\"9.9.9.9\"]",
            "listen[1]: \"localhost:53\" is not an address",
        ),
        (
            "listen = [\"127.0.0.1:0\"]\ndefault_servers = [\"9.9.9.9\"]",
            "listen[0]: \"127.0.0.1:0\" has port 0",
        ),
        (
            "listen = [\"127.0.0.1\", \"127.0.0.1:53\"]\ndefault_servers = [\"9.9.9.9\"]",
            "listen[1]: 127.0.0.1:53 is already given as listen[0]",
        ),
        (
            "listen = [\"127.0.0.1:53\"]",
            "default_servers: empty and no [[zone]]",
        ),
        (
            &format!("{base}[[zone]]\nname = \"a..b\"\nservers = [\"10.0.0.1\"]\n"),
            "zone[0].name: \"a..b\" is not a DNS name",
        ),
        (
            &format!("{base}[[zone]]\nname = \".\"\nservers = [\"10.0.0.1\"]\n"),
            "zone[0].name: the root zone",
        ),
        (
            &format!(
                "{base}[[zone]]\nname = \"cluster.local.\"\nservers = [\"10.0.0.1\"]\n\
                 [[zone]]\nname = \"CLUSTER.local\"\nservers = [\"10.0.0.2\"]\n"
            ),
            "zone[1].name: the zone cluster.local. is already configured as zone[0]",
        ),
        (
            &format!("{base}[[zone]]\nname = \"cluster.local.\"\n"),
            "zone[0].servers: no server given",
        ),
        (
            &format!("{base}[[zone]]\nname = \"x.\"\nservers = [\"10.0.0.1:0\"]\n"),
            "zone[0].servers[0]: \"10.0.0.1:0\" has port 0",
        ),
        (
            &format!("{base}[[zone]]\nname = \"x.\"\nservers = [\"10.0.0.1\"]\nport = 5\n"),
            "port",
        ),
        (
            &format!("{base}max_ttl_secs = 0\n"),
            "max_ttl_secs: 0 is out of range",
        ),
        (
            &format!("{base}max_negative_ttl_secs = 99999\n"),
            "max_negative_ttl_secs: 99999 is out of range",
        ),
        (
            &format!("{base}stale_for_secs = 999999999\n"),
            "stale_for_secs: 999999999 is out of range",
        ),
        (
            &format!("{base}max_entries = 0\n"),
            "max_entries: 0 is out of range",
        ),
        (
            &format!("{base}upstream_timeout_ms = 0\n"),
            "upstream_timeout_ms: 0 is out of range",
        ),
        (&format!("{base}max_ttl_secs = \"1h\"\n"), "max_ttl_secs"),
        (
            &format!("{base}max_bytes = 16777216\n"),
            "max_bytes: the cache no longer has a byte budget",
        ),
        (
            &format!("{base}allow = []\n"),
            "allow: empty, so every client would be refused",
        ),
        (
            &format!("{base}allow = [\"10.0.0.0/8\", \"10.0.0.1/8\"]\n"),
            "allow[1]: \"10.0.0.1/8\" is not a network like \"10.0.0.0/8\", \"fd00::/8\" or \
             \"10.1.2.3\": bits are set beyond the prefix length; write the network address, \
             10.0.0.0/8",
        ),
        (
            &format!("{base}allow = [\"10.0.0.0/40\"]\n"),
            "allow[0]: \"10.0.0.0/40\" is not a network",
        ),
        (
            &format!("{base}allow = [\"pods\"]\n"),
            "allow[0]: \"pods\" is not a network",
        ),
        (&format!("{base}allow = \"10.0.0.0/8\"\n"), "allow"),
    ];
    for (text, expected) in cases {
        let message = parse_err(text);
        assert!(
            message.contains(expected),
            "for {text:?}: {message:?} does not contain {expected:?}"
        );
    }
}

#[test]
fn load_names_the_file() {
    let missing = Path::new("/nonexistent/redirector-cache.toml");
    let error = CacheConfig::load(missing).expect_err("no such file");
    assert!(matches!(&error, CacheConfigError::Read { path, .. } if path == missing));
    assert!(
        error
            .to_string()
            .contains("/nonexistent/redirector-cache.toml")
    );
}

#[test]
fn longest_zone_wins() {
    let config = CacheConfig::parse(
        r#"
        listen = ["127.0.0.1:53"]
        default_servers = ["10.0.0.1"]
        [[zone]]
        name = "local."
        servers = ["10.0.0.2"]
        [[zone]]
        name = "svc.cluster.local."
        servers = ["10.0.0.4"]
        [[zone]]
        name = "cluster.local."
        servers = ["10.0.0.3"]
        "#,
    )
    .expect("valid");
    let upstream = |text: &str| config.upstreams_for(&name(text))[0].ip().to_string();
    assert_eq!(upstream("example.com."), "10.0.0.1");
    assert_eq!(upstream("local."), "10.0.0.2");
    assert_eq!(upstream("printer.local."), "10.0.0.2");
    // A label boundary, not a string suffix.
    assert_eq!(upstream("notcluster.local."), "10.0.0.2");
    assert_eq!(upstream("cluster.local."), "10.0.0.3");
    assert_eq!(upstream("Pod.Cluster.LOCAL."), "10.0.0.3");
    assert_eq!(
        upstream("kube-dns.kube-system.svc.cluster.local."),
        "10.0.0.4"
    );
    assert_eq!(upstream("com."), "10.0.0.1");
    assert_eq!(upstream("."), "10.0.0.1");
}

#[test]
fn no_default_servers_means_none_outside_zones() {
    let config = CacheConfig::parse(
        r#"
        listen = ["127.0.0.1:53"]
        [[zone]]
        name = "cluster.local"
        servers = ["10.0.0.3"]
        "#,
    )
    .expect("valid");
    assert!(config.upstreams_for(&name("example.com.")).is_empty());
    assert_eq!(config.upstreams_for(&name("a.cluster.local.")).len(), 1);
}
