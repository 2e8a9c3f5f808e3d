//! The table's own rules, `docs/kernels.md`'s copy of it, and the decision for the kernels
//! redirector meets (the floor, older ones, arm64's JIT, backports, failed probes, the override).

use std::collections::BTreeSet;

use aya::{programs::ProgramError, util::KernelVersion};

use super::*;

#[test]
fn releases_are_named_by_major_and_minor() {
    assert_eq!(mainline(FLOOR), "5.15");
    assert_eq!(mainline(KernelVersion::new(6, 12, 117)), "6.12");
    assert_eq!(mainline(KernelVersion::new(4, 19, 325)), "4.19");
}

#[test]
fn every_required_feature_is_at_or_below_the_floor() {
    for feature in FEATURES {
        if feature.since > FLOOR {
            assert!(
                matches!(feature.need, Need::Optional { .. }),
                "{} ({}) is newer than the floor {}: it must be optional",
                feature.name,
                mainline(feature.since),
                mainline(FLOOR)
            );
        }
        // A helper probe needs helpers to ask about.
        assert!(
            feature.probe != Probe::Helpers || matches!(feature.uses, Uses::Helpers { .. }),
            "{}",
            feature.name
        );
    }
    let ids: BTreeSet<&str> = FEATURES.iter().map(|feature| feature.id).collect();
    assert_eq!(ids.len(), FEATURES.len(), "ids are unique");
}

/// The 5.15 node the floor is for, with the probes answering as its kernel would: every
/// feature up to 5.15, nothing newer.
fn on_5_15(feature: &KernelFeature) -> Result<bool, ProgramError> {
    Ok(feature.since <= FLOOR)
}

#[test]
fn a_5_15_kernel_runs_without_set_retval_and_says_so() {
    let support = KernelSupport::decide(
        "5.15.0-1064-azure",
        Some(KernelVersion::new(5, 15, 0)),
        &[],
        on_5_15,
    );
    assert!(require(&support).is_ok());
    let degraded: Vec<&str> = support
        .degraded()
        .map(|finding| finding.feature.id)
        .collect();
    assert_eq!(degraded, [SET_RETVAL]);
    assert!(!support.has(SET_RETVAL));
    assert!(support.has("nft_notrack"), "decided at use, not here");
}

/// `docs/kernels.md`'s example: Amazon Linux 2's 5.10, its probes answering as its release would.
#[test]
fn a_5_10_kernel_is_refused_with_what_it_lacks() {
    let support = KernelSupport::decide(
        "5.10.240-238.955.amzn2.x86_64",
        Some(KernelVersion::new(5, 10, 240)),
        &[],
        |feature| Ok(feature.since <= KernelVersion::new(5, 10, 0)),
    );
    assert_eq!(
        require(&support).unwrap_err().to_string(),
        "Linux 5.10.240-238.955.amzn2.x86_64 lacks bpf_ktime_get_coarse_ns in sock_addr and \
         cgroup_skb programs (5.11, probed), SO_NETNS_COOKIE (agent) (5.14, by release), which \
         redirector needs: run it on Linux 5.15 or later (or on a kernel with these \
         backported) (nothing was loaded or attached)"
    );
}

/// An arm64 node on 5.15 (Ubuntu 22.04, `CONFIG_BPF_JIT_ALWAYS_ON`): its JIT compiles the
/// fetching atomics only from 5.18, so the probe's load fails and the agent runs without
/// them, switched off, instead of crash-looping on the programs' load.
#[test]
fn an_arm64_5_15_without_the_fetching_atomics_in_its_jit_runs_degraded() {
    let support = KernelSupport::decide(
        "5.15.0-1064-azure",
        Some(KernelVersion::new(5, 15, 0)),
        &[],
        |feature| Ok(feature.since <= FLOOR && feature.id != ATOMIC_FETCH),
    );
    assert!(require(&support).is_ok());
    let degraded: Vec<&str> = support
        .degraded()
        .map(|finding| finding.feature.id)
        .collect();
    assert_eq!(degraded, [ATOMIC_FETCH, SET_RETVAL]);
    assert!(!support.has(ATOMIC_FETCH));
}

#[test]
fn probes_decide_over_the_release_number() {
    // A backport: a 5.15 whose probe finds bpf_set_retval has it.
    let support = KernelSupport::decide(
        "5.15.0-1064-azure",
        Some(KernelVersion::new(5, 15, 0)),
        &[],
        |_| Ok(true),
    );
    assert!(support.has(SET_RETVAL));
    assert_eq!(support.degraded().count(), 0);
    // A kernel new by its number whose probe misses a required helper is refused, and the
    // error says the probe decided.
    let support = KernelSupport::decide(
        "6.18.0",
        Some(KernelVersion::new(6, 18, 0)),
        &[],
        |feature| Ok(feature.id != "sock_addr_sk_storage"),
    );
    let error = require(&support).unwrap_err();
    assert_eq!(
        error.missing,
        "bpf_sk_storage_get in sock_addr programs (5.3, probed)"
    );
    let text = error.to_string();
    assert!(text.contains("Linux 6.18.0 lacks"), "{text}");
    assert!(text.contains("Linux 5.15 or later"), "{text}");
}

#[test]
fn features_without_a_probe_are_decided_by_release_and_a_failed_probe_falls_back() {
    let failed = || {
        ProgramError::SyscallError(aya::sys::SyscallError {
            call: "bpf_prog_load",
            io_error: std::io::Error::from_raw_os_error(libc::EPERM),
        })
    };
    let support = KernelSupport::decide(
        "5.4.0-1-generic",
        Some(KernelVersion::new(5, 4, 0)),
        &[],
        |_| Err(failed()),
    );
    let error = require(&support).unwrap_err();
    for expected in [
        "cgroup v2 sock_release (5.9, by release)",
        "BPF_F_MMAPABLE array (5.5, by release)",
        "SO_NETNS_COOKIE (agent) (5.14, by release)",
    ] {
        assert!(error.missing.contains(expected), "{}", error.missing);
    }
    assert!(!error.missing.contains("recvmsg"), "{}", error.missing);
    assert!(
        !error.missing.contains("set_retval"),
        "optional: {}",
        error.missing
    );
    // Unreadable: nothing is missing by its number, the verifier decides.
    let support = KernelSupport::decide("weird", None, &[], |_| Err(failed()));
    assert!(require(&support).is_ok());
}

#[test]
fn the_test_override_names_known_features_only() {
    assert_eq!(parse_absent(" set_retval ,").unwrap(), [SET_RETVAL]);
    assert_eq!(parse_absent("").unwrap(), Vec::<&str>::new());
    let error = parse_absent("set_retval,bpf_loop").unwrap_err();
    assert_eq!(error.id, "bpf_loop");
    assert!(
        error
            .to_string()
            .contains("set_retval, raw_tracepoint_test_run, nft_notrack"),
        "{error}"
    );
    let support = KernelSupport::decide(
        "6.18.0",
        Some(KernelVersion::new(6, 18, 0)),
        &[SET_RETVAL],
        |_| Ok(true),
    );
    let degraded: Vec<Decision> = support
        .degraded()
        .map(|finding| finding.decided_by)
        .collect();
    assert_eq!(degraded, [Decision::TestOverride]);
}

#[test]
fn the_documented_table_is_this_table() {
    let page = include_str!("../../../../docs/kernels.md");
    let rows: Vec<Vec<String>> = page
        .lines()
        .skip_while(|line| !line.starts_with("| feature"))
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|line| {
            line.trim_matches('|')
                .split(" | ")
                .map(|cell| cell.trim().to_owned())
                .collect()
        })
        .collect();
    let expected: Vec<Vec<String>> = FEATURES
        .iter()
        .map(|feature| {
            vec![
                feature.name.to_owned(),
                feature.used_for.to_owned(),
                mainline(feature.since),
                match feature.probe {
                    Probe::Program(_) => "probe: program type",
                    Probe::Map(_) => "probe: map type",
                    Probe::Helpers => "probe: helper",
                    Probe::Release => "release",
                    Probe::AtUse => "at use",
                    Probe::AtomicFetch => "probe: loads them",
                }
                .to_owned(),
                match feature.need {
                    Need::Required => "refuses to start".to_owned(),
                    Need::Optional { without, .. } => format!("degrades: {without}"),
                },
            ]
        })
        .collect();
    assert_eq!(rows, expected, "docs/kernels.md's table");
}
