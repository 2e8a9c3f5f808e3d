//! The agent's HTTP endpoint: `/metrics` (Prometheus), `/healthz` (the control loop turns),
//! `/readyz` (programs attached, every pool synced once).

use std::{
    collections::VecDeque, convert::Infallible, net::SocketAddr, sync::Arc, sync::Mutex,
    time::Duration,
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    Request, Response, StatusCode, body::Incoming, server::conn::http1, service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, task::AbortHandle};
use tracing::{debug, warn};

use super::{metrics, snapshot, stats::AgentStats};
use crate::datapath::Maps;

/// The endpoint could not be opened.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot listen on {address} for metrics and health: set metrics.address to a free address (or metrics.enabled = false)"
)]
pub struct BindError {
    /// The configured address.
    pub address: SocketAddr,
    /// What the OS said.
    #[source]
    pub source: std::io::Error,
}

/// What the endpoint reads.
#[derive(Debug)]
pub struct Endpoint {
    /// The agent's pinned maps, opened for reading.
    pub maps: Mutex<Maps>,
    /// What the agent observed.
    pub stats: Arc<AgentStats>,
    /// How long the control loop may go without a turn before `/healthz` fails.
    pub health_window: Duration,
}

/// At most this many connections are open at once; one more closes the oldest. Refusing the
/// newcomer instead would let any pod on the node hold every slot with idle connections and fail
/// kubelet's `/healthz` probes (restarting the agent); closing the oldest always serves a new
/// client, and a flood must open this many connections within one probe's round trip to
/// displace it.
const MAX_CONNECTIONS: usize = 128;
/// A client must send its request head within this.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// No connection lives longer than this.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// Binds `address`.
pub fn bind(address: SocketAddr) -> Result<std::net::TcpListener, BindError> {
    let listener =
        std::net::TcpListener::bind(address).map_err(|source| BindError { address, source })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| BindError { address, source })?;
    Ok(listener)
}

/// The endpoint's thread; dropping it stops the server.
#[derive(Debug)]
pub struct Server {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Serves `endpoint` on `listener` from a thread and runtime of its own, so that scrapes (or a
/// flood of connections) never delay the control loop's probes; connections are capped (the
/// oldest gives way) and timed out.
pub fn serve(listener: std::net::TcpListener, endpoint: Endpoint) -> std::io::Result<Server> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let thread = std::thread::Builder::new()
        .name("metrics".to_owned())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match TcpListener::from_std(listener) {
                    Ok(listener) => listener,
                    Err(error) => {
                        warn!(error = %error, "cannot serve metrics");
                        return;
                    }
                };
                tokio::select! {
                    _ = stopped => {}
                    () = accept_loop(listener, Arc::new(endpoint)) => {}
                }
            });
        })?;
    Ok(Server {
        stop: Some(stop),
        thread: Some(thread),
    })
}

async fn accept_loop(listener: TcpListener, endpoint: Arc<Endpoint>) {
    // Oldest first.
    let mut open: VecDeque<AbortHandle> = VecDeque::with_capacity(MAX_CONNECTIONS);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                warn!(error = %error, "accepting a metrics connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        open.retain(|connection| !connection.is_finished());
        if open.len() >= MAX_CONNECTIONS
            && let Some(oldest) = open.pop_front()
        {
            debug!("too many metrics connections; closing the oldest");
            oldest.abort();
        }
        let endpoint = Arc::clone(&endpoint);
        let connection = tokio::spawn(async move {
            let service = service_fn(move |request: Request<Incoming>| {
                let response = endpoint.respond(request.uri().path());
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                Ok(Err(error)) => debug!(error = %error, "metrics connection ended with an error"),
                Err(_) => debug!("metrics connection timed out"),
                Ok(Ok(())) => {}
            }
        });
        open.push_back(connection.abort_handle());
    }
}

impl Endpoint {
    fn respond(&self, path: &str) -> Response<Full<Bytes>> {
        match path {
            "/metrics" => self.metrics(),
            "/healthz" => {
                let quiet = self.stats.since_heartbeat();
                if quiet <= self.health_window {
                    text(StatusCode::OK, "ok\n".to_owned())
                } else {
                    text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "the control loop has not turned for {:.1} s (steering goes on in the kernel)\n",
                            quiet.as_secs_f64()
                        ),
                    )
                }
            }
            "/readyz" => {
                if self.stats.is_ready() {
                    text(StatusCode::OK, "ready\n".to_owned())
                } else {
                    text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not ready: waiting for the first sync of every upstream pool\n".to_owned(),
                    )
                }
            }
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /metrics, /healthz or /readyz\n".to_owned(),
            ),
        }
    }

    fn metrics(&self) -> Response<Full<Bytes>> {
        let listeners = {
            let maps = self
                .maps
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            snapshot::listeners(&maps)
        };
        match listeners {
            Ok(listeners) => {
                let mut response = Response::new(Full::new(Bytes::from(metrics::render(
                    &listeners,
                    &self.stats,
                    std::time::SystemTime::now(),
                ))));
                if let Ok(value) =
                    "application/openmetrics-text; version=1.0.0; charset=utf-8".parse()
                {
                    response
                        .headers_mut()
                        .insert(hyper::header::CONTENT_TYPE, value);
                }
                response
            }
            Err(error) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot read the pinned maps: {error}\n"),
            ),
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}
