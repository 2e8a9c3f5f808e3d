//! `redirector run`: the agent.

use std::path::PathBuf;

use anyhow::bail;
use redirector::{
    agent::{Agent, StartOptions},
    config::{Config, DEFAULT_CONFIG_PATH},
};

use super::{LogFormat, absent_features_for_tests, init_logging, runtime, stop_signal};

#[derive(clap::Args, Debug)]
pub(crate) struct RunArgs {
    /// The configuration file (TOML).
    #[arg(long, env = "REDIRECTOR_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    pub(crate) config: PathBuf,
    /// The cgroup v2 directory to attach to (overrides `cgroup`; default: the cgroup v2 root).
    #[arg(long, env = "REDIRECTOR_CGROUP")]
    pub(crate) cgroup: Option<PathBuf>,
    /// The bpffs directory to pin maps in (overrides `pin_dir`).
    #[arg(long, env = "REDIRECTOR_PIN_DIR")]
    pub(crate) pin_dir: Option<PathBuf>,
    /// Log filter: error, warn, info, debug, trace, or tracing directives (overrides `log_level`).
    #[arg(long, env = "REDIRECTOR_LOG")]
    pub(crate) log_level: Option<String>,
    /// Reset: remove every pinned program and map before loading, instead of adopting or
    /// migrating them. DNS to the listeners passes unsteered (and an operator's modes, socket
    /// counts and translations are lost) until the new programs are attached; no upgrade or
    /// rollback needs it.
    #[arg(long)]
    pub(crate) replace: bool,
    /// The kernel programs log their decisions into this log (debugging; overrides
    /// `kernel_log`).
    #[arg(long)]
    pub(crate) kernel_log: bool,
    /// Log format: human (default) or json (one object per line).
    #[arg(long, env = "REDIRECTOR_LOG_FORMAT", value_enum, default_value_t = LogFormat::Human)]
    pub(crate) log_format: LogFormat,
}

pub(crate) fn run(args: RunArgs) -> anyhow::Result<()> {
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

    tracing::info!(
        version = redirector::release::VERSION,
        commit = redirector::release::COMMIT,
        layout = redirector::release::LAYOUT,
        "starting redirector"
    );
    let runtime = runtime()?;
    runtime.block_on(async {
        let stop = stop_signal()?;
        let options = StartOptions {
            replace: args.replace,
            absent_features: absent_features_for_tests()?,
            layout_bump: super::test_switch("REDIRECTOR_TEST_LAYOUT_BUMP"),
            fail_after_load: super::test_switch("REDIRECTOR_TEST_FAIL_AFTER_LOAD"),
            fail_before_attach: super::test_switch("REDIRECTOR_TEST_FAIL_BEFORE_ATTACH"),
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
