//! rustfmt and clippy, warnings denied, on the userspace crates and on the eBPF crate for its
//! own target.

use std::process::Command;

use anyhow::{Context as _, bail};

use crate::toolchain::Pin;

/// Runs every lint; fails on the first that reports anything.
pub fn run() -> anyhow::Result<()> {
    cargo(
        &["fmt", "--all", "--", "--check"],
        "rustfmt found unformatted code: run `cargo fmt --all`",
    )?;
    cargo(
        &[
            // `--all-targets` leaves out a test with `test = false`: the node's, which only the
            // node's VM runs, is named.
            &["clippy", "--all-targets", "--test", "node"],
            &crate::workspace::USERSPACE[..],
            &["--", "-D", "warnings"],
        ]
        .concat(),
        "clippy reported warnings in the userspace crates",
    )?;
    let mut ebpf = Pin::ebpf()?.run("cargo");
    ebpf.args([
        "clippy",
        "--package",
        "redirector-ebpf",
        "--release",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--",
        "-D",
        "warnings",
    ]);
    check(&mut ebpf, "clippy reported warnings in the eBPF crate")
}

/// Runs `cargo args` with the workspace toolchain.
pub fn cargo(args: &[&str], failure: &str) -> anyhow::Result<()> {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    command.args(args);
    check(&mut command, failure)
}

/// Runs `command` with inherited output; `failure` is the error when it fails.
pub fn check(command: &mut Command, failure: &str) -> anyhow::Result<()> {
    let status = command
        .status()
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{failure} ({status})");
    }
    Ok(())
}
