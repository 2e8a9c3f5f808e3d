//! Network namespaces: the agent probes the caches and reads their socket tables from the
//! namespace the caches run in (the node's; in tests, a namespace the test made).

use std::{
    fs::File,
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
};

/// `SO_NETNS_COOKIE` (5.14+): the cookie of a socket's network namespace.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// Why something could not be done in a network namespace. `path` names the namespace
/// (`/proc/PID/ns/net`, `/run/netns/NAME`).
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file could not be opened.
    #[error(
        "cannot open the network namespace {path}; give a path such as /proc/1/ns/net or /run/netns/NAME"
    )]
    Open {
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// Entering it failed.
    #[error("cannot enter the network namespace {path} (needs CAP_SYS_ADMIN)")]
    Enter {
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: nix::Error,
    },
    /// The work inside failed.
    #[error("{action} in the network namespace {path} failed")]
    Inside {
        /// What was being done.
        action: &'static str,
        /// The path (`self` for the agent's own).
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The helper thread died.
    #[error("the thread working in the network namespace {path} panicked")]
    Thread { path: PathBuf },
}

/// Runs `work` in the network namespace at `netns` (on a short-lived thread that enters it, so the
/// caller's namespace never changes), or right here when `netns` is `None`. Sockets created by
/// `work` stay in that namespace for their lifetime.
pub fn run_in<T: Send + 'static>(
    netns: Option<&Path>,
    action: &'static str,
    work: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> Result<T, NetnsError> {
    let Some(path) = netns else {
        return work().map_err(|source| NetnsError::Inside {
            action,
            path: PathBuf::from("self"),
            source,
        });
    };
    let file = File::open(path).map_err(|source| NetnsError::Open {
        path: path.to_owned(),
        source,
    })?;
    let owned_path = path.to_owned();
    std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|source| {
            NetnsError::Enter {
                path: owned_path.clone(),
                source,
            }
        })?;
        work().map_err(|source| NetnsError::Inside {
            action,
            path: owned_path,
            source,
        })
    })
    .join()
    .map_err(|_| NetnsError::Thread {
        path: path.to_owned(),
    })?
}

/// Work sent to a [`NetnsWorker`].
type Job = Box<dyn FnOnce() + Send>;

/// A thread that lives in one network namespace and runs work there, so that creating a socket in
/// the caches' namespace (every probe does) costs a message, not a thread and a `setns`.
#[derive(Debug, Clone)]
pub struct NetnsWorker {
    jobs: std::sync::mpsc::Sender<Job>,
    path: PathBuf,
}

impl NetnsWorker {
    /// Starts a worker in the network namespace at `netns` (or the agent's own).
    pub fn start(netns: Option<&Path>) -> Result<Self, NetnsError> {
        let file = netns
            .map(|path| {
                File::open(path).map_err(|source| NetnsError::Open {
                    path: path.to_owned(),
                    source,
                })
            })
            .transpose()?;
        let path = netns.map_or_else(|| PathBuf::from("self"), Path::to_owned);
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let (ready, entered) = std::sync::mpsc::channel();
        let thread_path = path.clone();
        std::thread::Builder::new()
            .name("netns-worker".to_owned())
            .spawn(move || {
                if let Some(file) = file
                    && let Err(source) =
                        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                {
                    let _ = ready.send(Err(NetnsError::Enter {
                        path: thread_path,
                        source,
                    }));
                    return;
                }
                let _ = ready.send(Ok(()));
                for job in queue {
                    job();
                }
            })
            .map_err(|source| NetnsError::Inside {
                action: "starting a worker thread",
                path: path.clone(),
                source,
            })?;
        entered
            .recv()
            .map_err(|_| NetnsError::Thread { path: path.clone() })??;
        Ok(Self { jobs, path })
    }

    /// Runs `work` in the worker's namespace and returns its result.
    pub async fn run<T: Send + 'static>(
        &self,
        action: &'static str,
        work: impl FnOnce() -> std::io::Result<T> + Send + 'static,
    ) -> Result<T, NetnsError> {
        let (done, result) = tokio::sync::oneshot::channel();
        self.jobs
            .send(Box::new(move || {
                let _ = done.send(work());
            }))
            .map_err(|_| NetnsError::Thread {
                path: self.path.clone(),
            })?;
        result
            .await
            .map_err(|_| NetnsError::Thread {
                path: self.path.clone(),
            })?
            .map_err(|source| NetnsError::Inside {
                action,
                path: self.path.clone(),
                source,
            })
    }
}

/// The cookie the kernel gives the network namespace at `netns` (or the agent's own):
/// `bpf_get_netns_cookie` returns the same number for sockets created there.
pub fn cookie(netns: Option<&Path>) -> Result<u64, NetnsError> {
    run_in(netns, "reading the namespace cookie", || {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
        let mut cookie: u64 = 0;
        let mut len = size_of::<u64>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
        let result = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_NETNS_COOKIE,
                (&raw mut cookie).cast(),
                &raw mut len,
            )
        };
        if result != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(cookie)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_namespace_has_a_stable_nonzero_cookie() {
        let first = cookie(None).unwrap();
        assert_ne!(first, 0);
        assert_eq!(cookie(None).unwrap(), first);
    }

    #[test]
    fn a_missing_namespace_file_is_named() {
        let error = cookie(Some(Path::new("/run/netns/no-such-namespace"))).unwrap_err();
        assert!(
            error.to_string().contains("/run/netns/no-such-namespace"),
            "{error}"
        );
    }
}
