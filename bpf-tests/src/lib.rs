//! The test harness of redirector: sandboxes made of a cgroup, network namespaces, veths, real
//! DNS servers and clients, in which the real eBPF object is loaded and attached.
//!
//! Safety on shared machines: programs attach only to a cgroup the sandbox creates below the
//! cgroup v2 root, never to the root; every address lives inside the sandbox's namespaces; only
//! processes the sandbox started are ever signalled; and everything is removed on drop.

pub mod bpffs;
pub mod caches;
pub mod cgroup;
pub mod cli;
pub mod command;
pub mod conntrack;
pub mod container;
pub mod dns;
pub mod fake_kube;
pub mod go_peers;
pub mod harness;
pub mod http;
pub mod kube_apiserver;
pub mod netns;
pub mod node;
pub mod pace;
pub mod resolvers;
pub mod sandbox;
pub mod shipped;
pub mod stream;
pub mod topology;
pub mod vm_notes;
