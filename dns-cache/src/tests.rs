//! The real server on 127.0.0.1 (ephemeral ports) against fake upstreams spawned by each test.
//!
//! Here the cache under test and what every test shares; below, the fake upstream
//! (`fake_upstream`) and DNS on the wire (`wire`), then the tests by what they test: the cache
//! (`caching`), the forwarding (`forwarding`), the answers (`answers`), who may ask (`access`),
//! the server's life and bounds (`server`).

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use tokio::{sync::oneshot, task::JoinHandle};

use crate::{CacheConfig, CacheServer, DEFAULT_ALLOW, server::Limits};

mod access;
mod answers;
mod caching;
mod fake_upstream;
mod forwarding;
mod server;
mod wire;

/// Bounds every wait on the network in these tests.
const WAIT: Duration = Duration::from_secs(5);
const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// The addresses the fake upstreams answer with, told apart in the answers.
const UPSTREAM_A: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const UPSTREAM_B: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

fn config(default_servers: Vec<SocketAddr>) -> CacheConfig {
    CacheConfig {
        listen: vec![SocketAddr::from((LOOPBACK, 0))],
        zones: Vec::new(),
        default_servers,
        max_ttl: Duration::from_secs(3600),
        max_negative_ttl: Duration::from_secs(300),
        stale_for: Duration::from_secs(30),
        max_entries: 1000,
        upstream_timeout: Duration::from_millis(500),
        allow: DEFAULT_ALLOW.to_vec(),
    }
}

/// The cache under test, serving until dropped.
struct Running {
    address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Running {
    async fn start(config: CacheConfig) -> Self {
        Self::start_with(config, Limits::DEFAULT).await
    }

    async fn start_with(config: CacheConfig, limits: Limits) -> Self {
        let server = CacheServer::bind_with(config, limits)
            .await
            .expect("bind the cache");
        let address = server.local_addrs()[0];
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(server.serve(async {
            let _ = stopped.await;
        }));
        Self {
            address,
            stop: Some(stop),
            task,
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

/// hickory-resolver's cache reads the real clock (it cannot be moved forward), so the tests
/// that watch answers age sleep, with TTLs of seconds.
async fn sleep(seconds: f64) {
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
}
