//! The agent's nftables table, rendered from what it must untrack. Pure text: unit-tested here,
//! applied by `nft` as one batch (one kernel transaction).
//!
//! ```text
//! table inet redirector
//!   set local4/local6       protocol . address . port of every listener and cache
//!   chain prerouting (raw)  requests arriving for a local endpoint (pods over their veth)
//!   chain output (raw)      requests of host-network clients to a local endpoint; the caches'
//!                           replies
//! ```
//! Raw priority (-300) runs before conntrack (-200), so an untracked packet never creates an
//! entry. Sets keyed by `meta l4proto . address . th port` match exactly the endpoints given (a
//! cache on another port), never "anything on port 53".
//!
//! Failover traffic to the upstreams is never untracked. By address it cannot be told apart from
//! traffic redirector did not steer (a pod asking the kube-dns ClusterIP, whose DNATed replies come
//! from the same endpoint address and port), and an untracked reply skips the reverse NAT, so that
//! client would get its answer from an address it never asked. Failover traffic is also rare: it
//! flows only while a cache is down.

use std::{collections::BTreeSet, fmt::Write as _, net::IpAddr};

/// The table's family and name: `inet` covers IPv4 and IPv6 in one table.
pub const TABLE: &str = "inet redirector";

/// A transport protocol of DNS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    /// UDP.
    Udp,
    /// TCP.
    Tcp,
}

impl Protocol {
    fn keyword(self) -> &'static str {
        match self {
            Self::Udp => "udp",
            Self::Tcp => "tcp",
        }
    }
}

/// One DNS endpoint whose traffic is untracked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Endpoint {
    /// The protocol.
    pub protocol: Protocol,
    /// The address (IPv4-mapped addresses are written as IPv4).
    pub address: IpAddr,
    /// The port.
    pub port: u16,
}

impl Endpoint {
    /// `address:port` over UDP and over TCP (separate ports when kube-dns names them apart).
    #[must_use]
    pub fn both(address: IpAddr, udp_port: u16, tcp_port: u16) -> [Self; 2] {
        let address = address.to_canonical();
        [
            Self {
                protocol: Protocol::Udp,
                address,
                port: udp_port,
            },
            Self {
                protocol: Protocol::Tcp,
                address,
                port: tcp_port,
            },
        ]
    }
}

/// What the table untracks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ruleset {
    /// The listeners and caches: requests to them and their replies.
    pub local: BTreeSet<Endpoint>,
}

impl Ruleset {
    /// The whole table as one `nft -f` batch that replaces any previous version of it: the
    /// leading `add` makes the `delete` valid on a first install, and the kernel applies the three
    /// as one transaction, so packets see the old table or the new one, never none.
    #[must_use]
    pub fn render(&self) -> String {
        let mut text = format!("add table {TABLE}\ndelete table {TABLE}\ntable {TABLE} {{\n");
        text.push_str(
            "\tcomment \"redirector: DNS to and from the node-local caches bypasses conntrack\"\n",
        );
        set(&mut text, "local4", false, &self.local);
        set(&mut text, "local6", true, &self.local);

        // Each chain is named after its hook.
        for (hook, rules) in [("prerouting", PREROUTING), ("output", OUTPUT)] {
            let _ = writeln!(
                text,
                "\tchain {hook} {{\n\t\ttype filter hook {hook} priority raw; policy accept;"
            );
            for (way, comment) in rules {
                rule(&mut text, *way, comment);
            }
            text.push_str("\t}\n");
        }
        text.push_str("}\n");
        text
    }

    /// A batch that removes the table, and succeeds when there is none.
    #[must_use]
    pub fn removal() -> String {
        format!("add table {TABLE}\ndelete table {TABLE}\n")
    }
}

/// Writes the set `name` of the endpoints of one family.
fn set(text: &mut String, name: &str, ipv6: bool, endpoints: &BTreeSet<Endpoint>) {
    let family = if ipv6 { "ipv6_addr" } else { "ipv4_addr" };
    let _ = write!(
        text,
        "\tset {name} {{\n\t\ttype inet_proto . {family} . inet_service\n"
    );
    let elements: Vec<String> = endpoints
        .iter()
        .filter(|endpoint| endpoint.address.is_ipv6() == ipv6)
        .map(|endpoint| {
            format!(
                "{} . {} . {}",
                endpoint.protocol.keyword(),
                endpoint.address,
                endpoint.port
            )
        })
        .collect();
    // nft refuses an empty element list; an empty set is written without one.
    if !elements.is_empty() {
        let _ = writeln!(text, "\t\telements = {{ {} }}", elements.join(", "));
    }
    text.push_str("\t}\n");
}

/// Which way a rule matches the endpoints: packets to them (requests) or from them (replies).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    To,
    From,
}

/// The rules of the prerouting chain: requests arriving from other namespaces (pods).
const PREROUTING: &[(Way, &str)] = &[(Way::To, "requests to a listener or cache")];

/// The rules of the output chain: what this namespace sends.
const OUTPUT: &[(Way, &str)] = &[
    (Way::To, "host requests to a listener or cache"),
    (Way::From, "replies of a cache"),
];

/// Writes the IPv4 and IPv6 `notrack` rules matching the local endpoints `way`.
fn rule(text: &mut String, way: Way, comment: &str) {
    let (address, port) = match way {
        Way::To => ("daddr", "dport"),
        Way::From => ("saddr", "sport"),
    };
    for (family, suffix) in [("ip", "4"), ("ip6", "6")] {
        let _ = writeln!(
            text,
            "\t\tmeta l4proto . {family} {address} . th {port} @local{suffix} notrack comment \"{comment}\""
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local() -> BTreeSet<Endpoint> {
        let mut local = BTreeSet::new();
        local.extend(Endpoint::both("169.254.10.10".parse().unwrap(), 53, 53));
        local.extend(Endpoint::both("fd00:53::10".parse().unwrap(), 53, 53));
        local.extend(Endpoint::both(
            "::ffff:169.254.20.10".parse().unwrap(),
            5353,
            5353,
        ));
        local
    }

    #[test]
    fn every_listener_and_cache_in_its_family_set() {
        let text = Ruleset { local: local() }.render();
        assert!(text.starts_with("add table inet redirector\ndelete table inet redirector\n"));
        assert!(
            text.contains("elements = { udp . 169.254.10.10 . 53, udp . 169.254.20.10 . 5353, tcp . 169.254.10.10 . 53, tcp . 169.254.20.10 . 5353 }"),
            "{text}"
        );
        assert!(
            text.contains("elements = { udp . fd00:53::10 . 53, tcp . fd00:53::10 . 53 }"),
            "{text}"
        );
        assert!(text.contains("meta l4proto . ip daddr . th dport @local4 notrack"));
        assert!(text.contains("meta l4proto . ip6 saddr . th sport @local6 notrack"));
        assert!(
            !text.contains("upstream"),
            "failover traffic stays tracked by default: {text}"
        );
    }
}
