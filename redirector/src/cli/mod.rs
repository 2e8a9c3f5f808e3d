//! The subcommands, one file each, and what they share: the runtime, the stop signal, logging
//! and the tests' switch for absent kernel features.

pub(crate) mod cache;
pub(crate) mod check_config;
pub(crate) mod drain;
pub(crate) mod probe;
pub(crate) mod run;
pub(crate) mod state;
pub(crate) mod status;
pub(crate) mod top;
pub(crate) mod uninstall;

use anyhow::Context as _;
use clap::ValueEnum;
use redirector::sys::kernel_support;
use tracing_subscriber::EnvFilter;

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LogFormat {
    /// Lines for people.
    Human,
    /// One JSON object per line, for log pipelines.
    Json,
}

/// A single-threaded runtime for one command.
pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Resolves with the signal's name at the first SIGTERM or SIGINT (call it inside a runtime).
pub(crate) fn stop_signal() -> anyhow::Result<impl Future<Output = &'static str>> {
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

pub(crate) fn init_logging(filter: &str, format: LogFormat) -> anyhow::Result<()> {
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

/// Whether the test-only switch `variable` is set to 1: `REDIRECTOR_TEST_LAYOUT_BUMP` (start as a
/// release whose layout differs: every map migrates, the pins record the next layout and hold a
/// map this release does not know) or `REDIRECTOR_TEST_FAIL_AFTER_LOAD` (fail the start after
/// the load and the migration, before anything runs) or `REDIRECTOR_TEST_FAIL_BEFORE_ATTACH`
/// (fail the start after it wrote the maps the running programs share, before the swap).
pub(crate) fn test_switch(variable: &str) -> bool {
    std::env::var_os(variable).is_some_and(|value| value == "1")
}

/// `REDIRECTOR_TEST_ABSENT_FEATURES`: kernel features the agent and `status` take as absent, so
/// that tests run the degraded paths on kernels that have everything.
pub(crate) fn absent_features_for_tests() -> anyhow::Result<Vec<&'static str>> {
    let variable = kernel_support::ABSENT_FOR_TESTS_VARIABLE;
    match std::env::var(variable) {
        Ok(list) => Ok(kernel_support::parse_absent(&list)?),
        Err(std::env::VarError::NotPresent) => Ok(Vec::new()),
        Err(error) => Err(error).with_context(|| format!("reading {variable}")),
    }
}
