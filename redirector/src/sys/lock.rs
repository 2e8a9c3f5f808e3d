//! One agent per node: the running agent holds an exclusive `flock` on the lock file, which
//! records its pid. The lock goes with the process, however it ends.

use std::{
    fs::{File, OpenOptions},
    io::{Read as _, Seek as _, Write as _},
    path::{Path, PathBuf},
};

use nix::fcntl::{Flock, FlockArg};

/// Why the lock could not be taken. `path` is the configured `lock_file`.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds it.
    #[error(
        "another redirector agent (pid {pid}) holds {path}: one agent runs per node; stop it first \
         (systemctl stop redirector, or kill {pid}), or give this one another lock_file and pin_dir"
    )]
    Held {
        path: PathBuf,
        /// The holder's pid, as it recorded it.
        pid: String,
    },
    /// The file could not be created or locked.
    #[error("cannot lock {path}")]
    Io {
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

/// The held lock; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct InstanceLock {
    _lock: Flock<File>,
    path: PathBuf,
}

impl InstanceLock {
    /// Takes the lock at `path` (creating the file and its directory) and writes this pid into it.
    pub fn acquire(path: &Path) -> Result<Self, LockError> {
        let io = |source| LockError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((mut file, errno)) if errno == nix::errno::Errno::EWOULDBLOCK => {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                return Err(LockError::Held {
                    path: path.to_owned(),
                    pid: pid.trim().to_owned(),
                });
            }
            Err((_, errno)) => return Err(io(errno.into())),
        };
        lock.set_len(0).map_err(io)?;
        lock.rewind().map_err(io)?;
        writeln!(lock, "{}", std::process::id()).map_err(io)?;
        Ok(Self {
            _lock: lock,
            path: path.to_owned(),
        })
    }

    /// The lock file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The pid of the agent holding the lock at `path`, if one does. Only reads (`/proc/locks` and
/// the pid the holder recorded), so it never disturbs an agent or an `uninstall` taking the lock
/// at the same moment.
#[must_use]
pub fn holder(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let metadata = std::fs::metadata(path).ok()?;
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let recorded = std::fs::read_to_string(path).ok();
    holder_in(
        &locks,
        metadata.dev(),
        metadata.ino(),
        recorded.as_deref().map(str::trim),
    )
}

/// The holder among the `flock`s of `locks` (`/proc/locks`) of the file `device`, `inode`.
///
/// /proc/locks names a file as MAJOR:MINOR:INODE of the file system that holds it. On an overlay
/// (a container's root, a VM's) that is the upper layer's device, which `stat` on the overlay
/// does not show; the inode number is the same. There, a lock on the same inode number taken by
/// the pid the file records is the holder.
fn holder_in(locks: &str, device: u64, inode: u64, recorded: Option<&str>) -> Option<String> {
    // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (waiters have "->" and are skipped).
    let flocks: Vec<(&str, &str)> = locks
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.get(1) == Some(&"FLOCK")).then_some((*fields.get(4)?, *fields.get(5)?))
        })
        .collect();
    let exact = format!(
        "{:02x}:{:02x}:{inode}",
        libc::major(device),
        libc::minor(device)
    );
    if let Some((pid, _)) = flocks.iter().find(|(_, file)| *file == exact) {
        return Some((*pid).to_owned());
    }
    let recorded = recorded?;
    let same_inode = format!(":{inode}");
    flocks
        .iter()
        .find(|(pid, file)| *pid == recorded && file.ends_with(&same_inode))
        .map(|(pid, _)| (*pid).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid() {
        let path =
            std::env::temp_dir().join(format!("redirector-lock-test-{}", std::process::id()));
        let first = InstanceLock::acquire(&path).unwrap();
        assert_eq!(holder(&path), Some(std::process::id().to_string()));
        let error = InstanceLock::acquire(&path).unwrap_err();
        assert!(
            error
                .to_string()
                .contains(&format!("(pid {})", std::process::id())),
            "{error}"
        );
        drop(first);
        assert_eq!(holder(&path), None, "released");
        let again = InstanceLock::acquire(&path).expect("free again once released");
        drop(again);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn an_overlay_lock_is_found_by_inode_and_recorded_pid() {
        let locks = "1: FLOCK  ADVISORY  WRITE 4242 00:2a:1234 0 EOF\n\
                     2: POSIX  ADVISORY  WRITE 77 00:1b:1234 0 EOF\n";
        // The overlay's device (00:1b) is not the upper layer's (00:2a).
        let overlay = libc::makedev(0, 0x1b);
        assert_eq!(
            holder_in(locks, overlay, 1234, Some("4242")),
            Some("4242".to_owned())
        );
        assert_eq!(
            holder_in(locks, overlay, 1234, Some("99")),
            None,
            "another pid"
        );
        assert_eq!(
            holder_in(locks, overlay, 1234, None),
            None,
            "nothing recorded"
        );
        assert_eq!(
            holder_in(locks, overlay, 12345, Some("4242")),
            None,
            "another inode"
        );
        let upper = libc::makedev(0, 0x2a);
        assert_eq!(holder_in(locks, upper, 1234, None), Some("4242".to_owned()));
    }
}
