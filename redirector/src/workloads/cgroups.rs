//! Cgroup ids back to paths: an index of the cgroup v2 hierarchy, by a bounded walk of its mount.
//!
//! A cgroup's id is the inode number of its directory (what `bpf_get_current_cgroup_id`
//! reports), and the kernel offers no lookup from id to path that an unprivileged walk does not
//! (`open_by_handle_at` needs `CAP_DAC_READ_SEARCH`), so the index walks the directories and
//! notes each one's inode. Ids are never reused while the machine runs (they are 64-bit and only
//! grow), so a name once found stays true: a cgroup that disappears keeps its name in the index
//! until the walk after the one that saw it gone, for counts read just after a pod ends.

use std::{
    collections::{HashMap, VecDeque},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::sys::cgroup::{self, CgroupError};

/// Bounds of one walk: a node has thousands of cgroups, and the walk must stay a small, steady
/// cost whatever a workload creates below its own cgroup (delegated subtrees are the workload's
/// to fill).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanLimits {
    /// How deep below the root the walk goes (the root is 0).
    pub max_depth: usize,
    /// How many cgroups (directories, the root included) the walk notes at most.
    pub max_cgroups: usize,
}

impl Default for ScanLimits {
    /// Depth 16: a container of a pod is at depth 4 or 5 (crun's `container` child), 8 or so on
    /// a node that is itself a container (kind), and host services at 2 or 3; deeper is a
    /// workload's own nesting. 65,536 cgroups: a full node (250 pods of a few containers each,
    /// and the host's units) is far below it, and a walk of that many takes well under a second.
    fn default() -> Self {
        Self {
            max_depth: 16,
            max_cgroups: 65_536,
        }
    }
}

/// What a walk found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scan {
    /// Each cgroup's id and its path relative to the hierarchy's root (no leading slash; empty
    /// for the root).
    pub paths: HashMap<u64, String>,
    /// Whether a limit stopped the walk before it saw every cgroup.
    pub truncated: bool,
    /// Directories that could not be read or inspected (other than those that disappeared
    /// during the walk, which a node's churn makes ordinary).
    pub unreadable: usize,
}

/// Why a walk could not start.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// The root of the walk could not be read.
    #[error(
        "cannot read the cgroup v2 directory {path}, so cgroups cannot be named; check that the \
         agent sees the host's cgroup v2 hierarchy there (the DaemonSet mounts /sys/fs/cgroup \
         from the host)"
    )]
    Root {
        /// The directory.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

/// Walks the hierarchy mounted at `root`, breadth first (a truncated walk keeps the upper levels,
/// where pods and units are), naming each cgroup by `prefix` (the hierarchy's directory that is
/// mounted at `root`, relative to its root; empty when the whole hierarchy is) joined with its
/// path below `root`.
pub fn scan(root: &Path, prefix: &str, limits: ScanLimits) -> Result<Scan, ScanError> {
    let root_error = |source| ScanError::Root {
        path: root.to_owned(),
        source,
    };
    let root_id = std::fs::metadata(root).map_err(root_error)?.ino();
    // Read here, so that an unreadable root is an error rather than an empty index.
    let root_entries = std::fs::read_dir(root).map_err(root_error)?;
    let prefix = prefix.trim_matches('/').to_owned();
    let mut found = Scan::default();
    found.paths.insert(root_id, prefix.clone());
    let mut queue = VecDeque::from([(root.to_owned(), prefix, 0_usize, Some(root_entries))]);
    while let Some((dir, relative, depth, entries)) = queue.pop_front() {
        let entries = match entries.map_or_else(|| std::fs::read_dir(&dir), Ok) {
            Ok(entries) => entries,
            Err(error) => {
                found.count_unreadable(&error);
                continue;
            }
        };
        for entry in entries {
            let entry = match entry {
                Ok(entry) => entry,
                Err(error) => {
                    found.count_unreadable(&error);
                    break;
                }
            };
            // `file_type` does not follow symbolic links (cgroupfs has none, a test's tree might).
            if !entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                continue;
            }
            if depth >= limits.max_depth {
                found.truncated = true;
                break;
            }
            if found.paths.len() >= limits.max_cgroups {
                // Full: the rest of the queue would only be read to be dropped.
                found.truncated = true;
                return Ok(found);
            }
            let path = entry.path();
            let id = match std::fs::symlink_metadata(&path) {
                Ok(metadata) => metadata.ino(),
                Err(error) => {
                    found.count_unreadable(&error);
                    continue;
                }
            };
            let name = entry.file_name().to_string_lossy().into_owned();
            let child = if relative.is_empty() {
                name
            } else {
                format!("{relative}/{name}")
            };
            found.paths.insert(id, child.clone());
            queue.push_back((path, child, depth + 1, None));
        }
    }
    Ok(found)
}

/// The mount of this machine's cgroup v2 hierarchy: the one of the whole hierarchy, else the
/// first one mountinfo lists.
fn hierarchy_mount() -> Result<cgroup::Cgroup2Mount, CgroupError> {
    let mut mounts = cgroup::mounts()?;
    if mounts.is_empty() {
        return Err(CgroupError::NoCgroup2);
    }
    let whole = mounts
        .iter()
        .position(|mount| mount.root == Path::new("/"))
        .unwrap_or(0);
    Ok(mounts.swap_remove(whole))
}

/// The id of the hierarchy's root cgroup: its directory's inode number, the first kernfs gives.
const ROOT_CGROUP_ID: u64 = 1;

/// The id of every cgroup of this machine, by one walk of a mount of the whole hierarchy (told
/// by its directory's id, which holds also where mountinfo shows the root relative to a cgroup
/// namespace, as in a container); `None` when the walk cannot see all of it (no such mount, a
/// limit reached, a directory it could not read): then no cgroup can be said gone. A cgroup made
/// while the walk runs may be missed: a caller asks only of cgroups it knew before the walk.
#[must_use]
pub fn every_id() -> Option<std::collections::HashSet<u64>> {
    let mounts = cgroup::mounts().ok()?;
    let whole = mounts.iter().find(|mount| {
        std::fs::metadata(&mount.mount_point).is_ok_and(|dir| dir.ino() == ROOT_CGROUP_ID)
    })?;
    let found = scan(&whole.mount_point, "", ScanLimits::default()).ok()?;
    (!found.truncated && found.unreadable == 0).then(|| found.paths.into_keys().collect())
}

impl Scan {
    fn count_unreadable(&mut self, error: &std::io::Error) {
        if error.kind() != std::io::ErrorKind::NotFound {
            self.unreadable += 1;
        }
    }
}

/// The index: cgroup id → path relative to the hierarchy's root. A lookup of an id it does not
/// hold walks the hierarchy again, at most once per `rescan_after`: ids counted by the programs
/// belong to cgroups that exist (or just did), so a miss is most often a cgroup newer than the
/// last walk, and the bound keeps a stream of unknown ids from turning into a stream of walks.
#[derive(Debug)]
pub struct CgroupNames {
    /// Where the hierarchy is mounted.
    root: PathBuf,
    /// The hierarchy's directory mounted there, relative to its root.
    prefix: String,
    limits: ScanLimits,
    rescan_after: Duration,
    /// The last walk's cgroups.
    current: HashMap<u64, String>,
    /// Cgroups the walk before the last saw, and the last did not.
    departed: HashMap<u64, String>,
    /// When the last walk began, whether it succeeded or not.
    scanned_at: Option<Instant>,
    truncated: bool,
    unreadable: usize,
    /// Whether the last walk could not start.
    failing: bool,
}

impl CgroupNames {
    /// An index of the hierarchy mounted at `root`, whose whole tree is mounted there (the
    /// usual `/sys/fs/cgroup`), walked at the first lookup.
    #[must_use]
    pub fn new(root: impl Into<PathBuf>, limits: ScanLimits, rescan_after: Duration) -> Self {
        Self::with_prefix(root, "", limits, rescan_after)
    }

    /// An index of a hierarchy of which `root` shows the directory `prefix` (relative to the
    /// hierarchy's root; a mount from inside a cgroup namespace, or a bind mount), so that paths
    /// are still relative to the hierarchy's root.
    #[must_use]
    pub fn with_prefix(
        root: impl Into<PathBuf>,
        prefix: &str,
        limits: ScanLimits,
        rescan_after: Duration,
    ) -> Self {
        Self {
            root: root.into(),
            prefix: prefix.trim_matches('/').to_owned(),
            limits,
            rescan_after,
            current: HashMap::new(),
            departed: HashMap::new(),
            scanned_at: None,
            truncated: false,
            unreadable: 0,
            failing: false,
        }
    }

    /// An index of this machine's cgroup v2 hierarchy, found in mountinfo as the agent's
    /// attachment point is (the mount of the whole hierarchy, else the first one).
    pub fn open(limits: ScanLimits, rescan_after: Duration) -> Result<Self, CgroupError> {
        let mount = hierarchy_mount()?;
        Ok(Self::with_prefix(
            &mount.mount_point,
            &mount.root.to_string_lossy(),
            limits,
            rescan_after,
        ))
    }

    /// The path of cgroup `id`, relative to the hierarchy's root; walks again first when the id
    /// is unknown and the last walk is `rescan_after` old. An error is a walk that could not
    /// start; the index keeps what it had.
    pub fn path(&mut self, id: u64) -> Result<Option<&str>, ScanError> {
        self.path_at(id, Instant::now())
    }

    /// [`Self::path`], at time `now`.
    pub fn path_at(&mut self, id: u64, now: Instant) -> Result<Option<&str>, ScanError> {
        let known = self.current.contains_key(&id) || self.departed.contains_key(&id);
        let due = self
            .scanned_at
            .is_none_or(|at| now.saturating_duration_since(at) >= self.rescan_after);
        if !known && due {
            self.rescan(now)?;
        }
        Ok(self
            .current
            .get(&id)
            .or_else(|| self.departed.get(&id))
            .map(String::as_str))
    }

    /// Walks the hierarchy now, whatever the last walk's age.
    pub fn rescan(&mut self, now: Instant) -> Result<(), ScanError> {
        // A failed walk counts too: a root that cannot be read is not read again at every miss.
        self.scanned_at = Some(now);
        self.failing = true;
        let found = scan(&self.root, &self.prefix, self.limits)?;
        self.failing = false;
        let mut previous = std::mem::replace(&mut self.current, found.paths);
        previous.retain(|id, _| !self.current.contains_key(id));
        self.departed = previous;
        self.truncated = found.truncated;
        self.unreadable = found.unreadable;
        Ok(())
    }

    /// Whether the last walk could not start (the index holds what an earlier one found).
    #[must_use]
    pub fn failing(&self) -> bool {
        self.failing
    }

    /// Whether the last walk stopped at a limit (some cgroups may stay unnamed).
    #[must_use]
    pub fn truncated(&self) -> bool {
        self.truncated
    }

    /// How many directories the last walk could not read.
    #[must_use]
    pub fn unreadable(&self) -> usize {
        self.unreadable
    }

    /// How many cgroups the index names (the last walk's, and those that just departed).
    #[must_use]
    pub fn len(&self) -> usize {
        self.current.len() + self.departed.len()
    }

    /// Whether the index names no cgroup (before the first walk).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A scratch hierarchy for tests of what reads cgroup paths.
#[cfg(test)]
pub(crate) mod scratch {
    use std::{os::unix::fs::MetadataExt as _, path::PathBuf};

    /// A scratch directory that stands in for the cgroup mount, removed when dropped.
    pub struct Tree(PathBuf);

    impl Tree {
        pub fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("redirector-cgroups-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("a scratch directory");
            Self(dir)
        }

        /// Creates `relative` (and its parents) and returns its id.
        pub fn add(&self, relative: &str) -> u64 {
            let path = self.0.join(relative);
            std::fs::create_dir_all(&path).expect("a directory");
            // Files in a cgroup directory are its interface files: never named.
            std::fs::write(path.join("cgroup.procs"), "").expect("a file");
            self.id(relative)
        }

        pub fn id(&self, relative: &str) -> u64 {
            std::fs::metadata(self.0.join(relative))
                .expect("exists")
                .ino()
        }

        pub fn remove(&self, relative: &str) {
            std::fs::remove_dir_all(self.0.join(relative)).expect("removed");
        }

        /// Its root, where the cgroup mount would be.
        pub fn root(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{scratch::Tree, *};

    #[test]
    fn every_id_holds_the_root_and_this_processs_cgroup() {
        let ids = every_id().expect("a walk of this machine's whole cgroup v2 hierarchy");
        assert!(ids.contains(&ROOT_CGROUP_ID));
        let own = cgroup::own_cgroup().expect("this process's cgroup");
        assert!(ids.contains(&own.id), "{} ({})", own.path.display(), own.id);
    }

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn every_directory_is_named_by_its_inode() {
        let tree = Tree::new("names");
        let service = tree.add("system.slice/containerd.service");
        let container = tree.add("kubepods.slice/kubepods-pod1.slice/cri-containerd-a.scope");
        let found = scan(tree.root(), "", ScanLimits::default()).expect("a walk");
        assert!(!found.truncated);
        assert_eq!(found.unreadable, 0);
        assert_eq!(found.paths[&tree.id("")], "");
        assert_eq!(found.paths[&service], "system.slice/containerd.service");
        assert_eq!(
            found.paths[&container],
            "kubepods.slice/kubepods-pod1.slice/cri-containerd-a.scope"
        );
        assert_eq!(found.paths.len(), 6, "{:?}", found.paths);
    }

    #[test]
    fn a_prefix_makes_paths_relative_to_the_hierarchys_root() {
        let tree = Tree::new("prefix");
        let container = tree.add("cri-containerd-a.scope");
        let found = scan(
            tree.root(),
            "/kubepods.slice/kubepods-pod1.slice/",
            ScanLimits::default(),
        )
        .expect("a walk");
        assert_eq!(
            found.paths[&tree.id("")],
            "kubepods.slice/kubepods-pod1.slice"
        );
        assert_eq!(
            found.paths[&container],
            "kubepods.slice/kubepods-pod1.slice/cri-containerd-a.scope"
        );
    }

    #[test]
    fn the_depth_limit_truncates_and_keeps_the_upper_levels() {
        let tree = Tree::new("depth");
        let deep = tree.add("a/b/c/d");
        let limits = ScanLimits {
            max_depth: 2,
            max_cgroups: 100,
        };
        let found = scan(tree.root(), "", limits).expect("a walk");
        assert!(found.truncated);
        assert_eq!(found.paths[&tree.id("a/b")], "a/b");
        assert!(!found.paths.contains_key(&tree.id("a/b/c")));
        assert!(!found.paths.contains_key(&deep));
        // Exactly deep enough: not truncated.
        let limits = ScanLimits {
            max_depth: 4,
            max_cgroups: 100,
        };
        let found = scan(tree.root(), "", limits).expect("a walk");
        assert!(!found.truncated);
        assert_eq!(found.paths[&deep], "a/b/c/d");
    }

    #[test]
    fn the_count_limit_truncates_breadth_first() {
        let tree = Tree::new("count");
        for top in ["a", "b", "c"] {
            tree.add(&format!("{top}/child"));
        }
        let limits = ScanLimits {
            max_depth: 16,
            max_cgroups: 4,
        };
        let found = scan(tree.root(), "", limits).expect("a walk");
        assert!(found.truncated);
        assert_eq!(found.paths.len(), 4);
        // The root and the three top-level cgroups come before any child.
        for top in ["a", "b", "c"] {
            assert_eq!(found.paths[&tree.id(top)], top);
        }
    }

    #[test]
    fn an_unreadable_root_is_an_error_that_says_where() {
        let error = scan(Path::new("/nonexistent/cgroup"), "", ScanLimits::default())
            .expect_err("no such directory");
        assert!(error.to_string().contains("/nonexistent/cgroup"), "{error}");
        assert!(std::error::Error::source(&error).is_some());
    }

    #[test]
    fn an_unknown_id_rescans_at_most_once_per_interval() {
        let tree = Tree::new("rescan");
        let first = tree.add("system.slice/a.service");
        let mut names = CgroupNames::new(tree.root(), ScanLimits::default(), MINUTE);
        assert!(names.is_empty());
        let start = Instant::now();
        // The first lookup walks.
        assert_eq!(
            names.path_at(first, start).expect("a walk"),
            Some("system.slice/a.service")
        );
        let second = tree.add("system.slice/b.service");
        // A miss within the interval does not walk again.
        assert_eq!(
            names.path_at(second, start + MINUTE / 2).expect("no walk"),
            None
        );
        // A known id never walks, whatever the last walk's age.
        assert_eq!(
            names.path_at(first, start + MINUTE).expect("no walk"),
            Some("system.slice/a.service")
        );
        assert_eq!(names.scanned_at, Some(start));
        // A miss after the interval does.
        assert_eq!(
            names.path_at(second, start + MINUTE).expect("a walk"),
            Some("system.slice/b.service")
        );
        // The interval counts from that walk.
        let third = tree.add("system.slice/c.service");
        assert_eq!(
            names
                .path_at(third, start + MINUTE * 3 / 2)
                .expect("no walk"),
            None
        );
        assert_eq!(
            names.path_at(third, start + MINUTE * 2).expect("a walk"),
            Some("system.slice/c.service")
        );
    }

    #[test]
    fn a_departed_cgroup_keeps_its_name_for_one_more_walk() {
        let tree = Tree::new("departed");
        let gone = tree.add("kubepods/pod1/abc");
        let mut names = CgroupNames::new(tree.root(), ScanLimits::default(), Duration::ZERO);
        let now = Instant::now();
        names.rescan(now).expect("a walk");
        tree.remove("kubepods/pod1/abc");
        names.rescan(now).expect("a walk");
        assert_eq!(
            names.path_at(gone, now).expect("known"),
            Some("kubepods/pod1/abc")
        );
        names.rescan(now).expect("a walk");
        assert_eq!(names.path_at(gone, now).expect("a walk"), None);
    }

    #[test]
    fn a_failed_walk_keeps_the_index_and_waits_its_interval() {
        let tree = Tree::new("failed");
        let known = tree.add("system.slice/a.service");
        let mut names = CgroupNames::new(
            tree.root().join("system.slice"),
            ScanLimits::default(),
            MINUTE,
        );
        let start = Instant::now();
        names.rescan(start).expect("a walk");
        tree.remove("system.slice");
        let error = names
            .path_at(u64::MAX, start + MINUTE)
            .expect_err("the root is gone");
        assert!(matches!(error, ScanError::Root { .. }));
        assert!(names.failing());
        // Still named, and the next miss within the interval does not try again.
        assert_eq!(
            names.path_at(known, start + MINUTE).expect("known"),
            Some("a.service")
        );
        assert_eq!(
            names
                .path_at(u64::MAX, start + MINUTE * 3 / 2)
                .expect("no walk"),
            None
        );
    }

    /// This machine's hierarchy names this process's own cgroup as /proc/self/cgroup writes it
    /// (reading the hierarchy needs no privilege).
    #[test]
    fn this_machines_hierarchy_names_this_processs_cgroup() {
        let own = std::fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
        let written = own
            .lines()
            .find_map(|line| line.strip_prefix("0::"))
            .expect("this process is in a cgroup v2 hierarchy (a `0::` line)")
            .trim();
        let mut names =
            CgroupNames::open(ScanLimits::default(), MINUTE).expect("a cgroup v2 mount");
        let mount = names.root.clone();
        let id = std::fs::metadata(mount.join(written.trim_start_matches('/')))
            .unwrap_or_else(|error| panic!("{written} below {}: {error}", mount.display()))
            .ino();
        assert_eq!(
            names.path(id).expect("a walk"),
            Some(written.trim_matches('/')),
            "the cgroup of this process in {}",
            mount.display()
        );
        // And the cgroups right below the root, whoever's they are, by their names.
        for entry in std::fs::read_dir(&mount).expect("the mount") {
            let entry = entry.expect("an entry");
            if !entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                continue;
            }
            let Ok(metadata) = entry.metadata() else {
                continue; // gone since
            };
            let expected = Path::new(&names.prefix).join(entry.file_name());
            assert_eq!(
                names.path(metadata.ino()).expect("a walk").map(Path::new),
                Some(expected.as_path())
            );
        }
    }
}
