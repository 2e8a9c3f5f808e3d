//! Builds the kernel programs (`redirector-ebpf`) for the BPF target and leaves the object in
//! `$OUT_DIR/redirector-ebpf`, where `src/datapath/mod.rs` embeds it.
//!
//! This does what `aya-build` does, with two differences: it passes `-C target-cpu=v3` (the v3
//! ISA, kernel 5.1+: 32-bit jumps and subregisters; measured here, connect4 and sendmsg4 shrink
//! from 392 to 360 instructions), and it stays quiet unless the build fails, instead of relaying
//! every line of the nested cargo as a warning.
//!
//! It also records the commit the agent is built from (`REDIRECTOR_COMMIT` for `--version`,
//! `status` and `redirector_build_info`): the environment's `REDIRECTOR_COMMIT` when set (a build
//! without the git directory, as the Containerfile's), else `git rev-parse HEAD`, else `unknown`.
//!
//! The nested build runs on the dated nightly that `redirector-ebpf/rust-toolchain.toml` pins
//! (`REDIRECTOR_EBPF_TOOLCHAIN` overrides it), named to rustup explicitly: this script runs from
//! the workspace, where rustup would otherwise pick the userspace pin.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

/// The eBPF crate's package and binary name.
const EBPF_PACKAGE: &str = "redirector-ebpf";

/// Names another toolchain than the pin, for trying one (xtask's setup and lints read it too).
const TOOLCHAIN_OVERRIDE: &str = "REDIRECTOR_EBPF_TOOLCHAIN";

/// The `[toolchain]` table of a `rust-toolchain.toml`.
#[derive(serde::Deserialize)]
struct ToolchainFile {
    toolchain: Toolchain,
}

#[derive(serde::Deserialize)]
struct Toolchain {
    channel: String,
}

/// The channel the eBPF pin names.
fn pinned_channel(file: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading the eBPF toolchain pin {}", file.display()))?;
    let pin: ToolchainFile = toml::from_str(&text)
        .with_context(|| format!("parsing the eBPF toolchain pin {}", file.display()))?;
    Ok(pin.toolchain.channel)
}

/// The variable the commit is given in, to the build and to the crate.
const COMMIT: &str = "REDIRECTOR_COMMIT";

/// `git` run in `workspace` with `args`, its output trimmed; `None` where git or the repository
/// is missing.
fn git(workspace: &Path, args: &[&str]) -> Option<String> {
    let output = Command::new("git")
        .args(args)
        .current_dir(workspace)
        .output()
        .ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    (output.status.success() && !text.trim().is_empty()).then(|| text.trim().to_owned())
}

/// The commit the crate is built from (12 hex digits), and makes cargo run this script again
/// when HEAD moves.
fn commit(workspace: &Path) -> String {
    println!("cargo::rerun-if-env-changed={COMMIT}");
    if let Ok(commit) = env::var(COMMIT)
        && !commit.is_empty()
    {
        return commit;
    }
    // HEAD names a branch whose ref file (or packed-refs) moves at each commit. Only files that
    // exist are named: cargo runs a script again at every build for a missing one.
    let branch = git(workspace, &["symbolic-ref", "-q", "HEAD"]);
    for file in ["HEAD", "packed-refs"].into_iter().chain(branch.as_deref()) {
        if let Some(path) = git(workspace, &["rev-parse", "--git-path", file])
            && workspace.join(&path).exists()
        {
            println!("cargo::rerun-if-changed={}", workspace.join(path).display());
        }
    }
    git(workspace, &["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_owned())
}

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?);
    let workspace = manifest_dir
        .parent()
        .context("the redirector crate sits inside the workspace")?;
    println!("cargo::rustc-env={COMMIT}={}", commit(workspace));
    for input in ["redirector-ebpf", "redirector-common"] {
        println!(
            "cargo::rerun-if-changed={}",
            workspace.join(input).display()
        );
    }
    println!("cargo::rerun-if-env-changed={TOOLCHAIN_OVERRIDE}");

    let out_dir = PathBuf::from(env::var("OUT_DIR").context("OUT_DIR")?);
    let target = match env::var("CARGO_CFG_TARGET_ENDIAN").as_deref() {
        Ok("big") => "bpfeb-unknown-none",
        _ => "bpfel-unknown-none",
    };
    let arch = env::var("CARGO_CFG_TARGET_ARCH").context("CARGO_CFG_TARGET_ARCH")?;
    let pin_file = workspace.join(EBPF_PACKAGE).join("rust-toolchain.toml");
    let toolchain = match env::var(TOOLCHAIN_OVERRIDE) {
        Ok(toolchain) if !toolchain.is_empty() => toolchain,
        _ => pinned_channel(&pin_file)?,
    };
    let target_dir = out_dir.join("ebpf-target");

    let rustflags = [
        format!("--cfg=bpf_target_arch=\"{arch}\""),
        "-Cdebuginfo=2".to_owned(),
        "-Clink-arg=--btf".to_owned(),
        "-Ctarget-cpu=v3".to_owned(),
    ]
    .join("\x1f");
    let mut build = Command::new("rustup");
    build
        .args(["run", &toolchain, "cargo", "build", "--quiet", "--release"])
        .args(["--package", EBPF_PACKAGE, "--bin", EBPF_PACKAGE])
        .args(["--target", target, "-Z", "build-std=core"])
        .arg("--target-dir")
        .arg(&target_dir)
        .current_dir(workspace)
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags)
        // The outer build's compiler settings must not leak into the eBPF one.
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN");
    let output = build.output().with_context(|| {
        format!(
            "running `rustup run {toolchain} cargo build` for the eBPF object (is rustup installed?)"
        )
    })?;
    if !output.status.success() {
        for line in String::from_utf8_lossy(&output.stderr).lines() {
            println!("cargo::warning={line}");
        }
        bail!(
            "building the eBPF object with {toolchain} failed ({}); it needs that toolchain with \
             rust-src, and a bpf-linker built against the same LLVM: run `cargo xtask setup`, \
             which installs what is missing and checks that the two agree",
            output.status
        );
    }
    let built = target_dir.join(target).join("release").join(EBPF_PACKAGE);
    copy(&built, &out_dir.join(EBPF_PACKAGE))
}

fn copy(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::copy(from, to)
        .map(drop)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))
}
