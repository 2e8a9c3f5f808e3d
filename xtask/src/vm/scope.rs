//! What the VMs leave to the host kernel's run: tests of what runs above the kernel (the agent's
//! userspace, cache daemons, resolver libraries) over kernel paths that tests run in every VM
//! take as well. Under TCG they would cost about 40 % of the VM time and prove nothing more of a
//! kernel; they still run on every `cargo xtask test`, on the host's kernel. Every VM run says
//! what it left out.

/// Tests of the bpf-tests the VMs do not run unless asked.
pub struct HostOnly {
    /// The test binary.
    pub binary: &'static str,
    /// Substrings of the names of its tests left out (libtest's `--skip`); empty: the whole
    /// binary.
    pub skip: &'static [&'static str],
    /// Why no kernel is missed.
    pub why: &'static str,
}

/// The tests the VMs leave to the host, with their reasons.
pub const HOST_ONLY: &[HostOnly] = &[
    HostOnly {
        binary: "failover",
        skip: &[
            "_of_dnsmasq_",
            "_of_unbound_",
            "_of_the_embedded_cache",
            "_of_coredns_",
        ],
        why: "kill -9, stop and hang through dnsmasq, unbound, the embedded cache and CoreDNS: \
              the test server's run of each takes the same kernel paths, and \
              wildcard_and_reuseport_sockets_are_counted_one_by_one their socket shapes",
    },
    HostOnly {
        binary: "coredns",
        skip: &[],
        why: "CoreDNS's own ways (Go's SIGURG, multisocket, its netpoller at capacity) over the \
              signal program, the socket counts and the stall stamps, which signal and stall \
              run whole on 6.1",
    },
    HostOnly {
        binary: "kube_apiserver",
        skip: &[],
        why: "the agent's API client and the shipped RBAC against a real API server are \
              userspace; the pools it writes take the paths steering's tests run in the VMs",
    },
    HostOnly {
        binary: "drain",
        skip: &["a_drained_coredns"],
        why: "the same drain and restart as the test server's, with CoreDNS in lameduck",
    },
    HostOnly {
        binary: "agent_cli",
        skip: &["a_bad_configuration_is_refused", "run_without_root_says_so"],
        why: "the CLI's checks before it touches the kernel",
    },
    HostOnly {
        binary: "kubernetes",
        skip: &[],
        why: "EndpointSlice sync against the fake API server is the agent's userspace; the pools \
              it writes take the map updates and steering that steering's tests run in the VMs",
    },
    HostOnly {
        binary: "telemetry",
        skip: &[
            "readyz_waits_for_every_pool",
            "systemd_hears_ready",
            "status_tells_the_truth",
            "operator_mistakes_get_one_sentence",
        ],
        why: "the agent's HTTP endpoints, sd_notify, status text and error messages",
    },
    HostOnly {
        binary: "helm_chart",
        skip: &[],
        why: "helm and kustomize rendering the manifests: no kernel in it",
    },
    HostOnly {
        binary: "container",
        skip: &[],
        why: "the image and the container runtime's sandboxing (capabilities, seccomp, mounts) \
              around the same agent; its kernel paths are the ones steering runs in the VMs",
    },
    HostOnly {
        binary: "upgrade",
        skip: &[
            "a_newer_cli_on_an_older_releases_pins",
            "under_corednss_load",
        ],
        why: "what the CLI reads of another release's pins and says is userspace; an upgrade \
              under CoreDNS's load does in the kernel what one under the test server's does",
    },
    HostOnly {
        binary: "lifecycle",
        skip: &["after_a_reboot_dns_fails_only_until"],
        why: "an agent's first start on no pins is what every VM test's first start does; this \
              test times the window before it on the host",
    },
    HostOnly {
        binary: "workloads",
        skip: &["status_the_metrics_and_top_name_each_pod"],
        why: "how status, the metrics and top name the workloads is userspace over the counts \
              the kernel-subset test checks on every kernel",
    },
    HostOnly {
        binary: "resolvers",
        skip: &[],
        why: "how c-ares, glibc and musl answer the egress program's EPERM is userspace; \
              long_lived's kernel-subset test shows the kernel's side (the refused send, the \
              move) on every kernel",
    },
];

/// Whether the VMs leave out `host`'s tests: unless `everything`, or `named` (the `--tests`
/// argument) names its binary.
fn left_out(host: &HostOnly, named: &[String], everything: bool) -> bool {
    !everything && !named.iter().any(|name| name == host.binary)
}

/// The binaries that a kernel's full run (x86_64's 6.1 in every `cargo xtask test`) takes whole:
/// the programs' own decisions on that kernel (steering and replies, the signal program, the
/// stall detection). Every other binary contributes its tests of [`KERNEL_SUBSET`] there, as on
/// every kernel (the egress program's moves of a kept socket, kill -9 with no agent, restarts
/// under a stream): the agent's logic above the same paths (probes, drains, upgrades, the CLI,
/// telemetry) and the conntrack bypass's nftables table run on the host's kernel, and whole in a
/// VM on request (`--tests NAME`, `--with-host-only`, a filter).
pub const KERNEL_BINARIES: &[&str] = &["steering", "signal", "stall"];

/// Whether a kernel's full run takes `binary` whole: one of [`KERNEL_BINARIES`], or asked for
/// (named in `--tests`, or `everything`: `--with-host-only` or a filter).
#[must_use]
pub fn runs_whole(binary: &str, named: &[String], everything: bool) -> bool {
    everything || KERNEL_BINARIES.contains(&binary) || named.iter().any(|name| name == binary)
}

/// Whether the VMs run the test binary `binary` at all.
#[must_use]
pub fn runs_binary(binary: &str, named: &[String], everything: bool) -> bool {
    !HOST_ONLY.iter().any(|host| {
        host.binary == binary && host.skip.is_empty() && left_out(host, named, everything)
    })
}

/// libtest arguments that leave out the host-only tests of the binaries that run. Test names
/// are unique across the bpf-tests, so a `--skip` given to every binary matches only its own.
#[must_use]
pub fn skip_args(named: &[String], everything: bool) -> Vec<String> {
    HOST_ONLY
        .iter()
        .filter(|host| left_out(host, named, everything))
        .flat_map(|host| host.skip)
        .flat_map(|skip| ["--skip".to_owned(), (*skip).to_owned()])
        .collect()
}

/// One line per entry the VMs leave out, for the run's header and summary.
#[must_use]
pub fn describe(named: &[String], everything: bool) -> String {
    HOST_ONLY
        .iter()
        .filter(|host| left_out(host, named, everything))
        .map(|host| {
            let which = if host.skip.is_empty() {
                format!("{} (every test)", host.binary)
            } else {
                format!("{} tests matching {}", host.binary, host.skip.join(", "))
            };
            format!("  left to the host kernel: {which}: {}\n", host.why)
        })
        .collect()
}

/// The kernel subset: the kernel's side of each path, by test binary. Every `cargo xtask test`
/// runs it on arm64 (Debian's 6.1 cloud-arm64 kernel under qemu's TCG, several times slower than
/// the x86_64 guests) and on x86_64's 6.12, which sits between 6.1 and the host's kernel, where
/// every test runs. Every test starts the agent, which loads and attaches every program, so the
/// subset also shows that kernel's verifier accepting all of them. `cargo xtask vm-test --arch
/// aarch64 --whole-suite` and `cargo xtask vm-test --kernel 6.12` run there what x86_64's 6.1
/// runs (every test the VMs can run with `--with-host-only` too).
pub const KERNEL_SUBSET: &[(&str, &[&str])] = &[
    (
        "steering",
        &[
            // UDP and TCP, IPv4 and IPv6, connected and unconnected, to the cache.
            "cache_answers_every_transport_while_it_serves",
            // The same to the upstreams, and every reply shown as the listener's.
            "upstream_mode_steers_every_transport_and_rewrites_replies",
            // What the kernel probes decide without bpf_set_retval (6.1 has none in sock_addr).
            "without_bpf_set_retval_the_fail_policy_fails_with_eperm_and_says_so",
            // The path arm64 before 5.18 runs: the fetching atomics switched off.
            "without_fetching_atomics_the_programs_load_count_and_fail_over_and_say_so",
        ],
    ),
    // kill -9 of the cache with no agent: the kernel fails over by itself.
    (
        "failover",
        &["the_kernel_fails_over_alone_after_the_agent_is_killed"],
    ),
    // The egress program refuses a kept connected socket's send so that it moves.
    (
        "long_lived",
        &["a_connected_socket_leaves_a_killed_cache_and_returns_after_a_restart"],
    ),
    // Agent restarts (kill -9, SIGTERM) adopting the pins under a query stream.
    (
        "lifecycle",
        &["restarts_under_a_query_stream_lose_no_query_and_keep_state"],
    ),
    // Each workload's queries by route and replies by rcode (the ingress program's packet
    // reads), over every transport, and the exempt cgroups; a cache older than the agent, run
    // as shipped, known by its reads and exempt; the rate limit on every path a query takes
    // (each refusal's errno, a connected socket's sendto, a flood from every CPU at once).
    (
        "workloads",
        &[
            "two_pods_get_exact_counts_by_route_and_rcode_and_exempt_cgroups_none",
            "a_cache_older_than_the_shipped_agent_is_no_workload",
            "a_flooding_pod_is_held_to_its_rate_and_a_quiet_pod_beside_it_loses_nothing",
        ],
    ),
];

/// The libtest filters that run only `binary`'s tests of [`KERNEL_SUBSET`] (`--exact` and their
/// names); `None` when the subset has none of its tests.
#[must_use]
pub fn subset_filters(binary: &str) -> Option<Vec<String>> {
    KERNEL_SUBSET
        .iter()
        .find(|(name, _)| *name == binary)
        .map(|(_, tests)| {
            std::iter::once("--exact".to_owned())
                .chain(tests.iter().map(|test| (*test).to_owned()))
                .collect()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel's full run takes the kernel binaries whole, others only when asked for.
    #[test]
    fn the_kernel_binaries_run_whole_and_the_others_when_asked() {
        assert!(runs_whole("stall", &[], false));
        assert!(!runs_whole("drain", &[], false));
        assert!(runs_whole("drain", &["drain".to_owned()], false));
        assert!(runs_whole("drain", &[], true));
        let dir = crate::workspace::workspace_root().join("bpf-tests/tests");
        for binary in KERNEL_BINARIES {
            assert!(dir.join(format!("{binary}.rs")).exists(), "no {binary}.rs");
        }
    }

    /// Every test of the kernel subset exists in its binary's source.
    #[test]
    fn the_kernel_subset_names_tests_that_exist() {
        let dir = crate::workspace::workspace_root().join("bpf-tests/tests");
        for (binary, tests) in KERNEL_SUBSET {
            let source = std::fs::read_to_string(dir.join(format!("{binary}.rs")))
                .unwrap_or_else(|error| panic!("{binary}.rs: {error}"));
            for test in *tests {
                assert!(
                    source.contains(&format!("fn {test}(")),
                    "{binary} has no test {test}"
                );
            }
        }
        assert_eq!(
            subset_filters("failover").as_deref(),
            Some(
                &[
                    "--exact".to_owned(),
                    "the_kernel_fails_over_alone_after_the_agent_is_killed".to_owned()
                ][..]
            )
        );
        assert!(subset_filters("kubernetes").is_none());
    }

    #[test]
    fn host_only_tests_are_left_out_unless_named_or_asked_for() {
        let none: [String; 0] = [];
        assert!(!runs_binary("resolvers", &none, false));
        assert!(runs_binary("resolvers", &["resolvers".to_owned()], false));
        assert!(runs_binary("resolvers", &none, true));
        assert!(runs_binary("failover", &none, false));
        let skips = skip_args(&none, false);
        assert!(
            skips
                .windows(2)
                .any(|pair| pair == ["--skip", "_of_dnsmasq_"])
        );
        let failover_named = skip_args(&["failover".to_owned()], false);
        assert!(!failover_named.iter().any(|arg| arg == "_of_dnsmasq_"));
        assert!(
            failover_named
                .iter()
                .any(|arg| arg == "run_without_root_says_so")
        );
        assert!(skip_args(&none, true).is_empty());
        assert!(describe(&none, true).is_empty());
        assert_eq!(describe(&none, false).lines().count(), HOST_ONLY.len());
    }

    /// Every skip matches tests of its own binary only, and at least one: a rename must not
    /// make a skip miss its tests, or leave out another binary's.
    #[test]
    fn every_skip_matches_tests_of_its_binary_only() {
        let tests_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bpf-tests/tests");
        let mut names: Vec<(String, String)> = Vec::new();
        for entry in std::fs::read_dir(&tests_dir).expect("bpf-tests/tests is readable") {
            let path = entry.expect("a directory entry").path();
            let Some(binary) = path.file_stem().and_then(|stem| stem.to_str()) else {
                continue;
            };
            let source = std::fs::read_to_string(&path).expect("a test source is readable");
            let mut lines = source.lines();
            while let Some(line) = lines.next() {
                if line.trim() != "#[test]" {
                    continue;
                }
                if let Some(name) = lines
                    .next()
                    .and_then(|next| next.trim().strip_prefix("fn "))
                    .and_then(|rest| rest.split('(').next())
                {
                    names.push((binary.to_owned(), name.to_owned()));
                }
            }
        }
        assert!(names.len() > 50, "found only {} tests", names.len());
        for host in HOST_ONLY {
            assert!(
                names.iter().any(|(binary, _)| binary == host.binary),
                "no test binary {}",
                host.binary
            );
            for skip in host.skip {
                let matched: Vec<&(String, String)> = names
                    .iter()
                    .filter(|(_, name)| name.contains(skip))
                    .collect();
                assert!(!matched.is_empty(), "{skip} matches no test");
                assert!(
                    matched.iter().all(|(binary, _)| binary == host.binary),
                    "{skip} matches tests of other binaries: {matched:?}"
                );
            }
        }
    }
}
