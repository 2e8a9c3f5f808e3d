//! Is a listener's cache alive? Its sockets (counted in the kernel, seeded and reconciled from
//! the socket tables here) and real DNS probes decide. And are the upstream targets it fails over
//! to alive (`upstreams`)?

pub mod binds;
pub mod cache_tasks;
pub mod drain;
pub mod health;
pub mod probe;
pub mod reconcile;
pub mod sockdiag;
pub mod upstreams;
