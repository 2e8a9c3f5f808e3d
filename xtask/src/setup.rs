//! Installs what building and testing need, when it is missing; takes well under a second when
//! everything is there.

use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, bail};

use crate::{
    arch::Arch,
    toolchain::{EBPF_TOOLCHAIN_OVERRIDE, LLVM_MAJOR, Pin},
};

/// Debian packages the build and the tests use, besides Debian's LLVM and clang
/// (`debian_packages` adds them).
const DEBIAN_PACKAGES: &[&str] = &[
    // bpf-linker's LLVM needs them to link.
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
    // The resolver tests: Debian's python3 (the VMs share it), pip for pycares from PyPI, and
    // musl-gcc for the static musl client (`bpf-tests/build.rs`).
    "python3",
    "python3-pip",
    "musl-tools",
    // `cargo xtask vm-test`: qemu (with QEMU 7.2's virtiofsd), busybox for the guest's
    // initramfs, depmod for the kernels' module index and modprobe in the guest.
    "qemu-system-x86",
    // The VM runner's arm64 kernels: qemu-system-aarch64.
    "qemu-system-arm",
    "busybox-static",
    "kmod",
    // `systemd-analyze verify` of the shipped unit (redirector/tests/deploy.rs).
    "systemd",
    // promtool: `check rules` and `test rules` of deploy/prometheus (redirector/tests/deploy.rs).
    "prometheus",
    // The image test (bpf-tests/tests/container.rs): podman with runc (crun refuses a hybrid
    // cgroup layout), containers-common's default seccomp profile, mmdebstrap for the base
    // image, objcopy to strip the binary.
    "podman",
    "runc",
    "golang-github-containers-common",
    "mmdebstrap",
    "binutils",
    // The image's root filesystem (deploy/container/rootfs.sh): update-ca-certificates' openssl.
    "ca-certificates",
    // The real API server's test (bpf-tests/src/kube_apiserver.rs): its service account key.
    "openssl",
];

/// Where Debian's LLVM lives.
fn llvm_prefix() -> String {
    format!("/usr/lib/llvm-{LLVM_MAJOR}")
}

/// Makes sure every build and test dependency is present, and that the eBPF toolchain and
/// bpf-linker agree on LLVM.
pub fn ensure() -> anyhow::Result<()> {
    ensure_debian_packages()?;
    ensure_musl_targets()?;
    let ebpf = Pin::ebpf()?;
    ensure_ebpf_toolchain(&ebpf)?;
    let linker = ensure_bpf_linker()?;
    check_llvm_agrees(&ebpf, &linker)?;
    ensure_test_python()
}

/// pycares, the c-ares binding the resolver tests drive (`bpf-tests/src/resolvers.rs`), at this
/// version (c-ares 1.34.9 inside).
const PYCARES: &str = "pycares==5.2.1";

/// Installs pycares for Debian's python3 into `target/test-python` (`pip install --target`: the
/// system's packages stay untouched), unless it imports from there already.
fn ensure_test_python() -> anyhow::Result<()> {
    let python = "/usr/bin/python3";
    let target = crate::workspace::workspace_root().join("target/test-python");
    let imports = Command::new(python)
        .args(["-c", "import pycares"])
        .env("PYTHONPATH", &target)
        .output()
        .is_ok_and(|output| output.status.success());
    if imports {
        return Ok(());
    }
    eprintln!("xtask: installing {PYCARES} into {}", target.display());
    let mut install = Command::new(python);
    install
        .args(["-m", "pip", "install", "--quiet", "--upgrade", "--target"])
        .arg(&target)
        .arg(PYCARES)
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env("PIP_ROOT_USER_ACTION", "ignore");
    if !status_ok(&mut install)? {
        bail!(
            "`{python} -m pip install --target {} {PYCARES}` failed; see pip's output above",
            target.display()
        );
    }
    Ok(())
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Every Debian package setup installs: with the list, Debian's LLVM for bpf-linker, and clang
/// of the same major for the C that `ring` compiles for the musl targets (`Arch::cargo_env`).
fn debian_packages() -> Vec<String> {
    [
        format!("llvm-{LLVM_MAJOR}-dev"),
        format!("clang-{LLVM_MAJOR}"),
    ]
    .into_iter()
    .chain(DEBIAN_PACKAGES.iter().map(|&package| package.to_owned()))
    .collect()
}

fn missing_debian_packages() -> anyhow::Result<Vec<String>> {
    let packages = debian_packages();
    let output = Command::new("dpkg-query")
        .args(["-W", "-f=${Package} ${db:Status-Status}\n"])
        .args(&packages)
        .output()
        .context("running dpkg-query (this task expects a Debian machine)")?;
    let installed = String::from_utf8_lossy(&output.stdout);
    Ok(packages
        .into_iter()
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

/// Adds the static musl target of every architecture (`cargo xtask build --target`, the images,
/// the VMs) to the workspace's stable toolchain, unless rustup has them. The eBPF toolchain is
/// left alone: the object is the same for every architecture.
fn ensure_musl_targets() -> anyhow::Result<()> {
    let pin = Pin::userspace()?;
    let listed = Command::new("rustup")
        .args(["target", "list", "--installed", "--toolchain", &pin.channel])
        .env_remove("RUSTUP_TOOLCHAIN")
        .output()
        .context("running rustup (the build needs rustup, https://rustup.rs)")?;
    let installed = String::from_utf8_lossy(&listed.stdout);
    let missing: Vec<&str> = Arch::ALL
        .iter()
        .map(|arch| arch.musl_target())
        .filter(|target| !installed.lines().any(|line| line.trim() == *target))
        .collect();
    if listed.status.success() && missing.is_empty() {
        return Ok(());
    }
    eprintln!(
        "xtask: adding the Rust targets {} to the toolchain {}",
        missing.join(", "),
        pin.channel
    );
    let mut add = Command::new("rustup");
    add.args(["target", "add", "--toolchain", &pin.channel])
        .args(&missing)
        .env_remove("RUSTUP_TOOLCHAIN");
    if !status_ok(&mut add)? {
        bail!(
            "`rustup target add --toolchain {} {}` failed; see rustup's output above",
            pin.channel,
            missing.join(" ")
        );
    }
    Ok(())
}

/// Installs the eBPF toolchain the pin names, with its components, unless rustup has them. A
/// toolchain named by `REDIRECTOR_EBPF_TOOLCHAIN` is the caller's: it must run, and is not installed.
fn ensure_ebpf_toolchain(pin: &Pin) -> anyhow::Result<()> {
    if pin.overridden {
        let runs = pin
            .run("rustc")
            .arg("--version")
            .output()
            .is_ok_and(|output| output.status.success());
        if !runs {
            bail!(
                "{EBPF_TOOLCHAIN_OVERRIDE} names {}, which rustup cannot run: install it (with \
                 {}), or unset {EBPF_TOOLCHAIN_OVERRIDE} to use the pin in {}",
                pin.channel,
                pin.components.join(", "),
                pin.file.display()
            );
        }
        return Ok(());
    }
    let installed = Command::new("rustup")
        .args([
            "component",
            "list",
            "--installed",
            "--toolchain",
            &pin.channel,
        ])
        .output()
        .context("running rustup (the eBPF build needs rustup, https://rustup.rs)")?;
    let listed = String::from_utf8_lossy(&installed.stdout);
    let missing: Vec<&str> = pin
        .components
        .iter()
        .map(String::as_str)
        .filter(|component| {
            !listed
                .lines()
                .any(|line| line == *component || line.starts_with(&format!("{component}-")))
        })
        .collect();
    if installed.status.success() && missing.is_empty() {
        return Ok(());
    }
    eprintln!(
        "xtask: installing the eBPF toolchain {} with {} (pinned in {})",
        pin.channel,
        pin.components.join(", "),
        pin.source()
    );
    let mut install = Command::new("rustup");
    install
        .args(["toolchain", "install", &pin.channel, "--profile", "minimal"])
        .args(["--no-self-update", "--component", &pin.components.join(",")]);
    if !status_ok(&mut install)? {
        bail!(
            "`rustup toolchain install {} --profile minimal --component {}` failed; see rustup's \
             output above",
            pin.channel,
            pin.components.join(",")
        );
    }
    Ok(())
}

/// The bpf-linker the eBPF build runs (the first on PATH, as cargo and rustc see it).
#[derive(Debug)]
struct Linker {
    path: PathBuf,
    /// The LLVM major it is built against, when it can be told.
    llvm_major: Option<u32>,
}

fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"))
}

/// `program` as PATH resolves it.
fn on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

fn bpf_linker_install_command() -> String {
    let prefix = llvm_prefix();
    format!(
        "LLVM_PREFIX={prefix} LLVM_SYS_{LLVM_MAJOR}1_PREFIX={prefix} cargo install --force \
         bpf-linker --no-default-features --features llvm-{LLVM_MAJOR}"
    )
}

fn ensure_bpf_linker() -> anyhow::Result<Linker> {
    if let Some(path) = on_path("bpf-linker") {
        let runs = Command::new(&path)
            .arg("--version")
            .output()
            .is_ok_and(|output| output.status.success());
        if !runs {
            bail!(
                "{} does not run (`--version` fails): reinstall it with `{}`",
                path.display(),
                bpf_linker_install_command()
            );
        }
        return Ok(Linker {
            llvm_major: linker_llvm_major(&path),
            path,
        });
    }
    eprintln!("xtask: installing bpf-linker (LLVM {LLVM_MAJOR}, about a minute)");
    let prefix = llvm_prefix();
    let mut install = Command::new("cargo");
    install
        .args([
            "install",
            "bpf-linker",
            "--no-default-features",
            "--features",
        ])
        .arg(format!("llvm-{LLVM_MAJOR}"))
        .env("LLVM_PREFIX", &prefix)
        .env(format!("LLVM_SYS_{LLVM_MAJOR}1_PREFIX"), &prefix)
        // Any toolchain builds it; the workspace's pin is the one cargo picks here.
        .env_remove("RUSTUP_TOOLCHAIN");
    if !status_ok(&mut install)? {
        bail!(
            "installing bpf-linker failed; run `{}` by hand",
            bpf_linker_install_command()
        );
    }
    let installed = cargo_home().join("bin/bpf-linker");
    let path = on_path("bpf-linker").with_context(|| {
        format!(
            "cargo installed {}, but it is not on PATH: add {} to PATH",
            installed.display(),
            cargo_home().join("bin").display()
        )
    })?;
    Ok(Linker {
        llvm_major: linker_llvm_major(&path),
        path,
    })
}

/// The LLVM major a bpf-linker binary is built against: from the shared library it needs
/// (`libLLVM.so.22.1`, `libLLVM-22.so`), else from cargo's record of the features it was
/// installed with (a static build: `llvm-22`), if it is the one cargo installed.
fn linker_llvm_major(path: &std::path::Path) -> Option<u32> {
    let dynamic = Command::new("readelf")
        .arg("--dynamic")
        .arg(path)
        .output()
        .ok()
        .and_then(|output| llvm_major_of_needed(&String::from_utf8_lossy(&output.stdout)));
    dynamic.or_else(|| {
        if path != cargo_home().join("bin/bpf-linker") {
            return None;
        }
        let record = std::fs::read_to_string(cargo_home().join(".crates2.json")).ok()?;
        llvm_major_of_install_record(&record)
    })
}

/// The major of the `libLLVM` entry among `readelf --dynamic`'s NEEDED lines.
fn llvm_major_of_needed(dynamic: &str) -> Option<u32> {
    dynamic
        .lines()
        .filter(|line| line.contains("(NEEDED)"))
        .find_map(|line| {
            let library = line.split('[').nth(1)?.trim_end_matches(']');
            let version = library
                .strip_prefix("libLLVM.so.")
                .or_else(|| library.strip_prefix("libLLVM-"))?;
            version
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
}

/// The `llvm-N` feature cargo recorded for its install of bpf-linker (`$CARGO_HOME/.crates2.json`).
fn llvm_major_of_install_record(record: &str) -> Option<u32> {
    let record: serde_json::Value = serde_json::from_str(record).ok()?;
    let (_, install) = record
        .get("installs")?
        .as_object()?
        .iter()
        .find(|(package, _)| package.starts_with("bpf-linker "))?;
    install
        .get("features")?
        .as_array()?
        .iter()
        .filter_map(serde_json::Value::as_str)
        .find_map(|feature| feature.strip_prefix("llvm-")?.parse().ok())
}

/// The eBPF toolchain's rustc and bpf-linker must be on one LLVM major: bpf-linker reads the
/// bitcode rustc writes, and a newer LLVM's bitcode fails there with "Invalid record".
fn check_llvm_agrees(pin: &Pin, linker: &Linker) -> anyhow::Result<()> {
    let rustc = pin.llvm_major()?;
    if rustc != LLVM_MAJOR {
        bail!(
            "the eBPF toolchain {} (from {}) is built on LLVM {rustc}, but the build links with \
             LLVM {LLVM_MAJOR} (xtask/src/toolchain.rs: LLVM_MAJOR, Debian's llvm-{LLVM_MAJOR}-dev): \
             pin a nightly whose `rustc -vV` says LLVM {LLVM_MAJOR}, or move LLVM_MAJOR with the \
             checklist in docs/development.md (\"The eBPF toolchain\")",
            pin.channel,
            pin.source()
        );
    }
    match linker.llvm_major {
        Some(major) if major == LLVM_MAJOR => Ok(()),
        Some(major) => bail!(
            "{} is built against LLVM {major}, but the eBPF toolchain {} is on LLVM {rustc}: \
             reinstall it with `{}`",
            linker.path.display(),
            pin.channel,
            bpf_linker_install_command()
        ),
        None => bail!(
            "cannot tell which LLVM {} is built against (it needs no libLLVM and cargo has no \
             record of installing it); the eBPF toolchain {} is on LLVM {rustc}: reinstall it \
             with `{}`",
            linker.path.display(),
            pin.channel,
            bpf_linker_install_command()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_linker_llvm_is_read_from_its_needed_libraries() {
        let dynamic = " 0x0000000000000001 (NEEDED)             Shared library: [libz.so.1]\n \
                       0x0000000000000001 (NEEDED)             Shared library: [libLLVM.so.22.1]\n";
        assert_eq!(llvm_major_of_needed(dynamic), Some(22));
        let older = " 0x0000000000000001 (NEEDED)             Shared library: [libLLVM-19.so]\n";
        assert_eq!(llvm_major_of_needed(older), Some(19));
        let none = " 0x0000000000000001 (NEEDED)             Shared library: [libc.so.6]\n";
        assert_eq!(llvm_major_of_needed(none), None);
    }

    #[test]
    fn the_linker_llvm_is_read_from_cargos_install_record() {
        let record = r#"{"installs":{"bpf-linker 0.13.0 (registry+https://github.com/rust-lang/crates.io-index)":{"features":["llvm-22"],"no_default_features":true}}}"#;
        assert_eq!(llvm_major_of_install_record(record), Some(22));
        let default_features = r#"{"installs":{"bpf-linker 0.13.0 (x)":{"features":[]}}}"#;
        assert_eq!(llvm_major_of_install_record(default_features), None);
    }
}
