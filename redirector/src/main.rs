//! `redirector`: the agent and its command line.

use std::{path::PathBuf, process::ExitCode};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand, ValueEnum};
use redirector::{
    agent::{Agent, StartOptions},
    config::{Config, ConntrackSettings, DEFAULT_CONFIG_PATH, DEFAULT_LOCK_FILE, DEFAULT_PIN_DIR},
    conntrack_bypass::nft::Nft,
    datapath::Maps,
    kernel_support,
    netns::NetnsWorker,
    telemetry,
};
use redirector_common::listener::{LIVENESS_SOCKETS_AND_PROBES, Route, explain};
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(version, about = "eBPF fast-path DNS redirector for Kubernetes nodes")]
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
    /// Show every listener's state, the programs, the conntrack bypass and whether an agent
    /// runs, from the pinned maps (works while the agent is stopped).
    Status(StatusArgs),
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

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// The configuration file (TOML).
    #[arg(long, env = "REDIRECTOR_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// The cgroup v2 directory to attach to (overrides `cgroup`; default: the cgroup v2 root).
    #[arg(long, env = "REDIRECTOR_CGROUP")]
    cgroup: Option<PathBuf>,
    /// The bpffs directory to pin maps in (overrides `pin_dir`).
    #[arg(long, env = "REDIRECTOR_PIN_DIR")]
    pin_dir: Option<PathBuf>,
    /// Log filter: error, warn, info, debug, trace, or tracing directives (overrides `log_level`).
    #[arg(long, env = "REDIRECTOR_LOG")]
    log_level: Option<String>,
    /// Replace pins of another redirector version instead of refusing to start.
    #[arg(long)]
    replace: bool,
    /// The kernel programs log their decisions into this log (debugging; overrides
    /// `kernel_log`).
    #[arg(long)]
    kernel_log: bool,
    /// Log format: human (default) or json (one object per line).
    #[arg(long, env = "REDIRECTOR_LOG_FORMAT", value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    /// Lines for people.
    Human,
    /// One JSON object per line, for log pipelines.
    Json,
}

#[derive(clap::Args, Debug)]
struct StatusArgs {
    /// The agent's configuration file: its pin directory, lock file, caches' namespace and nft
    /// (defaults are used when the file does not exist).
    #[arg(long, env = "REDIRECTOR_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// The pin directory (overrides the configuration's).
    #[arg(long, env = "REDIRECTOR_PIN_DIR")]
    pin_dir: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct StateArgs {
    /// The listener's name, as in the configuration.
    #[arg(long)]
    listener: String,
    /// The new mode.
    #[arg(long, value_enum)]
    set: Mode,
    /// The running agent's pin directory.
    #[arg(long, env = "REDIRECTOR_PIN_DIR", default_value = DEFAULT_PIN_DIR)]
    pin_dir: PathBuf,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Always the cache.
    Cache,
    /// Always the upstream pool.
    Upstream,
    /// Follow the cache's health.
    Auto,
}

impl From<Mode> for redirector_common::settings::Mode {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::Cache => Self::Cache,
            Mode::Upstream => Self::Upstream,
            Mode::Auto => Self::Auto,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Uninstall { config } => uninstall(&config),
        Command::State(args) => set_state(&args),
        Command::Status(args) => status(&args),
        Command::Cache { config, log_level } => cache(&config, &log_level),
        Command::CheckConfig { config } => check_config(&config),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// A single-threaded runtime for one command.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Resolves with the signal's name at the first SIGTERM or SIGINT (call it inside a runtime).
fn stop_signal() -> anyhow::Result<impl Future<Output = &'static str>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        }
    })
}

fn init_logging(filter: &str, format: LogFormat) -> anyhow::Result<()> {
    let filter = EnvFilter::try_new(filter).with_context(|| {
        format!("the log level {filter:?} is not a valid filter (try info or debug)")
    })?;
    // Colours only for a terminal: journald, kubectl logs and log shippers would keep the
    // escape sequences.
    let logger = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => logger.init(),
        LogFormat::Json => logger.json().flatten_event(true).init(),
    }
    Ok(())
}

fn run(args: RunArgs) -> anyhow::Result<()> {
    let mut config = Config::load(&args.config)?;
    if let Some(cgroup) = args.cgroup {
        config.cgroup = Some(cgroup);
    }
    if let Some(pin_dir) = args.pin_dir {
        config.pin_dir = pin_dir;
    }
    config.kernel_log |= args.kernel_log;
    let filter = args
        .log_level
        .or_else(|| config.log_level.clone())
        .unwrap_or_else(|| "info".to_owned());
    init_logging(&filter, args.log_format)?;
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "redirector run needs root (CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN): run it with sudo or as a systemd service"
        );
    }

    let runtime = runtime()?;
    runtime.block_on(async {
        let stop = stop_signal()?;
        let options = StartOptions {
            replace: args.replace,
            absent_features: absent_features_for_tests()?,
        };
        let mut agent = Agent::start(&config, options).await?;
        let ran = agent
            .run(async {
                let signal = stop.await;
                tracing::info!(signal, "stopping");
            })
            .await;
        agent.shutdown();
        Ok(ran?)
    })
}

fn uninstall(path: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    init_logging(
        config.log_level.as_deref().unwrap_or("warn"),
        LogFormat::Human,
    )?;
    let runtime = runtime()?;
    let report = runtime.block_on(redirector::agent::uninstall(&config))?;
    println!(
        "uninstalled: {}; pins under {} removed{}{}",
        if report.detached {
            "programs detached"
        } else {
            "no programs were attached"
        },
        config.pin_dir.display(),
        report
            .interface
            .map(|name| format!("; listener addresses removed from {name}"))
            .unwrap_or_default(),
        if report.conntrack_table_removed {
            "; nftables table inet redirector removed"
        } else {
            ""
        }
    );
    Ok(())
}

fn set_state(args: &StateArgs) -> anyhow::Result<()> {
    let mut maps = Maps::open_pinned(&args.pin_dir)?;
    let Some((id, info)) = maps.listener_by_name(&args.listener)? else {
        let known: Vec<String> = maps
            .listeners()?
            .iter()
            .filter_map(|(_, info)| info.name().map(str::to_owned))
            .collect();
        bail!(
            "there is no listener {:?}; the running agent has: {}",
            args.listener,
            known.join(", ")
        );
    };
    let address = std::net::IpAddr::from(info.addr);
    let previous = maps.mode(id)?;
    maps.set_mode(id, args.set.into())?;
    let mode = maps.mode(id)?;
    let liveness = maps
        .listener_config(address)?
        .map_or(LIVENESS_SOCKETS_AND_PROBES, |config| config.liveness);
    let (route, reason) = explain(liveness, &mode, &maps.health(id)?, &maps.socket_counts(id)?);
    let target = match route {
        Route::Cache => "the cache",
        Route::Upstream => "the upstream pool",
    };
    println!(
        "listener {} ({address}): mode {} (was {}); DNS goes to {target} ({})",
        args.listener,
        telemetry::snapshot::mode_name(mode.mode),
        telemetry::snapshot::mode_name(previous.mode),
        telemetry::snapshot::reason_text(reason),
    );
    Ok(())
}

fn status(args: &StatusArgs) -> anyhow::Result<()> {
    // Without a configuration file, the defaults say where to look.
    let (pin_dir, lock_file, cache_netns, nft_binary) = if args.config.exists() {
        let config = Config::load(&args.config)?;
        (
            config.pin_dir,
            config.lock_file,
            config.cache_netns,
            config.conntrack.nft,
        )
    } else {
        (
            PathBuf::from(DEFAULT_PIN_DIR),
            PathBuf::from(DEFAULT_LOCK_FILE),
            None,
            ConntrackSettings::default().nft,
        )
    };
    let pin_dir = args.pin_dir.clone().unwrap_or(pin_dir);
    let runtime = runtime()?;
    let maps = Maps::open_pinned(&pin_dir)?;
    let kernel = kernel_support::KernelSupport::probe(&absent_features_for_tests()?);
    let report = runtime.block_on(async {
        // The table is looked at in the caches' namespace; not being able to is no reason to
        // hide the rest of the report.
        let nft =
            NetnsWorker::start(cache_netns.as_deref()).map(|worker| Nft::new(&nft_binary, worker));
        telemetry::status::gather(&maps, &pin_dir, &lock_file, nft.as_ref(), &kernel).await
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", telemetry::status::render_table(&report));
    }
    Ok(())
}

/// `REDIRECTOR_TEST_ABSENT_FEATURES`: kernel features the agent and `status` take as absent, so
/// that tests run the degraded paths on kernels that have everything.
fn absent_features_for_tests() -> anyhow::Result<Vec<&'static str>> {
    let variable = kernel_support::ABSENT_FOR_TESTS_VARIABLE;
    match std::env::var(variable) {
        Ok(list) => Ok(kernel_support::parse_absent(&list)?),
        Err(std::env::VarError::NotPresent) => Ok(Vec::new()),
        Err(error) => Err(error).with_context(|| format!("reading {variable}")),
    }
}

#[cfg(feature = "embedded-cache")]
fn cache(path: &std::path::Path, log_level: &str) -> anyhow::Result<()> {
    use dns_cache::{CacheConfig, CacheServer};

    let config = CacheConfig::load(path)?;
    init_logging(log_level, LogFormat::Human)?;
    let runtime = runtime()?;
    runtime.block_on(async {
        let stop = stop_signal()?;
        let server = CacheServer::bind(config).await?;
        tracing::info!(
            listen = ?server.local_addrs(),
            "embedded cache serving"
        );
        server
            .serve(async {
                stop.await;
            })
            .await;
        tracing::info!("embedded cache stopped");
        anyhow::Ok(())
    })
}

/// The agent's production build leaves the embedded cache out: no deployment runs it.
#[cfg(not(feature = "embedded-cache"))]
fn cache(_path: &std::path::Path, _log_level: &str) -> anyhow::Result<()> {
    bail!(
        "this redirector was built without the embedded cache (a tool for dev boxes, demos and \
         tests, left out of the agent's production build); build one that has it with \
         `cargo build --package redirector --features embedded-cache`"
    )
}

fn check_config(path: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    println!(
        "{}: valid, {} listener(s): {}",
        path.display(),
        config.listeners.len(),
        config
            .listeners
            .iter()
            .map(|listener| format!("{} ({})", listener.name, listener.address))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
