//! The shipped image, built from the Containerfile and run the way the DaemonSet runs it, with
//! Debian's podman (runc) on storage of the tests' own.
//!
//! - **The base image**: no registry is reachable, so `debian:12-slim` is an mmdebstrap of
//!   Debian 12 (minbase, no documentation), imported under that name, once per storage.
//! - **The build stage**: replaced by this build's binary through a named build context
//!   (`--build-context build=DIR`, which podman, like BuildKit, puts in place of the stage of
//!   that name); the runtime stage is built from the Containerfile as shipped.
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

/// The image the Containerfile's runtime stage starts from.
pub const BASE_IMAGE: &str = "docker.io/library/debian:12-slim";
/// What the tests tag the built image.
pub const IMAGE: &str = "localhost/redirector:test";

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
            bail!(
                "podman {} failed ({}): {}{}",
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
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

static BUILT: Mutex<Option<u64>> = Mutex::new(None);

/// Builds [`IMAGE`] from `workspace`'s Containerfile with `binary` as the build stage's output,
/// making the base image first if the storage lacks it. Later calls in the same process return
/// the first build.
pub fn build_image(podman: &Podman, workspace: &Path, binary: &Path) -> anyhow::Result<Image> {
    let mut built = BUILT
        .lock()
        .map_err(|_| anyhow::anyhow!("an image build panicked"))?;
    if let Some(size) = *built {
        return Ok(Image { name: IMAGE, size });
    }
    if !podman.has_current_base()? {
        make_base_image(podman)?;
    }
    let context = podman.root.with_file_name("build-context");
    let out = context.join("out");
    let _ = std::fs::remove_dir_all(&context);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let stripped = out.join("redirector");
    crate::command::run(
        "objcopy",
        [
            "--strip-debug".to_owned(),
            binary.display().to_string(),
            stripped.display().to_string(),
        ],
    )
    .context("stripping the redirector binary for the image")?;
    for (from, to) in [
        ("deploy/seccomp/redirector.json", "seccomp.json"),
        ("deploy/container/prepare-node.sh", "prepare-node"),
    ] {
        std::fs::copy(workspace.join(from), out.join(to))
            .with_context(|| format!("copying {from} into the build context"))?;
    }
    // The runtime stage copies nothing from the main context: give it an empty one.
    let empty = context.join("empty");
    std::fs::create_dir_all(&empty).with_context(|| format!("creating {}", empty.display()))?;
    let containerfile = workspace.join("Containerfile");
    podman.run(
        &[
            "build",
            // apt-get in the runtime stage reaches Debian's mirror from the host's namespace:
            // no bridge, no firewall rules of podman's.
            "--network",
            "host",
            "--build-context",
            &format!("build={}", context.display()),
            "--file",
            &containerfile.display().to_string(),
            "--tag",
            IMAGE,
            &empty.display().to_string(),
        ],
        Duration::from_secs(600),
    )?;
    let size = podman
        .run(
            &["image", "inspect", "--format", "{{.Size}}", IMAGE],
            Duration::from_secs(30),
        )?
        .trim()
        .parse()
        .context("podman's image size")?;
    *built = Some(size);
    Ok(Image { name: IMAGE, size })
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
