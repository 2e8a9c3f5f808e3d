//! The sandbox's network: the listener addresses on the node's loopback, the veths to the pod
//! and upstream namespaces with their addresses and routes, forwarding, the namespaces'
//! resolv.conf; and a link for listener addresses the agent manages.

use super::{PREFIX, Sandbox};
use crate::topology::{self, CLUSTER_LISTENER, NODE_LISTENER, V6_LISTENER};

impl Sandbox {
    pub(super) fn wire(&self) -> anyhow::Result<()> {
        let tag = &self.tag;
        let (node, pod, up) = (&self.node, &self.pod, &self.upstream);
        // Before any link exists, so that every interface inherits it: no duplicate address
        // detection (addresses, link-local ones included, are usable at once, so NDP never waits
        // on a tentative address), and the node forwards between pod and upstreams.
        for netns in [node, pod, up] {
            netns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
            netns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
        }
        node.sysctl("net.ipv4.ip_forward", "1")?;
        node.sysctl("net.ipv6.conf.default.forwarding", "1")?;
        node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        // Listener addresses on the node (their own namespace's loopback).
        for address in [
            format!("{NODE_LISTENER}/32"),
            format!("{CLUSTER_LISTENER}/32"),
        ] {
            node.ip(&["addr", "add", &address, "dev", "lo"])?;
        }
        node.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{V6_LISTENER}/128"),
            "dev",
            "lo",
            "nodad",
        ])?;

        let links = [
            (
                pod,
                format!("{PREFIX}{tag}np"),
                format!("{PREFIX}{tag}pn"),
                "1",
            ),
            (
                up,
                format!("{PREFIX}{tag}nu"),
                format!("{PREFIX}{tag}un"),
                "2",
            ),
        ];
        for (peer_ns, node_end, peer_end, net) in &links {
            node.ip(&[
                "link",
                "add",
                node_end,
                "type",
                "veth",
                "peer",
                "name",
                peer_end,
                "netns",
                peer_ns.name(),
            ])?;
            node.ip(&[
                "addr",
                "add",
                &format!("198.18.{net}.1/24"),
                "dev",
                node_end,
            ])?;
            node.ip(&[
                "-6",
                "addr",
                "add",
                &format!("fd00:{net}::1/64"),
                "dev",
                node_end,
                "nodad",
            ])?;
            node.ip(&["link", "set", node_end, "up"])?;
            peer_ns.ip(&["link", "set", peer_end, "up"])?;
        }
        pod.ip(&[
            "addr",
            "add",
            &format!("{}/24", topology::POD_V4),
            "dev",
            &links[0].2,
        ])?;
        pod.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{}/64", topology::POD_V6),
            "dev",
            &links[0].2,
            "nodad",
        ])?;
        for address in [topology::UPSTREAM_A_V4, topology::UPSTREAM_B_V4] {
            up.ip(&["addr", "add", &format!("{address}/24"), "dev", &links[1].2])?;
        }
        for address in [topology::UPSTREAM_A_V6, topology::UPSTREAM_B_V6] {
            up.ip(&[
                "-6",
                "addr",
                "add",
                &format!("{address}/64"),
                "dev",
                &links[1].2,
                "nodad",
            ])?;
        }
        for (peer_ns, gateway_v4, gateway_v6) in [
            (pod, topology::NODE_POD_SIDE_V4, topology::NODE_POD_SIDE_V6),
            (
                up,
                topology::NODE_UPSTREAM_SIDE_V4,
                topology::NODE_UPSTREAM_SIDE_V6,
            ),
        ] {
            peer_ns.ip(&["route", "add", "default", "via", &gateway_v4.to_string()])?;
            peer_ns.ip(&[
                "-6",
                "route",
                "add",
                "default",
                "via",
                &gateway_v6.to_string(),
            ])?;
        }

        let resolv = format!("nameserver {NODE_LISTENER}\noptions timeout:2 attempts:1\n");
        pod.write_resolv_conf(&resolv)?;
        node.write_resolv_conf(&resolv)?;
        Ok(())
    }

    /// A link of the sandbox's own in the node namespace for listener addresses the agent
    /// manages (`[interface] kind = "existing"`): one end of a veth pair, up. This kernel has no
    /// `dummy` driver; the pair goes away with the namespace.
    pub fn add_listener_link(&self) -> anyhow::Result<String> {
        let (link, peer) = (
            format!("{PREFIX}{}l0", self.tag),
            format!("{PREFIX}{}l1", self.tag),
        );
        self.node
            .ip(&["link", "add", &link, "type", "veth", "peer", "name", &peer])?;
        for end in [&link, &peer] {
            self.node.ip(&["link", "set", end, "up"])?;
        }
        Ok(link)
    }
}
