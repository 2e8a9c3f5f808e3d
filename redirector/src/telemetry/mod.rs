//! What operators see: what the agent observed (`stats`), a snapshot of every listener from the
//! pinned maps, Prometheus metrics, the health endpoints, Kubernetes Events on the Node, `status`,
//! and `top`'s live view of the workloads' DNS.

pub mod http;
pub mod metrics;
pub mod node_events;
pub mod snapshot;
pub mod stats;
pub mod status;
pub mod top;
