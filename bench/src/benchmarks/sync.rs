//! EndpointSlice event at the (fake) API server to the kernel's pool map updated.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::percentile;
use bpf_tests::{
    fake_kube::{FakeKube, endpoint_slice},
    harness::{CLUSTER_ID, Harness},
    sandbox::{Sandbox, Tools},
};

/// The latency of pool syncs.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SyncLatency {
    /// Events timed.
    pub events: usize,
    /// Median, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// The slowest, ms.
    pub max_ms: f64,
}

/// `events` endpoint changes, one after the other, each timed from the API server's write to the
/// kernel's map holding it (polled every 100 µs).
pub fn measure(events: usize) -> anyhow::Result<SyncLatency> {
    let kube = FakeKube::start()?;
    let slice = |address: &str| {
        endpoint_slice(
            "kube-dns-v4",
            "kube-dns",
            "IPv4",
            53,
            &[(address, true, false)],
        )
    };
    kube.apply(slice("10.244.0.1"));
    let mut sandbox = Sandbox::new(Tools::beside_current_exe()?)?;
    sandbox.start_standard_servers()?;
    let kubeconfig = sandbox.write_file("kubeconfig", &kube.kubeconfig())?;
    let text = sandbox.config_toml_with(
        "[[listener]]\nname = \"node\"\naddress = \"169.254.10.10\"\nupstreams = [\"198.18.2.2\"]\n\n[[listener]]\nname = \"cluster\"\naddress = \"169.254.10.11\"\nkube_dns = \"kube-system/kube-dns\"\n",
        &format!(
            "[interface]\nmanage = false\n\n[kubernetes]\nkubeconfig = {:?}\n",
            kubeconfig.display().to_string()
        ),
    );
    let harness = Harness::with_config(sandbox, &text)?;
    let holds = |address: std::net::IpAddr| -> anyhow::Result<bool> {
        Ok(harness
            .maps
            .pool(CLUSTER_ID)?
            .targets()
            .iter()
            .any(|target| std::net::IpAddr::from(target.addr) == address))
    };
    let mut samples = Vec::with_capacity(events);
    for event in 0..events {
        let address = format!("10.244.{}.{}", 1 + event / 250, 1 + event % 250);
        let ip: std::net::IpAddr = address.parse()?;
        let started = Instant::now();
        kube.apply(slice(&address));
        while !holds(ip)? {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(10),
                "event {event} never reached the kernel"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        samples.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(SyncLatency {
        events,
        p50_ms: percentile(&samples, 50.0),
        p99_ms: percentile(&samples, 99.0),
        max_ms: percentile(&samples, 100.0),
    })
}
