//! Conntrack bypass: DNS between clients and the node-local caches never creates a conntrack
//! entry. eBPF cannot untrack a packet (no helper or kfunc does), so the agent owns one small
//! nftables table of raw-priority `notrack` rules (`ruleset`), installs it in one transaction with
//! `nft` (`nft`), compares it with what it installed at every check and restores it when someone
//! changed or flushed it. Failover traffic to the upstreams stays tracked (see `ruleset`).
//!
//! Failing to install never stops the agent: DNS is steered either way, only tracked. A node
//! without nftables is reported once in the log and as `unavailable` in the agent's state.

pub mod nft;
pub mod ruleset;

use std::{collections::BTreeSet, sync::Arc};

use tracing::{info, warn};

use self::{
    nft::{Nft, NftError},
    ruleset::{Endpoint, Ruleset, TABLE},
};
use crate::config::Config;

/// Where the bypass stands.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum BypassStatus {
    /// Not configured (`conntrack.bypass = false`).
    #[default]
    Disabled,
    /// The table is in place as the agent installed it.
    Active,
    /// nftables cannot be used on this node (no `nft`, or a kernel without nf_tables); checked
    /// again at every interval.
    Unavailable,
    /// Installing failed for another reason; retried at every interval.
    Failing,
}

impl BypassStatus {
    /// The name used in logs, metrics and `status`.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Self::Disabled => "disabled",
            Self::Active => "active",
            Self::Unavailable => "unavailable",
            Self::Failing => "failing",
        }
    }
}

/// What one check did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checked {
    /// The table was as installed.
    Unchanged,
    /// The table was installed (first time, or with new contents).
    Installed,
    /// The table had been changed or removed by someone else and was restored.
    Restored,
    /// Nothing could be installed (see the status).
    NotInstalled,
}

/// The listeners' and caches' DNS endpoints, UDP and TCP.
#[must_use]
pub fn local_endpoints(config: &Config) -> BTreeSet<Endpoint> {
    config
        .listeners
        .iter()
        .flat_map(|listener| {
            let mut endpoints = Endpoint::both(
                listener.address,
                redirector_common::DNS_PORT,
                redirector_common::DNS_PORT,
            )
            .to_vec();
            endpoints.extend(Endpoint::both(
                listener.cache.ip(),
                listener.cache.port(),
                listener.cache.port(),
            ));
            endpoints
        })
        .collect()
}

/// Keeps the agent's nftables table true.
#[derive(Debug)]
pub struct ConntrackBypass {
    nft: Nft,
    desired: Ruleset,
    /// The table as nft listed it right after the agent installed it.
    installed: Option<String>,
    status: BypassStatus,
    last_error: Option<Arc<NftError>>,
    restorations: u64,
}

impl ConntrackBypass {
    /// A keeper of `desired` through `nft`; nothing is installed until [`Self::check`].
    #[must_use]
    pub fn new(nft: Nft, desired: Ruleset) -> Self {
        Self {
            nft,
            desired,
            installed: None,
            status: BypassStatus::Unavailable,
            last_error: None,
            restorations: 0,
        }
    }

    /// Where the bypass stands.
    #[must_use]
    pub fn status(&self) -> &BypassStatus {
        &self.status
    }

    /// Why it is not active, when it is not.
    #[must_use]
    pub fn last_error(&self) -> Option<&Arc<NftError>> {
        self.last_error.as_ref()
    }

    /// How often the table was found changed and restored.
    #[must_use]
    pub fn restorations(&self) -> u64 {
        self.restorations
    }

    /// Replaces what the table must untrack and installs it when it changed.
    pub async fn set_desired(&mut self, desired: Ruleset) -> Checked {
        if desired == self.desired && self.installed.is_some() {
            return Checked::Unchanged;
        }
        self.desired = desired;
        self.install(false).await
    }

    /// Compares the table with what was installed and restores it when it differs (or installs
    /// it when it never was).
    pub async fn check(&mut self) -> Checked {
        let Some(installed) = &self.installed else {
            return self.install(false).await;
        };
        match self.nft.list_table(TABLE).await {
            Ok(Some(listing)) if &listing == installed => Checked::Unchanged,
            Ok(_) => self.install(true).await,
            Err(error) => {
                self.fail(error);
                Checked::NotInstalled
            }
        }
    }

    async fn install(&mut self, restoring: bool) -> Checked {
        let installed = async {
            self.nft
                .apply(
                    self.desired.render(),
                    "installing the conntrack bypass table",
                )
                .await?;
            self.nft.list_table(TABLE).await
        }
        .await;
        match installed {
            Ok(listing) => {
                self.installed = listing;
                if restoring {
                    self.restorations += 1;
                    warn!(
                        table = TABLE,
                        "the conntrack bypass table had been changed or removed; restored it"
                    );
                } else if self.status != BypassStatus::Active {
                    info!(
                        table = TABLE,
                        "DNS to and from the caches bypasses conntrack"
                    );
                }
                self.status = BypassStatus::Active;
                self.last_error = None;
                if restoring {
                    Checked::Restored
                } else {
                    Checked::Installed
                }
            }
            Err(error) => {
                self.fail(error);
                Checked::NotInstalled
            }
        }
    }

    /// Records a failure; logs it when the status changes (a node without nftables is said once).
    fn fail(&mut self, error: NftError) {
        let status = if error.is_unavailable() {
            BypassStatus::Unavailable
        } else {
            BypassStatus::Failing
        };
        if status != self.status || self.last_error.is_none() {
            warn!(
                table = TABLE,
                status = status.name(),
                error = %crate::error_chain(&error),
                "DNS to the caches is steered but TRACKED by conntrack: the bypass table could not be installed; retrying at every check"
            );
        }
        self.status = status;
        self.installed = None;
        self.last_error = Some(Arc::new(error));
    }
}

/// Removes the table (uninstall); no table is nothing to do.
pub async fn remove(nft: &Nft) -> Result<(), NftError> {
    nft.apply(Ruleset::removal(), "removing the conntrack bypass table")
        .await
}
