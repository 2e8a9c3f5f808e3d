//! The agent: turns a validated configuration into attached programs and filled maps, and takes
//! them down again.
//!
//! Everything that can be refused is checked before the first map is written: the attach cgroup,
//! every skipped cgroup, the pin directory.

use std::path::{Path, PathBuf};

use redirector_common::datapath::{MAX_CGROUP_LEVEL, listener_bit};
use tracing::info;

use crate::{
    cgroup::{self, Cgroup, CgroupError},
    config::{Config, EmptyPoolPolicy},
    datapath::{Datapath, DatapathError, ListenerEntry, Maps, SkipEntry},
};

/// Why the agent could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A cgroup in the configuration is unusable.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// A skipped cgroup too deep for the level mask.
    #[error("{key}: {path} is {level} levels deep; skipped cgroups must be at most {max} levels below the root", max = MAX_CGROUP_LEVEL)]
    CgroupTooDeep {
        /// The configuration key.
        key: String,
        /// The directory.
        path: PathBuf,
        /// Its level.
        level: u32,
    },
    /// The pin directory is not on a bpf filesystem.
    #[error(
        "{dir} is not on a bpf filesystem, so the maps cannot be pinned there; mount one with \
         `mount -t bpf bpf {mount}`, or set pin_dir to a directory on one"
    )]
    NoBpffs {
        /// The directory checked.
        dir: PathBuf,
        /// Where to mount bpffs.
        mount: PathBuf,
    },
    /// The pin directory could not be inspected or created.
    #[error("cannot prepare the pin directory {dir}")]
    PinDir {
        /// The directory.
        dir: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// Loading, attaching or filling the datapath failed.
    #[error(transparent)]
    Datapath(#[from] DatapathError),
}

/// A running agent: programs attached, maps filled and pinned. Dropping it detaches the programs;
/// [`Agent::stop`] also removes the pins.
#[derive(Debug)]
pub struct Agent {
    datapath: Datapath,
    maps: Maps,
    pin_dir: PathBuf,
}

impl Agent {
    /// Checks the environment against `config`, loads the datapath, fills its maps and attaches
    /// it. Nothing is attached unless every check passed.
    pub fn start(config: &Config) -> Result<Self, AgentError> {
        let attach_path = match &config.cgroup {
            Some(path) => path.clone(),
            None => cgroup::default_attach_cgroup()?,
        };
        let attach = Cgroup::resolve("cgroup", &attach_path)?;
        let skips = skip_entries(config)?;
        prepare_pin_dir(&config.pin_dir)?;

        let (mut datapath, mut maps) =
            Datapath::load(config.reverse_nat_entries, Some(&config.pin_dir))?;
        maps.set_skip_cgroups(&skips)?;
        for (id, listener) in config.listeners.iter().enumerate() {
            let entry = ListenerEntry {
                id: id as u32,
                name: &listener.name,
                address: listener.address,
                cache: listener.cache,
                empty_pool: listener.empty_pool,
            };
            maps.install_listener(&entry, &listener.upstreams)?;
        }
        datapath.attach(&attach.path)?;

        for listener in &config.listeners {
            let upstreams: Vec<String> =
                listener.upstreams.iter().map(ToString::to_string).collect();
            info!(
                listener = %listener.name,
                address = %listener.address,
                cache = %listener.cache,
                upstreams = %upstreams.join(","),
                empty_pool = match listener.empty_pool {
                    EmptyPoolPolicy::Pass => "pass",
                    EmptyPoolPolicy::Fail => "fail",
                },
                skipped_cgroups = listener.skip_cgroups.len(),
                "steering DNS for listener"
            );
        }
        info!(
            cgroup = %attach.path.display(),
            pin_dir = %config.pin_dir.display(),
            listeners = config.listeners.len(),
            "redirector is steering"
        );
        Ok(Self {
            datapath,
            maps,
            pin_dir: config.pin_dir.clone(),
        })
    }

    /// The maps, for reading counters and state.
    #[must_use]
    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    /// The maps, for changing state and pools.
    pub fn maps_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }

    /// The cgroup the programs are attached to.
    #[must_use]
    pub fn cgroup(&self) -> Option<&Path> {
        self.datapath.attached_to()
    }

    /// Detaches the programs and removes the pins.
    pub fn stop(self) -> Result<(), AgentError> {
        let Self {
            datapath,
            maps,
            pin_dir,
        } = self;
        drop(datapath);
        drop(maps);
        Maps::unpin(&pin_dir)?;
        info!("programs detached, pins removed");
        Ok(())
    }
}

/// The skipped cgroups of every listener, one entry per cgroup with the bits of every listener
/// that skips it.
fn skip_entries(config: &Config) -> Result<Vec<SkipEntry>, AgentError> {
    let mut entries: Vec<SkipEntry> = Vec::new();
    for (id, listener) in config.listeners.iter().enumerate() {
        for (index, path) in listener.skip_cgroups.iter().enumerate() {
            let key = format!("listener[{id}] ({:?}).skip_cgroups[{index}]", listener.name);
            let cgroup = Cgroup::resolve(&key, path)?;
            if cgroup.level > MAX_CGROUP_LEVEL {
                return Err(AgentError::CgroupTooDeep {
                    key,
                    path: cgroup.path,
                    level: cgroup.level,
                });
            }
            let bit = listener_bit(id as u32);
            match entries.iter_mut().find(|entry| entry.id == cgroup.id) {
                Some(entry) => entry.listeners |= bit,
                None => entries.push(SkipEntry {
                    id: cgroup.id,
                    level: cgroup.level,
                    listeners: bit,
                }),
            }
        }
    }
    Ok(entries)
}

/// Creates the pin directory on a bpf filesystem, or says how to get one.
fn prepare_pin_dir(pin_dir: &Path) -> Result<(), AgentError> {
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
