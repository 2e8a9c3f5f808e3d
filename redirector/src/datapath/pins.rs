//! The pin directory, and what a start does with each map pinned in it.
//!
//! - `maps/NAME`: the maps the attached programs use.
//! - `maps-next/NAME`: maps a start is creating beside them (a map this release has and the
//!   pins lack, or one of another size), moved into `maps/` once the start's programs run.
//! - `links/PROGRAM-0` or `links/PROGRAM-1`: every attachment (bpf_link).
//!
//! A start plans first ([`plan`]) and changes nothing that runs until its programs are loaded,
//! verified and filled: a pinned map of the same shape is reused as it is; any other is created
//! in `maps-next/`, filled from the pinned one (`migrate`), and only moved over it after the
//! links run the new programs. A start that fails before that removes `maps-next/` and leaves the
//! running set as it was.

use std::path::{Path, PathBuf};

use aya::maps::{Array, Map, MapData, MapInfo};
use redirector_common::{datapath::DatapathConfig, names};
use tracing::warn;

use super::{
    DatapathError, OBJECT,
    layout::{self, MIN_ADOPTABLE_LAYOUT, SK_STORAGE},
};

/// Sub-directory of the pin directory holding the maps in use.
pub(super) const MAPS_DIR: &str = "maps";
/// Sub-directory holding the maps a start creates beside them (bpffs refuses names with dots).
pub(super) const STAGED_MAPS_DIR: &str = "maps-next";
/// Sub-directory holding the attachments (bpf links).
pub(super) const LINKS_DIR: &str = "links";

/// What a start does with one map of its object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapAction {
    /// The pinned map has this object's shape: the new programs use it as it is.
    Reuse,
    /// The pinned map differs (`why`): a new one is created beside it and filled from it.
    Migrate {
        /// How it differs.
        why: String,
    },
    /// Nothing pinned: created (and filled by the agent, like on a first start).
    Create,
    /// The pinned map differs in more than its size (`why`): pins this release cannot read,
    /// which the layout rule rules out from layout 5 on.
    Unreadable {
        /// How it differs.
        why: String,
    },
}

/// The start's plan for the pin directory.
#[derive(Clone, Debug)]
pub struct Plan {
    /// One action per map of the object, in `names::ALL_MAPS` order.
    pub maps: Vec<(&'static str, MapAction)>,
    /// Pinned maps this object does not define (a newer release's, or one a later release
    /// retired): unpinned once this start's programs run.
    pub unknown: Vec<String>,
    /// Whether attachments are pinned (programs run on these maps).
    pub attached: bool,
    /// The layout version the pins record (`None`: nothing pinned, or unreadable).
    pub layout: Option<u32>,
}

/// Whether the pins can be adopted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing pinned: a first start.
    Empty,
    /// Adopt them as the plan says.
    Adopt,
    /// Maps that no program uses and that this agent cannot adopt (a start of an old release
    /// that failed before it attached): removing them loses nothing.
    Stale,
    /// Programs run on pins of a layout from before the compatibility rule (or none readable).
    Refused,
}

impl Plan {
    /// Whether the pins can be adopted.
    #[must_use]
    pub fn verdict(&self) -> Verdict {
        let any_pinned = self.attached
            || self.unknown.len() + self.count(|action| *action != MapAction::Create) > 0;
        if !any_pinned {
            return Verdict::Empty;
        }
        let readable = self.count(|action| matches!(action, MapAction::Unreadable { .. })) == 0;
        match self.layout {
            Some(layout) if layout >= MIN_ADOPTABLE_LAYOUT && readable => Verdict::Adopt,
            _ if self.attached => Verdict::Refused,
            _ => Verdict::Stale,
        }
    }

    /// How many maps the plan acts on as `which` says.
    #[must_use]
    pub fn count(&self, which: impl Fn(&MapAction) -> bool) -> usize {
        self.maps.iter().filter(|(_, action)| which(action)).count()
    }

    /// The maps that migrate (`unreadable`: that cannot be read), with why, for the log.
    #[must_use]
    pub fn differences(&self, unreadable: bool) -> String {
        let mut text = String::new();
        for (name, action) in &self.maps {
            let why = match action {
                MapAction::Migrate { why } if !unreadable => why,
                MapAction::Unreadable { why } if unreadable => why,
                _ => continue,
            };
            if !text.is_empty() {
                text.push_str("; ");
            }
            text.push_str(name);
            text.push_str(": ");
            text.push_str(why);
        }
        text
    }

    /// Where the new object finds (or creates and pins) `name`.
    #[must_use]
    pub fn pin_path(&self, pin_dir: &Path, name: &str) -> PathBuf {
        let reused = self
            .maps
            .iter()
            .any(|(planned, action)| *planned == name && *action == MapAction::Reuse);
        pin_dir
            .join(if reused { MAPS_DIR } else { STAGED_MAPS_DIR })
            .join(name)
    }
}

/// The entries of the maps whose size is a setting; every other map has the object's.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MapSizes {
    /// `REVERSE_NAT` (`reverse_nat_entries`).
    pub reverse_nat: u32,
    /// `WORKLOADS` (`workloads.tracked`).
    pub workloads: u32,
}

impl MapSizes {
    /// The configured entries of map `name`, if the configuration sizes it.
    #[must_use]
    pub fn of(&self, name: &str) -> Option<u32> {
        match name {
            names::MAP_REVERSE_NAT => Some(self.reverse_nat),
            names::MAP_WORKLOADS => Some(self.workloads),
            _ => None,
        }
    }
}

/// Looks at the pins under `pin_dir` and decides, for every map of the object, whether the new
/// programs reuse the pinned map, migrate it into a new one, or create it. First settles what an
/// earlier start left in `maps-next/` (see [`settle_staged`]), so the plan is made on the maps in
/// use. `sizes` gives the maps the configuration sizes their entries; `migrate_all` migrates
/// every map that can be (a test's stand-in for a release whose layout differs everywhere).
pub fn plan(pin_dir: &Path, sizes: MapSizes, migrate_all: bool) -> Result<Plan, DatapathError> {
    settle_staged(pin_dir)?;
    let maps_dir = pin_dir.join(MAPS_DIR);
    let object =
        aya_obj::Object::parse(OBJECT).map_err(|source| DatapathError::Object { source })?;
    let mut maps = Vec::with_capacity(names::ALL_MAPS.len());
    for name in names::ALL_MAPS {
        let path = maps_dir.join(name);
        if !path.exists() {
            maps.push((name, MapAction::Create));
            continue;
        }
        let defined = object
            .maps
            .get(name)
            .ok_or(DatapathError::MissingMap { name })?;
        let pinned = MapInfo::from_pin(&path)
            .map_err(|source| DatapathError::InspectPin { path, source })?;
        let max_entries = sizes.of(name).unwrap_or_else(|| defined.max_entries());
        let pinned_type = pinned.map_type().map_or(u32::MAX, |kind| kind as u32);
        let mut differences = Vec::new();
        for (field, pinned, expected) in [
            ("type", pinned_type, defined.map_type()),
            ("key size", pinned.key_size(), defined.key_size()),
            ("value size", pinned.value_size(), defined.value_size()),
            ("max entries", pinned.max_entries(), max_entries),
            ("flags", pinned.map_flags(), defined.map_flags()),
        ] {
            if pinned != expected {
                differences.push(format!("{field} {pinned} where {expected} is needed"));
            }
        }
        let action = if differences.is_empty() {
            if migrate_all && defined.map_type() != SK_STORAGE {
                MapAction::Migrate {
                    why: "every map migrates (REDIRECTOR_TEST_LAYOUT_BUMP)".to_owned(),
                }
            } else {
                MapAction::Reuse
            }
        } else if differences.len() == 1 && pinned.max_entries() != max_entries {
            MapAction::Migrate {
                why: differences.join(", "),
            }
        } else {
            // Only the number of entries of a released name ever changes (the layout rule):
            // anything else is pins this release cannot read.
            MapAction::Unreadable {
                why: differences.join(", "),
            }
        };
        maps.push((name, action));
    }
    let unknown = pinned_names(&maps_dir)
        .into_iter()
        .filter(|name| !names::ALL_MAPS.contains(&name.as_str()))
        .collect();
    let layout = pinned_layout(pin_dir);
    Ok(Plan {
        maps,
        unknown,
        attached: has_pinned_attachments(pin_dir),
        layout,
    })
}

/// The layout the agent that pinned the maps under `pin_dir` recorded (`DatapathConfig`'s
/// `layout_version`, a map every layout has kept as it is); `None` when it cannot be read.
#[must_use]
pub fn pinned_layout(pin_dir: &Path) -> Option<u32> {
    MapData::from_pin(pin_dir.join(MAPS_DIR).join(names::MAP_DATAPATH_CONFIG))
        .and_then(Map::from_map_data)
        .and_then(Array::<MapData, DatapathConfig>::try_from)
        .and_then(|config| config.get(&0, 0))
        .map(|config| config.layout_version)
        .ok()
}

/// The names of the pins in `dir` (none if it does not exist).
pub(super) fn pinned_names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|entry| entry.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Removes what an earlier start left in `maps-next/`, unless the attached programs use it: a
/// start killed after its programs ran and before it moved their maps into `maps/` left those
/// maps there, and they are the ones in use, so they are moved into `maps/` now.
pub fn settle_staged(pin_dir: &Path) -> Result<(), DatapathError> {
    let staged_dir = pin_dir.join(STAGED_MAPS_DIR);
    let staged = pinned_names(&staged_dir);
    if staged.is_empty() {
        return remove_dir_if_empty(&staged_dir);
    }
    let in_use = attached_map_ids(pin_dir);
    for name in staged {
        let path = staged_dir.join(&name);
        let used = MapInfo::from_pin(&path).is_ok_and(|info| in_use.contains(&info.id()));
        if used {
            warn!(map = %name, "an earlier start was stopped after its programs ran and before it moved their maps into place; moving them now");
            rename(&path, &pin_dir.join(MAPS_DIR).join(&name))?;
        } else {
            remove_file_if_present(&path)?;
        }
    }
    remove_dir_if_empty(&staged_dir)
}

/// The ids of every map the programs attached through the pins under `pin_dir` use.
fn attached_map_ids(pin_dir: &Path) -> Vec<u32> {
    let programs: Vec<u32> = super::pinned_program_ids(pin_dir)
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter(|program| programs.contains(&program.id()))
        .filter_map(|program| program.map_ids().ok().flatten())
        .flatten()
        .collect()
}

/// Moves a pin (bpffs renames within one filesystem, replacing the target).
pub(super) fn rename(from: &Path, to: &Path) -> Result<(), DatapathError> {
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir).map_err(|source| DatapathError::PinDir {
            path: dir.to_owned(),
            source,
        })?;
    }
    std::fs::rename(from, to).map_err(|source| DatapathError::PinDir {
        path: to.to_owned(),
        source,
    })
}

/// The two pin paths an attachment of `program` may have.
pub(super) fn link_slots(pin_dir: &Path, program: &str) -> [PathBuf; 2] {
    let dir = pin_dir.join(LINKS_DIR);
    [
        dir.join(format!("{program}-0")),
        dir.join(format!("{program}-1")),
    ]
}

/// True when a link pinned under `pin_dir` attaches a steering program (`connect`, `sendmsg`,
/// `recvmsg`, `getpeername`) to a cgroup: DNS is steered through these pins. Read from the links
/// themselves (their fdinfo's cgroup, 5.8), not assumed from the pin's presence: a cgroup link
/// whose cgroup is gone shows 0. The other links steer nothing (the signal program's tracing
/// link, the `cgroup_skb` programs, which only note or refuse what the steering programs
/// decided), and another release's uninstall may leave those of a newer one behind.
#[must_use]
pub fn has_pinned_attachments(pin_dir: &Path) -> bool {
    let links = pin_dir.join(LINKS_DIR);
    pinned_names(&links).iter().any(|name| {
        // A link is pinned as its program's name and a slot (`link_slots`).
        let program = name
            .rsplit_once('-')
            .map_or(name.as_str(), |(program, _)| program);
        names::SOCK_ADDR_PROGRAMS.contains(&program)
            && super::raw::open_pinned(&links.join(name))
                .ok()
                .and_then(super::raw::link_cgroup_id)
                .is_some_and(|cgroup| cgroup != 0)
    })
}

/// True when anything is pinned under `pin_dir`: a map or a link, of this release or another.
#[must_use]
pub fn has_pins(pin_dir: &Path) -> bool {
    [MAPS_DIR, STAGED_MAPS_DIR, LINKS_DIR]
        .iter()
        .any(|dir| !pinned_names(&pin_dir.join(dir)).is_empty())
}

/// How deep below its bpf filesystem's root another set of pins is looked for.
const OTHER_SETS_DEPTH: usize = 3;

/// Other redirector pin sets on the bpf filesystem of `pin_dir` whose programs are still
/// attached: what a changed `pin_dir` leaves steering DNS on state no agent updates (its
/// attachments are pinned there, not here, so neither the new agent nor `uninstall` of this
/// configuration touches them). A set is a directory with pinned attachments and a pinned
/// `LISTENERS` map, at most `OTHER_SETS_DEPTH` levels below the mount's root (deeper ones are
/// not looked for).
#[must_use]
pub fn other_attached_sets(pin_dir: &Path) -> Vec<PathBuf> {
    let on_bpffs = |path: &Path| {
        nix::sys::statfs::statfs(path)
            .is_ok_and(|stat| stat.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
    };
    let Ok(ours) = pin_dir.canonicalize() else {
        return Vec::new();
    };
    // The root of the mount: the highest directory still on a bpf filesystem.
    let mut root = ours.clone();
    while let Some(parent) = root.parent() {
        if !on_bpffs(parent) {
            break;
        }
        root = parent.to_owned();
    }
    let mut found = Vec::new();
    let mut pending = vec![(root, 0)];
    while let Some((dir, depth)) = pending.pop() {
        if dir != ours
            && has_pinned_attachments(&dir)
            && dir.join(MAPS_DIR).join(names::MAP_LISTENERS).exists()
        {
            found.push(dir.clone());
        }
        if depth == OTHER_SETS_DEPTH || dir == ours {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                pending.push((entry.path(), depth + 1));
            }
        }
    }
    found.sort();
    found
}

/// Removes every pin under `pin_dir` (maps in use and staged, and attachments, this release's
/// and any other's), then the directories when empty. Unpinning an attachment detaches its
/// program; the maps go with the last program or process holding them.
pub fn remove_pins(pin_dir: &Path) -> Result<(), DatapathError> {
    for dir in [LINKS_DIR, MAPS_DIR, STAGED_MAPS_DIR] {
        let dir = pin_dir.join(dir);
        for name in pinned_names(&dir) {
            remove_file_if_present(&dir.join(name))?;
        }
    }
    for path in [
        pin_dir.join(LINKS_DIR),
        pin_dir.join(MAPS_DIR),
        pin_dir.join(STAGED_MAPS_DIR),
        pin_dir.to_owned(),
    ] {
        remove_dir_if_empty(&path)?;
    }
    Ok(())
}

/// Removes `path` if it is an empty directory; leaves it (with a warning) if it holds files of
/// someone else.
pub(super) fn remove_dir_if_empty(path: &Path) -> Result<(), DatapathError> {
    match std::fs::remove_dir(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) if error.raw_os_error() == Some(libc::ENOTEMPTY) => {
            warn!(path = %path.display(), "left a directory that holds files of someone else");
            Ok(())
        }
        Err(source) => Err(DatapathError::PinDir {
            path: path.to_owned(),
            source,
        }),
    }
}

pub(super) fn remove_file_if_present(path: &Path) -> Result<(), DatapathError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DatapathError::PinDir {
            path: path.to_owned(),
            source,
        }),
    }
}

/// The released row's kind of `name`, for the log of what a start retires.
#[must_use]
pub fn retired_kind(name: &str) -> &'static str {
    match layout::released_map(name).map(|row| row.kind) {
        Some(layout::Kind::Config) => "configuration",
        Some(layout::Kind::Kept) => "state",
        None => "a newer release's",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_pin_directory_is_a_first_start() {
        let dir = std::env::temp_dir().join(format!("redirector-pins-{}", std::process::id()));
        let sizes = MapSizes {
            reverse_nat: 65_536,
            workloads: 4096,
        };
        let plan = plan(&dir, sizes, false).expect("nothing to inspect");
        assert_eq!(plan.verdict(), Verdict::Empty);
        assert_eq!(
            plan.count(|action| *action == MapAction::Create),
            names::ALL_MAPS.len()
        );
        assert!(
            plan.pin_path(&dir, names::MAP_POOLS)
                .ends_with("maps-next/POOLS")
        );
    }

    fn plan_of(layout: Option<u32>, attached: bool) -> Plan {
        Plan {
            maps: vec![(names::MAP_POOLS, MapAction::Reuse)],
            unknown: Vec::new(),
            attached,
            layout,
        }
    }

    #[test]
    fn pins_of_the_rule_are_adopted_whatever_their_release() {
        assert_eq!(plan_of(Some(5), true).verdict(), Verdict::Adopt);
        assert_eq!(plan_of(Some(97), true).verdict(), Verdict::Adopt);
        assert_eq!(plan_of(Some(4), true).verdict(), Verdict::Refused);
        assert_eq!(plan_of(None, true).verdict(), Verdict::Refused);
        assert_eq!(plan_of(Some(4), false).verdict(), Verdict::Stale);
    }
}
