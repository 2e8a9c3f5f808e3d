//! `cargo xtask image`: the Containerfile built with the machine's podman for each architecture,
//! and a manifest list naming them, without emulation and without pulling an image.
//!
//! Each architecture's agent is cross-built (`cargo xtask build --target ARCH`) and its root
//! filesystem made on this machine by `deploy/container/rootfs.sh` (mmdebstrap's extract variant,
//! from Debian's mirror); named build contexts hand both to the Containerfile in place of its
//! `build` and `rootfs` stages, so only its runtime stage, which has no RUN, is built. The images
//! are tagged NAME-amd64 and NAME-arm64, and the manifest list NAME lists them: the DaemonSet
//! names NAME and each node pulls its own.

use std::{path::Path, process::Command, time::Instant};

use anyhow::{Context as _, bail};

use crate::{
    arch::{Arch, Selection},
    lint, tasks,
    workspace::{target_dir, workspace_root},
};

/// `cargo xtask image`'s arguments.
#[derive(clap::Args, Debug)]
pub struct ImageArgs {
    /// The architectures to build for (repeat it, or `all`).
    #[arg(long = "target", value_name = "ARCH", default_value = "all")]
    targets: Vec<Selection>,
    /// The manifest list's name, with a tag; each architecture's image is tagged NAME-<arch>
    /// (Debian's name: amd64, arm64).
    #[arg(long, default_value = "localhost/redirector:dev")]
    name: String,
}

impl ImageArgs {
    /// Every architecture's image, and their list under `name`.
    pub fn for_release(name: String) -> Self {
        Self {
            targets: vec![Selection::All],
            name,
        }
    }
}

/// The name of `arch`'s image beside the list `name` (`repo:tag` → `repo:tag-arm64`).
pub fn arch_image(name: &str, arch: Arch) -> String {
    format!("{name}-{}", arch.debian())
}

/// Refuses a name without a tag, which `NAME-arm64` would turn into another repository.
fn check_name(name: &str) -> anyhow::Result<()> {
    let last = name.rsplit('/').next().unwrap_or(name);
    if !last.contains(':') || name.contains('@') {
        bail!(
            "--name {name} has no tag: give REPOSITORY:TAG (for example \
             registry.example.com/redirector:0.2.0); each architecture's image is tagged TAG-ARCH"
        );
    }
    Ok(())
}

fn podman(args: &[&str], failure: &str) -> anyhow::Result<String> {
    let output = Command::new("podman")
        .args(args)
        .output()
        .context("running podman (`cargo xtask setup` installs it)")?;
    if !output.status.success() {
        bail!(
            "{failure}: `podman {}` failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Builds the images and the list.
pub fn run(args: &ImageArgs) -> anyhow::Result<()> {
    tasks::require_root("image")?;
    check_name(&args.name)?;
    let arches = Selection::arches(&args.targets);
    let started = Instant::now();
    // One cargo build at a time, before any image.
    let binaries = arches
        .iter()
        .map(|&arch| Ok((arch, tasks::build_agent(arch)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut built = Vec::new();
    for (arch, binary) in &binaries {
        built.push(build_one(*arch, binary, &args.name)?);
    }
    if podman(&["manifest", "exists", &args.name], "").is_ok() {
        podman(
            &["manifest", "rm", &args.name],
            "removing the earlier manifest list",
        )?;
    }
    podman(
        &["manifest", "create", &args.name],
        "creating the manifest list",
    )?;
    for (arch, image, _) in &built {
        podman(
            &[
                "manifest",
                "add",
                &args.name,
                &format!("containers-storage:{image}"),
            ],
            &format!("adding the {} image to the list", arch.name()),
        )?;
    }
    eprintln!(
        "xtask: built in {:.0?}, without emulation:",
        started.elapsed()
    );
    for (arch, image, size) in &built {
        eprintln!(
            "  {image}  linux/{}  {:.1} MB",
            arch.debian(),
            *size as f64 / 1e6
        );
    }
    eprintln!(
        "  {}  the manifest list of {}",
        args.name,
        built
            .iter()
            .map(|(arch, _, _)| arch.debian())
            .collect::<Vec<_>>()
            .join(" and ")
    );
    eprintln!(
        "push the images and the list: podman manifest push --all {} docker://REGISTRY/redirector:TAG",
        args.name
    );
    Ok(())
}

/// Builds `arch`'s image from `binary`: returns its name and size.
fn build_one(arch: Arch, binary: &Path, name: &str) -> anyhow::Result<(Arch, String, u64)> {
    let started = Instant::now();
    let workspace = workspace_root();
    let work = target_dir().join("xtask/image").join(arch.debian());
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    }
    let out = work.join("build/out");
    let rootfs_context = work.join("rootfs");
    let empty = work.join("empty");
    for dir in [&out, &rootfs_context, &empty] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    for (from, to) in [
        (binary.to_owned(), "redirector"),
        (
            workspace.join("deploy/seccomp/redirector.json"),
            "seccomp.json",
        ),
        (
            workspace.join("deploy/container/prepare-node.sh"),
            "prepare-node",
        ),
    ] {
        std::fs::copy(&from, out.join(to))
            .with_context(|| format!("copying {} into the build context", from.display()))?;
    }
    eprintln!(
        "xtask: making Debian 12's root filesystem for {} (mmdebstrap, extract)",
        arch.debian()
    );
    let mut rootfs = Command::new(workspace.join("deploy/container/rootfs.sh"));
    rootfs.arg(arch.debian()).arg(rootfs_context.join("rootfs"));
    lint::check(
        &mut rootfs,
        &format!(
            "deploy/container/rootfs.sh {} failed (it needs Debian's mirror and mmdebstrap)",
            arch.debian()
        ),
    )?;
    let image = arch_image(name, arch);
    let containerfile = workspace.join("Containerfile");
    let mut build = Command::new("podman");
    build
        .arg("build")
        .args(["--platform", &arch.platform()])
        .arg(format!(
            "--build-arg=BUILDPLATFORM={}",
            Arch::host().platform()
        ))
        .arg(format!(
            "--build-context=build={}",
            work.join("build").display()
        ))
        .arg(format!(
            "--build-context=rootfs={}",
            rootfs_context.display()
        ))
        .arg("--file")
        .arg(&containerfile)
        .args(["--tag", &image])
        .arg(&empty);
    lint::check(
        &mut build,
        &format!("podman build of the {} image failed", arch.name()),
    )?;
    let platform = podman(
        &[
            "image",
            "inspect",
            "--format",
            "{{.Os}}/{{.Architecture}} {{.Size}}",
            &image,
        ],
        "inspecting the image",
    )?;
    let (built_platform, size) = platform
        .split_once(' ')
        .with_context(|| format!("podman image inspect said {platform:?}"))?;
    if built_platform != arch.platform() {
        bail!(
            "{image} is for {built_platform}, not {}: podman did not build for the platform asked",
            arch.platform()
        );
    }
    // The root filesystem is in the image now.
    std::fs::remove_dir_all(&rootfs_context)
        .with_context(|| format!("removing {}", rootfs_context.display()))?;
    eprintln!("xtask: {image} built in {:.0?}", started.elapsed());
    let size = size
        .parse()
        .with_context(|| format!("podman's size of {image}: {size:?}"))?;
    Ok((arch, image, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Containerfile's instructions (continued lines joined), grouped by stage.
    fn stages() -> Vec<Vec<String>> {
        let text = std::fs::read_to_string(workspace_root().join("Containerfile"))
            .expect("the Containerfile is readable");
        let mut stages: Vec<Vec<String>> = Vec::new();
        let mut instruction = String::new();
        for line in text.lines() {
            let line = line.trim();
            if instruction.is_empty() && (line.is_empty() || line.starts_with('#')) {
                continue;
            }
            if let Some(continued) = line.strip_suffix('\\') {
                instruction.push_str(continued);
                continue;
            }
            instruction.push_str(line);
            let done = std::mem::take(&mut instruction);
            if done.starts_with("FROM ") {
                stages.push(vec![done]);
            } else if let Some(stage) = stages.last_mut() {
                stage.push(done);
            }
        }
        stages
    }

    /// No emulation: every stage that runs a command runs on the build machine's platform, and
    /// the runtime stage (the last) runs none.
    #[test]
    fn only_stages_on_the_build_platform_run_commands() {
        let stages = stages();
        assert!(stages.len() >= 3, "{stages:?}");
        for stage in &stages {
            if stage
                .iter()
                .any(|instruction| instruction.starts_with("RUN "))
            {
                assert!(
                    stage[0].starts_with("FROM --platform=$BUILDPLATFORM "),
                    "a stage that runs commands on the target's platform: {}",
                    stage[0]
                );
            }
        }
        let runtime = stages.last().expect("a runtime stage");
        assert_eq!(runtime[0], "FROM scratch");
        assert!(
            runtime
                .iter()
                .all(|instruction| !instruction.starts_with("RUN ")),
            "{runtime:?}"
        );
    }

    /// The build stage builds the agent as `cargo xtask build --target` does, for every
    /// architecture, with the same environment.
    #[test]
    fn the_build_stage_builds_the_agent_as_xtask_does() {
        let build: Vec<String> = stages()
            .into_iter()
            .find(|stage| stage[0].ends_with(" AS build"))
            .expect("a build stage");
        let text = build.join("\n");
        for arch in Arch::ALL {
            let args = tasks::agent_build_args(arch).join(" ");
            let with_variable = args.replace(arch.musl_target(), "\"$target\"");
            assert!(text.contains(&format!("cargo {with_variable}")), "{text}");
            let selected = format!("{}) target={} ;;", arch.debian(), arch.musl_target());
            assert!(text.contains(&selected), "lacks {selected:?}: {text}");
            for (name, value) in arch.cargo_env() {
                assert!(
                    text.contains(&format!("{name}={value}")),
                    "lacks {name}={value}: {text}"
                );
            }
        }
    }

    #[test]
    fn each_architecture_is_tagged_beside_the_list() {
        assert_eq!(
            arch_image("registry.example.com/redirector:0.2.0", Arch::Aarch64),
            "registry.example.com/redirector:0.2.0-arm64"
        );
        check_name("registry.example.com:5000/redirector:0.1.0").expect("a tag");
        assert!(check_name("registry.example.com:5000/redirector").is_err());
        assert!(check_name("redirector@sha256:00").is_err());
    }
}
