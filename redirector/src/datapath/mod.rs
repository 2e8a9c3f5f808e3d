//! The kernel side seen from userspace: load the embedded object, attach its programs to a cgroup
//! (pinning each attachment, so steering and in-kernel failover outlive the agent's process), and
//! read and write its maps.

mod error;
mod maps;
mod socket_counts;

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    programs::{
        CgroupAttachMode, Program,
        links::{FdLink, PinnedLink},
    },
};
pub use error::DatapathError;
pub use maps::{ListenerEntry, ListenerTotals, Maps, SkipEntry, target_of};
use redirector_common::names;

/// The eBPF object built from `redirector-ebpf` by `build.rs`.
pub static OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/redirector-ebpf"));

/// Sub-directory of the pin directory holding the maps.
const PINNED_MAPS_DIR: &str = "maps";
/// Sub-directory of the pin directory holding the attachments (bpf links).
const PINNED_LINKS_DIR: &str = "links";

/// Every program, in attach order: the counting programs first, so that sockets bound from the
/// moment steering starts are counted.
const ALL_PROGRAMS: [&str; 11] = [
    names::PROG_POST_BIND4,
    names::PROG_POST_BIND6,
    names::PROG_SOCK_RELEASE,
    names::PROG_CONNECT4,
    names::PROG_CONNECT6,
    names::PROG_SENDMSG4,
    names::PROG_SENDMSG6,
    names::PROG_RECVMSG4,
    names::PROG_RECVMSG6,
    names::PROG_GETPEERNAME4,
    names::PROG_GETPEERNAME6,
];

/// The loaded object and its attachments. The attachments are pinned: dropping this (or the
/// agent dying) leaves them attached; [`Datapath::detach`] removes them.
#[derive(Debug)]
pub struct Datapath {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    links: Vec<PinnedLink>,
    attached_to: Option<PathBuf>,
}

impl Datapath {
    /// Loads the object (creating its maps) and every program (running the verifier), without
    /// attaching anything; pins the maps under `pin_dir/maps/`, replacing pins of an earlier run.
    /// Returns the typed map handles next to it.
    pub fn load(reverse_nat_entries: u32, pin_dir: &Path) -> Result<(Self, Maps), DatapathError> {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(names::MAP_REVERSE_NAT, reverse_nat_entries)
            .load(OBJECT)
            .map_err(|source| DatapathError::Load { source })?;
        for name in ALL_PROGRAMS {
            match program(&mut ebpf, name)? {
                Program::CgroupSockAddr(program) => program.load(),
                Program::CgroupSock(program) => program.load(),
                _ => return Err(DatapathError::ProgramType { name }),
            }
            .map_err(|source| DatapathError::Verify { name, source })?;
        }
        pin_maps(&ebpf, pin_dir)?;
        let maps = Maps::take(&mut ebpf)?;
        Ok((
            Self {
                ebpf,
                pin_dir: pin_dir.to_owned(),
                links: Vec::new(),
                attached_to: None,
            },
            maps,
        ))
    }

    /// Attaches every program to the cgroup v2 directory `cgroup` and pins each attachment under
    /// `pin_dir/links/`. Attachments pinned by an earlier agent are replaced.
    ///
    /// aya attaches through bpf_link on 5.7+, and a link attachment is always "multi": programs
    /// of other owners on the same cgroup (Cilium's socket LB, for one) keep running. The kernel
    /// refuses attach flags on links, hence `Single`, which passes none.
    pub fn attach(&mut self, cgroup: &Path) -> Result<(), DatapathError> {
        let cgroup_dir = File::open(cgroup).map_err(|source| DatapathError::OpenCgroup {
            path: cgroup.to_owned(),
            source,
        })?;
        let links_dir = self.pin_dir.join(PINNED_LINKS_DIR);
        std::fs::create_dir_all(&links_dir).map_err(|source| DatapathError::PinDir {
            path: links_dir.clone(),
            source,
        })?;
        for name in ALL_PROGRAMS {
            let attach_error = |source| DatapathError::Attach {
                name,
                path: cgroup.to_owned(),
                source,
            };
            let link_error = |source| DatapathError::Link { name, source };
            let link: FdLink = match program(&mut self.ebpf, name)? {
                Program::CgroupSockAddr(program) => {
                    let id = program
                        .attach(&cgroup_dir, CgroupAttachMode::Single)
                        .map_err(attach_error)?;
                    let link = program.take_link(id).map_err(attach_error)?;
                    FdLink::try_from(link).map_err(link_error)?
                }
                Program::CgroupSock(program) => {
                    let id = program
                        .attach(&cgroup_dir, CgroupAttachMode::Single)
                        .map_err(attach_error)?;
                    let link = program.take_link(id).map_err(attach_error)?;
                    FdLink::try_from(link).map_err(link_error)?
                }
                _ => return Err(DatapathError::ProgramType { name }),
            };
            let path = links_dir.join(name);
            remove_file_if_present(&path)?;
            let pinned =
                link.pin(&path)
                    .map_err(|source| DatapathError::PinLink { name, path, source })?;
            self.links.push(pinned);
        }
        self.attached_to = Some(cgroup.to_owned());
        Ok(())
    }

    /// The cgroup the programs are attached to.
    #[must_use]
    pub fn attached_to(&self) -> Option<&Path> {
        self.attached_to.as_deref()
    }

    /// Detaches every program (unpinning the attachments) and removes the map pins.
    pub fn detach(self) -> Result<(), DatapathError> {
        let Self { links, pin_dir, .. } = self;
        for link in links {
            // Unpinning leaves the FdLink, whose drop detaches the program.
            drop(link.unpin().map_err(|source| DatapathError::PinDir {
                path: pin_dir.join(PINNED_LINKS_DIR),
                source,
            })?);
        }
        remove_pins(&pin_dir)
    }
}

/// Removes every pin this module makes under `pin_dir` (maps and attachments), then the
/// directories if empty. Unpinning an attachment detaches its program.
pub fn remove_pins(pin_dir: &Path) -> Result<(), DatapathError> {
    for name in ALL_PROGRAMS {
        remove_file_if_present(&pin_dir.join(PINNED_LINKS_DIR).join(name))?;
    }
    for name in names::ALL_MAPS {
        remove_file_if_present(&pin_dir.join(PINNED_MAPS_DIR).join(name))?;
    }
    for path in [
        pin_dir.join(PINNED_LINKS_DIR),
        pin_dir.join(PINNED_MAPS_DIR),
        pin_dir.to_owned(),
    ] {
        match std::fs::remove_dir(&path) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            // Someone else's files share the directory: leave it.
            Err(error) if error.raw_os_error() == Some(libc::ENOTEMPTY) => {}
            Err(source) => return Err(DatapathError::PinDir { path, source }),
        }
    }
    Ok(())
}

/// True when an earlier agent left attachments pinned under `pin_dir`.
#[must_use]
pub fn has_pinned_attachments(pin_dir: &Path) -> bool {
    ALL_PROGRAMS
        .iter()
        .any(|name| pin_dir.join(PINNED_LINKS_DIR).join(name).exists())
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut Program, DatapathError> {
    ebpf.program_mut(name)
        .ok_or(DatapathError::MissingProgram { name })
}

/// Pins every map of the object under `pin_dir/maps/`, replacing pins left by an earlier run.
fn pin_maps(ebpf: &Ebpf, pin_dir: &Path) -> Result<(), DatapathError> {
    let dir = pin_dir.join(PINNED_MAPS_DIR);
    std::fs::create_dir_all(&dir).map_err(|source| DatapathError::PinDir {
        path: dir.clone(),
        source,
    })?;
    for name in names::ALL_MAPS {
        let map = ebpf.map(name).ok_or(DatapathError::MissingMap { name })?;
        let path = dir.join(name);
        remove_file_if_present(&path)?;
        map.pin(&path)
            .map_err(|source| DatapathError::Pin { name, path, source })?;
    }
    Ok(())
}

fn remove_file_if_present(path: &Path) -> Result<(), DatapathError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DatapathError::PinDir {
            path: path.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_object_defines_exactly_the_shared_names() {
        let object = aya_obj::Object::parse(OBJECT).expect("the embedded object parses");
        let mut maps: Vec<&str> = object.maps.keys().map(String::as_str).collect();
        maps.sort_unstable();
        let mut expected = names::ALL_MAPS.to_vec();
        expected.sort_unstable();
        assert_eq!(maps, expected);
        let mut programs: Vec<&str> = object.programs.keys().map(String::as_str).collect();
        programs.sort_unstable();
        let mut expected: Vec<&str> = names::SOCK_ADDR_PROGRAMS
            .iter()
            .chain(names::SOCK_PROGRAMS.iter())
            .copied()
            .collect();
        expected.sort_unstable();
        assert_eq!(programs, expected);
        let mut attached = ALL_PROGRAMS.to_vec();
        attached.sort_unstable();
        assert_eq!(attached, expected, "every program is attached");
    }
}
