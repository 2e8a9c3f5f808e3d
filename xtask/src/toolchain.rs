//! The two Rust toolchains the build uses, as their `rust-toolchain.toml` files pin them, and the
//! LLVM major that ties the eBPF one to bpf-linker.
//!
//! Userspace builds on the workspace's pin (`rust-toolchain.toml`), which rustup applies by itself.
//! The eBPF object builds on a dated nightly pinned in `redirector-ebpf/rust-toolchain.toml`:
//! `redirector/build.rs` and the lints name it to rustup explicitly (`rustup run CHANNEL`), since
//! they run from the workspace root. Nothing names the floating `nightly`: it moves to the newest
//! LLVM, which a bpf-linker built against Debian's LLVM cannot read ("Invalid record").

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use serde::Deserialize;

use crate::workspace::workspace_root;

/// The LLVM major of the eBPF toolchain and of bpf-linker: Debian's `llvm-N-dev` and bpf-linker's
/// `llvm-N` feature. The eBPF pin's rustc must report the same major (`rustc -vV`); `cargo xtask
/// setup` checks both sides.
pub const LLVM_MAJOR: u32 = 22;

/// Overrides the eBPF pin, for trying another nightly (`redirector/build.rs` reads it too).
pub const EBPF_TOOLCHAIN_OVERRIDE: &str = "REDIRECTOR_EBPF_TOOLCHAIN";

/// One `rust-toolchain.toml`.
#[derive(Debug, Clone, Deserialize)]
pub struct Pin {
    /// The toolchain, as rustup names it (`1.95.0`, `nightly-2026-05-19`).
    pub channel: String,
    /// Components the build needs besides the profile's.
    #[serde(default)]
    pub components: Vec<String>,
    /// Where it was read.
    #[serde(skip)]
    pub file: PathBuf,
    /// Whether `REDIRECTOR_EBPF_TOOLCHAIN` replaced the file's channel.
    #[serde(skip)]
    pub overridden: bool,
}

#[derive(Deserialize)]
struct File {
    toolchain: Pin,
}

impl Pin {
    /// The workspace's pin, for userspace.
    pub fn userspace() -> anyhow::Result<Self> {
        Self::read(&workspace_root().join("rust-toolchain.toml"))
    }

    /// The eBPF pin, unless `REDIRECTOR_EBPF_TOOLCHAIN` names another toolchain (then with the
    /// pin's components).
    pub fn ebpf() -> anyhow::Result<Self> {
        let mut pin = Self::read(&workspace_root().join("redirector-ebpf/rust-toolchain.toml"))?;
        if let Some(channel) = std::env::var(EBPF_TOOLCHAIN_OVERRIDE)
            .ok()
            .filter(|channel| !channel.is_empty())
        {
            pin.channel = channel;
            pin.overridden = true;
        }
        Ok(pin)
    }

    fn read(file: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("reading the toolchain pin {}", file.display()))?;
        Self::parse(&text, file)
    }

    fn parse(text: &str, file: &Path) -> anyhow::Result<Self> {
        let File { mut toolchain } = toml::from_str(text)
            .with_context(|| format!("parsing the toolchain pin {}", file.display()))?;
        toolchain.file = file.to_owned();
        Ok(toolchain)
    }

    /// Where the channel comes from, for messages.
    pub fn source(&self) -> String {
        if self.overridden {
            format!("${EBPF_TOOLCHAIN_OVERRIDE}")
        } else {
            self.file.display().to_string()
        }
    }

    /// `rustup run CHANNEL program`, with the caller's toolchain choice removed so that only the
    /// channel decides.
    pub fn run(&self, program: &str) -> Command {
        let mut command = Command::new("rustup");
        command
            .args(["run", &self.channel, program])
            .env_remove("RUSTUP_TOOLCHAIN");
        command
    }

    /// The LLVM major its rustc was built with (`rustc -vV`: `LLVM version: 22.1.4`).
    pub fn llvm_major(&self) -> anyhow::Result<u32> {
        let output = self
            .run("rustc")
            .arg("-vV")
            .output()
            .with_context(|| format!("running `rustup run {} rustc -vV`", self.channel))?;
        if !output.status.success() {
            bail!(
                "`rustup run {} rustc -vV` failed ({}): {}",
                self.channel,
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        llvm_major_of_rustc(&String::from_utf8_lossy(&output.stdout)).with_context(|| {
            format!(
                "`rustup run {} rustc -vV` names no LLVM version",
                self.channel
            )
        })
    }
}

/// The major of `LLVM version: X.Y.Z` in `rustc -vV`'s output.
fn llvm_major_of_rustc(verbose_version: &str) -> Option<u32> {
    verbose_version
        .lines()
        .find_map(|line| line.strip_prefix("LLVM version: "))
        .and_then(|version| version.split('.').next())
        .and_then(|major| major.trim().parse().ok())
}

/// The host's target triple, as rustup suffixes toolchain names with it.
pub fn host_triple() -> anyhow::Result<String> {
    let output = Pin::userspace()?
        .run("rustc")
        .arg("-vV")
        .output()
        .context("running `rustc -vV` for the host triple")?;
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("host: "))
        .map(str::to_owned)
        .context("`rustc -vV` names no host triple")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_pins_parse_and_the_ebpf_one_is_a_dated_nightly() {
        let userspace = Pin::userspace().expect("the workspace pin parses");
        assert!(
            userspace
                .channel
                .chars()
                .all(|c| c.is_ascii_digit() || c == '.'),
            "userspace is pinned to a stable release, not {:?}",
            userspace.channel
        );
        let ebpf = Pin::read(&workspace_root().join("redirector-ebpf/rust-toolchain.toml"))
            .expect("the eBPF pin parses");
        let date = ebpf
            .channel
            .strip_prefix("nightly-")
            .unwrap_or_else(|| panic!("the eBPF pin {:?} is not a nightly", ebpf.channel));
        let fields: Vec<&str> = date.split('-').collect();
        assert!(
            fields.len() == 3 && fields.iter().all(|f| f.parse::<u32>().is_ok()),
            "the eBPF pin {:?} is not a dated nightly (nightly-YYYY-MM-DD)",
            ebpf.channel
        );
        for component in ["rust-src", "clippy"] {
            assert!(
                ebpf.components.iter().any(|c| c == component),
                "the eBPF pin lacks {component}: {:?}",
                ebpf.components
            );
        }
    }

    #[test]
    fn the_llvm_major_is_read_from_rustc() {
        let output = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)\nbinary: rustc\n\
                      host: x86_64-unknown-linux-gnu\nLLVM version: 22.1.4\n";
        assert_eq!(llvm_major_of_rustc(output), Some(22));
        assert_eq!(llvm_major_of_rustc("rustc 1.0.0\n"), None);
    }

    #[test]
    fn a_pin_without_a_toolchain_table_is_refused() {
        let error = Pin::parse("channel = \"nightly\"\n", Path::new("x.toml"))
            .expect_err("a bare channel is not a toolchain file");
        assert!(format!("{error:#}").contains("x.toml"), "{error:#}");
    }

    /// The Containerfile installs bpf-linker the way setup does: the same LLVM major.
    #[test]
    fn the_containerfile_builds_bpf_linker_against_the_same_llvm() {
        let text = std::fs::read_to_string(workspace_root().join("Containerfile"))
            .expect("the Containerfile is readable");
        for needle in [
            format!("llvm-{LLVM_MAJOR}-dev"),
            format!("--features llvm-{LLVM_MAJOR}"),
            format!("/usr/lib/llvm-{LLVM_MAJOR}"),
            "redirector-ebpf/rust-toolchain.toml".to_owned(),
        ] {
            assert!(text.contains(&needle), "the Containerfile lacks {needle:?}");
        }
        assert!(
            !text.contains("install nightly"),
            "the Containerfile installs the floating nightly"
        );
    }
}
