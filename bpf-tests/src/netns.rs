//! Network namespaces the test creates, and removes when dropped.

use std::{path::PathBuf, process::Command};

use anyhow::Context as _;

use crate::command::run;

/// A named network namespace (`ip netns add`), deleted on drop, with its per-namespace
/// `/etc/netns/NAME/` (which `ip netns exec` bind-mounts over `/etc`).
#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Creates the namespace and brings its loopback up.
    pub fn create(name: &str) -> anyhow::Result<Self> {
        run("ip", ["netns", "add", name]).with_context(|| format!("creating netns {name}"))?;
        let netns = Self {
            name: name.to_owned(),
        };
        netns.ip(&["link", "set", "lo", "up"])?;
        Ok(netns)
    }

    /// The namespace's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `ip -n NAME args...`.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["-n", &self.name];
        full.extend_from_slice(args);
        run("ip", full).with_context(|| format!("ip {} in {}", args.join(" "), self.name))
    }

    /// Sets a sysctl inside the namespace.
    pub fn sysctl(&self, key: &str, value: &str) -> anyhow::Result<()> {
        run(
            "ip",
            [
                "netns",
                "exec",
                &self.name,
                "sysctl",
                "-q",
                "-w",
                &format!("{key}={value}"),
            ],
        )
        .with_context(|| format!("sysctl {key}={value} in {}", self.name))?;
        Ok(())
    }

    /// Runs `program args...` inside the namespace and returns its stdout.
    pub fn run(&self, program: &str, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["netns", "exec", &self.name, program];
        full.extend_from_slice(args);
        run("ip", full).with_context(|| format!("{program} {} in {}", args.join(" "), self.name))
    }

    /// A command that runs `program` inside the namespace.
    #[must_use]
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name, program]);
        command
    }

    /// Writes `/etc/netns/NAME/resolv.conf`, which commands run in the namespace see as
    /// `/etc/resolv.conf` (glibc's resolver reads it).
    pub fn write_resolv_conf(&self, text: &str) -> anyhow::Result<()> {
        let dir = self.etc_dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("resolv.conf");
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    }

    fn etc_dir(&self) -> PathBuf {
        PathBuf::from("/etc/netns").join(&self.name)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.etc_dir());
        // Deleting the namespace also removes its veth ends (and their peers).
        let _ = run("ip", ["netns", "del", &self.name]);
    }
}
