//! What `cargo xtask test`'s VMs need beyond the host's run, built at idle priority while the
//! host's tests and the first VMs run: the other architectures' tests, then the node's Go
//! programs (its kubelet, control plane and containerd) and the previous release's agent.
//!
//! The host's tests and most VM tests wait on queries and timers most of the time; these builds
//! take the CPU they leave (SCHED_IDLE: any other process that wants a CPU takes it first, so
//! the tests' timings are theirs). Only the boots that run what a build makes wait for it: the
//! node's boot, the last of the host architecture's, and the other architectures' runs.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
};

use anyhow::Context as _;

use crate::{
    arch::Arch,
    go_peers::{self, Cache, Peers},
};

/// The builds, on a thread of their own.
pub struct IdleBuilds {
    /// Set when the run has failed: the thread stops after the build at work.
    cancel: Arc<AtomicBool>,
    /// Whether the node's builds succeeded, once they are done.
    node: mpsc::Receiver<bool>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
}

impl IdleBuilds {
    /// Starts the builds.
    pub fn start() -> Self {
        let cancel = Arc::new(AtomicBool::new(false));
        let (node_done, node) = mpsc::channel();
        let cancelled = Arc::clone(&cancel);
        let thread = std::thread::spawn(move || build(&cancelled, &node_done));
        Self {
            cancel,
            node,
            thread: Some(thread),
        }
    }

    /// Waits until the node's builds are done; their error, if they failed.
    pub fn node_ready(&mut self) -> anyhow::Result<()> {
        match self.node.recv() {
            Ok(true) => Ok(()),
            // The thread ended before the node's builds, or they failed: its error.
            Ok(false) | Err(mpsc::RecvError) => self.finish(),
        }
    }

    /// Waits until every build is done; the first error.
    pub fn finish(&mut self) -> anyhow::Result<()> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        thread
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the VMs' builds panicked")))
    }
}

impl Drop for IdleBuilds {
    /// A run that failed before it needed them stops them after the build at work (a build
    /// left running would outlive the run).
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        let _ = self.finish();
    }
}

/// The thread's work: its own scheduling policy first, which the cargo, rustc and go processes it
/// starts inherit.
fn build(cancel: &AtomicBool, node_done: &mpsc::Sender<bool>) -> anyhow::Result<()> {
    let thread = nix::unistd::gettid().to_string();
    crate::lint::check(
        std::process::Command::new("chrt").args(["--idle", "--pid", "0", &thread]),
        "putting the VMs' builds at idle priority (chrt, util-linux) failed",
    )?;
    // The other architectures' tests first: cargo's lock on the target directory would hold
    // the first VM run's own (quick) build of the host's while they build, and they are done
    // within the host's tests.
    for arch in Arch::ALL.into_iter().filter(|arch| *arch != Arch::host()) {
        if cancel.load(Ordering::Relaxed) {
            return Ok(());
        }
        crate::vm::build_artifacts(arch)
            .with_context(|| format!("building the {} VM's tests", arch.name()))?;
    }
    let node = (|| {
        go_peers::ensure(Peers::Node, Cache::Remove)?;
        if cancel.load(Ordering::Relaxed) {
            return Ok(());
        }
        crate::previous_release::ensure().map(drop)
    })();
    // A receiver gone (a run that ended first) needs no word.
    let _ = node_done.send(node.is_ok());
    node.context("building the node's programs")
}
