//! Debian's cloud kernels for the VMs: the newest package of a series and architecture,
//! fetched with `apt-get download` (the host's apt for its own architecture, an apt of its own
//! for another: `foreign.rs`), unpacked with `dpkg-deb -x` and indexed with `depmod -b`, once.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use super::foreign::ForeignApt;
use crate::arch::Arch;

/// A Debian 12 kernel series the VM matrix covers, oldest first (the order of the variants).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Series {
    /// Debian 12's own kernel (`linux-image-6.1.0-N-cloud-amd64`).
    V6_1,
    /// The backported 6.12 of Debian 12 (`linux-image-6.12.N+debM-cloud-amd64`).
    V6_12,
}

impl Series {
    /// Every series, oldest first.
    pub const ALL: [Self; 2] = [Self::V6_1, Self::V6_12];

    /// The name used on the command line and in reports.
    pub fn label(self) -> &'static str {
        match self {
            Self::V6_1 => "6.1",
            Self::V6_12 => "6.12",
        }
    }

    /// True when `release` (a package name without `linux-image-`, or a `lib/modules` directory
    /// name) is a cloud kernel of this series for `arch`: `6.1.0-57-cloud-amd64`,
    /// `6.12.117+deb12-cloud-arm64`. Meta-packages (`6.12-cloud-amd64`) are not.
    fn has_release(self, release: &str, arch: Arch) -> bool {
        let Some(version) = release.strip_suffix(&format!("-cloud-{}", arch.debian())) else {
            return false;
        };
        match self {
            Self::V6_1 => version
                .strip_prefix("6.1.0-")
                .is_some_and(|abi| !abi.is_empty() && abi.bytes().all(|b| b.is_ascii_digit())),
            Self::V6_12 => version.strip_prefix("6.12.").is_some_and(|rest| {
                rest.split_once("+deb").is_some_and(|(patch, debian)| {
                    !patch.is_empty()
                        && patch.bytes().all(|b| b.is_ascii_digit())
                        && debian.bytes().all(|b| b.is_ascii_digit())
                })
            }),
        }
    }
}

/// The numbers of a release in order, for comparing releases of one series.
fn version_key(release: &str) -> Vec<u64> {
    release
        .split(|c: char| !c.is_ascii_digit())
        .filter(|run| !run.is_empty())
        .filter_map(|run| run.parse().ok())
        .collect()
}

/// The newest release of `series` for `arch` among `releases`.
fn newest<'a>(
    series: Series,
    arch: Arch,
    releases: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    releases
        .into_iter()
        .filter(|release| series.has_release(release, arch))
        .max_by_key(|release| version_key(release))
}

/// A kernel unpacked in the cache, ready to boot.
#[derive(Clone, Debug)]
pub struct Kernel {
    /// Its series.
    pub series: Series,
    /// Its architecture.
    pub arch: Arch,
    /// `uname -r` in the guest, and the `lib/modules` directory name.
    pub release: String,
    /// The kernel image.
    pub vmlinuz: PathBuf,
    /// `lib/modules/RELEASE` of the unpacked package, with `modules.dep` built by depmod.
    pub modules: PathBuf,
}

impl Kernel {
    /// The kernel of `release` in `dir`, when it was completely unpacked there.
    fn cached(series: Series, arch: Arch, release: &str, dir: &Path) -> Option<Self> {
        if !dir.join(READY).exists() {
            return None;
        }
        let vmlinuz = dir.join("boot").join(format!("vmlinuz-{release}"));
        let modules = modules_dir(dir, release)?;
        vmlinuz.exists().then(|| Self {
            series,
            arch,
            release: release.to_owned(),
            vmlinuz,
            modules,
        })
    }
}

/// Written last into an unpacked kernel's directory: without it the directory is incomplete.
const READY: &str = ".xtask-ready";

fn modules_dir(tree: &Path, release: &str) -> Option<PathBuf> {
    ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|base| tree.join(base).join(release))
        .find(|dir| dir.is_dir())
}

/// Every `linux-image-6.*` package name apt knows (one query for every series: apt-cache loads
/// its whole cache each time, which costs most of a second): the host's apt, or `foreign`'s.
pub fn available_releases(foreign: Option<&ForeignApt>) -> anyhow::Result<Vec<String>> {
    if let Some(apt) = foreign {
        apt.update()?;
        return Ok(apt
            .package_names("linux-image-6.")?
            .iter()
            .filter_map(|name| name.strip_prefix("linux-image-"))
            .map(str::to_owned)
            .collect());
    }
    let output = Command::new("apt-cache")
        .args(["pkgnames", "linux-image-6."])
        .output()
        .context("running apt-cache (the VM kernels come from Debian's archive)")?;
    if !output.status.success() {
        bail!(
            "`apt-cache pkgnames linux-image-6.` failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|name| name.trim().strip_prefix("linux-image-"))
        .map(str::to_owned)
        .collect())
}

/// The newest kernel of `series` that apt offers (`available`, from [`available_releases`]),
/// unpacked in `cache`: taken from the cache when it is there (no download, well under a
/// second), else fetched. Without apt's answer, the newest cached kernel of the series is used.
pub fn ensure(
    series: Series,
    arch: Arch,
    available: Option<&[String]>,
    cache: &Path,
    foreign: Option<&ForeignApt>,
) -> anyhow::Result<Kernel> {
    std::fs::create_dir_all(cache).with_context(|| format!("creating {}", cache.display()))?;
    let cached_releases: Vec<String> = std::fs::read_dir(cache)
        .with_context(|| format!("listing {}", cache.display()))?
        .filter_map(Result::ok)
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| series.has_release(name, arch))
        .collect();
    let wanted = match available
        .and_then(|names| newest(series, arch, names.iter().map(String::as_str)))
    {
        Some(release) => release.to_owned(),
        None => {
            let Some(release) = newest(series, arch, cached_releases.iter().map(String::as_str))
            else {
                bail!(
                    "apt knows no linux-image-{}*-cloud-{} package and none is cached in {}: \
                     run `apt-get update` (the package comes from Debian 12's archive, \
                     bookworm or bookworm-security)",
                    series.label(),
                    arch.debian(),
                    cache.display()
                );
            };
            eprintln!(
                "xtask: apt did not list {} kernels; using the cached {release}",
                series.label()
            );
            release.to_owned()
        }
    };
    let dir = cache.join(&wanted);
    if let Some(kernel) = Kernel::cached(series, arch, &wanted, &dir) {
        return Ok(kernel);
    }
    fetch(series, &wanted, cache, foreign)?;
    // Older releases of the series are never booted again: free their space.
    for old in cached_releases.iter().filter(|release| **release != wanted) {
        let _ = std::fs::remove_dir_all(cache.join(old));
    }
    Kernel::cached(series, arch, &wanted, &dir).with_context(|| {
        format!(
            "{} is incomplete after unpacking; remove it and run again",
            dir.display()
        )
    })
}

/// Downloads `linux-image-RELEASE`, unpacks it and builds its module index, in a scratch
/// directory renamed into place at the end (a run killed halfway leaves no half kernel).
fn fetch(
    series: Series,
    release: &str,
    cache: &Path,
    foreign: Option<&ForeignApt>,
) -> anyhow::Result<()> {
    let package = format!("linux-image-{release}");
    eprintln!(
        "xtask: fetching {package} for the {} VM (apt-get download)",
        series.label()
    );
    let scratch = cache.join(format!(".fetch-{}", std::process::id()));
    if scratch.exists() {
        std::fs::remove_dir_all(&scratch)
            .with_context(|| format!("removing {}", scratch.display()))?;
    }
    std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
    let result = (|| {
        if let Some(apt) = foreign {
            apt.download(&package, &scratch)?;
        } else {
            download_with_host_apt(&package, &scratch)?;
        }
        let deb = std::fs::read_dir(&scratch)
            .with_context(|| format!("listing {}", scratch.display()))?
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .find(|path| path.extension().is_some_and(|ext| ext == "deb"))
            .with_context(|| format!("apt-get download left no .deb in {}", scratch.display()))?;
        let tree = scratch.join("tree");
        let unpack = Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(&tree)
            .status()
            .context("running dpkg-deb")?;
        if !unpack.success() {
            bail!("`dpkg-deb -x {}` failed ({unpack})", deb.display());
        }
        if modules_dir(&tree, release).is_none() {
            bail!("{package} has no lib/modules/{release}");
        }
        // The package ships modules without their index (the postinst builds it on a real
        // install); the guest's modprobe needs modules.dep and modules.alias.
        let depmod = Command::new("depmod")
            .arg("-b")
            .arg(&tree)
            .arg(release)
            .status()
            .context("running depmod (package kmod; `cargo xtask setup` installs it)")?;
        if !depmod.success() {
            bail!("`depmod -b {} {release}` failed ({depmod})", tree.display());
        }
        std::fs::write(tree.join(READY), package.as_bytes()).context("marking the kernel ready")?;
        let dir = cache.join(release);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        std::fs::rename(&tree, &dir)
            .with_context(|| format!("moving the kernel into {}", dir.display()))?;
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

/// `apt-get download package` in `dir` with the host's apt.
fn download_with_host_apt(package: &str, dir: &Path) -> anyhow::Result<()> {
    let download = Command::new("apt-get")
        // apt drops to the _apt user for downloads, who cannot write here; it would fall
        // back to root with a warning anyway.
        .args(["-o", "APT::Sandbox::User=root", "download", package])
        .current_dir(dir)
        .status()
        .context("running apt-get download")?;
    if !download.success() {
        bail!(
            "`apt-get download {package}` failed ({download}); run `apt-get update` and try again"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_newest_cloud_kernel_of_each_series() {
        let names = [
            "6.1.0-9-cloud-amd64",
            "6.1.0-57-cloud-amd64",
            "6.1.0-57-cloud-amd64-dbg",
            "6.1.0-58-amd64",
            "6.1.0-57-cloud-amd64-unsigned",
            "6.12-cloud-amd64",
            "6.12.9+deb12-cloud-amd64",
            "6.12.117+deb12-cloud-amd64",
            "6.12.117+deb12-rt-amd64",
            "6.12.100+deb12-cloud-amd64",
        ];
        let x86 = Arch::X86_64;
        assert_eq!(
            newest(Series::V6_1, x86, names),
            Some("6.1.0-57-cloud-amd64")
        );
        assert_eq!(
            newest(Series::V6_12, x86, names),
            Some("6.12.117+deb12-cloud-amd64")
        );
        assert_eq!(newest(Series::V6_12, x86, ["6.1.0-57-cloud-amd64"]), None);
        let arm = [
            "6.1.0-57-cloud-arm64",
            "6.1.0-58-cloud-amd64",
            "6.12.117+deb12-cloud-arm64",
        ];
        assert_eq!(
            newest(Series::V6_1, Arch::Aarch64, arm),
            Some("6.1.0-57-cloud-arm64")
        );
        assert_eq!(
            newest(Series::V6_12, Arch::Aarch64, arm),
            Some("6.12.117+deb12-cloud-arm64")
        );
        assert_eq!(newest(Series::V6_1, x86, ["6.1.0-57-cloud-arm64"]), None);
    }
}
