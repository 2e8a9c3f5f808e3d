//! Operating-system plumbing, one idea a module: cgroups, network namespaces, the node's lock,
//! systemd's notify socket, the listener interface, capabilities, and what the kernel supports.

pub mod capabilities;
pub mod cgroup;
pub mod interface;
pub mod kernel_support;
pub mod lock;
pub mod netns;
pub mod sd_notify;
