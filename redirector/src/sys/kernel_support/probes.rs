//! The probes of the running kernel: its release (`uname(2)` and aya's reading of the upstream
//! version) and aya's probe of each feature that has one.

use aya::{
    programs::ProgramError,
    sys::{is_helper_supported, is_map_supported, is_program_supported},
    util::KernelVersion,
};
use tracing::warn;

use super::{KernelFeature, KernelSupport, Probe, Uses, atomics};

impl KernelSupport {
    /// Probes the running kernel (`uname(2)` and aya's probes), taking the features `absent`
    /// names as missing whatever the probes say. Needs `bpf(2)`: run it after the capability
    /// and seccomp checks.
    #[must_use]
    pub fn probe(absent: &[&str]) -> Self {
        let release = nix::sys::utsname::uname().map_or_else(
            |_| String::new(),
            |name| name.release().to_string_lossy().into_owned(),
        );
        // aya reads the version the way libbpf does: Ubuntu's `/proc/version_signature` and
        // Debian's `uname -v` name the upstream release where `uname -r` may not.
        let version = KernelVersion::current()
            .inspect_err(|error| {
                warn!(%release, %error, "the kernel's version cannot be read: only probes decide");
            })
            .ok();
        Self::decide(&release, version, absent, probe_feature)
    }
}

/// aya's probe for `feature`: every listed helper from every listed program type.
fn probe_feature(feature: &KernelFeature) -> Result<bool, ProgramError> {
    match (feature.probe, feature.uses) {
        (Probe::Program(program), _) => is_program_supported(program),
        (Probe::Map(map), _) => is_map_supported(map).map_err(ProgramError::SyscallError),
        (Probe::Helpers, Uses::Helpers { programs, helpers }) => {
            for program in programs {
                for helper in helpers {
                    if !is_helper_supported(*program, *helper)? {
                        return Ok(false);
                    }
                }
            }
            Ok(true)
        }
        (Probe::AtomicFetch, _) => atomics::probe().map_err(|io_error| {
            ProgramError::SyscallError(aya::sys::SyscallError {
                call: "bpf_prog_load",
                io_error,
            })
        }),
        // Rows without a probe never reach here; a `Helpers` probe without helpers has nothing
        // to ask (the table test refuses such a row).
        _ => Ok(true),
    }
}
