//! `cargo xtask`: the project's developer tasks. Each task first makes sure the machine has what
//! it needs (`setup`), so the README's commands work on a fresh machine.

mod arch;
mod elf;
mod go_peers;
mod idle_builds;
mod image;
mod lint;
mod pinned_rustup;
mod previous_release;
mod release;
mod setup;
mod sweep;
mod tasks;
mod toolchain;
mod vm;
mod workspace;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(about = "redirector developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand, Debug)]
enum Task {
    /// Install what is missing: the pinned eBPF toolchain, Debian's LLVM, bpf-linker, the Debian
    /// test tools, the tests' Go peers (CoreDNS, kube-apiserver, kubectl, etcd, built from
    /// bpf-tests/go); check that the eBPF toolchain and bpf-linker are on one LLVM.
    Setup,
    /// Build the eBPF object and every userspace crate; with `--target`, the shipped agent
    /// instead: static (musl), release, for each architecture named.
    Build {
        /// Build the agent for this architecture (repeat it, or `all`): into
        /// target/<musl target>/release/redirector, checked to be a static binary of it.
        #[arg(long = "target", value_name = "ARCH")]
        targets: Vec<arch::Selection>,
    },
    /// Build the image (Containerfile) for each architecture named, with no emulation, and a
    /// manifest list of them under one name (needs root: podman, mmdebstrap).
    Image(image::ImageArgs),
    /// What a release ships, into target/dist/VERSION: the static agents of both architectures,
    /// their images (OCI archives, and a manifest list in podman's storage), SHA256SUMS; from a
    /// clean checkout whose CHANGELOG.md dates the version (needs root: podman, mmdebstrap).
    Release(release::ReleaseArgs),
    /// rustfmt check, and clippy with warnings denied (userspace, and the eBPF crate on its target).
    Lint,
    /// Every test: lints, unit tests, and the privileged bpf-tests (needs root).
    Test {
        /// Skip the lints (for quick iterations; CI runs them).
        #[arg(long)]
        no_lint: bool,
        /// Only the host kernel: skip the VMs (on x86_64 Debian's 6.1: steering, signal and stall
        /// whole and the other binaries' kernel subset; 6.12: the kernel subset and the systemd
        /// boot; arm64's 6.1: the kernel subset; `cargo xtask vm-test`).
        #[arg(long)]
        no_vm: bool,
        /// Only run tests whose name contains this.
        filter: Option<String>,
    },
    /// Run the demo: a sandboxed node, the agent, DNS through a listener flipped to upstream and
    /// back, then the cache killed mid-stream and restarted (needs root).
    Demo {
        /// The cache: embedded (redirector cache), test-server, dnsmasq or unbound.
        #[arg(long, default_value = "embedded")]
        cache: String,
    },
    /// Benchmarks against the incumbents (dnsperf, conntrack, failover, setup, sync, memory,
    /// a soak), with optimized builds; writes results.json, results.md and SVG charts (needs root).
    Bench {
        /// Where the results go (relative paths are from the workspace root).
        #[arg(long, default_value = "docs/bench")]
        out: std::path::PathBuf,
        /// How long the soak (dnsperf at 80 % of the cache's capacity, looking for false
        /// failovers) runs, seconds.
        #[arg(long, default_value_t = 600)]
        soak_seconds: u64,
        /// How long each load at and past the cache's capacity (100 % and 150 %, looking for
        /// false failovers and false stalls) runs, seconds.
        #[arg(long, default_value_t = 300)]
        load_seconds: u64,
        /// Run only this benchmark (`workloads`: what DNS per workload costs, accounting off
        /// and on, and the memory per tracked cgroup); its results go to `--out` as NAME.json
        /// and NAME.md.
        #[arg(long)]
        only: Option<String>,
    },
    /// Remove sandboxes left by test runs that died (only those whose owner process is gone).
    Sweep,
    /// The privileged bpf-tests inside VMs booting Debian's 6.1 and 6.12 cloud kernels (qemu,
    /// TCG, no network device; needs root).
    VmTest(vm::VmArgs),
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.task {
        Task::Setup => {
            setup::ensure()?;
            go_peers::ensure(go_peers::Peers::Every, go_peers::Cache::Remove)
        }
        Task::Build { targets } => {
            setup::ensure()?;
            if targets.is_empty() {
                return tasks::build();
            }
            for arch in arch::Selection::arches(&targets) {
                tasks::build_agent(arch)?;
            }
            Ok(())
        }
        Task::Image(args) => {
            setup::ensure()?;
            image::run(&args)
        }
        Task::Release(args) => {
            setup::ensure()?;
            release::run(&args).map(drop)
        }
        Task::Lint => {
            setup::ensure()?;
            lint::run()
        }
        Task::Test {
            no_lint,
            no_vm,
            filter,
        } => {
            setup::ensure()?;
            pinned_rustup::enter()?;
            // Builds the Go peers too, beside the Rust builds, and what the VMs need beyond the
            // host's at idle priority beside the host's tests and the first VMs.
            let vm_builds = tasks::test(!no_lint, filter.as_deref(), !no_vm)?;
            let Some(mut vm_builds) = vm_builds else {
                eprintln!("xtask: VM tests skipped (--no-vm): only the host kernel was tested");
                return Ok(());
            };
            let started = std::time::Instant::now();
            // The node boots last: by then its programs are built.
            vm::run(
                &vm::VmArgs::suite().with_filter(filter.clone()),
                &mut || vm_builds.node_ready(),
            )?;
            vm_builds.finish()?;
            // Then the kernel's side on arm64: the subset on 6.1, under emulation.
            vm::run(&vm::VmArgs::arm64_subset().with_filter(filter), &mut || {
                Ok(())
            })?;
            eprintln!(
                "xtask: every test passed on the host and in the VMs ({:.0?} for the VMs)",
                started.elapsed()
            );
            Ok(())
        }
        Task::Demo { cache } => {
            setup::ensure()?;
            tasks::demo(&cache)
        }
        Task::Bench {
            out,
            soak_seconds,
            load_seconds,
            only,
        } => {
            setup::ensure()?;
            tasks::bench(&out, soak_seconds, load_seconds, only.as_deref())
        }
        Task::Sweep => sweep::run(),
        Task::VmTest(args) => {
            setup::ensure()?;
            go_peers::ensure(
                if args.node_boot() {
                    go_peers::Peers::Every
                } else {
                    go_peers::Peers::Host
                },
                go_peers::Cache::Remove,
            )?;
            vm::run(&args, &mut || Ok(()))
        }
    }
}
