//! The node listener's pool: the `nameserver` lines of the node's upstream resolv.conf (by
//! default systemd-resolved's `/run/systemd/resolve/resolv.conf`), watched with inotify on its
//! directory, so that atomic renames (how resolved and most tools write it) and deletions are
//! seen.

use std::{
    collections::{HashMap, HashSet},
    ffi::OsString,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use futures::StreamExt as _;
use inotify::{Inotify, WatchMask};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{
    FedListener, Offer, SourceEvent, SourceKind, Upstream,
    plausible::{self, Expect, Rejection},
};

/// How long a burst of file events is let settle before the file is read.
const SETTLE: Duration = Duration::from_millis(20);
/// How often a missing directory is looked for again.
const RETRY: Duration = Duration::from_secs(2);
/// How often the file is read again with no change seen: an unreadable file (permissions, I/O)
/// shows as a growing `redirector_pool_last_sync_age_seconds{source="resolv.conf"}`.
const RECHECK: Duration = Duration::from_secs(60);

/// The addresses of the `nameserver` lines, as written.
#[must_use]
pub fn nameservers(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.starts_with('#') && !line.starts_with(';'))
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("nameserver"))
                .then(|| words.next())
                .flatten()
        })
        .collect()
}

/// Each listener's pool from resolv.conf `text` (its family's nameservers, port 53, in file
/// order without duplicates), and the nameservers refused.
#[must_use]
pub fn pools(text: &str, fed: &[FedListener], listeners: &HashSet<IpAddr>) -> Offer {
    let mut pools: HashMap<u32, Vec<Upstream>> = fed
        .iter()
        .map(|listener| (listener.id, Vec::new()))
        .collect();
    let mut rejected = Vec::new();
    for written in nameservers(text) {
        let Ok(ip) = written.parse::<IpAddr>() else {
            // Also scoped IPv6 (`fe80::1%eth0`): a pod cannot use the node's interface scope.
            rejected.push((written.to_owned(), Rejection::Unparseable));
            continue;
        };
        let mut used = false;
        let mut refusal = None;
        for listener in fed {
            match plausible::check(ip, listener.address, listeners, Expect::Nameserver) {
                Ok(ip) => {
                    let pool = pools.entry(listener.id).or_default();
                    let upstream = Upstream::dns(ip);
                    if !pool.contains(&upstream) {
                        pool.push(upstream);
                    }
                    used = true;
                }
                Err(reason) => refusal = Some(reason),
            }
        }
        if let (false, Some(reason)) = (used, refusal) {
            // Of the other family than every fed listener, or never usable: say so.
            rejected.push((written.to_owned(), reason));
        }
    }
    Offer { pools, rejected }
}

/// Reads `path` and sends every fed listener's pool; a missing file is an empty pool, an
/// unreadable one changes nothing.
async fn publish(
    path: &Path,
    fed: &[FedListener],
    listeners: &HashSet<IpAddr>,
    events: &mpsc::Sender<SourceEvent>,
) {
    let text = match tokio::fs::read_to_string(path).await {
        Ok(text) => text,
        // Gone: the node has no upstream nameservers now.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            warn!(path = %path.display(), "the upstream resolv.conf is gone: the node listener has no upstreams");
            String::new()
        }
        // Unreadable for another reason (permissions, I/O): that says nothing about the
        // nameservers, so the last pool stays.
        Err(error) => {
            warn!(path = %path.display(), error = %error, "cannot read the upstream resolv.conf; keeping the last pool");
            return;
        }
    };
    let offer = pools(&text, fed, listeners);
    for (listener, upstreams) in &offer.pools {
        if upstreams.is_empty() {
            warn!(
                path = %path.display(),
                listener_id = listener,
                "NO USABLE UPSTREAM in resolv.conf: while this listener's cache is down, its empty-pool policy applies"
            );
        } else {
            info!(path = %path.display(), listener_id = listener, upstreams = ?upstreams.iter().map(ToString::to_string).collect::<Vec<_>>(), "upstreams from resolv.conf");
        }
    }
    // A closed channel means shutdown; `watch` notices and returns.
    if offer.send(SourceKind::ResolvConf, events).await.is_ok() {
        let _ = events
            .send(SourceEvent::Contact {
                source: SourceKind::ResolvConf,
            })
            .await;
    }
}

/// Publishes the pools from `path` now and after every change, until `events` closes.
pub async fn watch(
    path: PathBuf,
    fed: Vec<FedListener>,
    listeners: HashSet<IpAddr>,
    events: mpsc::Sender<SourceEvent>,
) {
    let directory = path
        .parent()
        .map_or_else(|| PathBuf::from("/"), Path::to_owned);
    let file_name: Option<OsString> = path.file_name().map(ToOwned::to_owned);
    loop {
        publish(&path, &fed, &listeners, &events).await;
        let stream = Inotify::init().and_then(|inotify| {
            inotify.watches().add(
                &directory,
                WatchMask::CLOSE_WRITE
                    | WatchMask::MOVED_TO
                    | WatchMask::MOVED_FROM
                    | WatchMask::CREATE
                    | WatchMask::DELETE
                    | WatchMask::DELETE_SELF,
            )?;
            inotify.into_event_stream([0u8; 4096])
        });
        let mut stream = match stream {
            Ok(stream) => stream,
            Err(error) => {
                warn!(directory = %directory.display(), error = %error, "cannot watch the resolv.conf directory; looking again shortly");
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        // Publish again once events for the file stop arriving, and every `RECHECK` (the file
        // read again is the source's contact, which the pools' age is measured from); restart
        // when the directory goes.
        loop {
            let event = match tokio::time::timeout(RECHECK, stream.next()).await {
                Ok(Some(Ok(event))) => event,
                Ok(_) => break,
                Err(_) => {
                    publish(&path, &fed, &listeners, &events).await;
                    if events.is_closed() {
                        return;
                    }
                    continue;
                }
            };
            if event.mask.contains(inotify::EventMask::DELETE_SELF) {
                break;
            }
            if event.name.as_deref() != file_name.as_deref() {
                continue;
            }
            while let Ok(Some(Ok(_))) = tokio::time::timeout(SETTLE, stream.next()).await {}
            publish(&path, &fed, &listeners, &events).await;
            if events.is_closed() {
                return;
            }
        }
        if events.is_closed() {
            return;
        }
        tokio::time::sleep(RETRY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fed() -> Vec<FedListener> {
        vec![
            FedListener {
                id: 0,
                address: "169.254.10.10".parse().unwrap(),
            },
            FedListener {
                id: 1,
                address: "fd00:53::10".parse().unwrap(),
            },
        ]
    }

    fn listeners() -> HashSet<IpAddr> {
        fed().iter().map(|listener| listener.address).collect()
    }

    fn ips(pool: &[Upstream]) -> Vec<String> {
        pool.iter()
            .map(|upstream| upstream.ip.to_string())
            .collect()
    }

    #[test]
    fn each_family_to_its_own_pool_ipv6_first_file() {
        let text = "# resolv.conf(5) of systemd-resolved\n\
                    nameserver 2001:4860:4860::8888\n\
                    nameserver 168.63.129.16\n\
                    ; a comment\n\
                    search cluster.local example.com\n\
                    options edns0 trust-ad\n\
                    nameserver 10.0.0.2\n";
        let Offer {
            pools: found,
            rejected,
        } = pools(text, &fed(), &listeners());
        assert_eq!(ips(&found[&0]), ["168.63.129.16", "10.0.0.2"]);
        assert_eq!(ips(&found[&1]), ["2001:4860:4860::8888"]);
        assert!(rejected.is_empty(), "{rejected:?}");
        assert!(
            found[&0]
                .iter()
                .all(|upstream| upstream.udp_port == 53 && upstream.tcp_port == 53)
        );
    }

    #[test]
    fn the_listener_itself_is_never_its_own_upstream() {
        let text = "nameserver 169.254.10.10\nnameserver 127.0.0.53\nnameserver 10.0.0.2\n";
        let Offer {
            pools: found,
            rejected,
        } = pools(text, &fed(), &listeners());
        assert_eq!(ips(&found[&0]), ["10.0.0.2"]);
        assert_eq!(
            rejected,
            vec![
                ("169.254.10.10".to_owned(), Rejection::Listener),
                ("127.0.0.53".to_owned(), Rejection::Loopback)
            ]
        );
    }

    #[test]
    fn nothing_usable_is_an_empty_pool() {
        let Offer {
            pools: found,
            rejected,
        } = pools(
            "nameserver 127.0.0.53\nnameserver fe80::1%eth0\n",
            &fed(),
            &listeners(),
        );
        assert!(found[&0].is_empty() && found[&1].is_empty());
        assert_eq!(rejected.len(), 2);
        let Offer { pools: found, .. } = pools("", &fed(), &listeners());
        assert!(found[&0].is_empty());
    }

    #[test]
    fn duplicates_and_comments_are_skipped() {
        let text = "nameserver 10.0.0.2\n#nameserver 10.0.0.3\nnameserver 10.0.0.2\nnameserver\n";
        let Offer { pools: found, .. } = pools(text, &fed(), &listeners());
        assert_eq!(ips(&found[&0]), ["10.0.0.2"]);
    }
}
