//! Conntrack in a sandbox namespace: switched on the way a node has it on (a firewall rule that
//! matches on `ct state`), its entries counted, and the agent's bypass table read.

use std::net::IpAddr;

use crate::netns::NetNs;

/// The firewall table a node would have: conntrack runs for every packet of the namespace once
/// a rule matches on connection state.
const NODE_FIREWALL: &str = "add table inet node-firewall; \
    add chain inet node-firewall input { type filter hook input priority filter; policy accept; }; \
    add chain inet node-firewall forward { type filter hook forward priority filter; policy accept; }; \
    add chain inet node-firewall output { type filter hook output priority filter; policy accept; }; \
    add rule inet node-firewall input ct state invalid drop; \
    add rule inet node-firewall forward ct state invalid drop; \
    add rule inet node-firewall output ct state invalid drop";

/// Turns conntrack on in `netns`, as on a node.
pub fn activate(netns: &NetNs) -> anyhow::Result<()> {
    netns.run("nft", &[NODE_FIREWALL])?;
    Ok(())
}

/// Forgets every entry of `netns`.
pub fn flush(netns: &NetNs) -> anyhow::Result<()> {
    for family in ["ipv4", "ipv6"] {
        // Exits 1 with "0 flow entries" when there is nothing to flush on some versions.
        let _ = netns.run("conntrack", &["-F", "-f", family]);
    }
    Ok(())
}

/// The entries of `netns` whose original or reply direction has `address` as source or
/// destination.
pub fn entries(netns: &NetNs, address: IpAddr) -> anyhow::Result<Vec<String>> {
    let family = if address.is_ipv4() { "ipv4" } else { "ipv6" };
    let listing = netns.run("conntrack", &["-L", "-f", family])?;
    let needles = [format!("src={address} "), format!("dst={address} ")];
    Ok(listing
        .lines()
        .filter(|line| needles.iter().any(|needle| line.contains(needle.as_str())))
        .map(str::to_owned)
        .collect())
}

/// `nft list table inet redirector` in `netns` (`None`: no such table).
pub fn bypass_table(netns: &NetNs) -> anyhow::Result<Option<String>> {
    match netns.run("nft", &["list", "table", "inet", "redirector"]) {
        Ok(listing) => Ok(Some(listing)),
        Err(error) if format!("{error:#}").contains("No such file or directory") => Ok(None),
        Err(error) => Err(error),
    }
}

/// Every rule of `netns` outside the agent's table, as `nft list ruleset` shows them (the
/// iptables-nft tables included), plus `iptables-legacy-save` and `ip6tables-legacy-save`.
pub fn other_rules(netns: &NetNs) -> anyhow::Result<String> {
    let ruleset = netns.run("nft", &["list", "ruleset"])?;
    let mut others = String::new();
    let mut ours = false;
    for line in ruleset.lines() {
        if line.starts_with("table ") {
            ours = line.starts_with("table inet redirector ");
        }
        if !ours {
            others.push_str(line);
            others.push('\n');
        }
    }
    for save in ["iptables-legacy-save", "ip6tables-legacy-save"] {
        let saved = netns.run(save, &[])?;
        // Without the timestamps of the comments and the packet counters of the chains.
        for line in saved.lines().filter(|line| !line.starts_with('#')) {
            let line = match line.split_once(" [") {
                Some((chain, _counters)) if line.starts_with(':') => chain,
                _ => line,
            };
            others.push_str(line);
            others.push('\n');
        }
    }
    Ok(others)
}
