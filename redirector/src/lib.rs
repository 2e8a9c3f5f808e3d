//! redirector: an eBPF fast-path DNS redirector for Kubernetes nodes.
//!
//! The library half of the agent: configuration, the datapath (the kernel programs and their
//! maps), and the agent's run loop. The binary (`src/main.rs`) is the CLI around it; the
//! privileged tests in `bpf-tests` drive the same code.

pub mod agent;
pub mod cgroup;
pub mod config;
pub mod conntrack_bypass;
pub mod datapath;
pub mod dns_cache;
pub mod interface;
pub mod liveness;
pub mod lock;
pub mod netns;
pub mod sd_notify;
pub mod sources;
pub mod telemetry;
