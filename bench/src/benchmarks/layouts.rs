//! What the programs cost a pod's DNS throughput, in both layouts a node runs (the cache on an
//! address of its own, every query rewritten to it, as NodeLocal DNSCache's listener and cache
//! would be; the cache on the listener address itself, nothing rewritten while it serves) and for
//! both kinds of socket (unconnected: dnsperf; connected: `dns-load`), each against the same
//! cache with no programs attached, in interleaved trials.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use anyhow::Context as _;
use serde::Serialize;

use super::{
    Spread,
    rig::{CACHE_ADDRESS, LISTENER, Rig},
    setup::SETTLE,
    steering::{self, TRIALS},
};
use bpf_tests::caches::{CacheKind, start_cache_at};

/// Where the cache listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Layout {
    /// On an address of its own: the programs rewrite every query from the listener to it.
    CacheAddress,
    /// On the listener address: nothing is rewritten while it serves.
    Listener,
}

impl Layout {
    /// Both, in the order of the tables.
    pub const ALL: [Self; 2] = [Self::CacheAddress, Self::Listener];

    /// The name in tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::CacheAddress => "cache on its own address (rewritten)",
            Self::Listener => "cache on the listener address",
        }
    }

    /// Where the pod sends without the programs: the cache itself.
    fn without(self) -> Ipv4Addr {
        match self {
            Self::CacheAddress => CACHE_ADDRESS,
            Self::Listener => LISTENER,
        }
    }
}

/// How the pod's sockets send.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Sockets {
    /// dnsperf: `sendto` from 4 long-lived unconnected sockets, 64 queries in flight each.
    Unconnected,
    /// `dns-load`: 4 long-lived connected sockets, 64 queries in flight each.
    Connected,
}

impl Sockets {
    /// Both, in the order of the tables.
    pub const ALL: [Self; 2] = [Self::Unconnected, Self::Connected];

    /// The name in tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Unconnected => "unconnected (dnsperf)",
            Self::Connected => "connected (dns-load)",
        }
    }
}

/// One layout and socket kind, with and without the programs.
#[derive(Clone, Debug, Serialize)]
pub struct LayoutThroughput {
    /// Where the cache listens.
    pub layout: Layout,
    /// How the pod sends.
    pub sockets: Sockets,
    /// Queries per second without the programs.
    pub without_qps: Spread,
    /// With them (the agent running).
    pub with_qps: Spread,
    /// Median with, over median without.
    pub ratio: f64,
    /// Queries lost with the programs, summed over trials.
    pub lost_with: u64,
}

/// What one program cost per run while one load ran in one layout, from the kernel's accounting
/// (in a run of its own, apart from the timed trials: the accounting's clock reads slow every
/// program down).
#[derive(Clone, Debug, Serialize)]
pub struct LayoutProgramCost {
    /// Where the cache listens.
    pub layout: Layout,
    /// What the pod did.
    pub load: &'static str,
    /// The program.
    pub program: &'static str,
    /// How often it ran.
    pub runs: u64,
    /// Nanoseconds per run.
    pub ns_per_run: f64,
}

/// The loads whose program costs are taken in each layout.
const COST_LOADS: [&str; 3] = [
    "dnsperf (unconnected)",
    "dns-load (connected)",
    "20000 connect() to the listener, fresh sockets",
];

/// One run of `COST_LOADS[load]` to the listener.
fn cost_load(rig: &Rig, load: usize) -> anyhow::Result<()> {
    match load {
        0 => run(rig, LISTENER, Sockets::Unconnected).map(drop),
        1 => run(rig, LISTENER, Sockets::Connected).map(drop),
        _ => {
            let target = SocketAddr::new(IpAddr::V4(LISTENER), 53).to_string();
            rig.in_pod(
                &rig.hook_cost.display().to_string(),
                &["--mode", "connect", "--target", &target, "--count", "20000"],
                Duration::from_secs(60),
            )
            .map(drop)
        }
    }
}

/// Every program's cost per run during each of `COST_LOADS`, in `layout` (the agent running).
fn program_costs(rig: &Rig, layout: Layout) -> anyhow::Result<Vec<LayoutProgramCost>> {
    let agent = match layout {
        Layout::CacheAddress => rig.start_agent()?,
        Layout::Listener => rig.start_agent_cache_on_listener()?,
    };
    std::thread::sleep(SETTLE);
    let accounting = crate::program_cost::Accounting::enable()?;
    let pin_dir = rig.sandbox.pin_dir();
    let mut costs = Vec::new();
    for (index, load) in COST_LOADS.iter().enumerate() {
        let before = accounting.snapshot(&pin_dir)?;
        cost_load(rig, index)?;
        let after = accounting.snapshot(&pin_dir)?;
        costs.extend(
            after
                .since(&before)
                .into_iter()
                .map(|runs| LayoutProgramCost {
                    layout,
                    load,
                    program: runs.program,
                    runs: runs.count,
                    ns_per_run: runs.ns_per_run(),
                }),
        );
    }
    drop(accounting);
    rig.stop_and_uninstall(agent)?;
    Ok(costs)
}

/// Queries per second and lost of one run.
fn run(rig: &Rig, server: Ipv4Addr, sockets: Sockets) -> anyhow::Result<(f64, u64)> {
    match sockets {
        Sockets::Unconnected => {
            let run = steering::dnsperf_to(rig, server)?;
            Ok((run.qps, run.lost))
        }
        Sockets::Connected => {
            let server = SocketAddr::new(IpAddr::V4(server), 53).to_string();
            let output = rig.in_pod(
                &rig.dns_load.display().to_string(),
                &["--server", &server, "--seconds", "3"],
                Duration::from_secs(30),
            )?;
            let value: serde_json::Value = serde_json::from_str(output.trim())?;
            let qps = value["qps"]
                .as_f64()
                .with_context(|| format!("dns-load printed {output}"))?;
            let lost = value["lost"]
                .as_u64()
                .with_context(|| format!("dns-load printed {output}"))?;
            Ok((qps, lost))
        }
    }
}

/// Every layout and socket kind, `TRIALS` interleaved trials each, then the programs' per-run
/// costs under each load in each layout. A second dnsmasq serves the listener address for the
/// second layout, and is stopped at the end.
pub fn measure(rig: &mut Rig) -> anyhow::Result<(Vec<LayoutThroughput>, Vec<LayoutProgramCost>)> {
    start_cache_at(
        &mut rig.sandbox,
        CacheKind::Dnsmasq,
        "cache on the listener",
        SocketAddr::new(IpAddr::V4(LISTENER), 53),
    )?;
    let mut runs: Vec<Samples> = Layout::ALL
        .iter()
        .flat_map(|layout| {
            Sockets::ALL.iter().map(|sockets| Samples {
                layout: *layout,
                sockets: *sockets,
                without: Vec::new(),
                with: Vec::new(),
                lost_with: 0,
            })
        })
        .collect();
    for trial in 0..TRIALS {
        for layout in Layout::ALL {
            // Every other trial measures with the programs first, so that an order effect hits
            // both sides alike.
            for with_programs in [trial % 2 == 1, trial % 2 == 0] {
                let agent = if with_programs {
                    let agent = match layout {
                        Layout::CacheAddress => rig.start_agent()?,
                        Layout::Listener => rig.start_agent_cache_on_listener()?,
                    };
                    std::thread::sleep(SETTLE);
                    Some(agent)
                } else {
                    None
                };
                for samples in runs.iter_mut().filter(|samples| samples.layout == layout) {
                    if with_programs {
                        let (qps, lost) = run(rig, LISTENER, samples.sockets)?;
                        samples.with.push(qps);
                        samples.lost_with += lost;
                    } else {
                        let (qps, _) = run(rig, layout.without(), samples.sockets)?;
                        samples.without.push(qps);
                    }
                }
                if let Some(agent) = agent {
                    rig.stop_and_uninstall(agent)?;
                }
            }
        }
    }
    let mut costs = Vec::new();
    for layout in Layout::ALL {
        costs.extend(program_costs(rig, layout)?);
    }
    rig.sandbox.stop_server("cache on the listener")?;
    let throughput = runs
        .into_iter()
        .map(|samples| {
            let (without_qps, with_qps) = (Spread::of(samples.without), Spread::of(samples.with));
            LayoutThroughput {
                layout: samples.layout,
                sockets: samples.sockets,
                ratio: with_qps.median / without_qps.median.max(1.0),
                without_qps,
                with_qps,
                lost_with: samples.lost_with,
            }
        })
        .collect();
    Ok((throughput, costs))
}

/// The trials of one layout and socket kind so far.
struct Samples {
    layout: Layout,
    sockets: Sockets,
    without: Vec<f64>,
    with: Vec<f64>,
    lost_with: u64,
}
