//! The agent configurations the sandbox writes: its cgroup, pins, lock file, drain socket and
//! node namespace, the probes' timings stretched by [`crate::pace`], then the test's tables and
//! listeners.

use std::{path::PathBuf, time::Duration};

use super::Sandbox;
use crate::pace::{paced, paced_ms};

/// The `[interface]` table of the sandbox's agent configurations: the listener addresses are the
/// sandbox's (on the node namespace's loopback), not the agent's to manage.
pub const UNMANAGED_INTERFACE: &str = "[interface]\nmanage = false\n";

impl Sandbox {
    /// An agent configuration for this sandbox: its cgroup, pin directory, lock file and node
    /// namespace, probes every 250 ms with a 200 ms timeout (the defaults' hysteresis), the
    /// default stall limit, a signal hold of 1.5 s (the default's 6 s would only slow the tests
    /// that wait it out), the upstream checks' default interval and timeout, socket
    /// counts reconciled every 500 ms (all stretched by [`crate::pace`]), metrics on a free
    /// loopback port, the listener addresses left to the sandbox (they are on the node's
    /// loopback), then `listeners` (TOML `[[listener]]` sections).
    #[must_use]
    pub fn config_toml(&self, listeners: &str) -> String {
        self.config_toml_with(listeners, UNMANAGED_INTERFACE)
    }

    /// The same, with `tables` (TOML tables such as `[interface]` or `[kubernetes]`) instead of
    /// the default `[interface] manage = false`.
    #[must_use]
    pub fn config_toml_with(&self, listeners: &str, tables: &str) -> String {
        self.config_toml_probing(
            listeners,
            tables,
            paced(Duration::from_millis(250)),
            paced(Duration::from_millis(200)),
        )
    }

    /// The same, probing every `interval` with `timeout` (the benchmarks use the agent's
    /// defaults).
    #[must_use]
    pub fn config_toml_probing(
        &self,
        listeners: &str,
        tables: &str,
        interval: Duration,
        timeout: Duration,
    ) -> String {
        self.config_toml_with_probe(
            listeners,
            tables,
            &format!(
                "interval_ms = {}\ntimeout_ms = {}\nstall_after_ms = {}\nsignal_hold_ms = {}\n\
                 upstream_interval_ms = {}\nupstream_timeout_ms = {}\n",
                interval.as_millis(),
                timeout.as_millis(),
                paced_ms(redirector::config::DEFAULT_STALL_AFTER_MS),
                paced_ms(1500),
                // The upstream checks' defaults, stretched together, so that a slower machine
                // checks each target as often per timeout as the host does.
                paced_ms(redirector::config::DEFAULT_UPSTREAM_INTERVAL_MS),
                paced_ms(redirector::config::DEFAULT_UPSTREAM_TIMEOUT_MS),
            ),
        )
    }

    /// The same, with `probe` as the body of the `[probe]` table (hysteresis included).
    #[must_use]
    pub fn config_toml_with_probe(&self, listeners: &str, tables: &str, probe: &str) -> String {
        format!(
            "cgroup = {:?}\npin_dir = {:?}\nlock_file = {:?}\ndrain_socket = {:?}\ncache_netns = {:?}\nsocket_reconcile_interval_ms = {}\n\n[probe]\n{probe}\n[metrics]\naddress = \"127.0.0.1:0\"\n\n{tables}\n{listeners}",
            self.cgroup.path().display().to_string(),
            self.pin_dir().display().to_string(),
            self.lock_file().display().to_string(),
            self.drain_socket().display().to_string(),
            self.node_netns_path().display().to_string(),
            paced_ms(500),
        )
    }

    /// The agent's drain socket in this sandbox (`drain_socket`).
    #[must_use]
    pub fn drain_socket(&self) -> PathBuf {
        self.scratch.0.join("drain").join("drain.sock")
    }

    /// The agent's lock file in the sandbox's configurations.
    #[must_use]
    pub fn lock_file(&self) -> PathBuf {
        self.scratch.0.join("agent.lock")
    }
}
