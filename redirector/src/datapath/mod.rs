//! The kernel side seen from userspace: load the embedded object, attach its programs to a cgroup,
//! pin everything so that steering and in-kernel failover outlive the agent's process, adopt what
//! an earlier agent pinned, and read and write the maps.
//!
//! Pin layout under the pin directory: `maps/NAME` for every map, `links/PROGRAM-0` or
//! `links/PROGRAM-1` for every attachment (bpf_link): a new agent pins its attachment in the free
//! slot before it unpins the old one (bpffs cannot rename).

mod count_protocol;
mod error;
mod maps;
mod socket_counts;

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, Map, MapData},
    programs::{
        CgroupAttachMode, CgroupSkbAttachType, Program,
        links::{FdLink, PinnedLink},
    },
};
pub use error::DatapathError;
pub use maps::{ListenerEntry, ListenerTotals, Maps, SkipEntry, target_of};
use redirector_common::{LAYOUT_VERSION, datapath::DatapathConfig, names};
use tracing::{info, warn};

/// The eBPF object built from `redirector-ebpf` by `build.rs`.
pub static OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/redirector-ebpf"));

/// Sub-directory of the pin directory holding the maps.
const PINNED_MAPS_DIR: &str = "maps";
/// Sub-directory of the pin directory holding the attachments (bpf links).
const PINNED_LINKS_DIR: &str = "links";

/// Every program, in attach order: the counting programs first, so that sockets bound from the
/// moment steering starts are counted.
pub const ALL_PROGRAMS: [&str; 12] = [
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
    // After connect: a socket it moves off a stale peer reconnects through the new connect4/6.
    names::PROG_EGRESS,
];

/// What the pin directory holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PinnedState {
    /// Nothing: a first start.
    Empty,
    /// Maps of this layout and shape: adopt them (and replace the attachments hitlessly).
    Compatible,
    /// Pins this agent cannot adopt.
    Incompatible {
        /// What does not fit.
        why: Incompatibility,
        /// Whether attachments are pinned too. Without them nothing steers through the maps (a
        /// start that failed or was killed before it attached left them), so removing them
        /// loses nothing.
        attached: bool,
    },
}

/// Why pinned maps cannot be adopted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Incompatibility {
    /// Another layout version (`None`: unreadable or never written).
    Layout {
        /// The layout version found.
        found: Option<u32>,
    },
    /// This layout, but maps whose kernel definition is not what this object and configuration
    /// define (a changed `reverse_nat_entries`, or a build of another shape).
    Shape(ShapeDifferences),
}

impl std::fmt::Display for Incompatibility {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Layout { found: Some(found) } => write!(f, "layout {found}"),
            Self::Layout { found: None } => f.write_str("no readable layout version"),
            Self::Shape(differences) => differences.fmt(f),
        }
    }
}

/// Every way the pinned maps differ from this object's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeDifferences(pub Vec<ShapeDifference>);

impl std::fmt::Display for ShapeDifferences {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (position, difference) in self.0.iter().enumerate() {
            let separator = if position == 0 { "" } else { "; " };
            write!(f, "{separator}{difference}")?;
        }
        Ok(())
    }
}

/// One way a pinned map differs from the map this object defines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeDifference {
    /// The map.
    pub map: &'static str,
    /// What differs: `type`, `key size`, `value size`, `max entries` or `flags`.
    pub field: &'static str,
    /// What the pinned map has.
    pub pinned: u32,
    /// What this object and configuration define.
    pub expected: u32,
}

impl std::fmt::Display for ShapeDifference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} has {} {} where {} is needed",
            self.map, self.field, self.pinned, self.expected
        )
    }
}

/// Looks at the pins under `pin_dir`: their layout version, and, for this layout, whether every
/// pinned map has the type, key and value sizes, entries and flags this object defines (with
/// `reverse_nat_entries` for the translation map).
pub fn pinned_state(
    pin_dir: &Path,
    reverse_nat_entries: u32,
) -> Result<PinnedState, DatapathError> {
    let maps_dir = pin_dir.join(PINNED_MAPS_DIR);
    let attached = has_pinned_attachments(pin_dir);
    let any_map = names::ALL_MAPS
        .iter()
        .any(|name| maps_dir.join(name).exists());
    if !any_map && !attached {
        return Ok(PinnedState::Empty);
    }
    let version = MapData::from_pin(maps_dir.join(names::MAP_DATAPATH_CONFIG))
        .and_then(Map::from_map_data)
        .and_then(Array::<MapData, DatapathConfig>::try_from)
        .and_then(|config| config.get(&0, 0))
        .map(|config| config.layout_version)
        .ok();
    if version != Some(LAYOUT_VERSION) {
        return Ok(PinnedState::Incompatible {
            why: Incompatibility::Layout { found: version },
            attached,
        });
    }
    let differences = shape_differences(&maps_dir, reverse_nat_entries)?;
    Ok(if differences.0.is_empty() {
        PinnedState::Compatible
    } else {
        PinnedState::Incompatible {
            why: Incompatibility::Shape(differences),
            attached,
        }
    })
}

/// How the maps pinned under `maps_dir` differ from the object's definitions.
fn shape_differences(
    maps_dir: &Path,
    reverse_nat_entries: u32,
) -> Result<ShapeDifferences, DatapathError> {
    let object =
        aya_obj::Object::parse(OBJECT).map_err(|source| DatapathError::Object { source })?;
    let mut differences = Vec::new();
    for name in names::ALL_MAPS {
        let path = maps_dir.join(name);
        if !path.exists() {
            // Created at load like on a first start.
            continue;
        }
        let defined = object
            .maps
            .get(name)
            .ok_or(DatapathError::MissingMap { name })?;
        let pinned = aya::maps::MapInfo::from_pin(&path)
            .map_err(|source| DatapathError::InspectPin { path, source })?;
        let max_entries = if name == names::MAP_REVERSE_NAT {
            reverse_nat_entries
        } else {
            defined.max_entries()
        };
        let pinned_type = pinned.map_type().map_or(u32::MAX, |kind| kind as u32);
        for (field, pinned, expected) in [
            ("type", pinned_type, defined.map_type()),
            ("key size", pinned.key_size(), defined.key_size()),
            ("value size", pinned.value_size(), defined.value_size()),
            ("max entries", pinned.max_entries(), max_entries),
            ("flags", pinned.map_flags(), defined.map_flags()),
        ] {
            if pinned != expected {
                differences.push(ShapeDifference {
                    map: name,
                    field,
                    pinned,
                    expected,
                });
            }
        }
    }
    Ok(ShapeDifferences(differences))
}

/// Removes the pins of a start that created them unless the start attaches: a first start is
/// all or nothing, so a failure (a verifier refusal, a listener interface that cannot be set up)
/// leaves no maps behind that the next start would have to judge. A start that adopted maps
/// leaves them as they were: the attachments of the earlier agent still use them.
#[derive(Debug)]
struct FreshPins {
    /// The pin directory, until the start attached.
    pin_dir: Option<PathBuf>,
}

impl FreshPins {
    /// Marks the start complete: the pins stay.
    fn keep(&mut self) {
        self.pin_dir = None;
    }
}

impl Drop for FreshPins {
    fn drop(&mut self) {
        if let Some(pin_dir) = self.pin_dir.take() {
            match remove_pins(&pin_dir) {
                Ok(()) => {
                    warn!(pin_dir = %pin_dir.display(), "removed the pins of this failed start");
                }
                Err(error) => {
                    warn!(pin_dir = %pin_dir.display(), error = %error, "cannot remove the pins of this failed start; the next start replaces them");
                }
            }
        }
    }
}

/// The loaded object. Its attachments are pinned: dropping it (or the agent dying) leaves them
/// attached; [`remove_pins`] detaches them.
#[derive(Debug)]
pub struct Datapath {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    attached_to: Option<PathBuf>,
    adopted: bool,
    load_times: LoadTimes,
    /// Removes the pins this start created unless it attaches.
    fresh: FreshPins,
}

/// Where `Datapath::load` spent its time.
#[derive(Clone, Copy, Debug)]
pub struct LoadTimes {
    /// Parsing the object, its BTF, and creating (or opening) and pinning the maps.
    pub object: std::time::Duration,
    /// Loading the programs: the kernel's verifier, run on every core (wall time).
    pub verify: std::time::Duration,
}

impl Datapath {
    /// Loads the object and every program (running the verifier), without attaching anything.
    /// Maps pinned under `pin_dir/maps/` are adopted, with their state (modes, counts, pools,
    /// translations), when `pinned_state` says they are compatible; missing ones are created and
    /// pinned. Returns the typed map handles next to it.
    ///
    /// With `kernel_log`, the programs' aya-log statements are live (`AYA_LOG_LEVEL` set to
    /// debug); without it the level is 0, a read-only global, so the verifier removes every
    /// logging branch and the programs pay nothing for them.
    ///
    /// `set_retval`: the kernel lets sock_addr programs call `bpf_set_retval` (probed by the
    /// caller); without it the read-only switch stays 0, the verifier removes the call, and the
    /// `fail` policy's syscalls fail with `EPERM`.
    pub fn load(
        reverse_nat_entries: u32,
        pin_dir: &Path,
        kernel_log: bool,
        set_retval: bool,
    ) -> Result<(Self, Maps), DatapathError> {
        let maps_dir = pin_dir.join(PINNED_MAPS_DIR);
        std::fs::create_dir_all(&maps_dir).map_err(|source| DatapathError::PinDir {
            path: maps_dir.clone(),
            source,
        })?;
        let adopted = maps_dir.join(names::MAP_DATAPATH_CONFIG).exists();
        let paths: Vec<(&str, PathBuf)> = names::ALL_MAPS
            .iter()
            .map(|name| (*name, maps_dir.join(name)))
            .collect();
        let log_level: u8 = if kernel_log {
            aya_log::Level::Debug as u8
        } else {
            0
        };
        let mut loader = EbpfLoader::new();
        loader.map_max_entries(names::MAP_REVERSE_NAT, reverse_nat_entries);
        loader.override_global(aya_log::LEVEL, &log_level, true);
        let set_retval = u8::from(set_retval);
        loader.override_global(names::GLOBAL_SET_RETVAL, &set_retval, true);
        for (name, path) in &paths {
            // Opens the pinned map when there is one, else creates and pins it.
            loader.map_pin_path(name, path.as_path());
        }
        // From here on a failure removes what this (first) start pinned.
        let fresh = FreshPins {
            pin_dir: (!adopted).then(|| pin_dir.to_owned()),
        };
        let started = std::time::Instant::now();
        let mut ebpf = loader
            .load(OBJECT)
            .map_err(|source| DatapathError::Load { source })?;
        let object = started.elapsed();
        verify_all(&mut ebpf)?;
        let load_times = LoadTimes {
            object,
            verify: started.elapsed() - object,
        };
        let maps = Maps::take(&mut ebpf)?;
        Ok((
            Self {
                ebpf,
                pin_dir: pin_dir.to_owned(),
                attached_to: None,
                adopted,
                load_times,
                fresh,
            },
            maps,
        ))
    }

    /// How long loading took, by step.
    #[must_use]
    pub fn load_times(&self) -> LoadTimes {
        self.load_times
    }

    /// Starts forwarding the programs' log records (aya-log) to the agent's log; only useful
    /// after loading with `kernel_log`.
    pub fn kernel_logger(
        &mut self,
    ) -> Result<aya_log::EbpfLogger<&'static dyn log::Log>, DatapathError> {
        aya_log::EbpfLogger::init(&mut self.ebpf)
            .map_err(|source| DatapathError::KernelLog { source })
    }

    /// True when the maps were adopted from an earlier agent.
    #[must_use]
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// Attaches every program to the cgroup v2 directory `cgroup` and pins each attachment under
    /// `pin_dir/links/`, replacing an earlier agent's: the new attachment is pinned in the free
    /// slot and only then is the old one unpinned (detaching it), so the old program runs until
    /// the new one does. Both running for a moment is harmless: a rewritten address is no
    /// listener address to the other, and a cache socket is counted once, by whoever inserts its
    /// cookie.
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
        let mut replaced = 0;
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
                Program::CgroupSkb(program) => {
                    let id = program
                        .attach(
                            &cgroup_dir,
                            CgroupSkbAttachType::Egress,
                            CgroupAttachMode::Single,
                        )
                        .map_err(attach_error)?;
                    let link = program.take_link(id).map_err(attach_error)?;
                    FdLink::try_from(link).map_err(link_error)?
                }
                _ => return Err(DatapathError::ProgramType { name }),
            };
            let [first, second] = link_slots(&self.pin_dir, name);
            let (new, old) = if first.exists() {
                (second, first)
            } else {
                (first, second)
            };
            remove_file_if_present(&new)?;
            let pinned: PinnedLink = link.pin(&new).map_err(|source| DatapathError::PinLink {
                name,
                path: new.clone(),
                source,
            })?;
            // The pin keeps the attachment; this process's descriptor is not needed.
            drop(pinned);
            if old.exists() {
                replaced += 1;
                // The new program runs: the old one may go.
                remove_file_if_present(&old)?;
            }
        }
        if replaced > 0 {
            info!(replaced, "replaced the programs an earlier agent attached");
        }
        self.attached_to = Some(cgroup.to_owned());
        self.fresh.keep();
        Ok(())
    }

    /// The cgroup the programs are attached to.
    #[must_use]
    pub fn attached_to(&self) -> Option<&Path> {
        self.attached_to.as_deref()
    }
}

/// Removes every pin this module makes under `pin_dir` (maps and attachments), then the
/// directories when empty. Unpinning an attachment detaches its program; the maps go with the
/// last program or process holding them.
pub fn remove_pins(pin_dir: &Path) -> Result<(), DatapathError> {
    for name in ALL_PROGRAMS {
        for slot in link_slots(pin_dir, name) {
            remove_file_if_present(&slot)?;
        }
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
            Err(error) if error.raw_os_error() == Some(libc::ENOTEMPTY) => {
                warn!(path = %path.display(), "left a directory that holds files of someone else");
            }
            Err(source) => return Err(DatapathError::PinDir { path, source }),
        }
    }
    Ok(())
}

/// The two pin paths an attachment of `program` may have.
fn link_slots(pin_dir: &Path, program: &str) -> [PathBuf; 2] {
    let dir = pin_dir.join(PINNED_LINKS_DIR);
    [
        dir.join(format!("{program}-0")),
        dir.join(format!("{program}-1")),
    ]
}

/// True when attachments are pinned under `pin_dir`.
#[must_use]
pub fn has_pinned_attachments(pin_dir: &Path) -> bool {
    ALL_PROGRAMS
        .iter()
        .flat_map(|name| link_slots(pin_dir, name))
        .any(|slot| slot.exists())
}

/// The ids of the programs attached through the pins under `pin_dir` (for `status` and tests).
#[must_use]
pub fn pinned_program_ids(pin_dir: &Path) -> Vec<(&'static str, u32)> {
    ALL_PROGRAMS
        .iter()
        .flat_map(|name| link_slots(pin_dir, name).map(|slot| (*name, slot)))
        .filter_map(|(name, slot)| {
            let link = PinnedLink::from_pin(slot).ok()?;
            let info = FdLink::from(link).info().ok()?;
            Some((name, info.program_id()))
        })
        .collect()
}

/// Loads every program, running the verifier, on as many threads as the machine has cores: the
/// kernel verifies each `BPF_PROG_LOAD` on the calling thread, and verification is most of the
/// agent's start (about 150 ms of CPU here, 30 ms for each rewriting program), so two cores halve
/// it. Workers take programs from the end of `ALL_PROGRAMS` first: the rewriting programs and the
/// egress check before the light counting ones, which then fill the gaps.
fn verify_all(ebpf: &mut Ebpf) -> Result<(), DatapathError> {
    let mut queue: Vec<(&'static str, &mut Program)> = Vec::with_capacity(ALL_PROGRAMS.len());
    let mut programs: Vec<(&str, &mut Program)> = ebpf.programs_mut().collect();
    for name in ALL_PROGRAMS {
        let index = programs
            .iter()
            .position(|(found, _)| *found == name)
            .ok_or(DatapathError::MissingProgram { name })?;
        queue.push((name, programs.swap_remove(index).1));
    }
    let workers = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(queue.len());
    let queue = std::sync::Mutex::new(queue);
    let next = || {
        queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop()
    };
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    while let Some((name, program)) = next() {
                        verify(name, program)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(|handle| {
            handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    })
}

/// Loads one program (the verifier runs here).
fn verify(name: &'static str, program: &mut Program) -> Result<(), DatapathError> {
    match program {
        Program::CgroupSockAddr(program) => program.load(),
        Program::CgroupSock(program) => program.load(),
        Program::CgroupSkb(program) => program.load(),
        _ => return Err(DatapathError::ProgramType { name }),
    }
    .map_err(|source| DatapathError::Verify { name, source })
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut Program, DatapathError> {
    ebpf.program_mut(name)
        .ok_or(DatapathError::MissingProgram { name })
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
        // Besides ours: aya-log's ring buffer and the read-only globals (its level).
        let mut expected = names::ALL_MAPS.to_vec();
        expected.extend([".rodata", "AYA_LOGS"]);
        expected.sort_unstable();
        assert_eq!(maps, expected);
        let mut programs: Vec<&str> = object.programs.keys().map(String::as_str).collect();
        programs.sort_unstable();
        let mut expected: Vec<&str> = names::SOCK_ADDR_PROGRAMS
            .iter()
            .chain(names::SOCK_PROGRAMS.iter())
            .chain(names::SKB_PROGRAMS.iter())
            .copied()
            .collect();
        expected.sort_unstable();
        assert_eq!(programs, expected);
        let mut attached = ALL_PROGRAMS.to_vec();
        attached.sort_unstable();
        assert_eq!(attached, expected, "every program is attached");
    }

    #[test]
    fn an_empty_pin_directory_is_a_first_start() {
        let dir = std::env::temp_dir().join(format!("redirector-pins-{}", std::process::id()));
        assert_eq!(
            pinned_state(&dir, 65_536).expect("nothing to inspect"),
            PinnedState::Empty
        );
    }
}
