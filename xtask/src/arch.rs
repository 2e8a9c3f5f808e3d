//! The architectures redirector is built and tested for, and what each needs: the static musl
//! target the agent and the test binaries are built for (cross-built from any host: only `ring`
//! compiles C, which clang builds for every target and rust-lld links against the musl that
//! Rust ships), Debian's name for it, the ELF machine of its binaries, and the qemu that boots
//! its kernels.

use crate::toolchain::LLVM_MAJOR;

/// `e_machine` of x86_64.
pub const EM_X86_64: u16 = 62;
/// `e_machine` of aarch64.
pub const EM_AARCH64: u16 = 183;

/// An architecture of the nodes redirector runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Arch {
    /// x86_64 (amd64).
    #[value(name = "x86_64")]
    X86_64,
    /// aarch64 (arm64): AWS Graviton, Ampere.
    #[value(name = "aarch64")]
    Aarch64,
}

impl Arch {
    /// Every architecture.
    pub const ALL: [Self; 2] = [Self::X86_64, Self::Aarch64];

    /// The one this xtask runs on.
    #[must_use]
    pub const fn host() -> Self {
        if cfg!(target_arch = "aarch64") {
            Self::Aarch64
        } else {
            Self::X86_64
        }
    }

    /// The name on the command line and in reports.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::X86_64 => "x86_64",
            Self::Aarch64 => "aarch64",
        }
    }

    /// Rust's static musl target.
    #[must_use]
    pub const fn musl_target(self) -> &'static str {
        match self {
            Self::X86_64 => "x86_64-unknown-linux-musl",
            Self::Aarch64 => "aarch64-unknown-linux-musl",
        }
    }

    /// Debian's (and the OCI platform's) name.
    #[must_use]
    pub const fn debian(self) -> &'static str {
        match self {
            Self::X86_64 => "amd64",
            Self::Aarch64 => "arm64",
        }
    }

    /// The OCI platform of its images (`podman build --platform`).
    #[must_use]
    pub fn platform(self) -> String {
        format!("linux/{}", self.debian())
    }

    /// The ELF header's `e_machine` of its binaries.
    #[must_use]
    pub const fn elf_machine(self) -> u16 {
        match self {
            Self::X86_64 => EM_X86_64,
            Self::Aarch64 => EM_AARCH64,
        }
    }

    /// The architecture of an ELF `e_machine`, if redirector builds for it.
    #[must_use]
    pub fn of_elf_machine(machine: u16) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|arch| arch.elf_machine() == machine)
    }

    /// The environment `cargo build --target MUSL_TARGET` needs on any host: clang for ring's C
    /// (ring builds it without the host's headers for a non-x86_64 musl target, and the host's
    /// are the target's on x86_64), rust-lld to link against Rust's own musl.
    #[must_use]
    pub fn cargo_env(self) -> Vec<(String, String)> {
        let target = self.musl_target();
        let underscored = target.replace('-', "_");
        vec![
            (format!("CC_{underscored}"), format!("clang-{LLVM_MAJOR}")),
            (
                format!("CARGO_TARGET_{}_LINKER", underscored.to_uppercase()),
                "rust-lld".to_owned(),
            ),
        ]
    }
}

/// An architecture, or every one, as `--target` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Selection {
    /// x86_64 (amd64).
    #[value(name = "x86_64")]
    X86_64,
    /// aarch64 (arm64).
    #[value(name = "aarch64")]
    Aarch64,
    /// Every architecture.
    All,
}

impl Selection {
    /// The architectures `selections` name, each once, in [`Arch::ALL`]'s order.
    #[must_use]
    pub fn arches(selections: &[Self]) -> Vec<Arch> {
        Arch::ALL
            .into_iter()
            .filter(|arch| {
                selections.iter().any(|selection| match selection {
                    Self::All => true,
                    Self::X86_64 => *arch == Arch::X86_64,
                    Self::Aarch64 => *arch == Arch::Aarch64,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_name_each_architecture_once_in_order() {
        assert_eq!(
            Selection::arches(&[Selection::Aarch64, Selection::X86_64, Selection::Aarch64]),
            vec![Arch::X86_64, Arch::Aarch64]
        );
        assert_eq!(Selection::arches(&[Selection::All]), Arch::ALL.to_vec());
        assert_eq!(
            Selection::arches(&[Selection::Aarch64]),
            vec![Arch::Aarch64]
        );
        assert!(Selection::arches(&[]).is_empty());
    }

    #[test]
    fn every_architecture_has_its_own_elf_machine() {
        for arch in Arch::ALL {
            assert_eq!(Arch::of_elf_machine(arch.elf_machine()), Some(arch));
        }
        assert_eq!(Arch::of_elf_machine(0), None);
    }
}
