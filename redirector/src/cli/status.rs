//! `redirector status`: every listener from the pinned state.

use std::path::PathBuf;

use anyhow::Context as _;

use redirector::{
    config::{Config, ConntrackSettings, DEFAULT_CONFIG_PATH, DEFAULT_LOCK_FILE, DEFAULT_PIN_DIR},
    conntrack_bypass::nft::Nft,
    datapath::{self, Maps},
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
    let maps = match Maps::open_pinned(&pin_dir) {
        Ok(maps) => maps,
        // Incomplete pins with no program on a cgroup (another release's `uninstall` removes
        // only the pins it knows): said from the links themselves, so nobody takes them for a
        // set that steers.
        Err(error)
            if datapath::has_pins(&pin_dir) && !datapath::has_pinned_attachments(&pin_dir) =>
        {
            return Err(error).context(format!(
                "no program is attached to a cgroup from {}, so nothing steers DNS: DNS to the \
                 listeners goes where it was sent; the pins there are what an uninstall left \
                 (another release's removes only the pins it knows): start the agent \
                 (`redirector run`), which removes them, or remove them: rm -r {}",
                pin_dir.display(),
                pin_dir.display()
            ));
        }
        Err(error) => return Err(error.into()),
    };
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
