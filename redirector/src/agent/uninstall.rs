//! `redirector uninstall`: detach every program, remove every pin, the listener addresses (and
//! the link the agent created), the pods' names recorded for the CLI, and the lock. Refused while
//! an agent runs.

use tracing::{info, warn};

use super::AgentError;
use crate::{
    config::Config,
    conntrack_bypass::{self, nft::Nft},
    datapath,
    sys::{interface, lock::InstanceLock, netns::NetnsWorker},
    workloads,
};

/// What `uninstall` removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UninstallReport {
    /// Programs were attached (and are detached now).
    pub detached: bool,
    /// The listener interface's name, when the addresses the agent added (or the link it created)
    /// were removed.
    pub interface: Option<String>,
    /// The conntrack bypass table is gone (false: nftables is not usable here, so there was
    /// none).
    pub conntrack_table_removed: bool,
}

/// Removes everything the agent of `config` created. Nothing to remove is no error.
pub async fn uninstall(config: &Config) -> Result<UninstallReport, AgentError> {
    let lock = InstanceLock::acquire(&config.lock_file)?;
    let detached = datapath::has_pinned_attachments(&config.pin_dir);
    // Looked for while this set's directory is there: the search starts from it.
    let others = datapath::other_attached_sets(&config.pin_dir);
    datapath::remove_pins(&config.pin_dir)?;
    let mut report = UninstallReport {
        detached,
        ..UninstallReport::default()
    };
    let worker =
        NetnsWorker::start(config.cache_netns.as_deref()).map_err(AgentError::CacheNetns)?;
    // Also when the bypass is off now: an earlier configuration may have had it on.
    match conntrack_bypass::remove(&Nft::new(&config.conntrack.nft, worker.clone())).await {
        Ok(()) => report.conntrack_table_removed = true,
        Err(error) if error.is_unavailable() => {
            warn!(error = %crate::error_chain(&error), "nftables is not usable here, so there is no conntrack bypass table to remove");
        }
        Err(source) => return Err(AgentError::ConntrackBypass { source }),
    }
    // Also when the agent no longer manages the interface: an earlier configuration may have.
    let record = interface::record_path(&config.lock_file);
    if config.interface.manage || record.exists() {
        let removed = interface::remove(&config.interface, &worker, &record).await?;
        report.interface = removed.then(|| config.interface.name.clone());
    }
    // The pods' names recorded for the CLI.
    let _ = std::fs::remove_file(workloads::names_file::path(&config.lock_file));
    // The drain socket (its directory may be a cache pod's mount: it stays).
    if let Some(socket) = &config.drain_socket {
        let _ = std::fs::remove_file(socket);
    }
    for other in others {
        warn!(pin_dir = %other.display(), "ANOTHER redirector set is still attached from this directory (an earlier pin_dir?); remove its pins to detach it: rm -r {}", other.display());
    }
    let path = lock.path().to_owned();
    drop(lock);
    let _ = std::fs::remove_file(&path);
    info!(pin_dir = %config.pin_dir.display(), detached, "uninstalled");
    Ok(report)
}
