//! The shipped image, built from the Containerfile and run the way the DaemonSet runs it, with
//! Debian's podman (runc) on storage of the tests' own.
//!
//! - **The base image**: no registry is reachable, so `debian:12-slim`, which the Containerfile's
//!   `rootfs` stage runs mmdebstrap in, is an mmdebstrap of Debian 12 (minbase, no
//!   documentation) for this machine's architecture, imported under that name, once per storage.
//! - **The build stage**: replaced by this build's binary through a named build context
//!   (`--build-context build=DIR`, which podman, like BuildKit, puts in place of the stage of
//!   that name); the `rootfs` and runtime stages are built from the Containerfile as shipped.
//! - **Each architecture**: the image for another one ([`Platform::Arm64`] on an x86_64 machine)
//!   is the same build with `--platform`, from a binary cross-built for it: `rootfs` runs on this
//!   machine's platform and the runtime stage has no RUN, so nothing of that architecture runs.
//!   podman before 5 does not set BUILDPLATFORM by itself: it is given.
//! - **The runtime**: runc (crun refuses the hybrid cgroup layout of the development machines;
//!   runc refuses `--cgroups=disabled`, so each container gets a `--cgroup-parent` below the
//!   sandbox's cgroup, and `--cgroups=no-conmon` keeps conmon out of it), no default ulimits
//!   (root there may lack CAP_SYS_RESOURCE), and never a network of podman's: the agent shares
//!   the sandbox's node namespace, the init container has none. The storage, the configuration,
//!   the runtime state and podman's temporary directory are the tests' own: nothing is written
//!   to the machine's podman configuration, storage or /run/libpod.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::command::output_within;

/// The image the Containerfile's `rootfs` stage runs mmdebstrap in.
pub const BASE_IMAGE: &str = "docker.io/library/debian:12-slim";
/// What the tests tag the image for this machine's architecture.
pub const IMAGE: &str = "localhost/redirector:test";

/// An architecture the image is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Platform {
    /// linux/amd64 (x86_64).
    Amd64,
    /// linux/arm64 (aarch64).
    Arm64,
}

impl Platform {
    /// This machine's.
    #[must_use]
    pub const fn host() -> Self {
        if cfg!(target_arch = "aarch64") {
            Self::Arm64
        } else {
            Self::Amd64
        }
    }

    /// Debian's and the OCI platform's name of the architecture.
    #[must_use]
    pub const fn debian(self) -> &'static str {
        match self {
            Self::Amd64 => "amd64",
            Self::Arm64 => "arm64",
        }
    }

    /// The OCI platform (`podman build --platform`).
    #[must_use]
    pub fn oci(self) -> String {
        format!("linux/{}", self.debian())
    }

    /// What the tests tag its image: [`IMAGE`] for this machine's, `IMAGE-ARCH` for another.
    #[must_use]
    pub fn image(self) -> &'static str {
        if self == Self::host() {
            return IMAGE;
        }
        match self {
            Self::Amd64 => "localhost/redirector:test-amd64",
            Self::Arm64 => "localhost/redirector:test-arm64",
        }
    }
}

/// podman with the tests' own storage and configuration.
#[derive(Clone, Debug)]
pub struct Podman {
    root: PathBuf,
    conf: PathBuf,
}

/// Where podman keeps its state of the running containers for the storage at `root`: on a
/// tmpfs, as podman expects, one per storage (two storages must not share their runtime state),
/// and short (podman refuses a runroot longer than 50 characters), so named by an FNV-1a hash of
/// the storage's path. Written beside the storage as `runroot`, where `cargo xtask sweep` reads
/// it.
#[must_use]
pub fn run_root(root: &Path) -> PathBuf {
    use std::os::unix::ffi::OsStrExt as _;
    let hash = root
        .as_os_str()
        .as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
        });
    PathBuf::from(format!("/run/rdt-podman-{hash:016x}"))
}

impl Podman {
    /// podman storing images under `dir` (kept between runs: the base image is made once).
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let conf = dir.join("containers.conf");
        let root = dir.join("storage");
        std::fs::write(
            &conf,
            format!(
                "[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = \"runc\"\n\
                 cgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\ntmp_dir = {:?}\n",
                run_root(&root).join("libpod").display().to_string()
            ),
        )
        .with_context(|| format!("writing {}", conf.display()))?;
        let runroot = dir.join("runroot");
        std::fs::write(&runroot, run_root(&root).as_os_str().as_encoded_bytes())
            .with_context(|| format!("writing {}", runroot.display()))?;
        Ok(Self { root, conf })
    }

    /// `podman` with the storage flags; the caller adds the command.
    #[must_use]
    pub fn command(&self) -> Command {
        let mut command = Command::new("podman");
        command
            .env("CONTAINERS_CONF", &self.conf)
            .arg("--root")
            .arg(&self.root)
            .arg("--runroot")
            .arg(run_root(&self.root))
            .args(["--storage-driver", "overlay"]);
        command
    }

    /// Runs `podman ARGS` to its end within `limit`; its standard output, or an error quoting
    /// what it printed.
    pub fn run(&self, args: &[&str], limit: Duration) -> anyhow::Result<String> {
        let mut command = self.command();
        command.args(args);
        let output = output_within(&mut command, limit)?;
        if !output.status.success() {
            // Its error first, then the end of a build's step log: a CI log's excerpt keeps the
            // start and the end of a long message.
            let stdout = String::from_utf8_lossy(&output.stdout);
            let lines: Vec<&str> = stdout.lines().collect();
            bail!(
                "podman {} failed ({}): {}\nthe last lines it printed:\n{}",
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim_end(),
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// True when the storage holds [`BASE_IMAGE`] made by this [`BASE_RECIPE`].
    fn has_current_base(&self) -> anyhow::Result<bool> {
        let mut command = self.command();
        command.args([
            "image",
            "inspect",
            "--format",
            &format!("{{{{index .Labels \"{BASE_RECIPE_LABEL}\"}}}}"),
            BASE_IMAGE,
        ]);
        let output = output_within(&mut command, Duration::from_secs(30))?;
        Ok(output.status.success()
            && String::from_utf8_lossy(&output.stdout).trim() == BASE_RECIPE.to_string())
    }
}

/// The image, built once per test binary.
#[derive(Debug)]
pub struct Image {
    /// Its name.
    pub name: &'static str,
    /// Its size as podman reports it, bytes.
    pub size: u64,
}

/// The images built in this process, by platform, with their sizes.
static BUILT: Mutex<Vec<(Platform, u64)>> = Mutex::new(Vec::new());

/// Builds [`IMAGE`], this machine's image, from `workspace`'s Containerfile with `binary` as the
/// build stage's output. See [`build_image_for`].
pub fn build_image(podman: &Podman, workspace: &Path, binary: &Path) -> anyhow::Result<Image> {
    build_image_for(podman, workspace, Platform::host(), binary)
}

/// Builds `platform`'s image ([`Platform::image`]) from `workspace`'s Containerfile with `binary`
/// (built for that platform) as the build stage's output, making the base image first if the
/// storage lacks it. One build at a time; later calls in the same process return the first build
/// of each platform.
pub fn build_image_for(
    podman: &Podman,
    workspace: &Path,
    platform: Platform,
    binary: &Path,
) -> anyhow::Result<Image> {
    let name = platform.image();
    let mut built = BUILT
        .lock()
        .map_err(|_| anyhow::anyhow!("an image build panicked"))?;
    if let Some((_, size)) = built.iter().find(|(done, _)| *done == platform) {
        return Ok(Image { name, size: *size });
    }
    if !podman.has_current_base()? {
        make_base_image(podman)?;
    }
    let context = podman
        .root
        .with_file_name(format!("build-context-{}", platform.debian()));
    let out = context.join("out");
    let _ = std::fs::remove_dir_all(&context);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let in_image = out.join("redirector");
    if platform == Platform::host() {
        // A debug build: its debug info is most of it.
        crate::command::run(
            "objcopy",
            [
                "--strip-debug".to_owned(),
                binary.display().to_string(),
                in_image.display().to_string(),
            ],
        )
        .context("stripping the redirector binary for the image")?;
    } else {
        // binutils' objcopy reads this machine's ELF only; a cross-built agent is a release
        // build, which goes in as the Containerfile's build stage installs it.
        std::fs::copy(binary, &in_image)
            .with_context(|| format!("copying {} into the build context", binary.display()))?;
    }
    for (from, to) in [
        ("deploy/seccomp/redirector.json", "seccomp.json"),
        ("deploy/container/prepare-node.sh", "prepare-node"),
    ] {
        std::fs::copy(workspace.join(from), out.join(to))
            .with_context(|| format!("copying {from} into the build context"))?;
    }
    // The main context: only what the `rootfs` stage copies from it.
    let main = context.join("main");
    let script = "deploy/container/rootfs.sh";
    std::fs::create_dir_all(main.join("deploy/container"))
        .with_context(|| format!("creating {}", main.display()))?;
    std::fs::copy(workspace.join(script), main.join(script))
        .with_context(|| format!("copying {script} into the build context"))?;
    let containerfile = workspace.join("Containerfile");
    podman.run(
        &[
            "build",
            "--platform",
            &platform.oci(),
            &format!("--build-arg=BUILDPLATFORM={}", Platform::host().oci()),
            // apt-get and mmdebstrap in the `rootfs` stage reach Debian's mirror from the
            // host's namespace: no bridge, no firewall rules of podman's.
            "--network",
            "host",
            "--build-context",
            &format!("build={}", context.display()),
            "--file",
            &containerfile.display().to_string(),
            "--tag",
            name,
            &main.display().to_string(),
        ],
        Duration::from_secs(900),
    )?;
    let size = podman
        .run(
            &["image", "inspect", "--format", "{{.Size}}", name],
            Duration::from_secs(30),
        )?
        .trim()
        .parse()
        .context("podman's image size")?;
    built.push((platform, size));
    Ok(Image { name, size })
}

/// An image's root filesystem, mounted read-only by podman (`podman image mount`) to read its
/// files without running anything of it; unmounted when dropped.
#[derive(Debug)]
pub struct MountedImage {
    podman: Podman,
    image: String,
    /// Where its root is.
    pub root: PathBuf,
}

impl MountedImage {
    /// Mounts `image`.
    pub fn new(podman: &Podman, image: &str) -> anyhow::Result<Self> {
        let root = podman.run(&["image", "mount", image], Duration::from_secs(60))?;
        Ok(Self {
            podman: podman.clone(),
            image: image.to_owned(),
            root: PathBuf::from(root.trim()),
        })
    }

    /// Where `path` (absolute in the image) is on this machine, its symbolic links followed
    /// inside the image: an absolute link target is the image's, not this machine's.
    pub fn resolve(&self, path: &str) -> anyhow::Result<PathBuf> {
        let mut resolved = PathBuf::new();
        let mut pending: Vec<String> = path
            .split('/')
            .filter(|part| !part.is_empty())
            .rev()
            .map(str::to_owned)
            .collect();
        let mut links = 0;
        while let Some(part) = pending.pop() {
            match part.as_str() {
                "." => continue,
                ".." => {
                    resolved.pop();
                    continue;
                }
                _ => {}
            }
            let candidate = resolved.join(&part);
            let on_host = self.root.join(&candidate);
            match std::fs::symlink_metadata(&on_host) {
                Ok(meta) if meta.file_type().is_symlink() => {
                    links += 1;
                    anyhow::ensure!(links < 40, "{path}: too many symbolic links in the image");
                    let target = std::fs::read_link(&on_host)?;
                    let target = target.to_string_lossy();
                    if target.starts_with('/') {
                        resolved = PathBuf::new();
                    }
                    pending.extend(
                        target
                            .split('/')
                            .filter(|part| !part.is_empty())
                            .rev()
                            .map(str::to_owned),
                    );
                }
                Ok(_) => resolved = candidate,
                Err(error) => {
                    return Err(error).with_context(|| format!("{path} in {}", self.image));
                }
            }
        }
        Ok(self.root.join(resolved))
    }
}

impl Drop for MountedImage {
    fn drop(&mut self) {
        let _ = self
            .podman
            .run(&["image", "unmount", &self.image], Duration::from_secs(60));
    }
}

/// The label of the base image that names the recipe it was made by.
const BASE_RECIPE_LABEL: &str = "redirector.test.base-recipe";
/// Raise it when [`make_base_image`] changes, so that stored base images are made again.
const BASE_RECIPE: u32 = 2;

/// apt's configuration in Debian's official images: no package caches left in a layer.
const APT_NO_CACHES: &str = r#"DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
"#;

/// An mmdebstrap of Debian 12 (minbase, apt set up as in the official slim images) imported as
/// [`BASE_IMAGE`].
fn make_base_image(podman: &Podman) -> anyhow::Result<()> {
    let tarball = podman.root.with_file_name("debian-12-minbase.tar");
    let apt_conf = podman.root.with_file_name("docker-clean");
    std::fs::write(&apt_conf, APT_NO_CACHES)
        .with_context(|| format!("writing {}", apt_conf.display()))?;
    let mut mmdebstrap = Command::new("mmdebstrap");
    mmdebstrap
        .args([
            "--variant=minbase",
            "--mode=root",
            "--format=tar",
            // As the slim images: no documentation, manual pages or translations.
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/* \"$1\"/var/cache/apt/*.bin \
             \"$1\"/var/cache/apt/archives/*.deb",
        ])
        .arg(format!(
            "--customize-hook=copy-in {} /etc/apt/apt.conf.d",
            apt_conf.display()
        ))
        .arg("bookworm")
        .arg(&tarball)
        .arg("http://deb.debian.org/debian");
    let output = output_within(&mut mmdebstrap, Duration::from_secs(600))?;
    if !output.status.success() {
        bail!(
            "mmdebstrap of Debian 12 failed ({}); it needs Debian's mirror: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    podman.run(
        &[
            "import",
            &format!("--change=LABEL {BASE_RECIPE_LABEL}={BASE_RECIPE}"),
            &tarball.display().to_string(),
            BASE_IMAGE,
        ],
        Duration::from_secs(120),
    )?;
    let _ = std::fs::remove_file(&tarball);
    Ok(())
}

/// A container the test named; removed (killed first) when dropped.
#[derive(Debug)]
pub struct Named {
    podman: Podman,
    /// Its name.
    pub name: String,
}

impl Named {
    /// Takes care of the container `name`, removing one of that name left by an earlier run.
    #[must_use]
    pub fn new(podman: &Podman, name: &str) -> Self {
        let named = Self {
            podman: podman.clone(),
            name: name.to_owned(),
        };
        named.remove();
        named
    }

    /// Kills and removes the container (nothing when there is none).
    pub fn remove(&self) {
        let _ = self.podman.run(
            &["rm", "--force", "--time", "0", &self.name],
            Duration::from_secs(30),
        );
    }
}

impl Drop for Named {
    fn drop(&mut self) {
        self.remove();
    }
}
