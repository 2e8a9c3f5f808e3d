//! What the agent needs of the process's effective capabilities (`CapEff` in `/proc/self/status`),
//! checked at start so that a missing one is named instead of failing deep in the kernel; and
//! whether bpf(2) is let through at all (a seccomp filter can refuse it to a process that holds
//! every capability).

/// A Linux capability, by name and bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capability {
    /// As the man pages write it.
    pub name: &'static str,
    bit: u32,
}

/// Attaching to cgroups, nftables, the listener link.
pub const CAP_NET_ADMIN: Capability = Capability {
    name: "CAP_NET_ADMIN",
    bit: 12,
};
/// `setns` into the caches' namespace; stands in for CAP_BPF and CAP_PERFMON.
pub const CAP_SYS_ADMIN: Capability = Capability {
    name: "CAP_SYS_ADMIN",
    bit: 21,
};
/// Pointer arithmetic and other operations the verifier allows only to "perfmon-capable"
/// loaders (5.8+).
pub const CAP_PERFMON: Capability = Capability {
    name: "CAP_PERFMON",
    bit: 38,
};
/// `bpf()` itself: maps, programs, links (5.8+).
pub const CAP_BPF: Capability = Capability {
    name: "CAP_BPF",
    bit: 39,
};

/// A set of capabilities, as the kernel's bit mask.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capabilities(u64);

impl Capabilities {
    /// The set of `capabilities`.
    #[must_use]
    pub fn of(capabilities: &[Capability]) -> Self {
        Self(
            capabilities
                .iter()
                .fold(0, |bits, capability| bits | (1 << capability.bit)),
        )
    }

    /// True when it holds `capability`.
    #[must_use]
    pub const fn contains(self, capability: Capability) -> bool {
        self.0 & (1 << capability.bit) != 0
    }
}

/// The `CapEff` bits of a `/proc/PID/status` text.
fn effective_set(status: &str) -> Option<u64> {
    let hex = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))?
        .trim();
    u64::from_str_radix(hex, 16).ok()
}

/// A capability the agent needs, and what for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Need {
    /// The capability.
    pub capability: Capability,
    /// What the agent does with it.
    pub why: &'static str,
}

impl std::fmt::Display for Need {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.capability.name, self.why)
    }
}

/// What the agent needs: CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN always; CAP_SYS_ADMIN only to
/// enter a `cache_netns`.
#[must_use]
pub fn needs(enters_cache_netns: bool) -> Vec<Need> {
    let mut needs = vec![
        Need {
            capability: CAP_BPF,
            why: "maps, programs and links",
        },
        Need {
            capability: CAP_PERFMON,
            why: "the verifier's view of the programs as the tests load them",
        },
        Need {
            capability: CAP_NET_ADMIN,
            why: "cgroup socket programs, the listener interface, the nftables table",
        },
    ];
    if enters_cache_netns {
        needs.push(Need {
            capability: CAP_SYS_ADMIN,
            why: "to enter cache_netns",
        });
    }
    needs
}

/// The needs among `needs` this process's effective set does not meet: CAP_SYS_ADMIN stands in
/// for CAP_BPF and CAP_PERFMON, as the kernel's `bpf_capable()` and `perfmon_capable()` say.
/// Empty when the set cannot be read (the kernel then decides).
#[must_use]
pub fn unmet(needs: &[Need]) -> Vec<Need> {
    let Some(status) = std::fs::read_to_string("/proc/self/status").ok() else {
        return Vec::new();
    };
    let Some(effective) = effective_set(&status).map(Capabilities) else {
        return Vec::new();
    };
    unmet_by(needs, effective)
}

fn unmet_by(needs: &[Need], effective: Capabilities) -> Vec<Need> {
    needs
        .iter()
        .copied()
        .filter(|need| {
            let stands_in = (need.capability == CAP_BPF || need.capability == CAP_PERFMON)
                && effective.contains(CAP_SYS_ADMIN);
            !effective.contains(need.capability) && !stands_in
        })
        .collect()
}

/// bpf(2) refused to a process that holds what it needs.
#[derive(Debug, thiserror::Error)]
#[error("{}", if *.seccomp_filtered {
    "bpf(2) is refused although the agent holds the capabilities it needs, and the process runs \
     under a seccomp filter: container runtimes' default profiles allow bpf(2) only with \
     CAP_SYS_ADMIN. Run the agent's container with the seccomp profile \
     deploy/seccomp/redirector.json (the runtime's default plus bpf(2) for CAP_BPF; the \
     DaemonSet's init container installs it as the Localhost profile redirector.json), or grant \
     CAP_SYS_ADMIN"
} else {
    "bpf(2) is refused although the agent holds the capabilities it needs, and no seccomp \
     filter is in place: the agent may be in a user namespace other than the host's (its \
     capabilities then count for nothing there), the kernel may lack bpf(2) \
     (CONFIG_BPF_SYSCALL), or a security module's policy (SELinux, AppArmor, a BPF LSM) denies it"
})]
pub struct BpfRefused {
    /// `Seccomp: 2` in `/proc/self/status`.
    pub seccomp_filtered: bool,
    /// What bpf(2) returned.
    #[source]
    pub source: aya::sys::SyscallError,
}

/// Creates and closes a one-entry array map, the cheapest bpf(2) call there is. EPERM or ENOSYS
/// (what seccomp filters return) is a refusal; any other answer is the kernel's to give later.
pub fn check_bpf_allowed() -> Result<(), BpfRefused> {
    let Err(source) = aya::sys::is_map_supported(aya::maps::MapType::Array) else {
        return Ok(());
    };
    if !matches!(
        source.io_error.raw_os_error(),
        Some(libc::EPERM | libc::ENOSYS)
    ) {
        return Ok(());
    }
    let seccomp_filtered = std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|status| seccomp_mode(&status) == Some(2));
    Err(BpfRefused {
        seccomp_filtered,
        source,
    })
}

/// The `Seccomp:` mode of a `/proc/PID/status` text: 0 off, 1 strict, 2 filter.
fn seccomp_mode(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Seccomp:"))?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_effective_set() {
        let status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000000c000001000\n";
        let effective = Capabilities(effective_set(status).expect("a CapEff line"));
        for (capability, held) in [
            (CAP_NET_ADMIN, true),
            (CAP_SYS_ADMIN, false),
            (CAP_PERFMON, true),
            (CAP_BPF, true),
        ] {
            assert_eq!(effective.contains(capability), held, "{capability:?}");
        }
        assert_eq!(effective_set("Name:\tx\n"), None);
    }

    #[test]
    fn reads_the_seccomp_mode() {
        assert_eq!(
            seccomp_mode("Name:\tx\nSeccomp:\t2\nSeccomp_filters:\t1\n"),
            Some(2)
        );
        assert_eq!(seccomp_mode("Name:\tx\nSeccomp:\t0\n"), Some(0));
        assert_eq!(seccomp_mode("Name:\tx\n"), None);
    }

    #[test]
    fn sys_admin_stands_in_for_bpf_and_perfmon_not_for_net_admin() {
        let only_sys_admin = Capabilities::of(&[CAP_SYS_ADMIN]);
        let unmet: Vec<&str> = unmet_by(&needs(true), only_sys_admin)
            .iter()
            .map(|need| need.capability.name)
            .collect();
        assert_eq!(unmet, ["CAP_NET_ADMIN"]);
        let least = Capabilities::of(&[CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN]);
        assert!(unmet_by(&needs(false), least).is_empty());
        let unmet: Vec<&str> = unmet_by(&needs(true), least)
            .iter()
            .map(|need| need.capability.name)
            .collect();
        assert_eq!(unmet, ["CAP_SYS_ADMIN"]);
    }
}
