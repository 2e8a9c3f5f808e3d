//! One agent per node: the running agent holds an exclusive `flock` on the lock file, which
//! records its pid. The lock goes with the process, however it ends.

use std::{
    fs::{File, OpenOptions},
    io::{Read as _, Seek as _, Write as _},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use nix::fcntl::{Flock, FlockArg};

/// Why the lock could not be taken. `path` is the configured `lock_file`.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another agent holds it.
    #[error(
        "another redirector agent (pid {pid}) holds {path}: one agent runs per node; stop it first \
         (systemctl stop redirector, or kill {pid}), or give this one another lock_file and pin_dir"
    )]
    Held {
        path: PathBuf,
        /// The holder's pid, as it recorded it.
        pid: String,
    },
    /// A process that is no agent holds it (an agent records its pid in the file).
    #[error(
        "{path} is locked by pid {pid} ({command}), which is not a redirector agent: while it \
         holds the lock no agent, uninstall or status can run. End that process; the agent keeps \
         the file 0600 in a directory only root can enter, so no other user can take it again"
    )]
    HeldByOther {
        path: PathBuf,
        /// The holder's pid, from /proc/locks.
        pid: String,
        /// Its command name (`/proc/PID/comm`), or `unknown`.
        command: String,
    },
    /// The file belongs to another user, who could open and lock it at will.
    #[error(
        "{path} belongs to uid {owner}, not to the agent's uid {agent}: another user could lock \
         the agent out with it. Remove it (no agent is running: none holds it) and start again"
    )]
    ForeignOwner {
        path: PathBuf,
        /// The file's owner.
        owner: u32,
        /// The agent's effective uid.
        agent: u32,
    },
    /// The directory of the file can be written by other users, who could replace the file.
    #[error(
        "{dir}, the directory of lock_file {path}, is writable by other users (mode {mode:04o}): \
         anyone could replace the lock. Put lock_file in a directory only root can write (the \
         default /run/redirector is created 0700)"
    )]
    OpenDirectory {
        path: PathBuf,
        dir: PathBuf,
        /// Its permission bits.
        mode: u32,
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
    /// Takes the lock at `path` (creating the file 0600, and its directory 0700 when missing) and
    /// writes this pid into it. A file of a wider mode (an older release's, made under the
    /// process's umask) is narrowed to 0600; a file of another user, or one in a directory other
    /// users can write, is refused: either would let a local user lock every agent out.
    pub fn acquire(path: &Path) -> Result<Self, LockError> {
        use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _};

        let io = |source| LockError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io)?;
            let mode = std::fs::metadata(dir).map_err(io)?.mode();
            // Writable by group or others, and not sticky (a sticky /tmp keeps others' hands off
            // root's file).
            if mode & 0o022 != 0 && mode & 0o1000 == 0 {
                return Err(LockError::OpenDirectory {
                    path: path.to_owned(),
                    dir: dir.to_owned(),
                    mode: mode & 0o7777,
                });
            }
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            // A symlink put in its place could point the agent at another file.
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(io)?;
        let metadata = file.metadata().map_err(io)?;
        let agent = nix::unistd::geteuid().as_raw();
        if metadata.uid() != agent {
            return Err(LockError::ForeignOwner {
                path: path.to_owned(),
                owner: metadata.uid(),
                agent,
            });
        }
        if metadata.mode() & 0o077 != 0 {
            file.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(io)?;
        }
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((mut file, errno)) if errno == nix::errno::Errno::EWOULDBLOCK => {
                let mut recorded = String::new();
                let _ = file.read_to_string(&mut recorded);
                return Err(held(path, recorded.trim()));
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

/// The agent's command name, as `/proc/PID/comm` shows it.
const AGENT_COMMAND: &str = "redirector";

/// Why the lock at `path` could not be taken: an agent holds it (the pid it recorded holds the
/// `flock`), or another process does (/proc/locks names it).
fn held(path: &Path, recorded: &str) -> LockError {
    use std::os::unix::fs::MetadataExt as _;
    let holder = std::fs::metadata(path).ok().and_then(|metadata| {
        let locks = std::fs::read_to_string("/proc/locks").ok()?;
        holder_in(&locks, metadata.dev(), metadata.ino(), Some(recorded))
    });
    let command = |pid: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .map_or_else(|_| "unknown".to_owned(), |comm| comm.trim().to_owned())
    };
    match holder {
        // Another pid than the one recorded is still an agent when it runs redirector: one in
        // another pid namespace (a pod's) records its own pid, or one that has not written its
        // pid yet.
        Some(pid) if pid != recorded && command(&pid) != AGENT_COMMAND => {
            let command = command(&pid);
            LockError::HeldByOther {
                path: path.to_owned(),
                pid,
                command,
            }
        }
        Some(pid) if pid != recorded => LockError::Held {
            path: path.to_owned(),
            pid,
        },
        _ => LockError::Held {
            path: path.to_owned(),
            pid: recorded.to_owned(),
        },
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
    fn the_file_is_private_and_a_wider_one_is_narrowed() {
        use std::os::unix::fs::MetadataExt as _;
        let dir = std::env::temp_dir().join(format!("redirector-lock-mode-{}", std::process::id()));
        let path = dir.join("agent.lock");
        let lock = InstanceLock::acquire(&path).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        drop(lock);
        // As an older release left it: readable by everyone, so anyone could flock it.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let lock = InstanceLock::acquire(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        drop(lock);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let error = InstanceLock::acquire(&path).unwrap_err();
        assert!(matches!(error, LockError::OpenDirectory { .. }), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_lock_held_by_another_process_names_it() {
        let path =
            std::env::temp_dir().join(format!("redirector-lock-other-{}", std::process::id()));
        let lock = InstanceLock::acquire(&path).unwrap();
        // What another process finds when the pid recorded is not the holder's.
        std::fs::write(&path, "1\n").unwrap();
        let error = held(&path, "1");
        assert!(
            matches!(&error, LockError::HeldByOther { pid, .. } if *pid == std::process::id().to_string()),
            "{error}"
        );
        assert!(
            error.to_string().contains("not a redirector agent"),
            "{error}"
        );
        drop(lock);
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
