//! The rehearsal of a fresh machine that `cargo xtask test` builds and lints in: a rustup home in
//! which only the pinned toolchains run.
//!
//! A fresh machine's rustup may hold any floating `nightly`, of whatever day it was installed or
//! updated, and a build that reaches for it links only while that day's LLVM matches bpf-linker's.
//! So the test task points `RUSTUP_HOME` at a home of its own (under the target directory) that
//! links the two pinned toolchains from the real home, holds a floating `nightly` whose every tool
//! fails with a message, and holds no `stable` (rustup's default). Any build or lint step that runs
//! a toolchain the pins do not name then fails, on every machine, whatever the real home holds.
//! Nothing is downloaded and the real home is not changed: setup has already installed the pins
//! there.

use std::{
    os::unix::fs::{PermissionsExt as _, symlink},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::{
    toolchain::{Pin, host_triple},
    workspace::target_dir,
};

/// The tools a toolchain's `bin` holds, each of which the poisoned `nightly` answers with an error.
const TOOLS: &[&str] = &[
    "cargo",
    "rustc",
    "rustdoc",
    "cargo-clippy",
    "clippy-driver",
    "rustfmt",
    "cargo-fmt",
];

/// The floating nightly, named here only to be poisoned.
const FLOATING_NIGHTLY: &str = "nightly"; // poisoned: never a toolchain to build with

/// The floating channels whose use the rehearsal turns into an error.
const FLOATING: &[&str] = &[FLOATING_NIGHTLY, "beta"];

/// Builds the pinned-only home and points this process (and so every command it starts) at it.
pub fn enter() -> anyhow::Result<PathBuf> {
    let real = real_home()?;
    let host = host_triple()?;
    let home = target_dir().join("xtask/rustup-pinned-only");
    let pinned = [Pin::userspace()?, Pin::ebpf()?].map(|pin| (full_name(&pin.channel, &host), pin));
    build(&home, &real, &host, &pinned)?;
    check_armed(&home, &host, &pinned)?;
    // SAFETY: xtask is single-threaded here (no thread has been started yet), so nothing reads
    // the environment while it changes.
    unsafe {
        std::env::set_var("RUSTUP_HOME", &home);
        // A toolchain the pins do not name must fail, not be downloaded into the rehearsal.
        std::env::set_var("RUSTUP_AUTO_INSTALL", "0");
    }
    eprintln!(
        "xtask: building and testing with only the pinned toolchains ({}) in {}",
        pinned
            .iter()
            .map(|(name, _)| name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        home.display()
    );
    Ok(home)
}

/// Checks that the newest eBPF object under `build_dir` (a profile's `build/`) was compiled by the
/// eBPF pin's rustc: its debug info names its producer (`clang LLVM (rustc version 1.97.0-nightly
/// (9eb3be26b 2026-05-18))`), which says which toolchain built it even when the build was warm.
pub fn check_object(build_dir: &Path) -> anyhow::Result<()> {
    let object = newest_object(build_dir)?;
    let bytes = std::fs::read(&object).with_context(|| format!("reading {}", object.display()))?;
    let producer = producer_of(&bytes)
        .with_context(|| format!("{} names no rustc producer", object.display()))?;
    let pin = Pin::ebpf()?;
    let output = pin
        .run("rustc")
        .arg("--version")
        .output()
        .with_context(|| format!("running `rustup run {} rustc --version`", pin.channel))?;
    let version = String::from_utf8_lossy(&output.stdout);
    let pinned = version
        .trim()
        .strip_prefix("rustc ")
        .unwrap_or(version.trim());
    if producer != pinned {
        bail!(
            "{} was compiled by rustc {producer}, not by the eBPF pin {} (rustc {pinned}): the \
             build did not use the pinned toolchain",
            object.display(),
            pin.channel
        );
    }
    eprintln!(
        "xtask: the eBPF object was compiled by the pinned {} (rustc {producer})",
        pin.channel
    );
    Ok(())
}

/// The most recently written `redirector-*/out/redirector-ebpf` below `build_dir`.
fn newest_object(build_dir: &Path) -> anyhow::Result<PathBuf> {
    let entries =
        std::fs::read_dir(build_dir).with_context(|| format!("listing {}", build_dir.display()))?;
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in entries {
        let entry = entry.with_context(|| format!("listing {}", build_dir.display()))?;
        if !entry
            .file_name()
            .to_string_lossy()
            .starts_with("redirector-")
        {
            continue;
        }
        let object = entry.path().join("out/redirector-ebpf");
        let Ok(modified) = object.metadata().and_then(|meta| meta.modified()) else {
            continue;
        };
        if newest.as_ref().is_none_or(|(time, _)| modified > *time) {
            newest = Some((modified, object));
        }
    }
    newest.map(|(_, object)| object).with_context(|| {
        format!(
            "no eBPF object (redirector-*/out/redirector-ebpf) below {}",
            build_dir.display()
        )
    })
}

/// The rustc version in an object's `DW_AT_producer` string.
fn producer_of(object: &[u8]) -> Option<&str> {
    const MARK: &[u8] = b"rustc version ";
    let start = object.windows(MARK.len()).position(|w| w == MARK)? + MARK.len();
    let end = object[start..].iter().position(|&b| b == 0)? + start;
    let producer = std::str::from_utf8(&object[start..end]).ok()?;
    // The producer closes its own parenthesis: `clang LLVM (rustc version V (H D))`.
    producer.strip_suffix(')')
}

/// rustup's home as rustup finds it.
fn real_home() -> anyhow::Result<PathBuf> {
    std::env::var_os("RUSTUP_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".rustup")))
        .context("neither RUSTUP_HOME nor HOME is set: cannot find rustup's home")
}

/// A toolchain's directory name: the channel with the host triple, unless it has one.
fn full_name(channel: &str, host: &str) -> String {
    if channel.ends_with(host) {
        channel.to_owned()
    } else {
        format!("{channel}-{host}")
    }
}

fn build(home: &Path, real: &Path, host: &str, pinned: &[(String, Pin)]) -> anyhow::Result<()> {
    if home.exists() {
        std::fs::remove_dir_all(home)
            .with_context(|| format!("removing the previous rehearsal home {}", home.display()))?;
    }
    let toolchains = home.join("toolchains");
    std::fs::create_dir_all(&toolchains)
        .with_context(|| format!("creating {}", toolchains.display()))?;
    for (name, pin) in pinned {
        let source = real.join("toolchains").join(name);
        if !source.join("bin/cargo").is_file() {
            bail!(
                "the toolchain {name} (pinned in {}) is not installed in {}: run `cargo xtask setup`",
                pin.source(),
                real.display()
            );
        }
        let link = toolchains.join(name);
        if !link.exists() {
            symlink(&source, &link)
                .with_context(|| format!("linking {} to {}", link.display(), source.display()))?;
        }
    }
    for channel in FLOATING {
        let name = full_name(channel, host);
        if pinned.iter().any(|(pinned, _)| *pinned == name) {
            continue;
        }
        poison(&toolchains.join(&name), &name)?;
    }
    let settings = format!(
        "version = \"12\"\ndefault_toolchain = \"{}\"\nprofile = \"minimal\"\n\
         auto_self_update = \"disable\"\n",
        full_name("stable", host)
    );
    std::fs::write(home.join("settings.toml"), settings).context("writing settings.toml")
}

/// Proves the rehearsal is in force before anything builds in it: through rustup, with this home,
/// every pinned toolchain runs and the floating `nightly` fails with its message.
fn check_armed(home: &Path, host: &str, pinned: &[(String, Pin)]) -> anyhow::Result<()> {
    let rustup = |toolchain: &str, tool: &str| {
        Command::new("rustup")
            .args(["run", toolchain, tool, "--version"])
            .env("RUSTUP_HOME", home)
            .env("RUSTUP_AUTO_INSTALL", "0")
            .env_remove("RUSTUP_TOOLCHAIN")
            .output()
            .with_context(|| format!("running `rustup run {toolchain} {tool} --version`"))
    };
    for (name, _) in pinned {
        let output = rustup(name, "rustc")?;
        if !output.status.success() {
            bail!(
                "the rehearsal's link to {name} does not run ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
    }
    let floating = full_name(FLOATING_NIGHTLY, host);
    if pinned.iter().all(|(name, _)| *name != floating) {
        let output = rustup(FLOATING_NIGHTLY, "cargo")?;
        if output.status.code() != Some(97) {
            bail!(
                "the rehearsal is not in force: `rustup run nightly cargo` with RUSTUP_HOME={} \
                 exited {} instead of reaching the poisoned toolchain",
                home.display(),
                output.status
            );
        }
    }
    Ok(())
}

/// A toolchain directory whose every tool says which toolchain was reached and fails.
fn poison(dir: &Path, name: &str) -> anyhow::Result<()> {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    for tool in TOOLS {
        let path = bin.join(tool);
        let script = format!(
            "#!/bin/sh\necho \"xtask rehearsal: {tool} of the unpinned toolchain {name} was run \
             ($0 $*); every build step must use a pinned toolchain (rust-toolchain.toml, \
             redirector-ebpf/rust-toolchain.toml)\" >&2\nexit 97\n"
        );
        std::fs::write(&path, script).with_context(|| format!("writing {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_get_the_host_once() {
        let host = "x86_64-unknown-linux-gnu";
        assert_eq!(
            full_name("nightly-2026-05-19", host),
            "nightly-2026-05-19-x86_64-unknown-linux-gnu"
        );
        assert_eq!(
            full_name("1.95.0-x86_64-unknown-linux-gnu", host),
            "1.95.0-x86_64-unknown-linux-gnu"
        );
    }

    #[test]
    fn the_producer_is_read_from_the_object() {
        let object =
            b"\x7fELF\0\0clang LLVM (rustc version 1.97.0-nightly (9eb3be26b 2026-05-18))\0x";
        assert_eq!(
            producer_of(object),
            Some("1.97.0-nightly (9eb3be26b 2026-05-18)")
        );
        assert_eq!(producer_of(b"\x7fELF\0no producer\0"), None);
    }

    /// The poisoned tools fail, and say which toolchain was reached.
    #[test]
    fn a_poisoned_tool_fails_and_names_its_toolchain() {
        let dir = std::env::temp_dir().join(format!("xtask-poison-{}", std::process::id()));
        poison(&dir, "nightly-x86_64-unknown-linux-gnu").expect("poisoning a scratch directory");
        let output = Command::new(dir.join("bin/cargo"))
            .arg("build")
            .output()
            .expect("running the poisoned cargo");
        std::fs::remove_dir_all(&dir).expect("removing the scratch directory");
        assert_eq!(output.status.code(), Some(97));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("nightly-x86_64-unknown-linux-gnu") && stderr.contains("build"),
            "{stderr}"
        );
    }
}
