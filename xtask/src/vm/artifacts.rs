//! What the guest runs: the bpf-tests test binaries and the programs they start, built on the
//! host by cargo and frozen in a snapshot for the length of the run.

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::Stdio,
};

use anyhow::{Context as _, bail};
use serde::Deserialize;

use crate::{arch::Arch, tasks::TESTED_BINARY_BUILD, workspace::USERSPACE};

/// The test target the systemd boot runs.
pub const SYSTEMD_BOOT: &str = "systemd_boot";
/// The test target the node boot runs.
pub const NODE: &str = "node";
/// The program that builds the node's images and runs its control plane on the host.
pub const NODE_HOST: &str = "node-host";

/// One test binary of bpf-tests (`tests/NAME.rs`).
#[derive(Clone, Debug)]
pub struct TestBinary {
    /// The test target's name (`steering`).
    pub name: String,
    /// The executable cargo built (`target/debug/deps/steering-HASH`).
    pub path: PathBuf,
}

/// Everything cargo built for the guest.
#[derive(Debug)]
pub struct Artifacts {
    /// The directory every executable is in or below (`target/debug`): the snapshot replaces it
    /// in the guest.
    pub profile_dir: PathBuf,
    /// The test binaries to run, by name.
    pub tests: Vec<TestBinary>,
    /// Every executable the tests may start or run (test binaries included).
    pub executables: Vec<PathBuf>,
    /// The redirector binary (`REDIRECTOR_BIN`).
    pub redirector: PathBuf,
    /// The systemd boot's test binary (`bpf-tests/tests/systemd_boot.rs`, `test = false`: only
    /// a guest booted by systemd can run it, so cargo's own `cargo test` leaves it out).
    pub systemd_boot: TestBinary,
    /// The node boot's test binary (`bpf-tests/tests/node.rs`, `test = false` as well).
    pub node: TestBinary,
    /// The node's host side (`bpf-tests/src/bin/node-host.rs`).
    pub node_host: PathBuf,
}

/// The fields of one line of cargo's JSON messages that matter here (a `compiler-artifact`
/// message; other messages leave them empty).
#[derive(Deserialize)]
struct Message {
    reason: String,
    #[serde(default)]
    manifest_path: Option<PathBuf>,
    #[serde(default)]
    executable: Option<PathBuf>,
    #[serde(default)]
    target: Option<Target>,
    #[serde(default)]
    profile: Option<Profile>,
}

#[derive(Deserialize)]
struct Target {
    kind: Vec<String>,
    name: String,
}

#[derive(Deserialize)]
struct Profile {
    test: bool,
}

/// An executable of cargo's output, from one `compiler-artifact` message.
struct Built {
    /// The `Cargo.toml` of its package.
    manifest_path: PathBuf,
    kinds: Vec<String>,
    name: String,
    is_test_harness: bool,
    executable: PathBuf,
}

/// Runs `cargo args --message-format=json-render-diagnostics` (errors still print for people, on
/// stderr) for `arch` (the host's: as `cargo xtask test` builds; another: cross-built for its
/// static musl target) and returns the executables it reports.
fn cargo_executables(args: &[&str], arch: Arch, failure: &str) -> anyhow::Result<Vec<Built>> {
    let mut command = crate::tasks::cargo_for(arch, args);
    command
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped());
    let mut child = command
        .spawn()
        .with_context(|| format!("running {command:?}"))?;
    let stdout = child.stdout.take().context("cargo's stdout is piped")?;
    let mut built = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's output")?;
        if !line.starts_with('{') {
            continue;
        }
        let message: Message =
            serde_json::from_str(&line).with_context(|| format!("cargo printed {line:?}"))?;
        if message.reason != "compiler-artifact" {
            continue;
        }
        let (Some(executable), Some(target), Some(manifest_path)) =
            (message.executable, message.target, message.manifest_path)
        else {
            continue;
        };
        built.push(Built {
            manifest_path,
            kinds: target.kind,
            name: target.name,
            is_test_harness: message.profile.is_some_and(|profile| profile.test),
            executable,
        });
    }
    let status = child.wait().context("waiting for cargo")?;
    if !status.success() {
        bail!("{failure} ({status}); cargo's errors are above");
    }
    Ok(built)
}

/// Builds the redirector binary and the workspace's tests, exactly as `cargo xtask test` does
/// (nothing is rebuilt after it), for the host's architecture; for another, the same cross-built
/// for its static musl target, bpf-tests alone. Returns the bpf-tests test binaries (with the
/// helper programs cargo builds for them), and keeps the tests named in `only` (every one when
/// empty).
pub fn build(only: &[String], arch: Arch) -> anyhow::Result<Artifacts> {
    let redirector = cargo_executables(
        TESTED_BINARY_BUILD,
        arch,
        "building the redirector binary failed",
    )?;
    // The crates the host run's `cargo test` selects (`USERSPACE`): a build of one package
    // unifies the dependencies' features differently and would compile everything again. A
    // cross build has no host run to share with: bpf-tests alone.
    let selection: &[&str] = if arch == Arch::host() {
        &USERSPACE
    } else {
        &["--package", "bpf-tests"]
    };
    let bpf_tests: Vec<Built> = cargo_executables(
        &[&["test", "--no-run"], selection].concat(),
        arch,
        "building the bpf-tests failed",
    )?
    .into_iter()
    .filter(|built| {
        built
            .manifest_path
            .parent()
            .is_some_and(|dir| dir.ends_with("bpf-tests"))
    })
    .collect();
    // Selected by name over the same crates, so that features unify as above.
    let boot_test = |name: &str| -> anyhow::Result<TestBinary> {
        cargo_executables(
            &[&["test", "--no-run", "--test", name], selection].concat(),
            arch,
            "building a boot's tests failed",
        )?
        .into_iter()
        .find(|built| built.name == name && built.kinds.iter().any(|kind| kind == "test"))
        .map(|built| TestBinary {
            name: built.name,
            path: built.executable,
        })
        .with_context(|| format!("cargo built no {name} test binary"))
    };
    let systemd_boot = boot_test(SYSTEMD_BOOT)?;
    let node = boot_test(NODE)?;
    let redirector_bin = redirector
        .iter()
        .find(|built| built.name == "redirector" && !built.is_test_harness)
        .map(|built| built.executable.clone())
        .context("cargo built no `redirector` binary")?;
    let mut tests: Vec<TestBinary> = bpf_tests
        .iter()
        .filter(|built| built.kinds.iter().any(|kind| kind == "test"))
        .map(|built| TestBinary {
            name: built.name.clone(),
            path: built.executable.clone(),
        })
        .collect();
    tests.sort_by(|a, b| a.name.cmp(&b.name));
    if !only.is_empty() {
        let unknown: Vec<&String> = only
            .iter()
            .filter(|name| {
                *name != SYSTEMD_BOOT
                    && *name != NODE
                    && !tests.iter().any(|test| &test.name == *name)
            })
            .collect();
        if !unknown.is_empty() {
            bail!(
                "no bpf-tests test binary named {unknown:?}; there are: {}",
                tests
                    .iter()
                    .map(|test| test.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        tests.retain(|test| only.contains(&test.name));
    }
    // The programs the tests start: the binaries (`CARGO_BIN_EXE_*`, the redirector), not the
    // unit-test harnesses of those binaries.
    let mut executables: Vec<PathBuf> = redirector
        .iter()
        .chain(&bpf_tests)
        .filter(|built| {
            built.kinds.iter().any(|kind| kind == "test")
                || (built.kinds.iter().any(|kind| kind == "bin") && !built.is_test_harness)
        })
        .map(|built| built.executable.clone())
        .collect();
    executables.push(systemd_boot.path.clone());
    executables.push(node.path.clone());
    let node_host = bpf_tests
        .iter()
        .find(|built| {
            built.name == NODE_HOST
                && built.kinds.iter().any(|kind| kind == "bin")
                && !built.is_test_harness
        })
        .map(|built| built.executable.clone())
        .context("cargo built no node-host binary")?;
    executables.sort();
    executables.dedup();
    let profile_dir = redirector_bin
        .parent()
        .context("the redirector binary has a directory")?
        .to_owned();
    if let Some(outside) = executables
        .iter()
        .find(|path| !path.starts_with(&profile_dir))
    {
        bail!(
            "{} is outside {}: the snapshot expects every executable in one profile directory",
            outside.display(),
            profile_dir.display()
        );
    }
    Ok(Artifacts {
        profile_dir,
        tests,
        executables,
        redirector: redirector_bin,
        systemd_boot,
        node,
        node_host,
    })
}

/// A frozen copy of the executables, laid out as in the profile directory, that the guest
/// mounts over it. Others may rebuild the workspace while the guest runs: a replaced file under
/// the guest's overlay root turns into "Stale file handle" (overlayfs does not allow its lower
/// layer to change), and the guest must test what was built when the run started anyway.
#[derive(Debug)]
pub struct Snapshot {
    dir: PathBuf,
}

impl Snapshot {
    /// Hard-links (or copies, across filesystems) every executable into `dir`. A hard link
    /// keeps the inode cargo wrote even when cargo replaces the file (rustc's linker and cargo's
    /// uplifting write new files and rename or relink, they never rewrite one in place).
    pub fn take(artifacts: &Artifacts, dir: &Path) -> anyhow::Result<Self> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        let snapshot = Self {
            dir: dir.to_owned(),
        };
        for executable in &artifacts.executables {
            let relative = executable
                .strip_prefix(&artifacts.profile_dir)
                .context("executables are in the profile directory")?;
            let copy = dir.join(relative);
            if let Some(parent) = copy.parent() {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("creating {}", parent.display()))?;
            }
            if std::fs::hard_link(executable, &copy).is_err() {
                std::fs::copy(executable, &copy).with_context(|| {
                    format!("copying {} to {}", executable.display(), copy.display())
                })?;
            }
        }
        Ok(snapshot)
    }

    /// The snapshot's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
