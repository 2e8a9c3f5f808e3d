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

/// Where cgroup v1 mounts its `cpu` controller on hosts that keep v1 beside the unified
/// hierarchy (this machine: the unified hierarchy has no controllers).
const CPU_V1_ROOT: &str = "/sys/fs/cgroup/cpu";

/// A CPU quota for processes the test started: a cgroup of its own under the `cpu` controller,
/// with `quota_us` of CPU time in every `period_us` (the CFS bandwidth control that Kubernetes'
/// CPU limits set, `cpu.max` in cgroup v2, `cpu.cfs_quota_us` and `cpu.cfs_period_us` in v1).
/// The processes keep their unified cgroup (the programs' attach point). On drop they go back to
/// the controller's root and the cgroup is removed: nothing is killed.
#[derive(Debug)]
pub struct CpuQuota {
    path: PathBuf,
    /// Which interface set the quota, for reports.
    pub how: String,
}

impl CpuQuota {
    /// Creates cgroup `name` under the v1 `cpu` controller with the quota. Fails with what to do
    /// when this host has no v1 `cpu` controller.
    pub fn create(name: &str, quota_us: u64, period_us: u64) -> anyhow::Result<Self> {
        let root = Path::new(CPU_V1_ROOT);
        if !root.join("cpu.cfs_quota_us").exists() {
            bail!(
                "no cgroup v1 cpu controller at {CPU_V1_ROOT}: a CPU quota needs it on this kind of \
                 host (the unified hierarchy here offers no controllers); run where v1 `cpu` is mounted"
            );
        }
        let path = root.join(name);
        std::fs::create_dir(&path)
            .with_context(|| format!("creating cgroup {}", path.display()))?;
        let quota = Self {
            path,
            how: format!(
                "cpu.cfs_quota_us {quota_us} / cpu.cfs_period_us {period_us} (cgroup v1, as cpu.max \"{quota_us} {period_us}\")"
            ),
        };
        let write = |file: &str, value: u64| {
            let file = quota.path.join(file);
            std::fs::write(&file, value.to_string())
                .with_context(|| format!("writing {value} to {}", file.display()))
        };
        write("cpu.cfs_period_us", period_us)?;
        write("cpu.cfs_quota_us", quota_us)?;
        Ok(quota)
    }

    /// Moves process `pid` (one the test started) and its threads under the quota.
    pub fn add(&self, pid: u32) -> anyhow::Result<()> {
        let procs = self.path.join("cgroup.procs");
        std::fs::write(&procs, pid.to_string())
            .with_context(|| format!("moving {pid} into {}", procs.display()))
    }

    /// How often the quota held its processes off the CPU so far (`nr_throttled` of
    /// `cpu.stat`).
    pub fn throttled(&self) -> anyhow::Result<u64> {
        let stat = self.path.join("cpu.stat");
        std::fs::read_to_string(&stat)
            .with_context(|| format!("reading {}", stat.display()))?
            .lines()
            .find_map(|line| line.strip_prefix("nr_throttled ")?.trim().parse().ok())
            .with_context(|| format!("no nr_throttled in {}", stat.display()))
    }
}

impl Drop for CpuQuota {
    fn drop(&mut self) {
        let pids = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
        for pid in pids.lines() {
            let _ = std::fs::write(Path::new(CPU_V1_ROOT).join("cgroup.procs"), pid.trim());
        }
        if let Err(error) = std::fs::remove_dir(&self.path) {
            eprintln!("cleanup: removing {}: {error}", self.path.display());
        }
    }
}

/// A pod's cgroups as the kubelet lays them out, down to one container's, below a test cgroup;
/// removed child first.
#[derive(Debug)]
pub struct KubeletCgroups {
    /// From the top (`kubepods…`) down to the container.
    levels: Vec<TestCgroup>,
}

impl KubeletCgroups {
    /// Pod `uid`'s, Burstable, under the systemd driver, with a containerd container
    /// (`kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, _ for ->.slice/
    /// cri-containerd-<id>.scope`).
    pub fn systemd(parent: &TestCgroup, uid: &str) -> anyhow::Result<Self> {
        let slice = uid.replace('-', "_");
        Self::chain(
            parent,
            &[
                "kubepods.slice",
                "kubepods-burstable.slice",
                &format!("kubepods-burstable-pod{slice}.slice"),
                &format!("cri-containerd-{}.scope", "a1".repeat(32)),
            ],
        )
    }

    /// Pod `uid`'s, BestEffort, under the cgroupfs driver (`kubepods/besteffort/pod<uid>/<id>`).
    pub fn cgroupfs(parent: &TestCgroup, uid: &str) -> anyhow::Result<Self> {
        Self::chain(
            parent,
            &[
                "kubepods",
                "besteffort",
                &format!("pod{uid}"),
                &"b2".repeat(32),
            ],
        )
    }

    fn chain(parent: &TestCgroup, names: &[&str]) -> anyhow::Result<Self> {
        let mut levels: Vec<TestCgroup> = Vec::new();
        for name in names {
            let next = levels.last().unwrap_or(parent).child(name)?;
            levels.push(next);
        }
        Ok(Self { levels })
    }

    /// The container's cgroup, where its processes run.
    #[must_use]
    pub fn container(&self) -> &TestCgroup {
        self.levels.last().expect("a chain has levels")
    }
}

impl Drop for KubeletCgroups {
    fn drop(&mut self) {
        // Children before parents.
        while let Some(level) = self.levels.pop() {
            drop(level);
        }
    }
}
