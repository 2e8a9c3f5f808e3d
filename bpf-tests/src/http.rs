//! A minimal HTTP/1.1 GET for the agent's loopback endpoints (`/metrics`, `/healthz`, `/readyz`).

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::Context as _;

/// A response: status code and body.
#[derive(Clone, Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The body.
    pub body: String,
}

/// `GET path` from `address` (a loopback address of the agent's).
pub fn get(address: SocketAddr, path: &str) -> anyhow::Result<Response> {
    anyhow::ensure!(
        address.ip().is_loopback(),
        "only loopback endpoints: {address}"
    );
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5))
        .with_context(|| format!("connecting to {address}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    stream
        .read_to_string(&mut raw)
        .context("reading the response")?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .context("a response without a body")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    Ok(Response {
        status,
        body: body.to_owned(),
    })
}

/// The value of the sample `name{labels}` (labels exactly as the exposition writes them, in
/// order) in a `/metrics` body.
#[must_use]
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse().ok()
    })
}
