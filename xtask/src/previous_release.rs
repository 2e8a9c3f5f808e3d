//! The previous release's agent, for the node's rollout from it to this build and back
//! (the suite's node, `bpf-tests/tests/node.rs`): its tree taken from git at the release's
//! commit (`git archive`, no work tree or worktree to keep; a shallow clone fetches that one
//! commit from its remote first) into `target/releases/VERSION/src`, and its agent built there
//! with its own lock file and toolchain pins into `target/releases/VERSION/target`; both kept, so
//! only the first node run pays the build.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, bail};

/// The release before this one.
pub const VERSION: &str = "0.2.0";
/// Its commit (CHANGELOG.md's 0.2.0; `cargo xtask release` built it).
pub const COMMIT: &str = "ee5a868329316d1af3db5ef9f879ce8ad47224c3";

/// The previous release's tree and its agent.
#[derive(Debug)]
pub struct PreviousRelease {
    /// Its source tree (its deploy/ for the image's other files).
    pub tree: PathBuf,
    /// Its agent, a debug build as the tests' own.
    pub redirector: PathBuf,
}

/// The commit as the agent names it (`--version`): its first 12 hex digits.
pub fn commit_label() -> &'static str {
    &COMMIT[..12]
}

/// Takes the tree out of git and builds its agent, unless already done.
pub fn ensure() -> anyhow::Result<PreviousRelease> {
    let dir = crate::workspace::target_dir()
        .join("releases")
        .join(VERSION);
    let tree = dir.join("src");
    let stamp = dir.join(".commit");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(COMMIT) {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&tree).with_context(|| format!("creating {}", tree.display()))?;
        extract(&tree)?;
        std::fs::write(&stamp, COMMIT).with_context(|| format!("writing {}", stamp.display()))?;
    }
    let target = dir.join("target");
    let started = Instant::now();
    eprintln!(
        "xtask: building {VERSION}'s agent (commit {COMMIT}) in {}",
        tree.display()
    );
    // Its own cargo (the tree's toolchain file names it), lock file and target directory.
    let mut build = Command::new("cargo");
    build
        .current_dir(&tree)
        .args([
            "build",
            "--locked",
            "--package",
            "redirector",
            "--bin",
            "redirector",
        ])
        .env("CARGO_TARGET_DIR", &target)
        // The tree has no .git: its build script takes the commit from here.
        .env("REDIRECTOR_COMMIT", commit_label())
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO");
    crate::tasks::remove_cargo_run_env(&mut build);
    let status = build
        .status()
        .with_context(|| format!("running {build:?}"))?;
    if !status.success() {
        bail!(
            "building {VERSION}'s agent in {} failed ({status}); see cargo's output above",
            tree.display()
        );
    }
    eprintln!(
        "xtask: {VERSION}'s agent ready in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(PreviousRelease {
        tree,
        redirector: target.join("debug/redirector"),
    })
}

/// Whether the repository has the commit's objects.
fn has_commit(workspace: &std::path::Path) -> anyhow::Result<bool> {
    Ok(Command::new("git")
        .current_dir(workspace)
        .args(["cat-file", "-e", &format!("{COMMIT}^{{commit}}")])
        .stderr(Stdio::null())
        .status()
        .context("running git cat-file")?
        .success())
}

/// `git archive COMMIT | tar -x -C tree`, after fetching the commit from `origin` where the
/// clone lacks it (a shallow clone, as CI systems make).
fn extract(tree: &std::path::Path) -> anyhow::Result<()> {
    let workspace = crate::workspace::workspace_root();
    if !has_commit(&workspace)? {
        eprintln!("xtask: this clone lacks {VERSION}'s commit {COMMIT}: fetching it from origin");
        let fetched = Command::new("git")
            .current_dir(&workspace)
            .args([
                "fetch",
                "--quiet",
                "--no-tags",
                "--depth=1",
                "origin",
                COMMIT,
            ])
            .status()
            .context("running git fetch")?;
        if !fetched.success() || !has_commit(&workspace)? {
            bail!(
                "this clone lacks {VERSION}'s commit {COMMIT}, which the node's rollback builds, \
                 and `git fetch origin {COMMIT}` failed ({fetched}): clone the repository with \
                 its history (not `--depth`), or run `git fetch --unshallow`"
            );
        }
    }
    let mut archive = Command::new("git")
        .current_dir(&workspace)
        .args(["archive", "--format=tar", COMMIT])
        .stdout(Stdio::piped())
        .spawn()
        .context("running git archive")?;
    let stdout = archive.stdout.take().context("git archive's output")?;
    let tar = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(tree)
        .stdin(stdout)
        .status()
        .context("running tar")?;
    let archived = archive.wait().context("waiting for git archive")?;
    if !archived.success() || !tar.success() {
        bail!(
            "taking {VERSION}'s tree (commit {COMMIT}) out of git failed (git archive: {archived}, \
             tar: {tar}); git's and tar's errors are above"
        );
    }
    Ok(())
}
