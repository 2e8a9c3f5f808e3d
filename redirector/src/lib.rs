//! redirector: an eBPF fast-path DNS redirector for Kubernetes nodes.
//!
//! The library half of the agent: configuration, the datapath (the kernel programs and their
//! maps), and the agent's run loop. The binary (`src/main.rs`) is the CLI around it; the
//! privileged tests in `bpf-tests` drive the same code.

pub mod agent;
pub mod config;
pub mod conntrack_bypass;
pub mod datapath;
pub mod dns_query;
pub mod liveness;
pub mod release;
pub mod sources;
pub mod sys;
pub mod telemetry;
pub mod workloads;

/// An error with its causes, `outer: inner: innermost`, for logs (a `tracing` field shows only
/// the outermost message of an error otherwise).
#[must_use]
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
