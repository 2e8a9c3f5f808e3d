//! The drain socket: a unix socket on which a cache's stop hook (a DaemonSet's `preStop`, a
//! unit's `ExecStop`) asks the agent to drain its cache (`redirector drain --socket`), with
//! neither the pins nor CAP_BPF of its own, and on which an operator asks the agent to probe a
//! listener's cache (`redirector probe`): the agent's sockets are never steered, so its probe
//! reaches the cache whatever the listener's route, which a `dig` to the cache's address (a
//! listener address in both shipped layouts) cannot. It is no network endpoint: only a process
//! that can open the socket file (mode 0600, root's) reaches it, so a cache's pod must be given
//! the socket's directory, and nothing else, to drain.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader},
    net::{UnixListener, UnixStream},
    task::JoinHandle,
};
use tracing::{info, warn};

use super::AgentError;
use crate::liveness::{
    drain::{self, DrainReply, DrainRequest},
    probe::{self, ProbeRequest, Prober},
};

/// The listeners' probers, by name: what `redirector probe` asks for.
pub type Probers = std::sync::Arc<Vec<(String, Prober)>>;

/// How long a client has to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest request line read.
const MAX_REQUEST: u64 = 4096;

/// Binds the drain socket at `path` (replacing a stale one) and serves it on a task of its own:
/// each request opens the maps pinned under `pin_dir` and reads the caches' sockets in
/// `cache_netns`, apart from the control loop.
///
/// # Errors
///
/// [`AgentError::DrainSocket`] when the directory or the socket cannot be made.
pub fn serve(
    path: &Path,
    pin_dir: PathBuf,
    cache_netns: Option<PathBuf>,
    probers: Probers,
) -> Result<JoinHandle<()>, AgentError> {
    let failed = |source| AgentError::DrainSocket {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(failed)?;
    }
    // A socket file left by an earlier agent: nobody listens on it (the lock says this agent is
    // the only one).
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(failed(error)),
    }
    let listener = UnixListener::bind(path).map_err(failed)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(failed)?;
    info!(socket = %path.display(), "serving drains");
    Ok(tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let pin_dir = pin_dir.clone();
                    let cache_netns = cache_netns.clone();
                    tokio::spawn(answer(stream, pin_dir, cache_netns, probers.clone()));
                }
                Err(error) => {
                    warn!(error = %error, "accepting on the drain socket failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }))
}

/// Reads one request, does it, writes one reply.
async fn answer(
    stream: UnixStream,
    pin_dir: PathBuf,
    cache_netns: Option<PathBuf>,
    probers: Probers,
) {
    let (reader, mut writer) = stream.into_split();
    let mut line = String::new();
    let read = tokio::time::timeout(
        REQUEST_TIMEOUT,
        BufReader::new(tokio::io::AsyncReadExt::take(reader, MAX_REQUEST)).read_line(&mut line),
    )
    .await;
    if let Ok(Ok(_)) = &read
        && let Ok(request) = serde_json::from_str::<ProbeRequest>(&line)
    {
        let reply = probe_now(&probers, &request.probe).await;
        write_reply(&mut writer, &reply).await;
        return;
    }
    let reply = match read {
        Ok(Ok(_)) => match serde_json::from_str::<DrainRequest>(&line) {
            Ok(request) => {
                info!(selection = %request.selection, cancel = request.cancel, wait = request.wait, "drain requested");
                let done = tokio::task::spawn_blocking(move || {
                    drain::handle(&pin_dir, cache_netns.as_deref(), &request)
                })
                .await;
                match done {
                    Ok(Ok(message)) => DrainReply { ok: true, message },
                    Ok(Err(error)) => {
                        let message = crate::error_chain(&error);
                        warn!(error = %message, "a drain failed");
                        DrainReply { ok: false, message }
                    }
                    Err(error) => DrainReply {
                        ok: false,
                        message: format!("the drain's task failed: {error}"),
                    },
                }
            }
            Err(error) => DrainReply {
                ok: false,
                message: format!("not a drain request ({error}): use `redirector drain --socket`"),
            },
        },
        Ok(Err(error)) => DrainReply {
            ok: false,
            message: format!("reading the request failed: {error}"),
        },
        Err(_) => DrainReply {
            ok: false,
            message: "no request within 5 s".to_owned(),
        },
    };
    write_reply(&mut writer, &reply).await;
}

/// Probes listener `name`'s cache once, as the agent's probes do.
async fn probe_now(probers: &Probers, name: &str) -> DrainReply {
    let Some((_, prober)) = probers.iter().find(|(listener, _)| listener == name) else {
        let known: Vec<&str> = probers
            .iter()
            .map(|(listener, _)| listener.as_str())
            .collect();
        return DrainReply {
            ok: false,
            message: format!(
                "the agent has no listener {name:?}; its listeners: {}",
                known.join(", ")
            ),
        };
    };
    let outcome = prober.probe().await;
    info!(listener = %name, outcome = ?outcome, "probe asked for on the drain socket");
    DrainReply {
        ok: outcome.is_alive(),
        message: probe::describe(name, prober.target(), &outcome),
    }
}

/// Writes one reply line; a client that left gets none.
async fn write_reply(writer: &mut tokio::net::unix::OwnedWriteHalf, reply: &DrainReply) {
    let Ok(mut text) = serde_json::to_string(reply) else {
        return;
    };
    text.push('\n');
    let _ = writer.write_all(text.as_bytes()).await;
}
