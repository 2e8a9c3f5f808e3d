//! What a start that failed takes back when nothing steered as it began: the nftables table and
//! the listener addresses (or link) it set up.

use tracing::warn;

use crate::{
    config::Config,
    conntrack_bypass::{self, nft::Nft},
    datapath,
    sys::{interface, lock::InstanceLock, netns::NetnsWorker},
};

/// What a start that failed must take back: when nothing steered as it took the lock (a first
/// install, or after an uninstall), the nftables table and the listener addresses (or link) it
/// set up serve nobody, and a node whose agent never starts must not keep them.
#[derive(Debug, Default)]
pub(super) struct FirstStart {
    pub(super) nothing_steered: bool,
}

impl FirstStart {
    /// Removes the conntrack bypass table and what the agent owns of the listener link, if this
    /// start took the lock with nothing steering and nothing steers now. Under the lock again:
    /// another agent may have started meanwhile, and what it set up is left alone.
    pub(super) async fn revert(&self, config: &Config) {
        if !self.nothing_steered {
            return;
        }
        let Ok(lock) = InstanceLock::acquire(&config.lock_file) else {
            return;
        };
        // Looked at under the lock: nothing may steer through what would be removed, neither from
        // this pin directory nor from another one on the same bpffs (a changed pin_dir's set).
        if datapath::has_pinned_attachments(&config.pin_dir)
            || !datapath::other_attached_sets(&config.pin_dir).is_empty()
        {
            return;
        }
        let worker = match NetnsWorker::start(config.cache_netns.as_deref()) {
            Ok(worker) => worker,
            Err(error) => {
                warn!(error = %crate::error_chain(&error), "cannot enter the caches' namespace to remove what this failed start set up; `redirector uninstall` removes it");
                return;
            }
        };
        if config.conntrack.bypass {
            match conntrack_bypass::remove(&Nft::new(&config.conntrack.nft, worker.clone())).await {
                Ok(()) => warn!("removed the conntrack bypass table of this failed start"),
                Err(error) if error.is_unavailable() => {}
                Err(error) => {
                    warn!(error = %crate::error_chain(&error), "cannot remove the conntrack bypass table of this failed start; `redirector uninstall` removes it");
                }
            }
        }
        let record = interface::record_path(&config.lock_file);
        if config.interface.manage || record.exists() {
            match interface::remove(&config.interface, &worker, &record).await {
                Ok(true) => {
                    warn!(link = %config.interface.name, "removed the listener addresses (or link) of this failed start")
                }
                Ok(false) => {}
                Err(error) => {
                    warn!(error = %crate::error_chain(&error), "cannot remove the listener addresses of this failed start; `redirector uninstall` removes them");
                }
            }
        }
        drop(lock);
    }
}
