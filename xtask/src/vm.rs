//! `cargo xtask vm-test`: the privileged bpf-tests inside VMs booting Debian's other kernels
//! (6.1 and 6.12), so the verifier's verdict and the hooks' behaviour are proven beyond the
//! host's own kernel.
//!
//! How a boot works: qemu (TCG; KVM cannot boot a stock kernel on these hosts) boots the
//! kernel of Debian's cloud package with a small initramfs. The guest has no network device.
//! Its root is the host's root file system, shared read-only by virtiofsd, under an overlay
//! whose upper layer is a tmpfs: the guest runs the host's very tools (ip, nft, dig, dnsmasq,
//! ...) and the test binaries cargo built, writes wherever the tests write, and leaves no trace
//! on the host. The kernel loads its modules on demand from the unpacked package. Results come
//! back on a second serial port, one line per test, and are reported per kernel.

mod artifacts;
mod foreign;
mod initramfs;
mod kernel;
mod machine;
mod node_host;
mod report;
mod rootfs;
mod scope;

use std::{
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

pub use kernel::Series;

use crate::arch::Arch;

/// Which kernels to boot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KernelChoice {
    /// Debian 12's 6.1.
    #[value(name = "6.1")]
    V6_1,
    /// Debian 12's backported 6.12.
    #[value(name = "6.12")]
    V6_12,
    /// Both, one after the other.
    All,
}

impl KernelChoice {
    fn series(self) -> Vec<Series> {
        match self {
            Self::V6_1 => vec![Series::V6_1],
            Self::V6_12 => vec![Series::V6_12],
            Self::All => Series::ALL.to_vec(),
        }
    }
}

/// What to run (`cargo xtask vm-test`'s arguments).
#[derive(Debug, clap::Parser)]
pub struct VmArgs {
    /// Which kernel: 6.1, 6.12, or all (one after the other).
    #[arg(long, value_enum, default_value = "all")]
    pub kernel: KernelChoice,
    /// The kernels' architecture. Another than the host's boots Debian's kernel of it under
    /// emulation, in a root file system of its own, with the tests cross-built; it runs only the
    /// kernel subset (`vm/scope.rs`) unless `--whole-suite`, `--tests` or a filter says
    /// otherwise.
    #[arg(long, value_enum, default_value_t = Arch::host())]
    pub arch: Arch,
    /// On another architecture than the host's: every test the host's VMs run, not the subset.
    #[arg(long, conflicts_with = "subset_on")]
    pub whole_suite: bool,
    /// Only the kernel subset (`vm/scope.rs`) on this kernel, everything on the others
    /// (`cargo xtask test` runs 6.12 so); ignored with `--tests` or a filter.
    #[arg(long, value_enum)]
    pub subset_on: Option<KernelChoice>,
    /// Only these bpf-tests test binaries (comma-separated: steering,failover; `systemd_boot`
    /// and `node` name those boots); default all, the boots on the newest kernel chosen.
    #[arg(long, value_delimiter = ',')]
    pub tests: Vec<String>,
    /// Hard limit of one boot in seconds: qemu is killed when it passes.
    #[arg(long, default_value_t = 1200)]
    pub timeout_secs: u64,
    /// Limit of one test binary inside the guest, in seconds.
    #[arg(long, default_value_t = 600)]
    pub binary_timeout_secs: u64,
    /// Tests run at once inside the guest (libtest's --test-threads; the guest has 2 CPUs).
    #[arg(long, default_value_t = 2)]
    pub test_threads: u32,
    /// How many times the tests stretch their waits, probe timings and event timings: qemu's
    /// TCG runs them several times slower than the host (REDIRECTOR_TEST_SLOWDOWN).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub slowdown: u32,
    /// Also run the tests the VMs leave to the host kernel (`vm/scope.rs` lists them and why).
    #[arg(long)]
    pub with_host_only: bool,
    /// Only tests whose name contains this.
    pub filter: Option<String>,
}

/// The node's test runs for about 8 minutes under TCG: its limit inside the guest, and its
/// boot's (with the images' import), whatever smaller limits the run's other boots are given.
const NODE_TEST_SECS: u64 = 2400;
const NODE_BOOT_SECS: u64 = 3000;
/// The node's disk (sparse: it takes only what the guest writes).
const NODE_DISK_GIB: u64 = 16;

/// The node's test that measures its reboot: the boot after it runs only that test, the boot
/// before every other (`bpf-tests/tests/node.rs`).
const NODE_REBOOT_TEST: &str = "after_the_node_reboots_dns_is_back_with_the_agent_or_the_cache";

/// The node boot's libtest filter: the reboot's test alone after the reboot, every other test
/// before it (with the run's filter, if any); nothing for other boots.
fn node_boot_filter(mode: initramfs::Mode, rebooted: bool, filter: Option<&str>) -> Vec<String> {
    match (mode, rebooted) {
        (initramfs::Mode::Node, true) => vec!["--exact".to_owned(), NODE_REBOOT_TEST.to_owned()],
        (initramfs::Mode::Node, false) => ["--skip", NODE_REBOOT_TEST]
            .into_iter()
            .map(str::to_owned)
            .chain(filter.map(str::to_owned))
            .collect(),
        _ => filter.map(str::to_owned).into_iter().collect(),
    }
}

impl VmArgs {
    /// Whether the run boots the suite's node: on the host's architecture, unless `--tests`
    /// leaves `node` out (as the systemd boot).
    #[must_use]
    pub fn node_boot(&self) -> bool {
        self.arch == Arch::host()
            && (self.tests.is_empty() || self.tests.iter().any(|name| name == artifacts::NODE))
    }

    /// The host architecture's VMs as every `cargo xtask test` runs them: on 6.1, the oldest
    /// kernel here, the kernel's full run (steering, signal and stall whole, the other binaries'
    /// kernel subset: `scope::runs_whole`); the kernel subset and the systemd boot on 6.12,
    /// which sits between it and the host's kernel, where every test runs.
    #[must_use]
    pub fn suite() -> Self {
        <Self as clap::Parser>::parse_from(["vm-test", "--subset-on", "6.12"])
    }

    /// These arguments with the libtest filter `filter`.
    #[must_use]
    pub fn with_filter(mut self, filter: Option<String>) -> Self {
        self.filter = filter;
        self
    }

    /// The kernel subset on arm64's 6.1, as every `cargo xtask test` runs it.
    #[must_use]
    pub fn arm64_subset() -> Self {
        <Self as clap::Parser>::parse_from(["vm-test", "--arch", "aarch64", "--kernel", "6.1"])
    }

    /// Whether `series` runs only the kernel subset: another architecture's kernels unless
    /// `--whole-suite`, and the kernels `--subset-on` names; never when tests or a filter are
    /// named.
    fn subset(&self, series: Series) -> bool {
        let chosen = self
            .subset_on
            .is_some_and(|choice| choice.series().contains(&series));
        let foreign = self.arch != Arch::host() && !self.whole_suite;
        (chosen || foreign) && self.tests.is_empty() && self.filter.is_none()
    }
}

fn require_root() -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "`cargo xtask vm-test` shares the host's root with the VM through virtiofsd, which \
             needs root (a mount namespace of its own, files of every owner): run it as root, \
             or with `sudo -E env PATH=$PATH cargo xtask vm-test`"
        );
    }
    Ok(())
}

/// Directories the guest mounts afresh (stage 2), hiding what the host has there.
const GUEST_OWN_DIRS: &[&str] = &["/run", "/proc", "/sys", "/dev"];

/// The guest sees only the host's root file system (a non-recursive bind), with its own /run,
/// /proc, ... on top: whatever it runs must be elsewhere on the root file system.
fn require_on_root_fs(path: &Path) -> anyhow::Result<()> {
    if let Some(dir) = GUEST_OWN_DIRS.iter().find(|dir| path.starts_with(dir)) {
        bail!(
            "{} is under {dir}, which the VM mounts afresh: put the workspace and its target \
             directory elsewhere (CARGO_TARGET_DIR)",
            path.display()
        );
    }
    let root = std::fs::metadata("/").context("reading / (its file system)")?;
    let here = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if root.dev() != here.dev() {
        bail!(
            "{} is on another file system than /, and the VM sees only the root file system: \
             put the workspace and its target directory (CARGO_TARGET_DIR) on /",
            path.display()
        );
    }
    Ok(())
}

/// The workspace's root, with its links resolved.
fn workspace_dir() -> anyhow::Result<PathBuf> {
    crate::workspace::workspace_root()
        .canonicalize()
        .context("finding the workspace")
}

/// Removes the directories of earlier runs whose process is gone (a concurrent run keeps its
/// own).
fn sweep_runs(vm_dir: &Path) {
    for entry in std::fs::read_dir(vm_dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("run-") else {
            continue;
        };
        let alive = pid.parse::<u32>().is_ok_and(|pid| {
            pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists()
        });
        if !alive {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// One boot: its report, or why it could not boot.
struct KernelResult {
    /// The kernel's label, and `+systemd` for the systemd boot.
    label: String,
    /// Test binaries it was to run.
    expected_binaries: usize,
    release: String,
    run: report::KernelRun,
    outcome: machine::Outcome,
    /// Time until stage 2 was ready (boot, modules, mounts).
    boot: Option<Duration>,
    log_dir: PathBuf,
}

/// Builds what a run on `arch` boots with (`run` builds it too, and finds nothing left to do),
/// so that `cargo xtask test` can build it beside the host's tests.
pub fn build_artifacts(arch: Arch) -> anyhow::Result<()> {
    artifacts::build(&[], arch).map(drop)
}

/// Runs the bpf-tests in a VM for each kernel of `options`; fails when any test, binary or
/// boot did. `before_node` runs before the node's boot, the last: `cargo xtask test` waits there
/// for the node's programs it builds beside the earlier runs.
pub fn run(
    options: &VmArgs,
    before_node: &mut dyn FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    require_root()?;
    let arch = options.arch;
    let foreign_arch = arch != Arch::host();
    let qemu = format!("/usr/bin/{}", machine::qemu_binary(arch));
    for tool in [qemu.as_str(), "/usr/lib/qemu/virtiofsd", "/bin/busybox"] {
        if !Path::new(tool).exists() {
            bail!(
                "{tool} is missing: run `cargo xtask setup` (it installs qemu-system-x86, \
                 qemu-system-arm and busybox-static)"
            );
        }
    }
    let started = Instant::now();
    let mut artifacts = artifacts::build(&options.tests, arch)?;
    // The systemd boot runs on the host's architecture (its guest is the host's own root).
    let systemd_boot = !foreign_arch
        && (options.tests.is_empty()
            || options
                .tests
                .iter()
                .any(|name| name == artifacts::SYSTEMD_BOOT));
    // The node boot, on the host's architecture too.
    let node_boot = options.node_boot();
    artifacts
        .tests
        .retain(|test| scope::runs_binary(&test.name, &options.tests, options.with_host_only));
    let series = options.kernel.series();
    // A binary with no test of the subset is left out of every run that is all subset.
    if series.iter().all(|series| options.subset(*series)) {
        artifacts
            .tests
            .retain(|test| scope::subset_filters(&test.name).is_some());
    }
    if artifacts.tests.is_empty() && !systemd_boot && !node_boot {
        bail!("bpf-tests has no test binary to run");
    }
    let target_dir = artifacts
        .profile_dir
        .parent()
        .context("the profile directory is inside the target directory")?
        .to_owned();
    let vm_dir = target_dir.join("vm");
    std::fs::create_dir_all(&vm_dir).with_context(|| format!("creating {}", vm_dir.display()))?;
    let workdir = crate::workspace::workspace_root().join("bpf-tests");
    let workdir = workdir
        .canonicalize()
        .with_context(|| format!("finding {}", workdir.display()))?;
    for path in [&vm_dir, &artifacts.profile_dir, &workdir] {
        require_on_root_fs(path)?;
    }
    sweep_runs(&vm_dir);

    let foreign_apt = foreign_arch
        .then(|| foreign::ForeignApt::new(arch, &vm_dir))
        .transpose()?;
    let available = match kernel::available_releases(foreign_apt.as_ref()) {
        Ok(names) => Some(names),
        Err(error) => {
            eprintln!("xtask: cannot ask apt for kernels ({error:#}); using cached ones");
            None
        }
    };
    let kernels = series
        .iter()
        .map(|series| {
            kernel::ensure(
                *series,
                arch,
                available.as_deref(),
                &vm_dir.join("kernels"),
                foreign_apt.as_ref(),
            )
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let guest = if foreign_arch {
        let root = rootfs::ensure(arch, &vm_dir)?;
        // The plan's paths (the workspace, the snapshot, the kernels' modules, the profile
        // directory) are the host's: bound into the guest's root at the same paths.
        let mut binds = vec![workspace_dir()?];
        let target = target_dir
            .canonicalize()
            .context("finding the target directory")?;
        if !target.starts_with(&binds[0]) {
            binds.push(target);
        }
        initramfs::Guest {
            busybox: root.join("bin/busybox"),
            extra_modules: &["virtio_console"],
            root: Some((root, binds)),
        }
    } else {
        initramfs::Guest {
            busybox: PathBuf::from(initramfs::HOST_BUSYBOX),
            extra_modules: &[],
            root: None,
        }
    };
    let results_port = match arch {
        Arch::X86_64 => "/dev/ttyS1",
        Arch::Aarch64 => "/dev/hvc0",
    };

    let run_dir = vm_dir.join(format!("run-{}", std::process::id()));
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let snapshot = artifacts::Snapshot::take(&artifacts, &run_dir.join("snapshot"))?;
    let mut test_args = vec![
        "--color".to_owned(),
        "never".to_owned(),
        "--test-threads".to_owned(),
        options.test_threads.to_string(),
    ];
    test_args.extend(scope::skip_args(&options.tests, options.with_host_only));
    test_args.extend(options.filter.clone());
    let workspace = workspace_dir()?;
    let plan = |kernel: &kernel::Kernel, mode: initramfs::Mode, rebooted: bool| {
        let subset = options.subset(kernel.series);
        let (tests, test_args) = match mode {
            initramfs::Mode::Tests => (&artifacts.tests[..], test_args.clone()),
            // One after the other: each test of the boot takes up where the last left the node.
            initramfs::Mode::Systemd | initramfs::Mode::Node => (
                std::slice::from_ref(if mode == initramfs::Mode::Node {
                    &artifacts.node
                } else {
                    &artifacts.systemd_boot
                }),
                ["--color", "never", "--test-threads", "1"]
                    .map(str::to_owned)
                    .into_iter()
                    // The node's test runs for many minutes: its progress as it comes (its
                    // table is a note too, `bpf_tests::vm_notes`).
                    .chain((mode == initramfs::Mode::Node).then(|| "--nocapture".to_owned()))
                    .chain(node_boot_filter(mode, rebooted, options.filter.as_deref()))
                    .collect(),
            ),
        };
        initramfs::Plan {
            kernel_modules: kernel.modules.clone(),
            snapshot: snapshot.dir().to_owned(),
            profile_dir: artifacts.profile_dir.clone(),
            workdir: workdir.clone(),
            redirector: artifacts.redirector.clone(),
            tests: tests
                .iter()
                .filter_map(|test| {
                    let whole = scope::runs_whole(
                        &test.name,
                        &options.tests,
                        options.with_host_only || options.filter.is_some(),
                    );
                    let filters = match mode {
                        initramfs::Mode::Tests if subset || !whole => {
                            scope::subset_filters(&test.name)?
                        }
                        _ => Vec::new(),
                    };
                    Some((test.name.clone(), test.path.clone(), filters))
                })
                .collect(),
            results: results_port.to_owned(),
            test_args,
            binary_timeout_secs: if mode == initramfs::Mode::Node {
                options.binary_timeout_secs.max(NODE_TEST_SECS)
            } else {
                options.binary_timeout_secs.max(1)
            },
            slowdown: options.slowdown,
            mode,
            workspace: workspace.clone(),
            node: None,
        }
    };
    let names: Vec<&str> = artifacts
        .tests
        .iter()
        .map(|test| test.name.as_str())
        .collect();
    eprintln!(
        "xtask: vm-test runs {} on {} (hard limit {} s per boot; waits stretched {}x)",
        names.join(", "),
        kernels
            .iter()
            .map(|kernel| kernel.release.as_str())
            .collect::<Vec<_>>()
            .join(" and "),
        options.timeout_secs,
        options.slowdown
    );
    let mut left_out = scope::describe(&options.tests, options.with_host_only);
    for kernel in kernels
        .iter()
        .filter(|kernel| options.subset(kernel.series))
    {
        left_out.push_str(&format!(
            "  on {} {}: only the kernel subset (vm/scope.rs; {} runs every test)\n",
            arch.name(),
            kernel.series.label(),
            if foreign_arch {
                "--whole-suite"
            } else {
                "vm-test without --subset-on"
            }
        ));
    }
    let everything = options.with_host_only || options.filter.is_some();
    let partial: Vec<&str> = names
        .iter()
        .copied()
        .filter(|name| !scope::runs_whole(name, &options.tests, everything))
        .collect();
    if !partial.is_empty() && kernels.iter().any(|kernel| !options.subset(kernel.series)) {
        left_out.push_str(&format!(
            "  of {}: only the kernel subset on every kernel (vm/scope.rs KERNEL_BINARIES; \
             --tests NAME runs a binary whole)\n",
            partial.join(", ")
        ));
    }
    eprint!("{left_out}");

    let mut boots: Vec<(&kernel::Kernel, initramfs::Mode)> = Vec::new();
    if !artifacts.tests.is_empty() {
        boots.extend(
            kernels
                .iter()
                .map(|kernel| (kernel, initramfs::Mode::Tests)),
        );
    }
    // The systemd boot, and the node's, on the newest kernel chosen (6.12 by default).
    for (wanted, mode, what, binary) in [
        (
            systemd_boot,
            initramfs::Mode::Systemd,
            "a boot with systemd as PID 1",
            artifacts::SYSTEMD_BOOT,
        ),
        (
            node_boot,
            initramfs::Mode::Node,
            "a Kubernetes node (kubelet, containerd, systemd)",
            artifacts::NODE,
        ),
    ] {
        if let Some(kernel) = kernels
            .iter()
            .filter(|_| wanted)
            .max_by_key(|kernel| kernel.series)
        {
            eprintln!("xtask: then {what} on {}: {binary}", kernel.release);
            boots.push((kernel, mode));
        }
    }
    let mut results = Vec::new();
    for (kernel, mode) in boots {
        let series = if foreign_arch {
            format!("{}-{}", kernel.series.label(), arch.debian())
        } else {
            kernel.series.label().to_owned()
        };
        let label = match mode {
            initramfs::Mode::Tests => series,
            initramfs::Mode::Systemd => format!("{series}+systemd"),
            initramfs::Mode::Node => format!("{series}+node"),
        };
        // The node's control plane, images and disk, for as long as its boots last.
        let node_host = if mode == initramfs::Mode::Node {
            before_node()?;
            // The rollout from the previous release's image and back runs its agent.
            let previous = crate::previous_release::ensure()?;
            let host = node_host::NodeHost::start(
                &artifacts.node_host,
                &run_dir.join("node"),
                &artifacts.profile_dir,
                &artifacts.redirector,
                &previous,
                &run_dir.join("node-host.log"),
            )?;
            let disk = run_dir.join("node-disk.img");
            machine::make_disk(&disk, NODE_DISK_GIB)?;
            Some((host, disk))
        } else {
            None
        };
        // The node boots again when its tests ask for a reboot, once.
        for rebooted in [false, true] {
            let label = if rebooted {
                format!("{label}+rebooted")
            } else {
                label.clone()
            };
            let initramfs = run_dir.join(format!("initramfs-{label}.cpio"));
            let log_dir = run_dir.join(&label);
            let mut plan = plan(kernel, mode, rebooted);
            plan.node = node_host
                .as_ref()
                .map(|(host, _)| (host.dir.clone(), host.api_port));
            initramfs::write(kernel, &guest, &plan, &initramfs)?;
            let mut run = report::KernelRun::default();
            let mut boot = None;
            let booting = Instant::now();
            eprintln!("xtask: [{label}] booting {}", kernel.release);
            let outcome = machine::run(
                &machine::Boot {
                    kernel,
                    initramfs: &initramfs,
                    dir: &log_dir,
                    timeout: Duration::from_secs(if node_host.is_some() {
                        options.timeout_secs.max(NODE_BOOT_SECS)
                    } else {
                        options.timeout_secs
                    }),
                    memory_mib: if node_host.is_some() {
                        machine::NODE_MEMORY_MIB
                    } else {
                        machine::MEMORY_MIB
                    },
                    forward: node_host.as_ref().map(|(host, _)| host.api_port),
                    disk: node_host.as_ref().map(|(_, disk)| disk.as_path()),
                },
                &mut |line| {
                    if let Some(progress) = run.feed(line) {
                        if matches!(progress, report::Progress::Ready(_)) {
                            boot = Some(booting.elapsed());
                        }
                        eprintln!("xtask: [{label}] {progress}");
                    }
                },
            )
            .with_context(|| format!("booting {}", kernel.release))?;
            let reboot = run.reboot && mode == initramfs::Mode::Node && !rebooted;
            results.push(KernelResult {
                label,
                expected_binaries: plan.tests.len(),
                release: kernel.release.clone(),
                run,
                outcome,
                boot,
                log_dir,
            });
            if !reboot {
                break;
            }
        }
        if let Some((host, disk)) = node_host {
            drop(host);
            let _ = std::fs::remove_file(disk);
        }
    }
    drop(snapshot);
    summarize(&results, &left_out, started.elapsed())
}

/// Prints every kernel's table and failures; fails unless every boot passed.
fn summarize(results: &[KernelResult], left_out: &str, total: Duration) -> anyhow::Result<()> {
    let mut failed = Vec::new();
    eprintln!();
    for result in results {
        let label = result.label.as_str();
        let (passed, failures, ignored) = result.run.counts();
        let outcome = &result.outcome;
        let ended = match outcome.status {
            Some(status) if status.success() => "powered off".to_owned(),
            Some(status) => format!("qemu ended with {status}"),
            None => "TIMED OUT: qemu was killed at the deadline".to_owned(),
        };
        eprintln!(
            "vm-test [{label}] {}: {passed} passed, {failures} failed, {ignored} ignored; \
             booted in {}, {:.1} s in all; {ended}",
            result.run.release.as_deref().unwrap_or(&result.release),
            result.boot.map_or_else(
                || "-".to_owned(),
                |boot| format!("{:.1} s", boot.as_secs_f64())
            ),
            outcome.elapsed.as_secs_f64(),
        );
        eprint!("{}", result.run.describe());
        for note in &result.run.notes {
            eprintln!("  measured: {note}");
        }
        if let Some(fatal) = &result.run.fatal {
            eprintln!("  the guest failed: {fatal}");
        }
        if result
            .run
            .release
            .as_deref()
            .is_some_and(|release| release != result.release)
        {
            eprintln!(
                "  the guest ran {} instead of {}",
                result.run.release.as_deref().unwrap_or_default(),
                result.release
            );
            failed.push(label);
            continue;
        }
        if !result.run.passed(result.expected_binaries) || outcome.status.is_none() {
            if !result.run.done {
                eprintln!(
                    "  the guest did not finish its tests; the kernel's console is {}",
                    outcome.console.display()
                );
            }
            failed.push(label);
        }
        eprintln!(
            "  logs: {} (console.log: the kernel; results.log: the tests)",
            result.log_dir.display()
        );
    }
    eprint!("{left_out}");
    eprintln!("xtask: vm-test took {total:.0?}");
    if !failed.is_empty() {
        bail!(
            "the bpf-tests failed in the VM on {}; the tables above say which and why",
            failed.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> VmArgs {
        <VmArgs as clap::Parser>::parse_from(std::iter::once("vm-test").chain(args.iter().copied()))
    }

    #[test]
    fn the_subset_runs_where_asked_and_never_for_named_tests() {
        let suite = VmArgs::suite();
        assert!(
            !suite.subset(Series::V6_1),
            "cargo xtask test runs the kernel's full run on 6.1"
        );
        assert!(suite.subset(Series::V6_12));
        let arm64 = VmArgs::arm64_subset();
        assert!(arm64.subset(Series::V6_1));
        let everything = parse(&[]);
        assert!(Series::ALL.iter().all(|series| !everything.subset(*series)));
        assert!(!parse(&["--arch", "aarch64", "--whole-suite"]).subset(Series::V6_1));
        assert!(parse(&["--subset-on", "all"]).subset(Series::V6_1));
        assert!(!parse(&["--subset-on", "6.12", "--tests", "drain"]).subset(Series::V6_12));
        assert!(!parse(&["--subset-on", "6.12", "restarts"]).subset(Series::V6_12));
    }

    #[test]
    fn the_node_boots_in_the_suite_and_when_named() {
        assert!(
            VmArgs::suite().node_boot(),
            "cargo xtask test boots the node"
        );
        assert!(!VmArgs::arm64_subset().node_boot());
        assert!(parse(&["--tests", "node"]).node_boot());
        assert!(!parse(&["--arch", "aarch64", "--tests", "node"]).node_boot());
        assert!(!parse(&["--tests", "steering"]).node_boot());
    }
}
