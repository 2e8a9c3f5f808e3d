//! `redirector`: the agent and its command line. This file parses and dispatches; each
//! subcommand is a file of `cli/`.

mod cli;

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use redirector::config::DEFAULT_CONFIG_PATH;

use crate::cli::{
    drain::DrainArgs, probe::ProbeArgs, run::RunArgs, state::StateArgs, status::StatusArgs,
    top::TopArgs,
};

#[derive(Parser, Debug)]
#[command(version = redirector::release::describe(), about = "eBPF fast-path DNS redirector for Kubernetes nodes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Load (or adopt) and attach the programs, fill the maps, and keep them true until SIGINT or
    /// SIGTERM; the programs stay attached after it stops.
    Run(RunArgs),
    /// Detach the programs and remove every pin, the listener addresses and the lock.
    Uninstall {
        /// The configuration file the agent ran with.
        #[arg(long, env = "REDIRECTOR_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
    },
    /// Force a listener to the cache or to its upstreams, or give it back to automatic failover.
    State(StateArgs),
    /// Move a cache's listeners, every one, upstream before planned work on the cache (until its
    /// next life is confirmed), optionally waiting until it has answered what it was handed.
    Drain(DrainArgs),
    /// Ask a listener's cache whether it serves, through the running agent, whose sockets the
    /// programs never steer (a `dig` to the cache's address may be steered upstream).
    Probe(ProbeArgs),
    /// Show every listener's state, the programs, the conntrack bypass and whether an agent
    /// runs, from the pinned maps (works while the agent is stopped).
    Status(StatusArgs),
    /// Show the busiest workloads' DNS live: queries per second, the share of each route, and
    /// their NXDOMAIN and SERVFAIL ratios, refreshed like top (from the pinned maps).
    Top(TopArgs),
    /// Run the embedded caching DNS forwarder (a small stand-in for CoreDNS on a dev box or in
    /// a demo) until SIGINT or SIGTERM. Only in builds with the `embedded-cache` feature.
    Cache {
        /// Its configuration file (TOML: listen, default_servers, [[zone]], ...).
        #[arg(long)]
        config: PathBuf,
        /// Log filter.
        #[arg(long, env = "REDIRECTOR_LOG", default_value = "info")]
        log_level: String,
    },
    /// Validate a configuration file and exit.
    CheckConfig {
        /// The configuration file.
        #[arg(long, env = "REDIRECTOR_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
        config: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => cli::run::run(args),
        Command::Uninstall { config } => cli::uninstall::uninstall(&config),
        Command::State(args) => cli::state::set_state(&args),
        Command::Drain(args) => cli::drain::drain(&args),
        Command::Probe(args) => cli::probe::probe(&args),
        Command::Status(args) => cli::status::status(&args),
        Command::Top(args) => cli::top::top(&args),
        Command::Cache { config, log_level } => cli::cache::cache(&config, &log_level),
        Command::CheckConfig { config } => cli::check_config::check_config(&config),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
