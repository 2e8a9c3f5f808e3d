//! Running `nft` in the caches' network namespace.
//!
//! Why the `nft` binary and not a netlink crate: the table is replaced as one `nft -f` batch,
//! which nft sends as one nfnetlink transaction (all or nothing, never through the xtables lock);
//! nft is the reference encoder of nf_tables' netlink protocol, so the rules are exactly those an
//! operator reads back with `nft list table inet redirector`; and kube-proxy's nftables mode
//! drives the kernel the same way. The Rust netlink crates for nf_tables describe themselves as
//! rough, and encoding expressions by hand would be ours to get wrong.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use crate::sys::netns::{NetnsError, NetnsWorker};

/// Why `nft` could not do its work. `binary` is the configured `conntrack.nft`.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// The binary is not there.
    #[error(
        "the nft binary {binary} was not found: install nftables (Debian: apt-get install nftables) or set conntrack.nft"
    )]
    Missing { binary: PathBuf },
    /// The kernel has no nf_tables (or no nfnetlink).
    #[error(
        "this kernel does not support nftables (nft said: {stderr}); load it with `modprobe nf_tables`, or set conntrack.bypass = false to stop trying"
    )]
    KernelUnsupported {
        /// What nft printed.
        stderr: String,
    },
    /// nft refused or failed the batch.
    #[error(
        "nft failed {action} (exit status {status}): {stderr}; check `nft list ruleset` for what conflicts, or set conntrack.bypass = false"
    )]
    Failed {
        /// What was being done.
        action: &'static str,
        /// nft's exit status.
        status: i32,
        /// What nft printed.
        stderr: String,
    },
    /// nft did not finish in time (and was killed).
    #[error("{binary} did not finish within {after:?} and was killed; the next check tries again")]
    TimedOut { binary: PathBuf, after: Duration },
    /// nft could not be run at all.
    #[error("cannot run {binary}")]
    Run {
        binary: PathBuf,
        /// What went wrong.
        #[source]
        source: NetnsError,
    },
}

impl NftError {
    /// Whether retrying cannot help until the node changes (a package, a kernel module).
    #[must_use]
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Missing { .. } | Self::KernelUnsupported { .. })
    }
}

/// How long one nft run may take before it is killed: a hung nft must not hold the table's
/// keeper forever.
pub const NFT_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `binary args`, feeding `stdin` from a thread of its own and collecting the output on
/// another (so that neither side can block the other on a full pipe), killing it after
/// `NFT_TIMEOUT`.
fn run_bounded(
    binary: &Path,
    args: &[String],
    stdin: Option<String>,
) -> std::io::Result<std::process::Output> {
    let mut child = Command::new(binary)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A write error means nft stopped reading because it failed: its stderr says why.
        std::thread::spawn(move || {
            let _ = pipe.write_all(text.as_bytes());
        });
    }
    let pid = child.id();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match finished.recv_timeout(NFT_TIMEOUT) {
        Ok(output) => output,
        Err(_) => {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "nft did not finish in time and was killed",
            ))
        }
    }
}

/// `nft`, run in one network namespace.
#[derive(Debug, Clone)]
pub struct Nft {
    binary: PathBuf,
    worker: NetnsWorker,
}

/// What one nft run produced.
struct Run {
    status: i32,
    stdout: String,
    stderr: String,
}

impl Nft {
    /// `binary`, run in the namespace of `worker`.
    #[must_use]
    pub fn new(binary: &Path, worker: NetnsWorker) -> Self {
        Self {
            binary: binary.to_owned(),
            worker,
        }
    }

    /// Applies `batch` (nft syntax) as one transaction.
    pub async fn apply(&self, batch: String, action: &'static str) -> Result<(), NftError> {
        let run = self.run(&["-f", "-"], Some(batch)).await?;
        self.check(run, action).map(drop)
    }

    /// The table `table` as nft lists it (`None`: there is no such table).
    pub async fn list_table(&self, table: &str) -> Result<Option<String>, NftError> {
        let mut args = vec!["list", "table"];
        args.extend(table.split_whitespace());
        let run = self.run(&args, None).await?;
        if run.status != 0 && run.stderr.contains("No such file or directory") {
            return Ok(None);
        }
        self.check(run, "listing the table").map(Some)
    }

    fn check(&self, run: Run, action: &'static str) -> Result<String, NftError> {
        if run.status == 0 {
            return Ok(run.stdout);
        }
        let stderr = run.stderr.trim().to_owned();
        // No nf_tables: the subsystem refuses the messages; no nfnetlink: the socket itself.
        if stderr.contains("Operation not supported") || stderr.contains("Protocol not supported") {
            return Err(NftError::KernelUnsupported { stderr });
        }
        Err(NftError::Failed {
            action,
            status: run.status,
            stderr,
        })
    }

    async fn run(&self, args: &[&str], stdin: Option<String>) -> Result<Run, NftError> {
        let binary = self.binary.clone();
        let args: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
        // The child is forked from the worker's thread, so it runs in the worker's namespace.
        let outcome = self
            .worker
            .run("running nft", move || run_bounded(&binary, &args, stdin))
            .await;
        match outcome {
            Ok(output) => Ok(Run {
                // Killed by a signal: no code; report it as a failure.
                status: output.status.code().unwrap_or(-1),
                stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            }),
            Err(NetnsError::Inside { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Err(NftError::Missing {
                    binary: self.binary.clone(),
                })
            }
            Err(NetnsError::Inside { source, .. })
                if source.kind() == std::io::ErrorKind::TimedOut =>
            {
                Err(NftError::TimedOut {
                    binary: self.binary.clone(),
                    after: NFT_TIMEOUT,
                })
            }
            Err(source) => Err(NftError::Run {
                binary: self.binary.clone(),
                source,
            }),
        }
    }
}
