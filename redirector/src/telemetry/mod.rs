//! What operators see: a snapshot of every listener from the pinned maps, Prometheus metrics,
//! and the health endpoints.

pub mod http;
pub mod metrics;
pub mod snapshot;
pub mod status;
