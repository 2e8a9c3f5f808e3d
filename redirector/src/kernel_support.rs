//! The kernel features redirector uses, the mainline release that introduced each, and the check
//! the agent runs before it loads anything: on an older kernel it refuses with the names of the
//! missing features instead of a verifier log.
//!
//! The table is the README's "Supported kernels" table (a test keeps the two equal). A release
//! number is a floor, not a proof: distribution kernels backport features, and the VM tests
//! (`cargo xtask vm-test`) prove the programs on Debian's 6.1 and 6.12 as well as on the host.

use std::fmt;

/// A mainline kernel release, `major.minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelVersion {
    /// The major number.
    pub major: u32,
    /// The minor number.
    pub minor: u32,
}

impl KernelVersion {
    /// `major.minor`.
    #[must_use]
    pub const fn new(major: u32, minor: u32) -> Self {
        Self { major, minor }
    }

    /// The release's `major.minor` from a `uname -r` string (`6.1.0-57-cloud-amd64`,
    /// `5.15.0-1064-azure`, `6.12.117+deb12-cloud-amd64`); `None` when it does not start with two
    /// numbers.
    #[must_use]
    pub fn parse(release: &str) -> Option<Self> {
        let mut numbers = release.splitn(3, '.');
        let major = numbers.next()?.parse().ok()?;
        let minor_digits: String = numbers
            .next()?
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        Some(Self::new(major, minor_digits.parse().ok()?))
    }
}

impl fmt::Display for KernelVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Whether the agent can run without a feature.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The programs or the agent cannot work without it: the agent refuses to start.
    Required,
    /// The agent degrades: it runs without the named function and reports it in status and
    /// metrics.
    Optional {
        /// What the agent does without it.
        without: &'static str,
    },
}

/// One kernel feature redirector uses.
#[derive(Clone, Copy, Debug)]
pub struct KernelFeature {
    /// The feature, as the kernel names it.
    pub name: &'static str,
    /// What redirector uses it for.
    pub used_for: &'static str,
    /// The first mainline release with it.
    pub since: KernelVersion,
    /// Whether the agent can run without it.
    pub need: Need,
}

/// Every kernel feature redirector uses, in the README's order.
pub const FEATURES: &[KernelFeature] = &[
    KernelFeature {
        name: "cgroup v2 `cgroup_skb` egress",
        used_for: "moving connected DNS sockets off a stale peer",
        since: KernelVersion::new(4, 10),
        need: Need::Required,
    },
    KernelFeature {
        name: "cgroup v2 `connect4`/`connect6`",
        used_for: "steering TCP and connected UDP",
        since: KernelVersion::new(4, 17),
        need: Need::Required,
    },
    KernelFeature {
        name: "cgroup v2 `post_bind4`/`post_bind6`",
        used_for: "counting the caches' sockets",
        since: KernelVersion::new(4, 17),
        need: Need::Required,
    },
    KernelFeature {
        name: "cgroup v2 `sendmsg4`/`sendmsg6`",
        used_for: "steering unconnected UDP",
        since: KernelVersion::new(4, 18),
        need: Need::Required,
    },
    KernelFeature {
        name: "`bpf_get_socket_cookie` in sock_addr programs",
        used_for: "per-socket target choice, reverse keys",
        since: KernelVersion::new(4, 19),
        need: Need::Required,
    },
    KernelFeature {
        name: "`bpf_skb_ancestor_cgroup_id` in cgroup_skb programs",
        used_for: "skipped cgroups at egress",
        since: KernelVersion::new(4, 19),
        need: Need::Required,
    },
    KernelFeature {
        name: "`__sk_buff.sk`, `bpf_sk_fullsock` in cgroup_skb programs",
        used_for: "the sending socket at egress",
        since: KernelVersion::new(5, 1),
        need: Need::Required,
    },
    KernelFeature {
        name: "cgroup v2 `recvmsg4`/`recvmsg6`",
        used_for: "reply source rewrite",
        since: KernelVersion::new(5, 2),
        need: Need::Required,
    },
    KernelFeature {
        name: "`bpf_sk_storage_get` in cgroup_skb programs",
        used_for: "a connected socket's translation at egress",
        since: KernelVersion::new(5, 2),
        need: Need::Required,
    },
    KernelFeature {
        name: "`BPF_MAP_FREEZE`, read-only global data",
        used_for: "the kernel-log level the verifier prunes on",
        since: KernelVersion::new(5, 2),
        need: Need::Required,
    },
    KernelFeature {
        name: "`bpf_sk_storage_get` in sock_addr programs",
        used_for: "marking steered sockets",
        since: KernelVersion::new(5, 3),
        need: Need::Required,
    },
    KernelFeature {
        name: "`BPF_F_MMAPABLE` array",
        used_for: "socket counts shared with the agent's atomic corrections",
        since: KernelVersion::new(5, 5),
        need: Need::Required,
    },
    KernelFeature {
        name: "`bpf_get_current_ancestor_cgroup_id` in sock_addr programs",
        used_for: "skipped cgroups",
        since: KernelVersion::new(5, 7),
        need: Need::Required,
    },
    KernelFeature {
        name: "cgroup `bpf_link`",
        used_for: "attachments pinned across restarts, next to other owners' programs",
        since: KernelVersion::new(5, 7),
        need: Need::Required,
    },
    KernelFeature {
        name: "`bpf_get_netns_cookie`, `bpf_get_socket_cookie` in cgroup sock programs",
        used_for: "the caches' namespace; socket identity",
        since: KernelVersion::new(5, 7),
        need: Need::Required,
    },
    KernelFeature {
        name: "cgroup v2 `getpeername4`/`getpeername6`",
        used_for: "connected peer rewrite",
        since: KernelVersion::new(5, 8),
        need: Need::Required,
    },
    KernelFeature {
        name: "`BPF_MAP_TYPE_RINGBUF`",
        used_for: "aya-log's buffer for kernel logging (created even with `kernel_log` off)",
        since: KernelVersion::new(5, 8),
        need: Need::Required,
    },
    KernelFeature {
        name: "cgroup v2 `sock_release`",
        used_for: "uncounting the caches' sockets: in-kernel failover",
        since: KernelVersion::new(5, 9),
        need: Need::Required,
    },
    KernelFeature {
        name: "`bpf_sk_storage_get` in cgroup sock programs",
        used_for: "marking the caches' sockets, so other closes skip the cookie lookup",
        since: KernelVersion::new(5, 9),
        need: Need::Required,
    },
    KernelFeature {
        name: "`SO_NETNS_COOKIE` (agent)",
        used_for: "the caches' namespace cookie",
        since: KernelVersion::new(5, 14),
        need: Need::Required,
    },
    KernelFeature {
        name: "`bpf_set_retval` in sock_addr programs",
        used_for: "`EHOSTUNREACH` for the `fail` policy",
        since: KernelVersion::new(6, 1),
        need: Need::Required,
    },
    KernelFeature {
        name: "nf_tables `notrack` in raw-priority `inet` chains (agent, via `nft`)",
        used_for: "conntrack bypass",
        since: KernelVersion::new(4, 3),
        need: Need::Optional {
            without: "DNS stays tracked; status and `redirector_conntrack_bypass_active` say so",
        },
    },
];

/// The oldest release with every required feature.
#[must_use]
pub fn minimum() -> KernelVersion {
    FEATURES
        .iter()
        .filter(|feature| feature.need == Need::Required)
        .map(|feature| feature.since)
        .max()
        .unwrap_or(KernelVersion::new(0, 0))
}

/// The running kernel and what it lacks.
#[derive(Clone, Debug)]
pub struct KernelCheck {
    /// `uname -r`.
    pub release: String,
    /// Its `major.minor`, `None` when the release string has none.
    pub version: Option<KernelVersion>,
}

impl KernelCheck {
    /// The running kernel (`uname(2)`).
    #[must_use]
    pub fn running() -> Self {
        let release = nix::sys::utsname::uname().map_or_else(
            |_| String::new(),
            |name| name.release().to_string_lossy().into_owned(),
        );
        Self::of(&release)
    }

    /// The kernel of release `release`.
    #[must_use]
    pub fn of(release: &str) -> Self {
        Self {
            release: release.to_owned(),
            version: KernelVersion::parse(release),
        }
    }

    /// The features the kernel is older than. A release that cannot be read lacks nothing: the
    /// verifier has the last word.
    pub fn missing(&self) -> impl Iterator<Item = &'static KernelFeature> + '_ {
        FEATURES
            .iter()
            .filter(move |feature| self.version.is_some_and(|version| version < feature.since))
    }
}

/// The running kernel is older than a required feature.
#[derive(Debug, thiserror::Error)]
#[error(
    "Linux {release} is older than {missing}, which redirector needs: run it on Linux {minimum} \
     or later (nothing was loaded or attached)"
)]
pub struct KernelTooOld {
    /// `uname -r`.
    pub release: String,
    /// The missing features with the release of each, joined.
    pub missing: String,
    /// The oldest release with everything.
    pub minimum: KernelVersion,
}

/// Refuses a kernel older than any required feature.
///
/// # Errors
/// [`KernelTooOld`], naming every missing feature.
pub fn require(check: &KernelCheck) -> Result<(), KernelTooOld> {
    let missing: Vec<String> = check
        .missing()
        .filter(|feature| feature.need == Need::Required)
        .map(|feature| format!("{} ({})", feature.name.replace('`', ""), feature.since))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(KernelTooOld {
        release: check.release.clone(),
        missing: missing.join(", "),
        minimum: minimum(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_parse_to_major_and_minor() {
        for (release, major, minor) in [
            ("6.1.0-57-cloud-amd64", 6, 1),
            ("6.12.117+deb12-cloud-amd64", 6, 12),
            ("5.15.0-1064-azure", 5, 15),
            ("5.18", 5, 18),
            ("6.18.0", 6, 18),
            ("4.18.0-553.el8_10.x86_64", 4, 18),
        ] {
            assert_eq!(
                KernelVersion::parse(release),
                Some(KernelVersion::new(major, minor)),
                "{release}"
            );
        }
        for release in ["", "linux", "6", "6.x", ".1"] {
            assert_eq!(KernelVersion::parse(release), None, "{release:?}");
        }
    }

    #[test]
    fn the_minimum_is_the_newest_required_feature() {
        assert_eq!(minimum(), KernelVersion::new(6, 1));
        assert!(require(&KernelCheck::of("6.1.0-57-cloud-amd64")).is_ok());
        assert!(require(&KernelCheck::of("6.18.0")).is_ok());
        // Unreadable: the verifier decides.
        assert!(require(&KernelCheck::of("weird")).is_ok());
    }

    #[test]
    fn an_old_kernel_is_refused_with_the_missing_features_named() {
        let error = require(&KernelCheck::of("5.15.0-1064-azure")).unwrap_err();
        assert_eq!(error.missing, "bpf_set_retval in sock_addr programs (6.1)");
        let text = error.to_string();
        assert!(text.contains("Linux 5.15.0-1064-azure"), "{text}");
        assert!(text.contains("Linux 6.1 or later"), "{text}");

        let error = require(&KernelCheck::of("5.4.0-1-generic")).unwrap_err();
        assert!(
            error.missing.contains("cgroup v2 sock_release (5.9)"),
            "{}",
            error.missing
        );
        assert!(
            error.missing.contains("BPF_F_MMAPABLE array (5.5)"),
            "{}",
            error.missing
        );
        assert!(!error.missing.contains("recvmsg"), "{}", error.missing);
        assert!(!error.missing.contains("notrack"), "{}", error.missing);
    }

    #[test]
    fn the_readme_table_is_this_table() {
        let readme = include_str!("../../README.md");
        let section = readme
            .split("## Supported kernels")
            .nth(1)
            .expect("the README has a Supported kernels section");
        let rows: Vec<Vec<String>> = section
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
                    feature.since.to_string(),
                    match feature.need {
                        Need::Required => "refuses to start".to_owned(),
                        Need::Optional { without } => format!("degrades: {without}"),
                    },
                ]
            })
            .collect();
        assert_eq!(rows, expected, "README's Supported kernels table");
    }
}
