//! `cargo xtask release`: what a release ships, built from a clean checkout of its commit: the
//! static agents of both architectures, the images of both under one manifest list, and a
//! SHA256SUMS of the files, in `target/dist/VERSION/`. The checklist around it is in
//! docs/development.md ("Making a release").

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::{
    arch::Arch,
    image::{self, ImageArgs},
    lint, tasks,
    workspace::{target_dir, workspace_root},
};

/// `cargo xtask release`'s arguments.
#[derive(clap::Args, Debug)]
pub struct ReleaseArgs {
    /// The images' repository; the release's version is their tag (NAME:VERSION, and
    /// NAME:VERSION-amd64 and -arm64 for each architecture's image).
    #[arg(long, default_value = "localhost/redirector")]
    name: String,
    /// Build from a checkout with uncommitted changes (for trying the command; never for a
    /// release, whose binaries must name the commit they are built from).
    #[arg(long)]
    allow_dirty: bool,
}

/// The workspace's version, from its Cargo.toml.
fn workspace_version(root: &Path) -> anyhow::Result<String> {
    let path = root.join("Cargo.toml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let manifest: toml::Table =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    manifest
        .get("workspace")
        .and_then(|workspace| workspace.get("package"))
        .and_then(|package| package.get("version"))
        .and_then(toml::Value::as_str)
        .map(str::to_owned)
        .context("Cargo.toml has no [workspace.package] version")
}

/// The release's date in CHANGELOG.md (`## [VERSION] - DATE`).
fn changelog_date(changelog: &str, version: &str) -> Option<String> {
    let heading = format!("## [{version}] - ");
    changelog
        .lines()
        .find_map(|line| line.strip_prefix(&heading))
        .map(str::to_owned)
}

/// `git ARGS` in the workspace, its output trimmed.
fn git(root: &Path, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("git")
        .args(args)
        .current_dir(root)
        .output()
        .with_context(|| format!("running git {args:?}"))?;
    if !output.status.success() {
        bail!(
            "git {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Copies `from` to `to`.
fn copy(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::copy(from, to)
        .map(drop)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))
}

/// Builds the release into `target/dist/VERSION/` and returns that directory.
pub fn run(args: &ReleaseArgs) -> anyhow::Result<PathBuf> {
    tasks::require_root("release")?;
    let root = workspace_root();
    let version = workspace_version(&root)?;
    let changelog =
        std::fs::read_to_string(root.join("CHANGELOG.md")).context("reading CHANGELOG.md")?;
    let Some(date) = changelog_date(&changelog, &version) else {
        bail!(
            "CHANGELOG.md has no section `## [{version}] - YYYY-MM-DD`: move the Unreleased \
             entries under it first (docs/development.md, \"Making a release\")"
        );
    };
    let dirty = git(&root, &["status", "--porcelain"])?;
    if !dirty.is_empty() && !args.allow_dirty {
        bail!(
            "the checkout has uncommitted changes; a release is built from its commit: commit \
             or stash them (or try the command with --allow-dirty)"
        );
    }
    let commit = git(&root, &["rev-parse", "--short=12", "HEAD"])?;

    let dist = target_dir().join("dist").join(&version);
    if dist.exists() {
        std::fs::remove_dir_all(&dist).with_context(|| format!("removing {}", dist.display()))?;
    }
    std::fs::create_dir_all(&dist).with_context(|| format!("creating {}", dist.display()))?;

    let mut files = Vec::new();
    for arch in Arch::ALL {
        let binary = tasks::build_agent(arch)?;
        let file = format!("redirector-{version}-linux-{}", arch.debian());
        copy(&binary, &dist.join(&file))?;
        files.push(file);
    }
    // The host's agent says what it is: the release and the commit being shipped.
    let host = dist.join(format!(
        "redirector-{version}-linux-{}",
        Arch::host().debian()
    ));
    let said = Command::new(&host)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", host.display()))?;
    let said = String::from_utf8_lossy(&said.stdout);
    if !said.contains(&format!("redirector {version} (commit {commit}")) {
        bail!(
            "{} --version says {said:?}, not release {version} at commit {commit}",
            host.display()
        );
    }

    let list = format!("{}:{version}", args.name);
    image::run(&ImageArgs::for_release(list.clone()))?;
    for arch in Arch::ALL {
        let file = format!("redirector-{version}-image-{}.oci.tar", arch.debian());
        let mut save = Command::new("podman");
        save.args(["save", "--quiet", "--format", "oci-archive", "--output"])
            .arg(dist.join(&file))
            .arg(image::arch_image(&list, arch));
        lint::check(
            &mut save,
            &format!("podman save of the {} image", arch.name()),
        )?;
        files.push(file);
    }

    let mut sums = Command::new("sha256sum");
    sums.args(&files).current_dir(&dist);
    let output = sums.output().context("running sha256sum")?;
    if !output.status.success() {
        bail!(
            "sha256sum failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    std::fs::write(dist.join("SHA256SUMS"), &output.stdout).context("writing SHA256SUMS")?;

    eprintln!(
        "xtask: release {version} of {date}, commit {commit}, in {}:",
        dist.display()
    );
    eprint!("{}", String::from_utf8_lossy(&output.stdout));
    eprintln!(
        "next: git tag -a v{version} -m 'redirector {version}' {commit}; podman manifest push \
         --all {list} docker://REGISTRY/redirector:{version}; publish the files with \
         CHANGELOG.md's section for {version}"
    );
    Ok(dist)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_is_the_workspaces_version_with_a_dated_changelog_section() {
        let root = workspace_root();
        let version = workspace_version(&root).unwrap();
        assert_eq!(version.split('.').count(), 3, "{version}");
        let changelog = std::fs::read_to_string(root.join("CHANGELOG.md")).unwrap();
        let date = changelog_date(&changelog, &version);
        assert!(date.is_some_and(|date| date.len() == 10), "{version}");
        assert_eq!(changelog_date(&changelog, "0.0.0"), None);
    }
}
