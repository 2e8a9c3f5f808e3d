//! The kernel side seen from userspace: load the embedded object, attach its programs to a cgroup,
//! pin everything so that steering and in-kernel failover outlive the agent's process, adopt what
//! an earlier agent (of this release, an older or a newer one) pinned, and read and write the
//! maps.
//!
//! A start never removes what runs before its replacement runs: it plans ([`pins::plan`]),
//! loads and verifies the new object on the pinned maps it can reuse and on new maps beside the
//! others ([`Datapath::load`]), fills those from the pinned ones ([`migrate`]), and only then
//! puts its programs in the pinned links, one hook at a time ([`Datapath::attach`]). The pin
//! layout and the rule that keeps releases compatible are in [`pins`] and [`layout`].

mod cache_activity;
mod clock;
mod count_protocol;
mod error;
pub mod layout;
mod maps;
mod migrate;
mod mmapped;
pub mod pins;
mod raw;
mod socket_counts;

use std::{
    fs::File,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    programs::{
        CgroupAttachMode, CgroupSkbAttachType, Program,
        links::{FdLink, PinnedLink},
    },
};
pub use clock::{TickClock, TickError};
pub use error::DatapathError;
pub use maps::{
    ExemptEntry, ExemptWrite, Journal, ListenerEntry, ListenerTotals, Maps, SkipEntry, target_of,
};
pub use migrate::Copied;
use pins::{
    LINKS_DIR, MAPS_DIR, STAGED_MAPS_DIR, link_slots, pinned_names, remove_dir_if_empty,
    remove_file_if_present, rename,
};
pub use pins::{
    MapAction, Plan, Verdict, has_pinned_attachments, has_pins, other_attached_sets, pinned_layout,
    remove_pins,
};
use redirector_common::{activity::StallTiming, names};
use tracing::{info, warn};

/// The eBPF object built from `redirector-ebpf` by `build.rs`.
pub static OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/redirector-ebpf"));

/// Every program, in attach order: the counting programs first, so that sockets bound from the
/// moment steering starts are counted.
pub const ALL_PROGRAMS: [&str; 14] = [
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
    // The queries that reach a cache's socket, for its stall detection.
    names::PROG_INGRESS,
    // Not on the cgroup: a raw tracepoint of the whole node.
    names::PROG_SIGNAL,
];

/// Removes what a start staged in `maps-next/` unless the start attaches: a failure (a verifier
/// refusal, a listener interface that cannot be set up, a taken metrics port) leaves the pinned
/// maps and the programs running on them exactly as they were; a first start that fails leaves
/// nothing that the next start would have to judge.
#[derive(Debug)]
struct Staged {
    /// The pin directory, until the start attached.
    pin_dir: Option<PathBuf>,
}

impl Staged {
    /// Marks the start complete: its maps are in place.
    fn keep(&mut self) {
        self.pin_dir = None;
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let Some(pin_dir) = self.pin_dir.take() else {
            return;
        };
        let staged_dir = pin_dir.join(STAGED_MAPS_DIR);
        let running = has_pinned_attachments(&pin_dir);
        let mut removed = pinned_names(&staged_dir)
            .into_iter()
            .try_for_each(|name| remove_file_if_present(&staged_dir.join(name)))
            .and_then(|()| remove_dir_if_empty(&staged_dir));
        if !running && pinned_names(&pin_dir.join(MAPS_DIR)).is_empty() {
            removed = removed
                .and_then(|()| remove_dir_if_empty(&pin_dir.join(MAPS_DIR)))
                .and_then(|()| remove_dir_if_empty(&pin_dir.join(LINKS_DIR)))
                .and_then(|()| remove_dir_if_empty(&pin_dir));
        }
        match removed {
            Ok(()) if running => warn!(
                pin_dir = %pin_dir.display(),
                "removed the pins of this failed start; DNS is still steered by the programs and maps an earlier agent attached, as they were"
            ),
            Ok(()) => warn!(pin_dir = %pin_dir.display(), "removed the pins of this failed start"),
            Err(error) => {
                warn!(pin_dir = %pin_dir.display(), error = %error, "cannot remove the pins of this failed start; the next start removes them");
            }
        }
    }
}

/// How one program was put in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Swap {
    /// Its pinned link now runs it (`BPF_LINK_UPDATE`).
    Updated,
    /// A new link runs it, and the old link was unpinned.
    Replaced,
    /// A new link runs it; there was none before.
    Added,
}

/// The loaded object. Its attachments are pinned: dropping it (or the agent dying) leaves them
/// attached; [`remove_pins`] detaches them.
#[derive(Debug)]
pub struct Datapath {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    attached_to: Option<PathBuf>,
    adopted: bool,
    plan: Plan,
    load_times: LoadTimes,
    /// The kernel's tick, reused from the pins or measured (`None`: it could not be).
    tick_clock: Option<TickClock>,
    /// Removes the maps this start staged unless it attaches.
    staged: Staged,
}

/// Where `Datapath::load` spent its time.
#[derive(Clone, Copy, Debug)]
pub struct LoadTimes {
    /// Parsing the object, its BTF, and creating (or opening) and pinning the maps.
    pub object: std::time::Duration,
    /// Loading the programs: the kernel's verifier, run on every core (wall time), and the
    /// measurement of the kernel's tick at a boot's first start (beside it, about 100 ms).
    pub verify: std::time::Duration,
    /// Copying the pinned maps the plan migrates into the new ones.
    pub migrate: std::time::Duration,
}

/// How to load the object.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Entries of the maps the configuration sizes.
    pub sizes: pins::MapSizes,
    /// The programs count DNS per workload (`workloads.accounting`); without it the read-only
    /// switch stays 0 and the verifier removes the counting.
    pub workloads: bool,
    /// The rate limit's schedule, one query's interval and the tolerance ahead of it in ns
    /// (`workloads.rate_limit_qps`); `None`: the read-only switch stays 0 and the verifier
    /// removes the limit.
    pub rate_limit_ns: Option<(u64, u64)>,
    /// Where the maps and links are pinned.
    pub pin_dir: PathBuf,
    /// The programs' aya-log statements are live (`AYA_LOG_LEVEL` at debug); without it the
    /// level is 0, a read-only global, so the verifier removes every logging branch and the
    /// programs pay nothing for them.
    pub kernel_log: bool,
    /// The kernel lets sock_addr programs call `bpf_set_retval` (probed by the caller); without
    /// it the read-only switch stays 0, the verifier removes the call, and the `fail` policy's
    /// syscalls fail with `EPERM`.
    pub set_retval: bool,
    /// The kernel runs the fetching atomics (probed by the caller); without them the programs
    /// keep counts with plain adds and leave stall detection to the agent's probes.
    pub atomic_fetch: bool,
    /// The kernel runs raw tracepoint programs on request (`BPF_PROG_TEST_RUN`, 5.10), so the
    /// tick can be measured when no pinned `STALL_TIMING` holds it; without it the programs read
    /// the coarse clock helper.
    pub measure_tick: bool,
    /// Fail after loading and migrating, before anything runs (tests only).
    pub fail_after_load: bool,
}

impl Datapath {
    /// Loads the object and every program (running the verifier) as `plan` says, without
    /// attaching anything: pinned maps of this shape are shared with the programs that run now;
    /// the others are created in `maps-next/` and filled from the pinned ones. Returns the typed
    /// map handles (on the new set) next to it.
    pub fn load(options: &LoadOptions, plan: Plan) -> Result<(Self, Maps), DatapathError> {
        let pin_dir = options.pin_dir.as_path();
        for dir in [MAPS_DIR, STAGED_MAPS_DIR] {
            let dir = pin_dir.join(dir);
            std::fs::create_dir_all(&dir)
                .map_err(|source| DatapathError::PinDir { path: dir, source })?;
        }
        let adopted = plan.verdict() == Verdict::Adopt;
        let paths: Vec<(&str, PathBuf)> = names::ALL_MAPS
            .iter()
            .map(|name| (*name, plan.pin_path(pin_dir, name)))
            .collect();
        let log_level: u8 = if options.kernel_log {
            aya_log::Level::Debug as u8
        } else {
            0
        };
        let mut loader = EbpfLoader::new();
        loader.map_max_entries(names::MAP_REVERSE_NAT, options.sizes.reverse_nat);
        loader.map_max_entries(names::MAP_WORKLOADS, options.sizes.workloads);
        let workloads = u8::from(options.workloads);
        loader.override_global(names::GLOBAL_WORKLOADS, &workloads, true);
        let (interval_ns, tolerance_ns) = options.rate_limit_ns.unwrap_or((0, 0));
        loader.override_global(names::GLOBAL_RATE_INTERVAL, &interval_ns, true);
        loader.override_global(names::GLOBAL_RATE_TOLERANCE, &tolerance_ns, true);
        loader.override_global(aya_log::LEVEL, &log_level, true);
        let set_retval = u8::from(options.set_retval);
        loader.override_global(names::GLOBAL_SET_RETVAL, &set_retval, true);
        let atomic_fetch = u8::from(options.atomic_fetch);
        loader.override_global(names::GLOBAL_ATOMIC_FETCH, &atomic_fetch, true);
        for (name, path) in &paths {
            // Opens the pinned map when there is one, else creates and pins it.
            loader.map_pin_path(name, path.as_path());
        }
        // From here on a failure removes what this start staged.
        let staged = Staged {
            pin_dir: Some(pin_dir.to_owned()),
        };
        let started = std::time::Instant::now();
        let mut ebpf = loader
            .load(OBJECT)
            .map_err(|source| DatapathError::Load { source })?;
        let object = started.elapsed();
        let pinned_tick = pinned_tick_clock(&ebpf);
        let measured_tick = verify_all(&mut ebpf, options.measure_tick && pinned_tick.is_none())?;
        let verified = started.elapsed();
        let tick_clock = pinned_tick.or_else(|| match measured_tick? {
            Ok(clock) => {
                info!(
                    tick_us = clock.tick_ns / 1000,
                    hz = clock.hz(),
                    "measured the kernel's tick for the activity stamps"
                );
                Some(clock)
            }
            Err(error) => {
                warn!(error = %crate::error_chain(&error), "cannot measure the kernel's tick; the programs read bpf_ktime_get_coarse_ns for the activity stamps instead (a few ns more per query handed to a cache; nothing else changes)");
                None
            }
        });
        for (name, action) in &plan.maps {
            if let MapAction::Migrate { why } = action {
                let copied = migrate::copy(pin_dir, name, raw::BPF_ANY)?;
                info!(map = name, why = %why, entries = copied.entries, dropped = copied.dropped, "migrated a pinned map into a new one beside it");
            }
        }
        if options.fail_after_load {
            return Err(DatapathError::InjectedFailure);
        }
        let load_times = LoadTimes {
            object,
            verify: verified - object,
            migrate: started.elapsed() - verified,
        };
        let maps = Maps::take(&mut ebpf)?;
        Ok((
            Self {
                ebpf,
                pin_dir: pin_dir.to_owned(),
                attached_to: None,
                adopted,
                plan,
                load_times,
                tick_clock,
                staged,
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

    /// The kernel's tick, for the activity stamps' clock (`None`: the programs read the coarse
    /// clock helper).
    #[must_use]
    pub fn tick_clock(&self) -> Option<TickClock> {
        self.tick_clock
    }

    /// True when the maps were adopted from an earlier agent.
    #[must_use]
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// What the start planned for each map.
    #[must_use]
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Puts every program in place on the cgroup v2 directory `cgroup`, then the maps it staged
    /// in place of the pinned ones, and retires what no program of this release uses.
    ///
    /// A program whose pinned link is attached to `cgroup` replaces the link's program in place
    /// (`BPF_LINK_UPDATE`, 5.7): each hook runs the old program or the new one, never neither nor
    /// both, and the link and its pin stay. A program without one (a first start, a program new
    /// in this release, another cgroup) is attached and pinned in the free slot, and only then is
    /// an old link unpinned (detaching it): both run for a moment, which is harmless, since a
    /// rewritten address is no listener address to the other, and a cache socket is counted by
    /// whoever inserts its cookie.
    ///
    /// aya attaches through bpf_link on 5.7+, and a link attachment is always "multi": programs
    /// of other owners on the same cgroup (Cilium's socket LB, for one) keep running. The kernel
    /// refuses attach flags on links, hence `Single`, which passes none.
    pub fn attach(&mut self, cgroup: &Path) -> Result<(), DatapathError> {
        let cgroup_dir = File::open(cgroup).map_err(|source| DatapathError::OpenCgroup {
            path: cgroup.to_owned(),
            source,
        })?;
        let cgroup_id = {
            use std::os::unix::fs::MetadataExt as _;
            cgroup_dir.metadata().map(|metadata| metadata.ino()).ok()
        };
        let links_dir = self.pin_dir.join(LINKS_DIR);
        std::fs::create_dir_all(&links_dir).map_err(|source| DatapathError::PinDir {
            path: links_dir.clone(),
            source,
        })?;
        let (mut updated, mut replaced, mut added) = (0, 0, 0);
        for name in ALL_PROGRAMS {
            let swapped = self.attach_program(name, &cgroup_dir, cgroup, cgroup_id);
            match swapped {
                Ok(Swap::Updated) => updated += 1,
                Ok(Swap::Replaced) => replaced += 1,
                Ok(Swap::Added) => added += 1,
                Err(error) if updated + replaced + added > 0 => {
                    warn!(
                        swapped = updated + replaced + added,
                        programs = ALL_PROGRAMS.len(),
                        failed = name,
                        "the swap stopped part way: the programs swapped in run on this start's maps (kept pinned), the others as an earlier agent left them; start the agent again to finish the swap"
                    );
                    return Err(error);
                }
                Err(error) => return Err(error),
            }
            // A program of this start runs on the staged maps from here on: a failure must not
            // remove them (the next start moves what is left into place).
            self.staged.keep();
        }
        if updated + replaced > 0 {
            info!(
                updated,
                replaced, "replaced the programs an earlier agent attached"
            );
        }
        self.attached_to = Some(cgroup.to_owned());
        self.put_staged_maps_in_place()?;
        self.retire_unknown()
    }

    /// Puts program `name` in place on `cgroup` (see [`Datapath::attach`]): updates its pinned
    /// link in place, or attaches and pins a new link and then unpins the old one.
    fn attach_program(
        &mut self,
        name: &'static str,
        cgroup_dir: &File,
        cgroup: &Path,
        cgroup_id: Option<u64>,
    ) -> Result<Swap, DatapathError> {
        let slots = link_slots(&self.pin_dir, name);
        let pinned = slots.iter().find(|slot| slot.exists()).cloned();
        let loaded = program(&mut self.ebpf, name)?;
        if let Some(pinned) = &pinned
            && update_in_place(name, loaded, pinned, cgroup_id)?
        {
            return Ok(Swap::Updated);
        }
        let link = attach_one(name, loaded, cgroup_dir, cgroup)?;
        let [first, second] = slots;
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
            // The new program runs: the old one may go.
            remove_file_if_present(&old)?;
            return Ok(Swap::Replaced);
        }
        Ok(Swap::Added)
    }

    /// Copies again what the old programs added to a migrated map since the first copy, then
    /// moves every staged map over the pinned one (which goes with the last program using it).
    fn put_staged_maps_in_place(&self) -> Result<(), DatapathError> {
        let staged_dir = self.pin_dir.join(STAGED_MAPS_DIR);
        for (name, action) in &self.plan.maps {
            if matches!(action, MapAction::Migrate { .. }) && migrate::refilled_after_swap(name) {
                let copied = migrate::copy(&self.pin_dir, name, raw::BPF_NOEXIST)?;
                info!(
                    map = name,
                    entries = copied.entries,
                    "copied what the replaced programs added to a migrated map while the new ones took over"
                );
            }
        }
        for name in pinned_names(&staged_dir) {
            rename(
                &staged_dir.join(&name),
                &self.pin_dir.join(MAPS_DIR).join(&name),
            )?;
        }
        remove_dir_if_empty(&staged_dir)
    }

    /// Unpins the maps and links of programs this release does not have (a newer release's,
    /// rolled back from): its programs no longer run.
    fn retire_unknown(&self) -> Result<(), DatapathError> {
        for name in &self.plan.unknown {
            info!(map = %name, holds = pins::retired_kind(name), "retiring a pinned map this release does not use");
            remove_file_if_present(&self.pin_dir.join(MAPS_DIR).join(name))?;
        }
        let links_dir = self.pin_dir.join(LINKS_DIR);
        for name in pinned_names(&links_dir) {
            let ours = ALL_PROGRAMS.iter().any(|program| {
                link_slots(&self.pin_dir, program)
                    .iter()
                    .any(|slot| slot.file_name() == Some(name.as_ref()))
            });
            if !ours {
                info!(link = %name, "detaching a program this release does not have");
                remove_file_if_present(&links_dir.join(name))?;
            }
        }
        Ok(())
    }

    /// The cgroup the programs are attached to.
    #[must_use]
    pub fn attached_to(&self) -> Option<&Path> {
        self.attached_to.as_deref()
    }
}

/// Stages an empty map named `name`, moved into `maps/` with this start's other maps
/// (`REDIRECTOR_TEST_LAYOUT_BUMP`: the stand-in for the state a newer layout adds, which a
/// rollback must retire).
pub fn pin_next_layout_map(pin_dir: &Path, name: &str) -> Result<(), DatapathError> {
    let path = pin_dir.join(STAGED_MAPS_DIR).join(name);
    if path.exists() {
        return Ok(());
    }
    raw::pin_new_array(&path, 8).map_err(|source| DatapathError::PinDir { path, source })
}

/// Replaces the program of the link pinned at `pinned` with `program` when the link is attached
/// to the cgroup `cgroup_id`; `false` when it is not (or its cgroup is unknown), for the caller
/// to attach anew.
fn update_in_place(
    name: &'static str,
    program: &Program,
    pinned: &Path,
    cgroup_id: Option<u64>,
) -> Result<bool, DatapathError> {
    let link = raw::open_pinned(pinned).map_err(|source| DatapathError::UpdateLink {
        name,
        path: pinned.to_owned(),
        source,
    })?;
    if cgroup_id.is_none() || raw::link_cgroup_id(&link) != cgroup_id {
        return Ok(false);
    }
    let program_fd = match program {
        Program::CgroupSockAddr(program) => program.fd(),
        Program::CgroupSock(program) => program.fd(),
        Program::CgroupSkb(program) => program.fd(),
        // Not a cgroup link (its fdinfo names no cgroup): attached anew above.
        _ => return Ok(false),
    }
    .map_err(|source| DatapathError::Verify { name, source })?;
    raw::update_link(link.as_fd(), program_fd.as_fd()).map_err(|source| {
        DatapathError::UpdateLink {
            name,
            path: pinned.to_owned(),
            source,
        }
    })?;
    Ok(true)
}

/// Attaches `program` to the cgroup and returns its link.
fn attach_one(
    name: &'static str,
    program: &mut Program,
    cgroup_dir: &File,
    cgroup: &Path,
) -> Result<FdLink, DatapathError> {
    let attach_error = |source| DatapathError::Attach {
        name,
        path: cgroup.to_owned(),
        source,
    };
    let link_error = |source| DatapathError::Link { name, source };
    Ok(match program {
        Program::CgroupSockAddr(program) => {
            let id = program
                .attach(cgroup_dir, CgroupAttachMode::Single)
                .map_err(attach_error)?;
            let link = program.take_link(id).map_err(attach_error)?;
            FdLink::try_from(link).map_err(link_error)?
        }
        Program::CgroupSock(program) => {
            let id = program
                .attach(cgroup_dir, CgroupAttachMode::Single)
                .map_err(attach_error)?;
            let link = program.take_link(id).map_err(attach_error)?;
            FdLink::try_from(link).map_err(link_error)?
        }
        Program::CgroupSkb(program) => {
            let direction = if name == names::PROG_INGRESS {
                CgroupSkbAttachType::Ingress
            } else {
                CgroupSkbAttachType::Egress
            };
            let id = program
                .attach(cgroup_dir, direction, CgroupAttachMode::Single)
                .map_err(attach_error)?;
            let link = program.take_link(id).map_err(attach_error)?;
            FdLink::try_from(link).map_err(link_error)?
        }
        // Raw tracepoint links cannot have their program replaced (no `update_prog`): a new one
        // is attached beside, and the old one unpinned after. Both running for a moment records
        // one signal twice, which only bumps an epoch once more.
        Program::RawTracePoint(program) => {
            let id = program
                .attach(names::SIGNAL_TRACEPOINT)
                .map_err(attach_error)?;
            let link = program.take_link(id).map_err(attach_error)?;
            FdLink::from(link)
        }
        _ => return Err(DatapathError::ProgramType { name }),
    })
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
///
/// With `measure_tick`, `dns_ticks` is loaded first and measures the kernel's tick on a thread of
/// its own meanwhile (it mostly sleeps): its result is returned.
fn verify_all(
    ebpf: &mut Ebpf,
    measure_tick: bool,
) -> Result<Option<Result<TickClock, TickError>>, DatapathError> {
    let mut queue: Vec<(&'static str, &mut Program)> = Vec::with_capacity(ALL_PROGRAMS.len());
    let mut programs: Vec<(&str, &mut Program)> = ebpf.programs_mut().collect();
    let mut take = |name: &'static str| {
        programs
            .iter()
            .position(|(found, _)| *found == name)
            .map(|index| programs.swap_remove(index).1)
            .ok_or(DatapathError::MissingProgram { name })
    };
    for name in ALL_PROGRAMS {
        queue.push((name, take(name)?));
    }
    let ticks = if measure_tick {
        let name = names::PROG_TICKS;
        let program = take(name)?;
        verify(name, program)?;
        match program {
            Program::RawTracePoint(program) => Some(&*program),
            _ => return Err(DatapathError::ProgramType { name }),
        }
    } else {
        None
    };
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
        let measuring = ticks.map(|program| scope.spawn(|| clock::measure(program)));
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
        })?;
        Ok(measuring.map(|handle| {
            handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        }))
    })
}

/// The tick an earlier agent of this boot measured, kept in the pinned `STALL_TIMING` (bpffs
/// does not outlive a boot); `None` when no element holds one (a new map, or one written by an
/// agent that could not measure).
fn pinned_tick_clock(ebpf: &Ebpf) -> Option<TickClock> {
    let map = ebpf.map(names::MAP_STALL_TIMING)?;
    let timings = aya::maps::Array::<_, StallTiming>::try_from(map).ok()?;
    timings
        .iter()
        .filter_map(Result::ok)
        .find_map(|timing| TickClock::of(&timing))
}

/// Loads one program (the verifier runs here).
fn verify(name: &'static str, program: &mut Program) -> Result<(), DatapathError> {
    match program {
        Program::CgroupSockAddr(program) => program.load(),
        Program::CgroupSock(program) => program.load(),
        Program::CgroupSkb(program) => program.load(),
        Program::RawTracePoint(program) => program.load(),
        _ => return Err(DatapathError::ProgramType { name }),
    }
    .map_err(|source| DatapathError::Verify { name, source })
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut Program, DatapathError> {
    ebpf.program_mut(name)
        .ok_or(DatapathError::MissingProgram { name })
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
            .chain(names::RAW_TRACEPOINT_PROGRAMS.iter())
            .copied()
            .collect();
        let mut attached = expected.clone();
        attached.sort_unstable();
        expected.push(names::PROG_TICKS);
        expected.sort_unstable();
        assert_eq!(programs, expected);
        let mut all = ALL_PROGRAMS.to_vec();
        all.sort_unstable();
        assert_eq!(all, attached, "every program but dns_ticks is attached");
    }
}
