//! build, test and demo.

use std::{path::PathBuf, process::Command, time::Instant};

use anyhow::{Context as _, bail};

use crate::{
    arch::Arch,
    go_peers::{Cache, Peers},
    idle_builds::IdleBuilds,
    lint::{self, cargo},
    pinned_rustup, sweep,
    workspace::{USERSPACE, target_dir, workspace_root},
};

pub fn require_root(task: &str) -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "`cargo xtask {task}` loads eBPF programs and creates cgroups and network namespaces: \
             it needs root. Run it as root, or with `sudo -E env PATH=$PATH cargo xtask {task}`"
        );
    }
    Ok(())
}

/// `cargo` arguments that build the redirector binary the tests run: with the embedded cache
/// they use as a node cache (the feature bpf-tests asks of it, so that the workspace's
/// `cargo test` builds the same binary and does not build it again).
pub const TESTED_BINARY_BUILD: &[&str] = &[
    "build",
    "--package",
    "redirector",
    "--features",
    "redirector/embedded-cache",
    "--bins",
];

/// Builds everything (the eBPF object comes with the `redirector` crate's build script).
pub fn build() -> anyhow::Result<()> {
    cargo(
        &[&["build", "--all-targets"], &USERSPACE[..]].concat(),
        "the build failed",
    )
}

/// The `cargo build` arguments of the shipped agent for `arch`: static musl, release, with the
/// locked dependencies; the Containerfile's build stage runs the same (a unit test keeps them
/// equal).
pub fn agent_build_args(arch: Arch) -> Vec<&'static str> {
    vec![
        "build",
        "--release",
        "--locked",
        "--package",
        "redirector",
        "--target",
        arch.musl_target(),
    ]
}

/// `cargo ARGS` for `arch`: the host's as every other build here runs it; another's for its
/// static musl target, with what that needs (`Arch::cargo_env`), and without what `cargo run`
/// set for xtask itself: ring's build script tracks CARGO_MANIFEST_DIR, so with it a `cargo
/// build` by hand and this one would each rebuild what the other built.
pub fn cargo_for(arch: Arch, args: &[&str]) -> Command {
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    build.args(args);
    if arch == Arch::host() {
        return build;
    }
    build
        .args(["--target", arch.musl_target()])
        .envs(arch.cargo_env());
    remove_cargo_run_env(&mut build);
    build
}

/// Removes from `build` what `cargo run` set for xtask itself (see [`cargo_for`]).
pub fn remove_cargo_run_env(build: &mut Command) {
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_MANIFEST_")
            || [
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
            ]
            .contains(&name.as_ref())
        {
            build.env_remove(name.as_ref());
        }
    }
}

/// Builds the shipped agent for `arch` (the eBPF object it embeds is built from the same source
/// for every architecture), checks that the binary is a static ELF executable of that
/// architecture, and returns its path.
pub fn build_agent(arch: Arch) -> anyhow::Result<PathBuf> {
    let started = Instant::now();
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    build.args(agent_build_args(arch)).envs(arch.cargo_env());
    remove_cargo_run_env(&mut build);
    lint::check(
        &mut build,
        &format!("building the agent for {} failed", arch.name()),
    )?;
    let binary = target_dir()
        .join(arch.musl_target())
        .join("release/redirector");
    crate::elf::check_static_binary(&binary, arch)?;
    let size = std::fs::metadata(&binary)
        .with_context(|| format!("reading {}", binary.display()))?
        .len();
    eprintln!(
        "xtask: built the agent for {} in {:.0?}: {} (a static {} ELF executable, {:.1} MB)",
        arch.name(),
        started.elapsed(),
        binary.display(),
        arch.name(),
        size as f64 / 1e6,
    );
    Ok(binary)
}

/// Builds the binary the tests run ([`TESTED_BINARY_BUILD`]) for another architecture than the
/// host's, as the arm64 VMs build it (so that they build nothing again), checks that it is a
/// static ELF executable of that architecture, and returns its path.
pub fn build_tested_agent(arch: Arch) -> anyhow::Result<PathBuf> {
    lint::check(
        &mut cargo_for(arch, TESTED_BINARY_BUILD),
        &format!("building the tested agent for {} failed", arch.name()),
    )?;
    let binary = target_dir()
        .join(arch.musl_target())
        .join("debug/redirector");
    crate::elf::check_static_binary(&binary, arch)?;
    Ok(binary)
}

/// Builds and runs the host's tests (with the lints, `with_lints`); with `vms`, returns the builds
/// the VMs need beyond the host's, begun at idle priority beside the host's tests
/// ([`IdleBuilds`]: the VM runs wait for them where they need them). Privileged tests are not
/// optional: without root this fails before running any.
pub fn test(
    with_lints: bool,
    filter: Option<&str>,
    vms: bool,
) -> anyhow::Result<Option<IdleBuilds>> {
    require_root("test")?;
    let started = Instant::now();
    sweep::run()?;
    report_free_space("at the start");
    let mut test = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    // The Go peers the host's tests run build beside the lints and the Rust builds, which leave
    // the cores idle at times (build scripts, links); only the tests need them. The scope waits
    // for both. The node's build later, from the same build cache.
    std::thread::scope(|scope| {
        let go_peers = scope.spawn(|| {
            crate::go_peers::ensure(Peers::Host, if vms { Cache::Keep } else { Cache::Remove })
        });
        let rust = build_for_tests(with_lints, &mut test);
        let go_peers = go_peers
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the Go peers' build panicked")));
        rust.and(go_peers)
    })?;
    if let Some(filter) = filter {
        test.args(["--", filter]);
    }
    report_free_space("before the tests");
    // Dropped on a failure, it stops after the build at work.
    let for_vms = vms.then(IdleBuilds::start);
    let tested = lint::check(&mut test, "tests failed");
    // The machine's disk is shared: a build or a test that fails for want of space says so here.
    report_free_space("after the tests");
    tested?;
    eprintln!("xtask: every test passed in {:.0?}", started.elapsed());
    Ok(for_vms)
}

/// Prints the space left on the target directory's file system.
fn report_free_space(when: &str) {
    let target = target_dir();
    match nix::sys::statvfs::statvfs(&target) {
        Ok(stat) => eprintln!(
            "xtask: {:.1} GiB free on {}'s file system {when}",
            (u128::from(stat.blocks_available()) * u128::from(stat.fragment_size())) as f64
                / f64::from(1u32 << 30),
            target.display()
        ),
        Err(error) => eprintln!(
            "xtask: cannot read the free space of {}: {error}",
            target.display()
        ),
    }
}

/// The lints (with `with_lints`) and the builds the tests run: the redirector binary, and the
/// other architectures' agents for the image test, named in `test`'s environment.
fn build_for_tests(with_lints: bool, test: &mut Command) -> anyhow::Result<()> {
    if with_lints {
        lint::run()?;
    }
    // The CLI tests run the real binary.
    cargo(TESTED_BINARY_BUILD, "building the redirector binary failed")?;
    pinned_rustup::check_object(&target_dir().join("debug/build"))?;
    let binary = target_dir().join("debug/redirector");
    test.arg("test")
        .args(USERSPACE)
        .arg("--no-fail-fast")
        .env("REDIRECTOR_BIN", &binary);
    // The image test builds the other architectures' images from the binaries the tests run
    // there (the arm64 VMs reuse the build).
    for arch in Arch::ALL.into_iter().filter(|arch| *arch != Arch::host()) {
        let agent = build_tested_agent(arch)?;
        test.env(
            format!("REDIRECTOR_BIN_{}", arch.name().to_uppercase()),
            agent,
        );
    }
    Ok(())
}

/// Builds and runs the demo.
pub fn demo(cache: &str) -> anyhow::Result<()> {
    require_root("demo")?;
    sweep::run()?;
    cargo(
        &[
            "build",
            "--package",
            "redirector",
            "--package",
            "bpf-tests",
            "--package",
            "redirector-demo",
            "--bins",
        ],
        "building the demo failed",
    )?;
    let dir = target_dir().join("debug");
    let mut demo = Command::new(dir.join("demo"));
    demo.args(["--cache", cache])
        .env("REDIRECTOR_BIN", dir.join("redirector"))
        .env("DNS_SERVER_BIN", dir.join("dns-server"))
        .env("DNS_QUERY_BIN", dir.join("dns-query"))
        .env("DNS_STREAM_BIN", dir.join("dns-stream"));
    lint::check(&mut demo, "the demo failed").context("running the demo")
}

/// Builds the agent and the bench with optimizations and runs the bench; the results (JSON,
/// Markdown, SVG charts) go to `out`. Run it on an otherwise idle machine: its comparisons are
/// ratios taken in the same run, but a busy neighbour still widens every spread. `only` names the
/// one benchmark to run (the bench's `--only`).
pub fn bench(
    out: &std::path::Path,
    soak_seconds: u64,
    load_seconds: u64,
    only: Option<&str>,
) -> anyhow::Result<()> {
    require_root("bench")?;
    sweep::run()?;
    cargo(
        &[
            "build",
            "--release",
            "--package",
            "redirector",
            "--package",
            "bpf-tests",
            "--package",
            "redirector-bench",
            "--bins",
        ],
        "building the bench failed",
    )?;
    let dir = target_dir().join("release");
    // A relative `out` is from the workspace root; an absolute one replaces it.
    let out = workspace_root().join(out);
    let mut bench = Command::new(dir.join("bench"));
    bench
        .arg("--out")
        .arg(&out)
        .args(["--soak-seconds", &soak_seconds.to_string()])
        .args(["--load-seconds", &load_seconds.to_string()])
        .env("REDIRECTOR_BIN", dir.join("redirector"));
    if let Some(only) = only {
        bench.args(["--only", only]);
    }
    lint::check(&mut bench, "the bench failed").context("running the bench")
}
