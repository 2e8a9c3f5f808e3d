//! The architectures redirector is built and tested for, and what each needs: the static musl
//! target the agent and the test binaries are built for (cross-built from any host: only `ring`
//! compiles C, which clang builds for every target and rust-lld links against the musl that
//! Rust ships), Debian's name for it, and the qemu that boots its kernels.

use crate::toolchain::LLVM_MAJOR;

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
