//! The agent's HTTP endpoint: `/metrics` (Prometheus), `/healthz` (the control loop turns),
//! `/readyz` (programs attached, every pool synced once).

use std::{convert::Infallible, net::SocketAddr, sync::Arc, sync::Mutex, time::Duration};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    Request, Response, StatusCode, body::Incoming, server::conn::http1, service::service_fn,
};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, task::JoinHandle};
use tracing::{debug, warn};

use super::{metrics, snapshot};
use crate::{agent::AgentStats, datapath::Maps};

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

/// Binds `address`.
pub async fn bind(address: SocketAddr) -> Result<TcpListener, BindError> {
    TcpListener::bind(address)
        .await
        .map_err(|source| BindError { address, source })
}

/// Serves `endpoint` on `listener` until the task is aborted.
#[must_use]
pub fn serve(listener: TcpListener, endpoint: Endpoint) -> JoinHandle<()> {
    let endpoint = Arc::new(endpoint);
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(error) => {
                    warn!(error = %error, "accepting a metrics connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let endpoint = Arc::clone(&endpoint);
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let response = endpoint.respond(request.uri().path());
                    async move { Ok::<_, Infallible>(response) }
                });
                if let Err(error) = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    debug!(error = %error, "metrics connection ended with an error");
                }
            });
        }
    })
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
