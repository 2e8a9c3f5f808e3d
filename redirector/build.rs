//! Builds the kernel programs (`redirector-ebpf`) for the BPF target and leaves the object in
//! `$OUT_DIR/redirector-ebpf`, where `src/datapath/mod.rs` embeds it.
//!
//! This does what `aya-build` does, with two differences: it passes `-C target-cpu=v3` (the v3
//! ISA, kernel 5.1+: 32-bit jumps and subregisters; measured here, connect4 and sendmsg4 shrink
//! from 392 to 360 instructions), and it stays quiet unless the build fails, instead of relaying
//! every line of the nested cargo as a warning.
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

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?);
    let workspace = manifest_dir
        .parent()
        .context("the redirector crate sits inside the workspace")?;
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
