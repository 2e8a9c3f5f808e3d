//! `redirector probe`: ask a listener's cache whether it serves, in a way the programs cannot
//! steer. In both shipped layouts the cache listens on a listener address, so a `dig` to it from
//! the node is itself steered upstream while the listener is failed over, and reports the
//! upstreams' health; the agent's own sockets are never steered, so the agent runs the probe (the
//! one its failover decisions use: the listener's `probe_name`, `probe.timeout_ms`, from the
//! caches' namespace) and says what answered. It asks over the agent's drain socket, so it needs
//! a running agent and no privilege but the socket's.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context as _, bail};
use redirector::{
    config::{Config, DEFAULT_CONFIG_PATH, DEFAULT_DRAIN_SOCKET},
    liveness::probe::ProbeRequest,
};

use super::drain::ask_agent;

#[derive(clap::Args, Debug)]
pub(crate) struct ProbeArgs {
    /// The listener's name, as in the configuration.
    #[arg(long)]
    pub(crate) listener: String,
    /// The agent's drain socket (default: `drain_socket` of the configuration).
    #[arg(long)]
    pub(crate) socket: Option<PathBuf>,
    /// The agent's configuration file, for its drain socket (the default socket is used when
    /// the file does not exist).
    #[arg(long, env = "REDIRECTOR_CONFIG", default_value = DEFAULT_CONFIG_PATH)]
    pub(crate) config: PathBuf,
}

/// The longest a probe takes (`probe.timeout_ms` is at most 10 intervals of at most a minute).
const PATIENCE: Duration = Duration::from_secs(30);

pub(crate) fn probe(args: &ProbeArgs) -> anyhow::Result<()> {
    let socket = match &args.socket {
        Some(socket) => socket.clone(),
        None if args.config.exists() => Config::load(&args.config)
            .with_context(|| format!("reading {}", args.config.display()))?
            .drain_socket
            .context(
                "the agent's configuration turns its drain socket off (drain_socket = \"\"), \
                 which `redirector probe` asks on: set one and restart the agent",
            )?,
        None => PathBuf::from(DEFAULT_DRAIN_SOCKET),
    };
    let request = ProbeRequest {
        probe: args.listener.clone(),
    };
    let reply = ask_agent(&socket, &request, "probe", PATIENCE)?;
    if reply.message.starts_with("not a drain request") {
        bail!(
            "the agent on {} does not answer probes (a release before `redirector probe`): {}",
            socket.display(),
            reply.message
        );
    }
    if !reply.ok {
        bail!("{}", reply.message);
    }
    println!("{}", reply.message);
    Ok(())
}
