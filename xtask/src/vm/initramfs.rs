//! The guest's initramfs: a static busybox, the modules the root file system needs, the two
//! init stages and the run's plan, as a `newc` cpio archive (what the kernel unpacks).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use super::kernel::Kernel;

/// Stage 1, the initramfs's `/init`.
const STAGE1: &str = include_str!("init.sh");
/// Stage 2, run on the overlay root.
const STAGE2: &str = include_str!("stage2.sh");
/// Stage 2 of the systemd boot.
const SYSTEMD_BOOT: &str = include_str!("systemd-boot.sh");
/// Stage 2 of the node boot.
const NODE_BOOT: &str = include_str!("node-boot.sh");
/// What the two boots with systemd share.
const GUEST_SYSTEMD: &str = include_str!("guest-systemd.sh");

/// Debian's busybox-static on the host: stage 1 runs before any library is reachable (a guest
/// of another architecture gets its own root file system's).
pub const HOST_BUSYBOX: &str = "/bin/busybox";

/// The busybox applets stage 1 calls.
const APPLETS: &[&str] = &[
    "sh",
    "mkdir",
    "mount",
    "umount",
    "insmod",
    "cp",
    "echo",
    "switch_root",
    "poweroff",
    "sleep",
];

/// Modules stage 1 loads (with what they depend on) unless the kernel has them built in:
/// virtio over PCI, virtiofs for the host's root, overlayfs for the writable layer on top.
const ROOT_MODULES: &[&str] = &["virtio_pci", "virtiofs", "overlay"];

/// What stage 2 needs to know, written into the initramfs as `/plan.sh` (shell assignments).
#[derive(Debug)]
pub struct Plan {
    /// The kernel's `lib/modules/RELEASE` on the host.
    pub kernel_modules: PathBuf,
    /// The snapshot of the executables.
    pub snapshot: PathBuf,
    /// The directory the snapshot is mounted over.
    pub profile_dir: PathBuf,
    /// Where the test binaries run (cargo runs integration tests in their package's directory).
    pub workdir: PathBuf,
    /// `REDIRECTOR_BIN`.
    pub redirector: PathBuf,
    /// The test binaries, by name, each with the libtest filters that choose its tests (none:
    /// every test).
    pub tests: Vec<(String, PathBuf, Vec<String>)>,
    /// The guest's results port.
    pub results: String,
    /// Arguments for every test binary.
    pub test_args: Vec<String>,
    /// Seconds one test binary may run in the guest.
    pub binary_timeout_secs: u64,
    /// `REDIRECTOR_TEST_SLOWDOWN` in the guest: how much the tests stretch their waits.
    pub slowdown: u32,
    /// What stage 2 does.
    pub mode: Mode,
    /// The workspace (the systemd boot installs the shipped unit from it).
    pub workspace: PathBuf,
    /// The node boot's: the node's directory, which the host wrote (`bpf_tests::node::NodeDir`),
    /// and the API server's port.
    pub node: Option<(PathBuf, u16)>,
}

/// What a boot does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Stage 2 runs the test binaries itself, as PID 1.
    Tests,
    /// Stage 2 prepares a node and execs systemd; a unit runs the test binaries after boot.
    Systemd,
    /// As `Systemd`, for a Kubernetes node (`node-boot.sh`) registered to the host's control
    /// plane.
    Node,
}

/// `text` as one shell word.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

fn quote_path(path: &Path) -> anyhow::Result<String> {
    path.to_str()
        .map(quote)
        .with_context(|| format!("{} is not UTF-8", path.display()))
}

impl Plan {
    fn to_shell(&self) -> anyhow::Result<String> {
        let mut names = Vec::new();
        let mut binaries = Vec::new();
        let mut filters = Vec::new();
        for (name, path, chosen) in &self.tests {
            names.push(quote(name));
            binaries.push(quote_path(path)?);
            filters.push(quote(&chosen.join(" ")));
        }
        let args: Vec<String> = self.test_args.iter().map(|arg| quote(arg)).collect();
        Ok(format!(
            "# Written by cargo xtask vm-test.\n\
             VM_KERNEL_MODULES={}\nVM_SNAPSHOT={}\nVM_PROFILE_DIR={}\nVM_WORKDIR={}\n\
             VM_REDIRECTOR_BIN={}\nVM_BINARY_TIMEOUT={}\nVM_SLOWDOWN={}\n\
             VM_MODE={}\nVM_WORKSPACE={}\nVM_RESULTS={}\n\
             VM_TEST_NAMES=({})\nVM_TEST_BINS=({})\nVM_TEST_FILTERS=({})\nVM_TEST_ARGS=({})\n\
             VM_NODE_DIR={}\nVM_NODE_API_PORT={}\nVM_NODE_NAME=node\n",
            quote_path(&self.kernel_modules)?,
            quote_path(&self.snapshot)?,
            quote_path(&self.profile_dir)?,
            quote_path(&self.workdir)?,
            quote_path(&self.redirector)?,
            self.binary_timeout_secs,
            self.slowdown,
            match self.mode {
                Mode::Tests => "tests",
                Mode::Systemd => "systemd",
                Mode::Node => "node",
            },
            quote_path(&self.workspace)?,
            quote(&self.results),
            names.join(" "),
            binaries.join(" "),
            filters.join(" "),
            args.join(" "),
            match &self.node {
                Some((dir, _)) => quote_path(dir)?,
                None => String::new(),
            },
            self.node.as_ref().map_or(0, |(_, port)| *port),
        ))
    }
}

/// What a guest's architecture changes in stage 1.
#[derive(Debug)]
pub struct Guest {
    /// The static busybox of the guest's architecture.
    pub busybox: PathBuf,
    /// Modules stage 1 loads besides the root's (the arm64 guest's results port is a virtio
    /// console).
    pub extra_modules: &'static [&'static str],
    /// For another architecture than the host's: its root file system (a host directory), and
    /// the host directories bound into it at their own paths.
    pub root: Option<(PathBuf, Vec<PathBuf>)>,
}

/// Writes the initramfs for `kernel`, `guest` and `plan` to `path`.
pub fn write(kernel: &Kernel, guest: &Guest, plan: &Plan, path: &Path) -> anyhow::Result<()> {
    let mut archive = Cpio::default();
    for dir in ["bin", "modules"] {
        archive.dir(dir);
    }
    let busybox = std::fs::read(&guest.busybox).with_context(|| {
        format!(
            "reading {} (package busybox-static)",
            guest.busybox.display()
        )
    })?;
    archive.file("bin/busybox", 0o755, &busybox);
    for applet in APPLETS {
        archive.symlink(&format!("bin/{applet}"), "busybox");
    }
    archive.file("init", 0o755, STAGE1.as_bytes());
    archive.file("stage2.sh", 0o755, STAGE2.as_bytes());
    archive.file("systemd-boot.sh", 0o755, SYSTEMD_BOOT.as_bytes());
    archive.file("node-boot.sh", 0o755, NODE_BOOT.as_bytes());
    archive.file("guest-systemd.sh", 0o644, GUEST_SYSTEMD.as_bytes());
    archive.file("plan.sh", 0o644, plan.to_shell()?.as_bytes());
    let (guest_root, binds) = match &guest.root {
        Some((root, binds)) => (
            quote_path(root)?,
            binds
                .iter()
                .map(|dir| dir.to_str().map(str::to_owned).context("paths are UTF-8"))
                .collect::<anyhow::Result<Vec<_>>>()?
                .join(" "),
        ),
        None => (String::new(), String::new()),
    };
    archive.file(
        "stage1.env",
        0o644,
        format!(
            "RESULTS={}\nGUEST_ROOT={guest_root}\nGUEST_BINDS={}\n",
            quote(&plan.results),
            quote(&binds)
        )
        .as_bytes(),
    );
    let mut order = String::new();
    for module in root_modules(&kernel.modules, guest.extra_modules)? {
        let name = module
            .file_name()
            .and_then(|name| name.to_str())
            .context("module file names are UTF-8")?;
        let (name, bytes) = match name.strip_suffix(".xz") {
            // busybox's insmod hands the file to the kernel as it is; 6.12's modules are
            // xz-compressed.
            Some(plain) => (plain.to_owned(), unxz(&module)?),
            None if name.ends_with(".ko") => (
                name.to_owned(),
                std::fs::read(&module).with_context(|| format!("reading {}", module.display()))?,
            ),
            None => bail!(
                "{} is compressed in a way stage 1 cannot load (only .ko and .ko.xz)",
                module.display()
            ),
        };
        archive.file(&format!("modules/{name}"), 0o644, &bytes);
        order.push_str(&name);
        order.push('\n');
    }
    archive.file("modules.order", 0o644, order.as_bytes());
    std::fs::write(path, archive.finish()).with_context(|| format!("writing {}", path.display()))
}

/// `busybox xz -dc module`.
fn unxz(module: &Path) -> anyhow::Result<Vec<u8>> {
    let output = Command::new(HOST_BUSYBOX)
        .args(["xz", "-dc"])
        .arg(module)
        .output()
        .with_context(|| format!("decompressing {}", module.display()))?;
    if !output.status.success() {
        bail!(
            "decompressing {} failed: {}",
            module.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(output.stdout)
}

/// The module files of [`ROOT_MODULES`] and their dependencies, each after what it needs, from
/// `modules.dep`; modules in `modules.builtin` need nothing.
fn root_modules(modules: &Path, extra: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let read = |name: &str| {
        let path = modules.join(name);
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    };
    let dep_text = read("modules.dep")?;
    let builtin_text = read("modules.builtin")?;
    let mut deps: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut by_name: HashMap<String, &str> = HashMap::new();
    for line in dep_text.lines() {
        let Some((file, needs)) = line.split_once(':') else {
            continue;
        };
        deps.insert(file, needs.split_whitespace().collect());
        by_name.insert(module_name(file), file);
    }
    let builtin: Vec<String> = builtin_text.lines().map(module_name).collect();

    fn visit<'a>(file: &'a str, deps: &HashMap<&'a str, Vec<&'a str>>, order: &mut Vec<&'a str>) {
        if order.contains(&file) {
            return;
        }
        for need in deps.get(file).into_iter().flatten() {
            visit(need, deps, order);
        }
        order.push(file);
    }

    let mut order = Vec::new();
    for wanted in ROOT_MODULES.iter().chain(extra) {
        match by_name.get(*wanted) {
            Some(file) => visit(file, &deps, &mut order),
            None if builtin.iter().any(|name| name == wanted) => {}
            None => bail!(
                "the kernel in {} has no {wanted} module, built in or loadable: it cannot mount \
                 the host's root",
                modules.display()
            ),
        }
    }
    Ok(order.into_iter().map(|file| modules.join(file)).collect())
}

/// `kernel/fs/fuse/virtiofs.ko.xz` → `virtiofs` (dashes as underscores, as the kernel names
/// modules).
fn module_name(file: &str) -> String {
    let base = file.rsplit('/').next().unwrap_or(file);
    let stem = base.split(".ko").next().unwrap_or(base);
    stem.replace('-', "_")
}

/// A `newc` cpio archive being built in memory.
#[derive(Debug, Default)]
struct Cpio {
    bytes: Vec<u8>,
    inodes: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.inodes += 1;
        let name_size = name.len() + 1;
        let fields = [
            self.inodes,
            mode,
            0, // uid
            0, // gid
            1, // nlink
            0, // mtime
            u32::try_from(data.len()).unwrap_or(u32::MAX),
            0, // devmajor
            0, // devminor
            0, // rdevmajor
            0, // rdevminor
            u32::try_from(name_size).unwrap_or(u32::MAX),
            0, // check
        ];
        self.bytes.extend_from_slice(b"070701");
        for field in fields {
            self.bytes
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    /// Pads to the next multiple of four bytes, as newc aligns names and data.
    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, &[]);
    }

    fn file(&mut self, name: &str, permissions: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | permissions, data);
    }

    fn symlink(&mut self, name: &str, target: &str) {
        self.entry(name, 0o120_777, target.as_bytes());
    }

    fn finish(mut self) -> Vec<u8> {
        self.inodes = 0;
        self.entry("TRAILER!!!", 0, &[]);
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_entries_are_aligned_and_end_with_the_trailer() {
        let mut archive = Cpio::default();
        archive.file("init", 0o755, b"#!/bin/sh\n");
        let bytes = archive.finish();
        assert!(bytes.starts_with(b"070701"));
        // header (110) + "init\0" (5) padded to 116, data 10 padded to 12.
        assert_eq!(&bytes[116..126], b"#!/bin/sh\n");
        assert_eq!(&bytes[128..134], b"070701");
        assert!(bytes.windows(10).any(|window| window == b"TRAILER!!!"));
        assert_eq!(bytes.len() % 4, 0);
    }

    #[test]
    fn module_names_and_quoting() {
        assert_eq!(module_name("kernel/fs/fuse/virtiofs.ko.xz"), "virtiofs");
        assert_eq!(
            module_name("kernel/drivers/virtio/virtio_pci.ko"),
            "virtio_pci"
        );
        assert_eq!(quote("it's"), r"'it'\''s'");
    }
}
