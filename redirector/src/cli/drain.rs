//! `redirector drain`: move a cache's listeners upstream before planned work on the cache (a
//! restart, an upgrade), and wait until the cache has nothing left to answer; the cache's next
//! life, once the agent's probes confirm it, gets its DNS back. A drain covers the cache, not one
//! of its listeners: every listener whose cache is the one named goes. On the node it works on
//! the pinned maps itself; from a cache's pod, which has neither the pins nor CAP_BPF, it asks
//! the agent over the agent's drain socket (`--socket`). Both resolve the listeners from the
//! pinned maps, so both move the same ones.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};
use redirector::{
    config::{Config, DEFAULT_CONFIG_PATH, DEFAULT_PIN_DIR},
    liveness::drain::{
        self, DEFAULT_SETTLE_MS, DEFAULT_TIMEOUT_MS, DrainReply, DrainRequest, Member, Selection,
    },
};

use super::{runtime, stop_signal};

#[derive(clap::Args, Debug)]
pub(crate) struct DrainArgs {
    /// A listener of the cache to drain, as the configuration names it: every listener the
    /// cache serves is drained with it, those whose `cache` is the same address and those whose
    /// cache sockets the same process holds (when the processes cannot be read, by address
    /// only, which the drain says). Repeat it to name more. With neither this nor `--all`, the
    /// drain moves the one cache, when every listener is that cache's.
    #[arg(long = "listener", value_name = "NAME")]
    pub(crate) listeners: Vec<String>,
    /// Drain every listener of every cache.
    #[arg(long, conflicts_with = "listeners")]
    pub(crate) all: bool,
    /// Say which listeners the drain would move, by the configuration file (`--config`), and
    /// change nothing: to check a stop hook's arguments against the agent's configuration.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Wait until the cache has read every query it was handed and its receive queues are
    /// empty (no sooner than the drain's 250 ms grace, in which a socket that connected to the
    /// cache the moment before may still send there), then `--settle-ms` for its last answers;
    /// fail if that takes longer than `--timeout-ms` (the listeners stay drained either way).
    #[arg(long)]
    pub(crate) wait: bool,
    /// How long `--wait` waits for the cache's queues to empty.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_MS)]
    pub(crate) timeout_ms: u64,
    /// How long `--wait` gives the cache for the answers to the last queries it read (a miss it
    /// forwards takes its upstream's time).
    #[arg(long, default_value_t = DEFAULT_SETTLE_MS)]
    pub(crate) settle_ms: u64,
    /// End a drain instead (the planned work was called off): the probes may confirm the cache
    /// that serves now.
    #[arg(long, conflicts_with = "wait")]
    pub(crate) cancel: bool,
    /// Ask the running agent over its drain socket (`drain_socket` in its configuration) instead
    /// of using the pinned maps: for a cache's pod or unit without the pins or CAP_BPF.
    #[arg(long)]
    pub(crate) socket: Option<PathBuf>,
    /// Wait for SIGTERM or SIGINT first, then drain: for a container beside the cache in its
    /// pod, which Kubernetes stops at the same moment as the cache (give the cache a `preStop`
    /// sleep longer than the drain takes).
    #[arg(long)]
    pub(crate) on_sigterm: bool,
    /// The agent's configuration file: its pin directory and the caches' network namespace
    /// (defaults are used when the file does not exist); with `--dry-run`, its listeners.
    #[arg(long, env = "REDIRECTOR_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    pub(crate) config: PathBuf,
    /// The pin directory (overrides the configuration's).
    #[arg(long, env = "REDIRECTOR_PIN_DIR")]
    pub(crate) pin_dir: Option<PathBuf>,
}

pub(crate) fn drain(args: &DrainArgs) -> anyhow::Result<()> {
    let selection = Selection {
        listeners: args.listeners.clone(),
        all: args.all,
    };
    if args.dry_run {
        return dry_run(&args.config, &selection);
    }
    if args.on_sigterm {
        let runtime = runtime()?;
        let signal = runtime.block_on(async { anyhow::Ok(stop_signal()?.await) })?;
        eprintln!("{signal}: draining {selection}");
    }
    let request = DrainRequest {
        selection,
        cancel: args.cancel,
        wait: args.wait,
        timeout_ms: args.timeout_ms,
        settle_ms: args.settle_ms,
    };
    if let Some(socket) = &args.socket {
        // The agent answers once the wait is over, or has failed.
        let patience = Duration::from_millis(request.timeout_ms + request.settle_ms);
        let reply = ask_agent(socket, &request, "drain", patience)?;
        // An agent from before whole-cache drains reads a request only with a `listener` in it.
        if !reply.ok && reply.message.starts_with("not a drain request") {
            bail!(
                "the agent on {} is from a release that drains one listener named with \
                 --listener and no other way: name one (that listener alone is drained), or \
                 upgrade the agent ({})",
                socket.display(),
                reply.message
            );
        }
        if !reply.ok {
            bail!("the agent could not drain: {}", reply.message);
        }
        println!("{}", reply.message);
        // An agent from before whole-cache drains drained the first listener named and nothing
        // else, and says so in its own words; this release's replies name the cache.
        let first = request.selection.listeners.first();
        if first.is_some_and(|name| {
            reply
                .message
                .starts_with(&format!("listener {name}: drained"))
        }) {
            bail!(
                "the agent on {} is from a release that drains only the listener named: it \
                 drained {} alone, and the cache's other listeners still send to it, so \
                 stopping the cache loses their queries; upgrade the agent, or until then run \
                 one `redirector drain --listener NAME` for each listener of the cache",
                socket.display(),
                first.map_or("one listener", String::as_str)
            );
        }
        return Ok(());
    }
    let (pin_dir, cache_netns) = if args.config.exists() {
        let config = Config::load(&args.config)?;
        (config.pin_dir, config.cache_netns)
    } else {
        (PathBuf::from(DEFAULT_PIN_DIR), None)
    };
    let pin_dir = args.pin_dir.clone().unwrap_or(pin_dir);
    let message = drain::handle(&pin_dir, cache_netns.as_deref(), &request)?;
    println!("{message}");
    Ok(())
}

/// Prints the caches and listeners `selection` names in the configuration at `path`.
fn dry_run(path: &Path, selection: &Selection) -> anyhow::Result<()> {
    let config = Config::load(path)
        .context("--dry-run reads the agent's configuration: give its file with --config")?;
    let listeners: Vec<Member> = config
        .listeners
        .iter()
        .enumerate()
        .map(|(index, listener)| Member {
            id: u32::try_from(index).unwrap_or(u32::MAX),
            name: listener.name.clone(),
            cache: listener.cache,
        })
        .collect();
    let caches = selection
        .resolve(&listeners, &[])
        .with_context(|| format!("in {}", path.display()))?;
    for cache in caches {
        println!("would drain {cache}");
    }
    println!(
        "(by the configuration's cache addresses; the drain itself also brings every listener \
         whose cache sockets a process of these caches holds, and says which it moved)"
    );
    Ok(())
}

/// Sends `request` (a `what`, for messages) on the agent's drain socket and reads its one-line
/// reply, waiting `patience` and 5 s more for it.
pub(crate) fn ask_agent(
    socket: &Path,
    request: &impl serde::Serialize,
    what: &str,
    patience: Duration,
) -> anyhow::Result<DrainReply> {
    let mut stream = UnixStream::connect(socket).with_context(|| {
        format!(
            "cannot reach the agent's drain socket {} (is the agent running, and is the socket's \
             directory mounted here?)",
            socket.display()
        )
    })?;
    stream
        .set_read_timeout(Some(patience + Duration::from_secs(5)))
        .context("setting the drain socket's timeout")?;
    let mut line =
        serde_json::to_string(request).with_context(|| format!("encoding the {what}"))?;
    line.push('\n');
    stream
        .write_all(line.as_bytes())
        .with_context(|| format!("sending the {what}"))?;
    let mut reply = String::new();
    BufReader::new(stream)
        .read_line(&mut reply)
        .with_context(|| format!("reading the agent's answer to the {what}"))?;
    serde_json::from_str(&reply)
        .with_context(|| format!("the agent's answer to the {what} is not one: {reply:?}"))
}
