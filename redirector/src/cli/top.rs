//! `redirector top`: the busiest workloads' DNS, read from the pinned maps twice a window.

use std::{io::IsTerminal as _, io::Write as _, path::PathBuf, time::Duration};

use anyhow::Context as _;
use redirector::{
    config::{Config, DEFAULT_CONFIG_PATH, DEFAULT_LOCK_FILE, DEFAULT_PIN_DIR},
    datapath::Maps,
    telemetry::top::{self, SortKey},
    workloads::{self, rates::Rates},
};

/// The shortest window: shorter ones read every tracked cgroup too often for rates worth reading.
const MIN_INTERVAL_MS: u64 = 200;

#[derive(clap::Args, Debug)]
pub(crate) struct TopArgs {
    /// The agent's configuration file: its pin directory (the default is used when the file
    /// does not exist).
    #[arg(long, env = "REDIRECTOR_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    pub(crate) config: PathBuf,
    /// The pin directory (overrides the configuration's).
    #[arg(long, env = "REDIRECTOR_PIN_DIR")]
    pub(crate) pin_dir: Option<PathBuf>,
    /// Milliseconds between refreshes: the window the rates are over.
    #[arg(long, default_value_t = 2000)]
    pub(crate) interval_ms: u64,
    /// Refreshes to show before exiting (0: until interrupted).
    #[arg(long, default_value_t = 0)]
    pub(crate) count: u64,
    /// Workloads to show.
    #[arg(long, default_value_t = 20)]
    pub(crate) limit: usize,
    /// What to sort by, busiest first.
    #[arg(long, value_enum, default_value_t = SortKey::Qps)]
    pub(crate) sort: SortKey,
    /// One JSON object per refresh instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn top(args: &TopArgs) -> anyhow::Result<()> {
    if args.interval_ms < MIN_INTERVAL_MS {
        anyhow::bail!(
            "--interval-ms {} is too short to read rates from; give at least {MIN_INTERVAL_MS}",
            args.interval_ms
        );
    }
    let config = if args.config.exists() {
        Some(Config::load(&args.config)?)
    } else {
        None
    };
    let pin_dir = match (&args.pin_dir, &config) {
        (Some(dir), _) => dir.clone(),
        (None, Some(config)) => config.pin_dir.clone(),
        (None, None) => PathBuf::from(DEFAULT_PIN_DIR),
    };
    let lock_file = config.map_or_else(
        || PathBuf::from(DEFAULT_LOCK_FILE),
        |config| config.lock_file,
    );
    let maps = Maps::open_pinned(&pin_dir)?;
    let interval = Duration::from_millis(args.interval_ms);
    let mut resolver = workloads::cli_resolver(interval, &lock_file);
    let names_file = workloads::names_file::path(&lock_file);
    let mut rates = Rates::default();
    let terminal = std::io::stdout().is_terminal();
    let mut stdout = std::io::stdout().lock();
    let mut last = std::time::Instant::now();
    rates.read(maps.workload_counts()?, Duration::ZERO);
    let mut shown = 0;
    while args.count == 0 || shown < args.count {
        std::thread::sleep(interval);
        let now = std::time::Instant::now();
        let read = rates.read(maps.workload_counts()?, now - last);
        let window = now - last;
        last = now;
        // Pods started since are named as soon as the agent records them (a failure to read
        // the record was told once; the last names stay).
        if let (Some(named), Ok(Some(pods))) =
            (resolver.as_mut(), workloads::names_file::read(&names_file))
        {
            named.set_pods(pods);
        }
        let (read, names) = workloads::rates::by_workload(read, |cgroup| {
            workloads::name_of(resolver.as_mut(), cgroup)
        });
        let frame = top::frame(read, &names, window, args.sort, args.limit);
        if args.json {
            writeln!(stdout, "{}", serde_json::to_string(&frame)?)
        } else if terminal {
            // Home and clear, then the frame: the table refreshes in place, as top's does.
            write!(stdout, "\x1b[H\x1b[2J{}", top::render(&frame))
        } else {
            writeln!(stdout, "{}", top::render(&frame))
        }
        .and_then(|()| stdout.flush())
        .context("writing to standard output")?;
        shown += 1;
    }
    Ok(())
}
