//! The cluster listener's pool: the ready endpoints of the kube-dns Service, from its
//! EndpointSlices (`discovery.k8s.io/v1`, label `kubernetes.io/service-name`), watched with
//! kube-rs. The watcher relists on its own (410 Gone, restarts) and backs off exponentially on
//! errors; while the API server is away, nothing is sent, so the kernel keeps the last known
//! good pool.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::IpAddr,
};

use futures::StreamExt as _;
use k8s_openapi::api::discovery::v1::{EndpointPort, EndpointSlice};
use kube::{
    Api, Client,
    runtime::{WatchStreamExt as _, watcher},
};
use redirector_common::DNS_PORT;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{
    FedListener, Offer, SourceEvent, SourceKind, Upstream,
    plausible::{self, Expect, Rejection},
};

/// The label EndpointSlices carry with their Service's name.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The port kube-dns names for UDP.
pub const UDP_PORT_NAME: &str = "dns";
/// The port kube-dns names for TCP.
pub const TCP_PORT_NAME: &str = "dns-tcp";

/// The UDP and TCP ports of a slice: the ports named `dns` and `dns-tcp`, else 53.
fn slice_ports(ports: Option<&Vec<EndpointPort>>) -> (u16, u16) {
    let named = |name: &str| {
        ports
            .into_iter()
            .flatten()
            .find(|port| port.name.as_deref() == Some(name))
            .and_then(|port| port.port)
            .and_then(|port| u16::try_from(port).ok())
            .filter(|port| *port != 0)
            .unwrap_or(DNS_PORT)
    };
    (named(UDP_PORT_NAME), named(TCP_PORT_NAME))
}

/// Each fed listener's pool from `slices` (ready, not terminating endpoints of its family, sorted,
/// without duplicates), and the addresses refused.
#[must_use]
pub fn pools<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    fed: &[FedListener],
    listeners: &HashSet<IpAddr>,
) -> Offer {
    let mut pools: HashMap<u32, Vec<Upstream>> = fed
        .iter()
        .map(|listener| (listener.id, Vec::new()))
        .collect();
    let mut rejected = Vec::new();
    for slice in slices {
        let family_v4 = match slice.address_type.as_str() {
            "IPv4" => true,
            "IPv6" => false,
            // FQDN slices carry names, not addresses.
            _ => continue,
        };
        let (udp_port, tcp_port) = slice_ports(slice.ports.as_ref());
        for endpoint in &slice.endpoints {
            let conditions = endpoint.conditions.as_ref();
            // A nil `ready` means ready (API contract); terminating endpoints are going away.
            let ready = conditions.and_then(|conditions| conditions.ready) != Some(false);
            let terminating =
                conditions.and_then(|conditions| conditions.terminating) == Some(true);
            if !ready || terminating {
                continue;
            }
            for written in &endpoint.addresses {
                let Ok(ip) = written.parse::<IpAddr>() else {
                    rejected.push((written.clone(), Rejection::Unparseable));
                    continue;
                };
                if ip.to_canonical().is_ipv4() != family_v4 {
                    rejected.push((written.clone(), Rejection::WrongFamily));
                    continue;
                }
                for listener in fed
                    .iter()
                    .filter(|listener| listener.address.is_ipv4() == family_v4)
                {
                    match plausible::check(ip, listener.address, listeners, Expect::PodAddress) {
                        Ok(ip) => pools.entry(listener.id).or_default().push(Upstream {
                            ip,
                            udp_port,
                            tcp_port,
                        }),
                        Err(reason) => rejected.push((written.clone(), reason)),
                    }
                }
            }
        }
    }
    for pool in pools.values_mut() {
        pool.sort_unstable();
        pool.dedup();
    }
    rejected.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    rejected.dedup();
    Offer { pools, rejected }
}

/// Watches the EndpointSlices of `namespace/service` and sends the fed listeners' pools on every
/// complete view (after each initial list, and on every change), until `events` closes.
pub async fn watch(
    client: Client,
    namespace: String,
    service: String,
    fed: Vec<FedListener>,
    listeners: HashSet<IpAddr>,
    events: mpsc::Sender<SourceEvent>,
) {
    let api: Api<EndpointSlice> = Api::namespaced(client, &namespace);
    let config = watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL}={service}"));
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut slices: BTreeMap<String, EndpointSlice> = BTreeMap::new();
    let mut relisting: Option<BTreeMap<String, EndpointSlice>> = None;
    while let Some(event) = stream.next().await {
        let complete = match event {
            Ok(watcher::Event::Init) => {
                relisting = Some(BTreeMap::new());
                false
            }
            Ok(watcher::Event::InitApply(slice)) => {
                if let Some(buffer) = relisting.as_mut() {
                    buffer.insert(key(&slice), slice);
                }
                false
            }
            Ok(watcher::Event::InitDone) => {
                if let Some(buffer) = relisting.take() {
                    slices = buffer;
                }
                info!(service = %format!("{namespace}/{service}"), slices = slices.len(), "listed EndpointSlices");
                true
            }
            Ok(watcher::Event::Apply(slice)) => {
                slices.insert(key(&slice), slice);
                true
            }
            Ok(watcher::Event::Delete(slice)) => {
                slices.remove(&key(&slice));
                true
            }
            Err(error) => {
                // The watcher backs off and retries; the pool stays as last known.
                warn!(service = %format!("{namespace}/{service}"), error = %error, "watching EndpointSlices failed; keeping the last known pool");
                if events
                    .send(SourceEvent::Failed {
                        source: SourceKind::Kubernetes,
                    })
                    .await
                    .is_err()
                {
                    return;
                }
                false
            }
        };
        if !complete {
            continue;
        }
        if pools(slices.values(), &fed, &listeners)
            .send(SourceKind::Kubernetes, &events)
            .await
            .is_err()
        {
            return;
        }
    }
}

fn key(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions};

    use super::*;

    fn endpoint(address: &str, ready: Option<bool>, terminating: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![address.to_owned()],
            conditions: Some(EndpointConditions {
                ready,
                serving: ready,
                terminating,
            }),
            ..Endpoint::default()
        }
    }

    fn slice(address_type: &str, ports: &[(&str, i32)], endpoints: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            address_type: address_type.to_owned(),
            endpoints,
            ports: Some(
                ports
                    .iter()
                    .map(|(name, port)| EndpointPort {
                        name: Some((*name).to_owned()),
                        port: Some(*port),
                        ..EndpointPort::default()
                    })
                    .collect(),
            ),
            ..EndpointSlice::default()
        }
    }

    fn fed() -> Vec<FedListener> {
        vec![
            FedListener {
                id: 1,
                address: "169.254.10.11".parse().unwrap(),
            },
            FedListener {
                id: 4,
                address: "fd00:53::11".parse().unwrap(),
            },
        ]
    }

    fn listeners() -> HashSet<IpAddr> {
        fed().iter().map(|listener| listener.address).collect()
    }

    #[test]
    fn ready_endpoints_with_named_ports_each_family_to_its_pool() {
        let slices = [
            slice(
                "IPv4",
                &[("dns", 1053), ("dns-tcp", 1054), ("metrics", 9153)],
                vec![
                    endpoint("10.244.1.7", Some(true), Some(false)),
                    endpoint("10.244.0.5", None, None),
                    endpoint("10.244.2.9", Some(false), None),
                    endpoint("10.244.3.1", Some(true), Some(true)),
                ],
            ),
            slice(
                "IPv6",
                &[],
                vec![endpoint("fd00:10:244::5", Some(true), None)],
            ),
        ];
        let Offer { pools, rejected } = pools(&slices, &fed(), &listeners());
        let v4: Vec<String> = pools[&1].iter().map(ToString::to_string).collect();
        assert_eq!(
            v4,
            ["10.244.0.5:1053 (tcp 1054)", "10.244.1.7:1053 (tcp 1054)"]
        );
        assert_eq!(
            pools[&4],
            vec![Upstream::dns("fd00:10:244::5".parse().unwrap())]
        );
        assert!(rejected.is_empty());
    }

    #[test]
    fn implausible_addresses_are_refused_and_never_pooled() {
        let slices = [slice(
            "IPv4",
            &[],
            vec![
                endpoint("127.0.0.1", Some(true), None),
                endpoint("169.254.10.11", Some(true), None),
                endpoint("not-an-ip", Some(true), None),
                endpoint("fd00::1", Some(true), None),
                endpoint("10.0.0.1", Some(true), None),
            ],
        )];
        let Offer { pools, rejected } = pools(&slices, &fed(), &listeners());
        assert_eq!(pools[&1], vec![Upstream::dns("10.0.0.1".parse().unwrap())]);
        let reasons: Vec<Rejection> = rejected.iter().map(|(_, reason)| *reason).collect();
        assert_eq!(
            reasons,
            [
                Rejection::Loopback,
                Rejection::Listener,
                Rejection::WrongFamily,
                Rejection::Unparseable
            ]
        );
    }

    #[test]
    fn duplicates_across_slices_count_once_and_fqdn_slices_are_skipped() {
        let slices = [
            slice("IPv4", &[], vec![endpoint("10.0.0.1", Some(true), None)]),
            slice("IPv4", &[], vec![endpoint("10.0.0.1", Some(true), None)]),
            slice(
                "FQDN",
                &[],
                vec![endpoint("dns.example.com", Some(true), None)],
            ),
        ];
        let Offer { pools, rejected } = pools(&slices, &fed(), &listeners());
        assert_eq!(pools[&1].len(), 1);
        assert!(rejected.is_empty());
    }
}
