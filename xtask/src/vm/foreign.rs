//! Debian 12's packages of another architecture than the host's (the arm64 kernels, and the
//! busybox of their guests' initramfs), fetched without touching the host's dpkg or apt: apt
//! runs against a package universe of its own under the VM cache (its sources, lists, status
//! and archive cache), with that architecture as its native one.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, bail};

use crate::arch::Arch;

/// Debian 12's suites the host's apt uses too: the kernels' security updates come from
/// bookworm-security.
const SOURCES: &str = "Types: deb\n\
URIs: http://deb.debian.org/debian\n\
Suites: bookworm bookworm-updates\n\
Components: main\n\
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\
\n\
Types: deb\n\
URIs: http://deb.debian.org/debian-security\n\
Suites: bookworm-security\n\
Components: main\n\
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n";

/// Package lists older than this are fetched again.
const LISTS_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// apt for `arch`, in `dir`.
#[derive(Clone, Debug)]
pub struct ForeignApt {
    arch: Arch,
    dir: PathBuf,
}

impl ForeignApt {
    /// The universe of `arch` under `cache` (created on first use).
    pub fn new(arch: Arch, cache: &Path) -> anyhow::Result<Self> {
        let dir = cache.join(format!("apt-{}", arch.debian()));
        for sub in [
            "etc/sources.list.d",
            "etc/preferences.d",
            "lists/partial",
            "cache",
        ] {
            let path = dir.join(sub);
            std::fs::create_dir_all(&path)
                .with_context(|| format!("creating {}", path.display()))?;
        }
        std::fs::write(dir.join("etc/sources.list.d/debian.sources"), SOURCES)
            .context("writing the foreign apt's sources")?;
        let status = dir.join("status");
        if !status.exists() {
            std::fs::write(&status, "").context("writing the foreign apt's dpkg status")?;
        }
        Ok(Self {
            arch,
            dir: dir
                .canonicalize()
                .context("finding the foreign apt's directory")?,
        })
    }

    /// `program` (apt-get, apt-cache) with this universe's options.
    fn command(&self, program: &str) -> Command {
        let dir = &self.dir;
        let mut command = Command::new(program);
        for option in [
            format!("APT::Architecture={}", self.arch.debian()),
            format!("APT::Architectures={}", self.arch.debian()),
            format!(
                "Dir::Etc::SourceList={}",
                dir.join("etc/none.list").display()
            ),
            format!(
                "Dir::Etc::SourceParts={}",
                dir.join("etc/sources.list.d").display()
            ),
            format!(
                "Dir::Etc::Preferences={}",
                dir.join("etc/none.pref").display()
            ),
            format!(
                "Dir::Etc::PreferencesParts={}",
                dir.join("etc/preferences.d").display()
            ),
            format!("Dir::State::Lists={}", dir.join("lists").display()),
            format!("Dir::State::status={}", dir.join("status").display()),
            format!("Dir::Cache={}", dir.join("cache").display()),
            // Not the host's lock: this universe is the run's own.
            "Debug::NoLocking=1".to_owned(),
            // apt drops to the _apt user for downloads, who cannot write here.
            "APT::Sandbox::User=root".to_owned(),
        ] {
            command.args(["-o", &option]);
        }
        command
    }

    /// Fetches the package lists unless fetched within the last day.
    pub fn update(&self) -> anyhow::Result<()> {
        let fresh = std::fs::metadata(self.dir.join("lists/updated"))
            .and_then(|meta| meta.modified())
            .ok()
            .and_then(|modified| SystemTime::now().duration_since(modified).ok())
            .is_some_and(|age| age < LISTS_MAX_AGE);
        if fresh {
            return Ok(());
        }
        eprintln!(
            "xtask: fetching Debian 12's {} package lists (apt of its own, under {})",
            self.arch.debian(),
            self.dir.display()
        );
        let status = self
            .command("apt-get")
            .args(["-q", "update"])
            .status()
            .context("running apt-get update for the foreign architecture")?;
        if !status.success() {
            bail!(
                "`apt-get update` of the {} package lists failed ({status}); it needs Debian's \
                 mirror (deb.debian.org)",
                self.arch.debian()
            );
        }
        std::fs::write(self.dir.join("lists/updated"), b"").context("marking the lists fresh")
    }

    /// Every package name starting with `prefix`.
    pub fn package_names(&self, prefix: &str) -> anyhow::Result<Vec<String>> {
        let output = self
            .command("apt-cache")
            .args(["pkgnames", prefix])
            .output()
            .context("running apt-cache for the foreign architecture")?;
        if !output.status.success() {
            bail!(
                "`apt-cache pkgnames {prefix}` ({}) failed: {}",
                self.arch.debian(),
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|name| name.trim().to_owned())
            .collect())
    }

    /// Downloads `package` into `dir`.
    pub fn download(&self, package: &str, dir: &Path) -> anyhow::Result<()> {
        let status = self
            .command("apt-get")
            .args(["-q", "download", package])
            .current_dir(dir)
            .status()
            .context("running apt-get download for the foreign architecture")?;
        if !status.success() {
            bail!(
                "`apt-get download {package}` ({}) failed ({status}); it needs Debian's mirror",
                self.arch.debian()
            );
        }
        Ok(())
    }
}
