//! Installs what building and testing need, when it is missing; takes well under a second when
//! everything is there.

use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, bail};

/// Debian packages the build and the tests use, with the command that shows each is there.
const DEBIAN_PACKAGES: &[&str] = &[
    // bpf-linker links against LLVM 22.
    "llvm-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    // Tests: program inspection, namespaces and links, DNS clients and servers.
    "bpftool",
    "iproute2",
    "dnsutils",
    "dnsmasq-base",
    "unbound",
    "nftables",
    // Coexistence tests: rules of iptables-nft and iptables-legacy beside the agent's table.
    "iptables",
    "conntrack",
    "dnsperf",
    // `cargo xtask vm-test`: qemu (with QEMU 7.2's virtiofsd), busybox for the guest's
    // initramfs, depmod for the kernels' module index and modprobe in the guest.
    "qemu-system-x86",
    "busybox-static",
    "kmod",
];

/// Where Debian's LLVM 22 lives.
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

/// Makes sure every build and test dependency is present.
pub fn ensure() -> anyhow::Result<()> {
    ensure_debian_packages()?;
    ensure_nightly_rust_src()?;
    ensure_bpf_linker()?;
    Ok(())
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn missing_debian_packages() -> anyhow::Result<Vec<&'static str>> {
    let output = Command::new("dpkg-query")
        .args(["-W", "-f=${Package} ${db:Status-Status}\n"])
        .args(DEBIAN_PACKAGES)
        .output()
        .context("running dpkg-query (this task expects a Debian machine)")?;
    let installed = String::from_utf8_lossy(&output.stdout);
    Ok(DEBIAN_PACKAGES
        .iter()
        .copied()
        .filter(|package| {
            !installed
                .lines()
                .any(|line| line == format!("{package} installed"))
        })
        .collect())
}

fn ensure_debian_packages() -> anyhow::Result<()> {
    let missing = missing_debian_packages()?;
    if missing.is_empty() {
        return Ok(());
    }
    let command = format!(
        "apt-get install -y --no-install-recommends {}",
        missing.join(" ")
    );
    if !is_root() {
        bail!(
            "missing Debian packages: {}. Install them with `sudo apt-get update && sudo {command}`, or run this task as root",
            missing.join(", ")
        );
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    // Tests start their own DNS servers inside namespaces: keep the packages' services from
    // starting on the machine (policy-rc.d answers "not allowed" while it exists).
    let policy = PolicyRcGuard::install()?;
    let mut install = Command::new("apt-get");
    install
        .args(["install", "-y", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive");
    if !status_ok(&mut install)? {
        status_ok(
            Command::new("apt-get")
                .arg("update")
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
        if !status_ok(&mut install)? {
            bail!("`{command}` failed; see apt's output above");
        }
    }
    drop(policy);
    let still = missing_debian_packages()?;
    if !still.is_empty() {
        bail!("apt-get did not install: {}", still.join(", "));
    }
    Ok(())
}

fn status_ok(command: &mut Command) -> anyhow::Result<bool> {
    Ok(command
        .status()
        .with_context(|| format!("running {command:?}"))?
        .success())
}

/// `/usr/sbin/policy-rc.d` returning 101 for the duration of an install, unless one exists.
struct PolicyRcGuard(Option<PathBuf>);

impl PolicyRcGuard {
    fn install() -> anyhow::Result<Self> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = PathBuf::from("/usr/sbin/policy-rc.d");
        if path.exists() {
            return Ok(Self(None));
        }
        std::fs::write(&path, "#!/bin/sh\nexit 101\n").context("writing policy-rc.d")?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .context("making policy-rc.d executable")?;
        Ok(Self(Some(path)))
    }
}

impl Drop for PolicyRcGuard {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn ensure_nightly_rust_src() -> anyhow::Result<()> {
    let installed = Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", "nightly"])
        .output()
        .context("running rustup (the eBPF build needs rustup's nightly toolchain)")?;
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|line| line.starts_with("rust-src"))
    {
        return Ok(());
    }
    eprintln!("xtask: adding rust-src to the nightly toolchain");
    let mut add = Command::new("rustup");
    add.args([
        "toolchain",
        "install",
        "nightly",
        "--profile",
        "minimal",
        "--component",
        "rust-src",
    ]);
    if !status_ok(&mut add)? {
        bail!("`rustup toolchain install nightly --component rust-src` failed; run it by hand");
    }
    Ok(())
}

fn cargo_bin_dir() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"))
        .join("bin")
}

fn ensure_bpf_linker() -> anyhow::Result<()> {
    let linker = cargo_bin_dir().join("bpf-linker");
    let works = Command::new(&linker)
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success());
    if works {
        return Ok(());
    }
    eprintln!("xtask: installing bpf-linker (LLVM 22, about a minute)");
    let mut install = Command::new("cargo");
    install
        .args([
            "install",
            "bpf-linker",
            "--no-default-features",
            "--features",
            "llvm-22",
        ])
        .env("LLVM_PREFIX", LLVM_PREFIX)
        .env("LLVM_SYS_221_PREFIX", LLVM_PREFIX)
        // The workspace pins a toolchain; bpf-linker builds with whatever rustup's default is.
        .env_remove("RUSTUP_TOOLCHAIN");
    if !status_ok(&mut install)? {
        bail!(
            "installing bpf-linker failed; run `LLVM_PREFIX={LLVM_PREFIX} LLVM_SYS_221_PREFIX={LLVM_PREFIX} \
             cargo install bpf-linker --no-default-features --features llvm-22` by hand"
        );
    }
    Ok(())
}
