//! The sandbox's scratch directory (removed with it): files and executables a test writes there,
//! readable and runnable by any user.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::Sandbox;

impl Sandbox {
    /// The sandbox's scratch folder (removed with it), for files a test writes.
    #[must_use]
    pub fn scratch_dir(&self) -> &Path {
        &self.scratch.0
    }

    /// Writes `text` to `name` in the sandbox's scratch directory (readable by everyone) and
    /// returns the path.
    pub fn write_file(&self, name: &str, text: &str) -> anyhow::Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = self.scratch.0.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        for open in [&self.scratch.0, &path] {
            std::fs::set_permissions(open, std::fs::Permissions::from_mode(0o755))
                .with_context(|| format!("opening up {}", open.display()))?;
        }
        Ok(path)
    }

    /// Copies the executable `from` into the sandbox's scratch directory as `name`, runnable by
    /// any user: a process of another user cannot reach it where cargo built it when the
    /// workspace is below a private directory (`/root`).
    ///
    /// `install(1)` writes the copy, never this process: a file this process had open for
    /// writing stays open in every child another test thread forks meanwhile, until that child
    /// execs, and executing the file then fails with ETXTBSY ("Text file busy"; seen in the VMs).
    pub fn copy_executable(&self, from: &Path, name: &str) -> anyhow::Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = self.scratch.0.join(name);
        crate::command::run(
            "install",
            [
                "-m",
                "0755",
                &from.display().to_string(),
                &path.display().to_string(),
            ],
        )
        .with_context(|| format!("copying {} to {}", from.display(), path.display()))?;
        std::fs::set_permissions(&self.scratch.0, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("opening up {}", self.scratch.0.display()))?;
        Ok(path)
    }

    /// Writes the script `text` to `name` in the sandbox's scratch directory, executable, and
    /// returns its path. Written as a draft by this process, then installed by `install(1)` (see
    /// [`Self::copy_executable`]).
    pub fn write_executable(&self, name: &str, text: &str) -> anyhow::Result<PathBuf> {
        let draft = self.write_file(&format!("{name}.draft"), text)?;
        self.copy_executable(&draft, name)
    }
}
