//! `cargo xtask`: the project's developer tasks. Each task first makes sure the machine has what
//! it needs (`setup`), so the README's commands work on a fresh machine.

mod lint;
mod setup;
mod sweep;
mod tasks;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(about = "redirector developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand, Debug)]
enum Task {
    /// Install what is missing: nightly rust-src, LLVM 22, bpf-linker, the Debian test tools.
    Setup,
    /// Build the eBPF object and every userspace crate.
    Build,
    /// rustfmt check, and clippy with warnings denied (userspace, and the eBPF crate on its target).
    Lint,
    /// Every test: lints, unit tests, and the privileged bpf-tests (needs root).
    Test {
        /// Skip the lints (for quick iterations; CI runs them).
        #[arg(long)]
        no_lint: bool,
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
    /// Remove sandboxes left by test runs that died (only those whose owner process is gone).
    Sweep,
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
        Task::Setup => setup::ensure(),
        Task::Build => {
            setup::ensure()?;
            tasks::build()
        }
        Task::Lint => {
            setup::ensure()?;
            lint::run()
        }
        Task::Test { no_lint, filter } => {
            setup::ensure()?;
            tasks::test(!no_lint, filter.as_deref())
        }
        Task::Demo { cache } => {
            setup::ensure()?;
            tasks::demo(&cache)
        }
        Task::Sweep => sweep::run(),
    }
}
