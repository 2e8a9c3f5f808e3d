//! The root file system of a guest of another architecture than the host's: the host's own
//! tools cannot run there, so the guest gets Debian 12's, made by mmdebstrap's `extract` variant
//! (packages unpacked, no maintainer script run, nothing of the target architecture executed:
//! no emulation, no binfmt handler), once, and kept under the VM cache while its recipe stays.

use std::{path::Path, path::PathBuf, process::Command};

use anyhow::{Context as _, bail};

use crate::arch::Arch;

/// The packages: what stage 2 and the tests run (bash, coreutils' `timeout` and `stty`, `ip`,
/// `nft`, `bpftool`, `dig`, `dnsmasq`, python3, modprobe), and what `extract` does not pull in
/// by itself (the Essential set: grep, sed, findutils, mount). Not pycares (the resolver tests
/// stay on the host) nor systemd (the systemd boot runs on the host's architecture).
const PACKAGES: &[&str] = &[
    "base-files",
    "base-passwd",
    "libc-bin",
    "bash",
    "dash",
    "coreutils",
    "mount",
    "util-linux",
    "netbase",
    "grep",
    "sed",
    "findutils",
    "gzip",
    "procps",
    "kmod",
    "busybox-static",
    "iproute2",
    "nftables",
    "bpftool",
    "dnsutils",
    "dnsmasq-base",
    "python3",
    // The rest of the whole suite (`--whole-suite`): another cache, the coexistence tests' rules
    // and their conntrack table.
    "unbound",
    "iptables",
    "conntrack",
];

/// The users and groups the caches' packages' maintainer scripts would add (which `extract`
/// does not run), so that the tests run dnsmasq and unbound as their packages do, dropping to
/// their own users: `passwd` lines, then `group` lines.
const CACHE_USERS: &str = "dnsmasq:x:999:65534:dnsmasq:/var/lib/misc:/usr/sbin/nologin\n\
                           unbound:x:102:105::/var/lib/unbound:/usr/sbin/nologin\n";
const CACHE_GROUPS: &str = "unbound:x:105:\n";

/// Written last, with the recipe: a tree without it, or with another recipe, is made again.
const READY: &str = ".xtask-rootfs";

/// The recipe a tree was made from.
fn recipe(arch: Arch) -> String {
    format!(
        "bookworm {} extract: {}\nusers: {CACHE_USERS}groups: {CACHE_GROUPS}",
        arch.debian(),
        PACKAGES.join(" ")
    )
}

/// The root file system for `arch` under `cache`, made when missing or made from another
/// recipe (about 260 MiB; 15 s here).
pub fn ensure(arch: Arch, cache: &Path) -> anyhow::Result<PathBuf> {
    let dir = cache.join(format!("rootfs-{}", arch.debian()));
    let wanted = recipe(arch);
    if std::fs::read_to_string(dir.join(READY)).is_ok_and(|made| made == wanted) {
        return Ok(dir);
    }
    eprintln!(
        "xtask: making the {} guest's root file system (mmdebstrap, extract: no emulation)",
        arch.debian()
    );
    let scratch = cache.join(format!(".rootfs-{}-{}", arch.debian(), std::process::id()));
    for old in [&scratch, &dir] {
        if old.exists() {
            std::fs::remove_dir_all(old).with_context(|| format!("removing {}", old.display()))?;
        }
    }
    let output = Command::new("mmdebstrap")
        .args(["--mode=root", "--variant=extract", "--skip=check/qemu"])
        .arg(format!("--arch={}", arch.debian()))
        .arg(format!("--include={}", PACKAGES.join(",")))
        // base-passwd's postinst, which does not run: users and groups for the tools; and the
        // caches' own users.
        .arg(format!(
            "--extract-hook=cp \"$1/usr/share/base-passwd/passwd.master\" \"$1/etc/passwd\" && \
             cp \"$1/usr/share/base-passwd/group.master\" \"$1/etc/group\" && \
             printf '{CACHE_USERS}' >> \"$1/etc/passwd\" && \
             printf '{CACHE_GROUPS}' >> \"$1/etc/group\""
        ))
        .arg("bookworm")
        .arg(&scratch)
        .args([
            "deb http://deb.debian.org/debian bookworm main",
            "deb http://deb.debian.org/debian bookworm-updates main",
            "deb http://deb.debian.org/debian-security bookworm-security main",
        ])
        .output()
        .context("running mmdebstrap (package mmdebstrap; `cargo xtask setup` installs it)")?;
    if !output.status.success() {
        let _ = std::fs::remove_dir_all(&scratch);
        bail!(
            "mmdebstrap of Debian 12 for {} failed ({}); it needs Debian's mirror: {}",
            arch.debian(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    // Mount points stage 2 needs that no package ships.
    for mount_point in ["sys", "proc", "dev", "run", "tmp", "lib/modules"] {
        let path = scratch.join(mount_point);
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
    }
    std::fs::write(scratch.join(READY), wanted).context("marking the root file system made")?;
    std::fs::rename(&scratch, &dir)
        .with_context(|| format!("moving the root file system to {}", dir.display()))?;
    Ok(dir)
}
