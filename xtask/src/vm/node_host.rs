//! The node boot's host side: bpf-tests' `node-host` (bpf_tests::node), which builds the node's
//! images and runs its control plane for as long as the boot lasts. Started before qemu, ready
//! when it has written the node's directory; stopped by closing its standard input (it stops the
//! control plane itself), and killed by its pid if it does not end.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::previous_release::PreviousRelease;

/// How long the first run may take to build the images (the base image is an mmdebstrap from
/// Debian's mirror) and start the control plane.
const READY_WITHIN: Duration = Duration::from_secs(1200);

/// The running host side.
#[derive(Debug)]
pub struct NodeHost {
    child: Option<Child>,
    /// The node's directory.
    pub dir: PathBuf,
    /// The API server's port on the loopback.
    pub api_port: u16,
}

impl NodeHost {
    /// Starts `program` for the node in `dir` and waits until it is ready; the agent's image is
    /// `redirector`'s, the previous release's is `previous`'s.
    pub fn start(
        program: &Path,
        dir: &Path,
        profile_dir: &Path,
        redirector: &Path,
        previous: &PreviousRelease,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let workspace = crate::workspace::workspace_root();
        let log_file =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(program)
            .arg("--node-dir")
            .arg(dir)
            .arg("--podman-dir")
            .arg(crate::workspace::target_dir().join("tmp/containers"))
            .arg("--workspace")
            .arg(&workspace)
            .arg("--redirector")
            .arg(redirector)
            .arg("--dns-stream")
            .arg(profile_dir.join("dns-stream"))
            .arg("--previous-version")
            .arg(crate::previous_release::VERSION)
            .arg("--previous-commit")
            .arg(crate::previous_release::commit_label())
            .arg("--previous-redirector")
            .arg(&previous.redirector)
            .arg("--previous-tree")
            .arg(&previous.tree)
            .stdin(Stdio::piped())
            .stdout(log_file.try_clone().context("opening the log again")?)
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        let mut host = Self {
            child: Some(child),
            dir: dir.to_owned(),
            api_port: 0,
        };
        let started = Instant::now();
        let ready = dir.join("ready");
        while !ready.exists() {
            if let Some(child) = host.child.as_mut()
                && let Some(status) = child.try_wait().context("waiting for node-host")?
            {
                bail!(
                    "node-host ended ({status}) before the node's control plane was up; see {}",
                    log.display()
                );
            }
            if started.elapsed() > READY_WITHIN {
                bail!(
                    "node-host was not ready within {} s; see {}",
                    READY_WITHIN.as_secs(),
                    log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let port = dir.join("api-port");
        host.api_port = std::fs::read_to_string(&port)
            .with_context(|| format!("reading {}", port.display()))?
            .trim()
            .parse()
            .with_context(|| format!("{} holds no port", port.display()))?;
        eprintln!(
            "xtask: [node] images and control plane ready in {} s",
            started.elapsed().as_secs()
        );
        Ok(host)
    }
}

impl Drop for NodeHost {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Its standard input closed: it stops the control plane and ends.
            drop(child.stdin.take());
            let by = Instant::now() + Duration::from_secs(30);
            while Instant::now() < by {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
