//! A private bpf filesystem for the test's pins, unmounted when dropped.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use nix::mount::{MntFlags, MsFlags, mount, umount2};

/// A bpffs mounted on a fresh directory.
#[derive(Debug)]
pub struct BpfFs {
    path: PathBuf,
}

impl BpfFs {
    /// Mounts a bpffs at `path` (created).
    pub fn mount(path: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))?;
        mount(
            Some("bpf"),
            path,
            Some("bpf"),
            MsFlags::empty(),
            None::<&str>,
        )
        .with_context(|| format!("mounting bpffs at {}", path.display()))?;
        Ok(Self {
            path: path.to_owned(),
        })
    }

    /// The mount point.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BpfFs {
    fn drop(&mut self) {
        let _ = umount2(&self.path, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.path);
    }
}
