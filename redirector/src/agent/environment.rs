//! What the agent checks and prepares on the host before it touches the kernel: cgroups to
//! skip, the pin directory.

use std::path::{Path, PathBuf};

use redirector_common::{
    datapath::{MAX_CGROUP_LEVEL, listener_bit},
    workloads::{EXEMPT_ACCOUNTING, EXEMPT_RATE_LIMIT, MAX_EXEMPT_CGROUPS},
};
use tracing::{debug, info, warn};

use super::AgentError;
use crate::{
    config::{Config, WorkloadSettings},
    datapath::{ExemptEntry, Maps, SkipEntry},
    sys::cgroup::{self, Cgroup},
};

/// Every listener's skipped cgroups, resolved (and so checked) before anything is loaded.
pub(super) fn resolve_skip_cgroups(config: &Config) -> Result<Vec<Vec<Cgroup>>, AgentError> {
    config
        .listeners
        .iter()
        .enumerate()
        .map(|(position, listener)| {
            listener
                .skip_cgroups
                .iter()
                .enumerate()
                .map(|(index, path)| {
                    let key = format!(
                        "listener[{position}] ({:?}).skip_cgroups[{index}]",
                        listener.name
                    );
                    let cgroup = Cgroup::resolve(&key, path)?;
                    if cgroup.level > MAX_CGROUP_LEVEL {
                        return Err(AgentError::CgroupTooDeep {
                            key,
                            path: cgroup.path,
                            level: cgroup.level,
                        });
                    }
                    Ok(cgroup)
                })
                .collect()
        })
        .collect()
}

/// The cgroups whose DNS the programs never count, with their descendants: every skipped cgroup
/// (the caches' own upstream queries, and the agent's probes when it runs below the attach
/// cgroup), the agent's own cgroup wherever else it runs (unless that holds the attach cgroup:
/// exempting it would exempt every workload), and `workloads.exempt_cgroups`; with the cgroups
/// of `workloads.rate_limit_exempt_cgroups`, counted but never limited. Those that exist are
/// resolved (and so checked) before anything is loaded.
pub(super) fn exempt_entries(
    config: &Config,
    skips: &[SkipEntry],
    attach: &Cgroup,
) -> Result<Vec<ExemptEntry>, AgentError> {
    let mut entries: Vec<ExemptEntry> = skips
        .iter()
        .map(|skip| ExemptEntry {
            id: skip.id,
            level: skip.level,
            exempt_from: EXEMPT_ACCOUNTING,
        })
        .collect();
    match cgroup::own_cgroup() {
        Ok(own) if !attach.path.starts_with(&own.path) => {
            add_exempt(&mut entries, &own, EXEMPT_ACCOUNTING);
        }
        Ok(_) => {}
        Err(error) => {
            warn!(error = %error, "cannot find the agent's own cgroup; its probes are counted as a workload's")
        }
    }
    for (list, exempt_from) in exempt_lists(&config.workloads) {
        for found in existing_cgroups(list.key, list.paths, attach)? {
            add_exempt(&mut entries, &found, exempt_from);
        }
    }
    Ok(entries)
}

/// `base` with the cgroups of the processes known as caches (`Maps::cache_task_cgroups`) that
/// `exists` says are still there: their own DNS, a cache's upstream queries and their replies,
/// is no workload's. `post_bind` exempts a cache's cgroup the moment it binds; this keeps the
/// entries of the caches' cgroups when the agent writes the set, and lets those gone drop out.
/// (By cgroup, not by process: the agent of a pod sees no host process ids.)
pub(super) fn with_caches(
    base: &[ExemptEntry],
    maps: &Maps,
    mut exists: impl FnMut(u64) -> bool,
) -> Vec<ExemptEntry> {
    let mut entries = base.to_vec();
    for (_, cgroup) in maps.cache_task_cgroups() {
        if cgroup != 0 && !entries.iter().any(|entry| entry.id == cgroup) && exists(cgroup) {
            entries.push(ExemptEntry {
                id: cgroup,
                level: 0,
                exempt_from: EXEMPT_ACCOUNTING,
            });
        }
    }
    entries
}

/// Says that `left_out` exempt cgroups were left out of `WORKLOAD_EXEMPT` for want of room:
/// their DNS is counted as a workload's (and a listed one may be rate-limited), which no query's
/// route depends on.
pub(super) fn tell_overflow(left_out: usize) {
    if left_out == 0 {
        return;
    }
    warn!(
        left_out,
        capacity = MAX_EXEMPT_CGROUPS,
        "more cgroups are exempt than the kernel's exempt set holds (the skipped cgroups, the \
         agent's, the listed ones, then the caches' that live); those left out are counted as \
         workloads: list fewer in workloads.exempt_cgroups and workloads.rate_limit_exempt_cgroups"
    );
}

/// A configured list of exempt cgroups: its key and paths.
pub(super) struct ExemptList<'a> {
    pub(super) key: &'static str,
    pub(super) paths: &'a [PathBuf],
}

/// The lists of exempt cgroups the configuration gives, with what each exempts from.
pub(super) fn exempt_lists(settings: &WorkloadSettings) -> [(ExemptList<'_>, u32); 2] {
    [
        (
            ExemptList {
                key: "workloads.exempt_cgroups",
                paths: &settings.exempt_cgroups,
            },
            EXEMPT_ACCOUNTING,
        ),
        (
            ExemptList {
                key: "workloads.rate_limit_exempt_cgroups",
                paths: &settings.rate_limit_exempt_cgroups,
            },
            EXEMPT_RATE_LIMIT,
        ),
    ]
}

/// The cgroups of `paths` (the list `key`) that exist now, resolved. One that does not yet (a
/// service not started) is exempt from the moment it exists: the agent looks again at every
/// reading of the counts.
pub(super) fn existing_cgroups(
    key: &str,
    paths: &[PathBuf],
    attach: &Cgroup,
) -> Result<Vec<Cgroup>, AgentError> {
    let mut found = Vec::new();
    for (index, path) in paths.iter().enumerate() {
        let key = format!("{key}[{index}]");
        if !path.exists() {
            debug!(key = %key, cgroup = %path.display(), "an exempt cgroup does not exist yet; it is exempt once it does");
            continue;
        }
        let cgroup = Cgroup::resolve(&key, path)?;
        if attach.path.starts_with(&cgroup.path) {
            return Err(AgentError::ExemptsEverything {
                key,
                path: cgroup.path,
                attach: attach.path.clone(),
            });
        }
        found.push(cgroup);
    }
    Ok(found)
}

/// Adds `cgroup`'s exemption `exempt_from` to `entries` (merged into the one it has); whether
/// that changed anything.
pub(super) fn add_exempt(
    entries: &mut Vec<ExemptEntry>,
    cgroup: &Cgroup,
    exempt_from: u32,
) -> bool {
    match entries.iter_mut().find(|entry| entry.id == cgroup.id) {
        Some(entry) if entry.exempt_from & exempt_from == exempt_from => false,
        Some(entry) => {
            entry.exempt_from |= exempt_from;
            true
        }
        None => {
            entries.push(ExemptEntry {
                id: cgroup.id,
                level: cgroup.level,
                exempt_from,
            });
            true
        }
    }
}

/// The skipped cgroups as the maps hold them: one entry per cgroup with the bits of every
/// listener (by `ids`, in configuration order) that skips it; plus the agent's own cgroup, for
/// every listener, when it sits below the attach point (its probes must never be steered).
pub(super) fn skip_entries(
    resolved: &[Vec<Cgroup>],
    ids: &[u32],
    attach: &Cgroup,
) -> Vec<SkipEntry> {
    let mut entries: Vec<SkipEntry> = Vec::new();
    let mut add =
        |cgroup: &Cgroup, bits: u64| match entries.iter_mut().find(|entry| entry.id == cgroup.id) {
            Some(entry) => entry.listeners |= bits,
            None => entries.push(SkipEntry {
                id: cgroup.id,
                level: cgroup.level,
                listeners: bits,
            }),
        };
    for (cgroups, id) in resolved.iter().zip(ids) {
        for cgroup in cgroups {
            add(cgroup, listener_bit(*id));
        }
    }
    match cgroup::own_cgroup() {
        Ok(own)
            if own.path.starts_with(&attach.path)
                && own.level > attach.level
                && own.level <= MAX_CGROUP_LEVEL =>
        {
            info!(cgroup = %own.path.display(), "the agent's own cgroup is skipped: its probes are never steered");
            add(
                &own,
                ids.iter().fold(0, |bits, id| bits | listener_bit(*id)),
            );
        }
        Ok(own) if own.path == attach.path => warn!(
            cgroup = %own.path.display(),
            "the agent runs in the cgroup the programs attach to: its probes to a cache on a \
             listener address are steered like any client's; run it in a cgroup of its own \
             (a systemd service or a pod is one)"
        ),
        Ok(_) => {}
        Err(error) => warn!(error = %error, "cannot find the agent's own cgroup"),
    }
    entries
}

/// Creates the pin directory on a bpf filesystem, or says how to get one.
pub(super) fn prepare_pin_dir(pin_dir: &Path) -> Result<(), AgentError> {
    // The deepest existing ancestor tells which filesystem the directory would be on.
    let existing = pin_dir
        .ancestors()
        .find(|dir| dir.exists())
        .unwrap_or_else(|| Path::new("/"));
    let on_bpffs = nix::sys::statfs::statfs(existing)
        .map(|stat| stat.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
        .unwrap_or(false);
    if !on_bpffs {
        return Err(AgentError::NoBpffs {
            dir: pin_dir.to_owned(),
            mount: if existing == Path::new("/") || existing == Path::new("/sys/fs") {
                PathBuf::from("/sys/fs/bpf")
            } else {
                existing.to_owned()
            },
        });
    }
    std::fs::create_dir_all(pin_dir).map_err(|source| AgentError::PinDir {
        dir: pin_dir.to_owned(),
        source,
    })
}
