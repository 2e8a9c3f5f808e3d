//! cgroups the test creates below the cgroup v2 root: programs attach here, never to the root.

use std::{
    fs::OpenOptions,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::command::kill_pid;

/// A cgroup v2 directory created by the test, removed on drop (after its processes, all started
/// by the test, are gone).
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
}

impl TestCgroup {
    /// Creates `parent/name`.
    pub fn create(parent: &Path, name: &str) -> anyhow::Result<Self> {
        let path = parent.join(name);
        std::fs::create_dir(&path)
            .with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(Self { path })
    }

    /// A child cgroup (removed before this one, as Rust drops it first when held after it).
    pub fn child(&self, name: &str) -> anyhow::Result<Self> {
        Self::create(&self.path, name)
    }

    /// The directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `cgroup.procs`, open for writing: hand it to `join_cgroup_before_exec`.
    pub fn procs(&self) -> anyhow::Result<OwnedFd> {
        open_procs(&self.path)
    }

    fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.trim().parse().ok())
            .collect()
    }

    fn remove(&self) -> anyhow::Result<()> {
        for _ in 0..100 {
            // Only processes this test moved in can be here.
            for pid in self.pids() {
                kill_pid(pid);
            }
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return Ok(()),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        bail!("cgroup {} could not be removed", self.path.display())
    }
}

/// The `cgroup.procs` file of the cgroup at `path`, open for writing.
pub fn open_procs(path: &Path) -> anyhow::Result<OwnedFd> {
    let procs = path.join("cgroup.procs");
    let file = OpenOptions::new()
        .write(true)
        .open(&procs)
        .with_context(|| format!("opening {}", procs.display()))?;
    Ok(file.into())
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        if let Err(error) = self.remove() {
            eprintln!("cleanup: {error:#}");
        }
    }
}
