//! `redirector status`: every listener from the pinned state.

use std::path::PathBuf;

use redirector::{
    config::{Config, ConntrackSettings, DEFAULT_CONFIG_PATH, DEFAULT_LOCK_FILE, DEFAULT_PIN_DIR},
    conntrack_bypass::nft::Nft,
    datapath::Maps,
    sys::{kernel_support, netns::NetnsWorker},
    telemetry,
};

use super::{absent_features_for_tests, runtime};

#[derive(clap::Args, Debug)]
pub(crate) struct StatusArgs {
    /// The agent's configuration file: its pin directory, lock file, caches' namespace and nft
    /// (defaults are used when the file does not exist).
    #[arg(long, env = "REDIRECTOR_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    pub(crate) config: PathBuf,
    /// The pin directory (overrides the configuration's).
    #[arg(long, env = "REDIRECTOR_PIN_DIR")]
    pub(crate) pin_dir: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn status(args: &StatusArgs) -> anyhow::Result<()> {
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
