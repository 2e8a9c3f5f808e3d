//! `redirector drain`: move a listener upstream before planned work on its cache (a restart, an
//! upgrade), and wait until the cache has nothing left to answer; the cache's next life, once
//! the agent's probes confirm it, gets its DNS back.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context as _, bail};
use redirector::{
    config::{Config, DEFAULT_CONFIG_PATH, DEFAULT_PIN_DIR},
    datapath::Maps,
    liveness::{drain, sockdiag::SocketTable},
};

#[derive(clap::Args, Debug)]
pub(crate) struct DrainArgs {
    /// The listener's name, as in the configuration.
    #[arg(long)]
    pub(crate) listener: String,
    /// Wait until the cache has read every query it was handed and its receive queues are
    /// empty, then `--settle-ms` for its last answers; fail if that takes longer than
    /// `--timeout-ms` (the listener stays drained either way).
    #[arg(long)]
    pub(crate) wait: bool,
    /// How long `--wait` waits for the cache's queues to empty.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) timeout_ms: u64,
    /// How long `--wait` gives the cache for the answers to the last queries it read (a miss it
    /// forwards takes its upstream's time).
    #[arg(long, default_value_t = 300)]
    pub(crate) settle_ms: u64,
    /// End a drain instead (the planned work was called off): the probes may confirm the cache
    /// that serves now.
    #[arg(long, conflicts_with = "wait")]
    pub(crate) cancel: bool,
    /// The agent's configuration file: its pin directory and the caches' network namespace
    /// (defaults are used when the file does not exist).
    #[arg(long, env = "REDIRECTOR_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    pub(crate) config: PathBuf,
    /// The pin directory (overrides the configuration's).
    #[arg(long, env = "REDIRECTOR_PIN_DIR")]
    pub(crate) pin_dir: Option<PathBuf>,
}

pub(crate) fn drain(args: &DrainArgs) -> anyhow::Result<()> {
    let (pin_dir, cache_netns) = if args.config.exists() {
        let config = Config::load(&args.config)?;
        (config.pin_dir, config.cache_netns)
    } else {
        (PathBuf::from(DEFAULT_PIN_DIR), None)
    };
    let pin_dir = args.pin_dir.clone().unwrap_or(pin_dir);
    let maps = Maps::open_pinned(&pin_dir)?;
    let Some((id, _)) = maps.listener_by_name(&args.listener)? else {
        let known: Vec<String> = maps
            .listeners()?
            .iter()
            .filter_map(|(_, info)| info.name().map(str::to_owned))
            .collect();
        bail!(
            "no listener {:?} in {}; the agent's listeners are: {}",
            args.listener,
            pin_dir.display(),
            known.join(", ")
        );
    };
    if args.cancel {
        if drain::end(&maps, id)? {
            println!(
                "listener {}: drain ended; its DNS goes back to the cache once the agent's probes \
                 confirm it",
                args.listener
            );
        } else {
            println!(
                "listener {}: no drain to end (the cache's next life ended it, or none began)",
                args.listener
            );
        }
        return Ok(());
    }
    let epoch = drain::begin(&maps, id)?;
    println!(
        "listener {}: drained (epoch {epoch}); its DNS goes upstream from now until the cache's \
         next life is confirmed",
        args.listener
    );
    if !args.wait {
        return Ok(());
    }
    let mut table = SocketTable::open(cache_netns.as_deref())
        .context("cannot read the caches' sockets to wait for their queues")?;
    let quiet = drain::wait_quiet(
        &maps,
        &mut table,
        id,
        Duration::from_millis(args.settle_ms),
        Duration::from_millis(args.timeout_ms),
    )?;
    println!(
        "listener {}: the cache read everything it was handed after {} ms; it can be stopped",
        args.listener,
        quiet.read_all_after.as_millis()
    );
    Ok(())
}
