//! The cluster listener's pool: the ready endpoints of the kube-dns Service, from its
//! EndpointSlices (`discovery.k8s.io/v1`, label `kubernetes.io/service-name`), watched with
//! kube-rs. The watcher relists on its own (410 Gone, restarts) and backs off exponentially on
//! errors; while the API server is away, nothing is sent, so the kernel keeps the last known
//! good pool.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::IpAddr,
    time::Duration,
};

use futures::StreamExt as _;
use k8s_openapi::api::discovery::v1::{EndpointPort, EndpointSlice};
use kube::{
    Api, Client,
    api::ListParams,
    runtime::{WatchStreamExt as _, watcher},
};
use tokio::{sync::mpsc, time::MissedTickBehavior};
use tracing::{error, info, warn};

use super::{
    FedListener, Offer, SourceEvent, SourceKind, Upstream,
    plausible::{self, Expect, Rejection},
};

/// The label EndpointSlices carry with their Service's name.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The name kube-dns gives its UDP port; used only to choose among several UDP ports.
pub const UDP_PORT_NAME: &str = "dns";
/// The name kube-dns gives its TCP port; used only when no TCP port shares the UDP port's number.
pub const TCP_PORT_NAME: &str = "dns-tcp";

/// The UDP and TCP ports of a slice's DNS servers, matched by protocol, not by name: kube-dns
/// names them `dns` and `dns-tcp`, CoreDNS's Helm chart `udp-53` and `tcp-53`, and a non-root
/// CoreDNS serves on 1053, so a name says little and 53 may be wrong. UDP: the slice's one UDP
/// port (of several, the one named `dns`, else the one with a TCP port of the same number). TCP:
/// the TCP port of the UDP port's number (a DNS server serves both on one; kube-dns's other TCP
/// port is its metrics), else the one named `dns-tcp`, else the UDP port's number. `None` when
/// no UDP port is usable, or several are and nothing tells them apart.
fn slice_ports(ports: Option<&Vec<EndpointPort>>) -> Option<(u16, u16)> {
    // An unset protocol is TCP (the API's default).
    let of = |protocol: &str| -> Vec<(Option<&str>, u16)> {
        ports
            .into_iter()
            .flatten()
            .filter(|port| port.protocol.as_deref().unwrap_or("TCP") == protocol)
            .filter_map(|port| {
                let number = u16::try_from(port.port?)
                    .ok()
                    .filter(|number| *number != 0)?;
                Some((port.name.as_deref(), number))
            })
            .collect()
    };
    let (udp, tcp) = (of("UDP"), of("TCP"));
    let udp_port = match udp.as_slice() {
        [] => return None,
        [(_, number)] => *number,
        several => several
            .iter()
            .find(|(name, _)| *name == Some(UDP_PORT_NAME))
            .map(|(_, number)| *number)
            .or_else(|| {
                let twinned: Vec<u16> = several
                    .iter()
                    .map(|(_, number)| *number)
                    .filter(|number| tcp.iter().any(|(_, tcp)| tcp == number))
                    .collect();
                (twinned.len() == 1).then(|| twinned[0])
            })?,
    };
    let tcp_port = tcp
        .iter()
        .find(|(_, number)| *number == udp_port)
        .or_else(|| tcp.iter().find(|(name, _)| *name == Some(TCP_PORT_NAME)))
        .map_or(udp_port, |(_, number)| *number);
    Some((udp_port, tcp_port))
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
        // A slice without endpoints (the controller's placeholder for a Service with none, whose
        // ports are empty) offers nothing to refuse.
        if slice.endpoints.is_empty() {
            continue;
        }
        let Some((udp_port, tcp_port)) = slice_ports(slice.ports.as_ref()) else {
            // Every endpoint of it would be a target of the wrong port: none is taken.
            rejected.push((
                format!("EndpointSlice {}", key(slice)),
                Rejection::NoDnsPort,
            ));
            continue;
        };
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

/// How long the periodic check waits for the API server's answer.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Watches the EndpointSlices of `namespace/service` and sends the fed listeners' pools on every
/// complete view (after each initial list, and on every change), until `events` closes. Each
/// view is a contact with the API server; so is the answer to a list of one slice every
/// `resync`, which tells a quiet watch from a lost API server (a watch with nothing to tell is
/// silent either way).
pub async fn watch(
    client: Client,
    namespace: String,
    service: String,
    fed: Vec<FedListener>,
    listeners: HashSet<IpAddr>,
    resync: Duration,
    events: mpsc::Sender<SourceEvent>,
) {
    let api: Api<EndpointSlice> = Api::namespaced(client, &namespace);
    let selector = format!("{SERVICE_NAME_LABEL}={service}");
    let config = watcher::Config::default().labels(&selector);
    let mut stream = watcher(api.clone(), config).default_backoff().boxed();
    let mut check = tokio::time::interval(resync);
    check.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // The first contact is the watcher's initial list.
    check.tick().await;
    let mut slices: BTreeMap<String, EndpointSlice> = BTreeMap::new();
    let mut relisting: Option<BTreeMap<String, EndpointSlice>> = None;
    loop {
        let event = tokio::select! {
            event = stream.next() => match event {
                Some(event) => event,
                None => return,
            },
            _ = check.tick() => {
                let listed = tokio::time::timeout(
                    CHECK_TIMEOUT,
                    api.list(&ListParams::default().labels(&selector).limit(1)),
                )
                .await;
                let contact = match listed {
                    Ok(Ok(_)) => SourceEvent::Contact {
                        source: SourceKind::Kubernetes,
                    },
                    Ok(Err(error)) => {
                        if let Some(refusal) = forbidden_client(&error) {
                            error!(service = %format!("{namespace}/{service}"), refusal, "{RBAC_HINT}");
                        } else {
                            warn!(service = %format!("{namespace}/{service}"), error = %error, "the API server did not answer the periodic check; keeping the last known pool");
                        }
                        SourceEvent::Failed {
                            source: SourceKind::Kubernetes,
                        }
                    }
                    Err(_) => {
                        warn!(service = %format!("{namespace}/{service}"), timeout = ?CHECK_TIMEOUT, "the API server did not answer the periodic check in time; keeping the last known pool");
                        SourceEvent::Failed {
                            source: SourceKind::Kubernetes,
                        }
                    }
                };
                if events.send(contact).await.is_err() {
                    return;
                }
                continue;
            }
        };
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
                // The watcher backs off and retries (a Role may be fixed while the agent runs);
                // the pool stays as last known. A refusal for want of RBAC says so at each retry.
                if let Some(refusal) = forbidden(&error) {
                    error!(service = %format!("{namespace}/{service}"), refusal, "{RBAC_HINT}");
                } else {
                    warn!(service = %format!("{namespace}/{service}"), error = %error, "watching EndpointSlices failed; keeping the last known pool");
                }
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
            || events
                .send(SourceEvent::Contact {
                    source: SourceKind::Kubernetes,
                })
                .await
                .is_err()
        {
            return;
        }
    }
}

/// What the agent says when the API server refuses it a verb on EndpointSlices (403).
const RBAC_HINT: &str = "the API server refused the agent's ServiceAccount a verb it needs on \
    EndpointSlices (get, list and watch discovery.k8s.io endpointslices in the kube_dns Service's \
    namespace); keeping the last known pool and retrying. Apply the Role and RoleBinding of \
    deploy/kubernetes/base (role.yaml, rolebinding.yaml) in that namespace, bound to the \
    ServiceAccount the agent runs as";

/// The API server's message when a watcher's call was refused for want of RBAC (403).
fn forbidden(error: &watcher::Error) -> Option<&str> {
    match error {
        watcher::Error::InitialListFailed(error)
        | watcher::Error::WatchStartFailed(error)
        | watcher::Error::WatchFailed(error) => forbidden_client(error),
        watcher::Error::WatchError(status) => {
            status.is_forbidden().then_some(status.message.as_str())
        }
        watcher::Error::NoResourceVersion => None,
    }
}

/// The API server's message when a call was refused for want of RBAC (403).
fn forbidden_client(error: &kube::Error) -> Option<&str> {
    match error {
        kube::Error::Api(status) if status.is_forbidden() => Some(status.message.as_str()),
        _ => None,
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

    /// kube-dns's ports: `dns` and `dns-tcp` on 53, `metrics` on 9153.
    const KUBE_DNS: &[(&str, Option<&str>, i32)] = &[
        ("dns", Some("UDP"), 53),
        ("dns-tcp", Some("TCP"), 53),
        ("metrics", Some("TCP"), 9153),
    ];

    fn slice(
        address_type: &str,
        ports: &[(&str, Option<&str>, i32)],
        endpoints: Vec<Endpoint>,
    ) -> EndpointSlice {
        EndpointSlice {
            address_type: address_type.to_owned(),
            endpoints,
            metadata: kube::api::ObjectMeta {
                name: Some("kube-dns-abcde".to_owned()),
                ..kube::api::ObjectMeta::default()
            },
            ports: Some(
                ports
                    .iter()
                    .map(|(name, protocol, port)| EndpointPort {
                        name: Some((*name).to_owned()),
                        protocol: protocol.map(ToOwned::to_owned),
                        port: Some(*port),
                        ..EndpointPort::default()
                    })
                    .collect(),
            ),
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
                &[
                    ("dns", Some("UDP"), 1053),
                    ("dns-tcp", Some("TCP"), 1054),
                    ("metrics", Some("TCP"), 9153),
                ],
                vec![
                    endpoint("10.244.1.7", Some(true), Some(false)),
                    endpoint("10.244.0.5", None, None),
                    endpoint("10.244.2.9", Some(false), None),
                    endpoint("10.244.3.1", Some(true), Some(true)),
                ],
            ),
            slice(
                "IPv6",
                KUBE_DNS,
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
            KUBE_DNS,
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
            slice(
                "IPv4",
                KUBE_DNS,
                vec![endpoint("10.0.0.1", Some(true), None)],
            ),
            slice(
                "IPv4",
                KUBE_DNS,
                vec![endpoint("10.0.0.1", Some(true), None)],
            ),
            slice(
                "FQDN",
                KUBE_DNS,
                vec![endpoint("dns.example.com", Some(true), None)],
            ),
        ];
        let Offer { pools, rejected } = pools(&slices, &fed(), &listeners());
        assert_eq!(pools[&1].len(), 1);
        assert!(rejected.is_empty());
    }

    #[test]
    fn ports_are_matched_by_protocol_whatever_their_names() {
        let ports = |ports: &[(&str, Option<&str>, i32)]| {
            let slice = slice("IPv4", ports, Vec::new());
            slice_ports(slice.ports.as_ref())
        };
        // CoreDNS's Helm chart, non-root on 1053, with its metrics port.
        assert_eq!(
            ports(&[
                ("udp-53", Some("UDP"), 1053),
                ("tcp-53", Some("TCP"), 1053),
                ("metrics", Some("TCP"), 9153),
            ]),
            Some((1053, 1053))
        );
        assert_eq!(ports(KUBE_DNS), Some((53, 53)));
        // No TCP port listed but the metrics': TCP goes to the UDP port's number.
        assert_eq!(
            ports(&[("udp", Some("UDP"), 1053), ("metrics", Some("TCP"), 9153)]),
            Some((1053, 1053))
        );
        // Several UDP ports: the one with a TCP twin.
        assert_eq!(
            ports(&[
                ("a", Some("UDP"), 5353),
                ("b", Some("UDP"), 1053),
                ("c", Some("TCP"), 1053),
            ]),
            Some((1053, 1053))
        );
        // Nothing to choose between, no UDP port, none at all; an unset protocol is TCP.
        assert_eq!(
            ports(&[("a", Some("UDP"), 5353), ("b", Some("UDP"), 1053)]),
            None
        );
        assert_eq!(ports(&[("dns", None, 53)]), None);
        assert_eq!(ports(&[]), None);
    }

    #[test]
    fn a_slice_without_a_dns_port_is_refused_not_pooled_on_53() {
        let slices = [slice(
            "IPv4",
            &[("metrics", Some("TCP"), 9153)],
            vec![endpoint("10.0.0.1", Some(true), None)],
        )];
        let Offer { pools, rejected } = pools(&slices, &fed(), &listeners());
        assert!(pools[&1].is_empty(), "{:?}", pools[&1]);
        assert_eq!(
            rejected,
            [(
                "EndpointSlice kube-dns-abcde".to_owned(),
                Rejection::NoDnsPort
            )]
        );
        // The placeholder of a Service without endpoints: no ports, nothing offered, no refusal.
        let placeholder = [slice("IPv4", &[], Vec::new())];
        let offer = super::pools(&placeholder, &fed(), &listeners());
        assert!(
            offer.pools[&1].is_empty() && offer.rejected.is_empty(),
            "{:?}",
            offer.rejected
        );
    }

    #[test]
    fn a_refusal_for_want_of_rbac_is_told_from_other_errors() {
        let refused = kube::core::Status::failure(
            "endpointslices.discovery.k8s.io is forbidden: cannot watch resource",
            "Forbidden",
        )
        .with_code(403);
        let start = watcher::Error::WatchStartFailed(kube::Error::Api(refused.clone().boxed()));
        assert_eq!(
            forbidden(&start),
            Some("endpointslices.discovery.k8s.io is forbidden: cannot watch resource")
        );
        assert!(forbidden(&watcher::Error::WatchError(refused.boxed())).is_some());
        let gone =
            kube::core::Status::failure("too old resource version", "Expired").with_code(410);
        assert_eq!(
            forbidden(&watcher::Error::WatchError(gone.clone().boxed())),
            None
        );
        assert_eq!(
            forbidden(&watcher::Error::InitialListFailed(kube::Error::Api(
                gone.boxed()
            ))),
            None
        );
        assert_eq!(forbidden(&watcher::Error::NoResourceVersion), None);
    }
}
