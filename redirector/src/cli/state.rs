//! `redirector state`: the operator's override of a listener.

use std::path::PathBuf;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use redirector::{config::DEFAULT_PIN_DIR, datapath::Maps, telemetry};
use redirector_common::{
    listener::{LIVENESS_SOCKETS_AND_PROBES, Route},
    settings::Mode,
};

#[derive(clap::Args, Debug)]
pub(crate) struct StateArgs {
    /// The listener's name, as in the configuration.
    #[arg(long)]
    pub(crate) listener: String,
    /// The new mode: cache (always the cache), upstream (always the upstream pool) or auto
    /// (follow the cache's health).
    #[arg(long, value_parser = mode_parser())]
    pub(crate) set: Mode,
    /// The running agent's pin directory.
    #[arg(long, env = "REDIRECTOR_PIN_DIR", default_value = DEFAULT_PIN_DIR)]
    pub(crate) pin_dir: PathBuf,
}

/// `--set`'s values: the modes by the names `Mode::label` gives them everywhere else.
fn mode_parser() -> impl TypedValueParser<Value = Mode> {
    PossibleValuesParser::new(Mode::ALL.iter().map(|mode| mode.label())).map(|label| {
        Mode::ALL
            .iter()
            .copied()
            .find(|mode| mode.label() == label)
            // The parser admits only these labels.
            .unwrap_or_default()
    })
}

pub(crate) fn set_state(args: &StateArgs) -> anyhow::Result<()> {
    let mut maps = Maps::open_pinned(&args.pin_dir)?;
    let (id, info) = maps.listener_named(&args.listener)?;
    let address = std::net::IpAddr::from(info.addr);
    let previous = maps.mode(id)?;
    maps.set_mode(id, args.set)?;
    let mode = maps.mode(id)?;
    let liveness = maps
        .listener_config(address)?
        .map_or(LIVENESS_SOCKETS_AND_PROBES, |config| config.liveness);
    let (route, reason) = maps.route(id, liveness)?;
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
