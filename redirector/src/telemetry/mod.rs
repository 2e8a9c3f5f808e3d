//! What operators see: what the agent observed (`stats`), a snapshot of every listener from the
//! pinned maps, Prometheus metrics, the health endpoints, and Kubernetes Events on the Node.

pub mod http;
pub mod metrics;
pub mod node_events;
pub mod snapshot;
pub mod stats;
pub mod status;
