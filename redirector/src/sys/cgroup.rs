//! cgroup v2 directories: finding the hierarchy, and the id and level of a directory in it.

use std::{
    os::unix::fs::MetadataExt as _,
    path::{Component, Path, PathBuf},
};

/// Where the kernel lists this process's mounts.
const MOUNTINFO: &str = "/proc/self/mountinfo";

/// A cgroup v2 directory, resolved.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Cgroup {
    /// The directory.
    pub path: PathBuf,
    /// Its id: the inode number of the directory, as `bpf_get_current_cgroup_id` reports it.
    pub id: u64,
    /// Its depth in the hierarchy (the root is 0), as `bpf_get_current_ancestor_cgroup_id` counts.
    pub level: u32,
}

/// A cgroup v2 mount from mountinfo.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Cgroup2Mount {
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Which directory of the hierarchy appears there (`/` unless mounted from inside a cgroup
    /// namespace or a bind mount).
    pub root: PathBuf,
}

/// Why a cgroup could not be used. `path` is the cgroup's directory.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// mountinfo (or /proc/self/cgroup) could not be read.
    #[error("cannot read {MOUNTINFO} or /proc/self/cgroup")]
    Mountinfo {
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// No cgroup2 filesystem is mounted: a cgroup v1-only host.
    #[error(
        "no cgroup v2 hierarchy is mounted (this host runs cgroup v1 only); redirector attaches to \
         cgroup v2: boot with systemd.unified_cgroup_hierarchy=1, or mount one with \
         `mount -t cgroup2 none /sys/fs/cgroup/unified`"
    )]
    NoCgroup2,
    /// The directory does not exist.
    #[error("{key}: the cgroup directory {path} does not exist; create it or fix the path")]
    Missing {
        /// The configuration key that named it.
        key: String,
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The directory is not on a cgroup2 filesystem.
    #[error(
        "{key}: {path} is not a cgroup v2 directory (a cgroup v1 controller, or no cgroup at all); \
         give a directory under the cgroup v2 mount{hint}"
    )]
    NotCgroup2 {
        /// The configuration key that named it.
        key: String,
        path: PathBuf,
        /// Where the cgroup v2 hierarchy is, when known.
        hint: String,
    },
    /// statfs failed.
    #[error("{key}: cannot inspect {path}")]
    Statfs {
        /// The configuration key that named it.
        key: String,
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: nix::Error,
    },
}

/// Parses mountinfo text and returns its cgroup2 mounts, in order.
#[must_use]
pub fn cgroup2_mounts(mountinfo: &str) -> Vec<Cgroup2Mount> {
    mountinfo
        .lines()
        .filter_map(|line| {
            // `ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER`
            let (before, after) = line.split_once(" - ")?;
            let fstype = after.split_whitespace().next()?;
            if fstype != "cgroup2" {
                return None;
            }
            let mut fields = before.split_whitespace();
            let root = fields.nth(3)?;
            let mount_point = fields.next()?;
            Some(Cgroup2Mount {
                mount_point: PathBuf::from(unescape_mountinfo(mount_point)),
                root: PathBuf::from(unescape_mountinfo(root)),
            })
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo` (three octal digits).
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let octal = bytes.get(index + 1..index + 4).filter(|digits| {
            bytes[index] == b'\\' && digits.iter().all(|digit| (b'0'..=b'7').contains(digit))
        });
        if let Some(digits) = octal {
            let value = digits
                .iter()
                .fold(0u32, |value, digit| value * 8 + u32::from(digit - b'0'));
            out.push(value as u8);
            index += 4;
        } else {
            out.push(bytes[index]);
            index += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup v2 mounts of this process.
pub fn mounts() -> Result<Vec<Cgroup2Mount>, CgroupError> {
    let text =
        std::fs::read_to_string(MOUNTINFO).map_err(|source| CgroupError::Mountinfo { source })?;
    Ok(cgroup2_mounts(&text))
}

/// The directory programs attach to by default: the root of the cgroup v2 hierarchy
/// (`/sys/fs/cgroup` on a pure v2 host, `/sys/fs/cgroup/unified` on a hybrid one).
pub fn default_attach_cgroup() -> Result<PathBuf, CgroupError> {
    let mounts = mounts()?;
    mounts
        .iter()
        .find(|mount| mount.root == Path::new("/"))
        .or_else(|| mounts.first())
        .map(|mount| mount.mount_point.clone())
        .ok_or(CgroupError::NoCgroup2)
}

/// The cgroup v2 directory this process belongs to (from `/proc/self/cgroup`).
pub fn own_cgroup() -> Result<Cgroup, CgroupError> {
    let text = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|source| CgroupError::Mountinfo { source })?;
    let relative = text
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .ok_or(CgroupError::NoCgroup2)?;
    let mounts = mounts()?;
    let mount = mounts
        .iter()
        .find(|mount| mount.root == Path::new("/"))
        .or_else(|| mounts.first())
        .ok_or(CgroupError::NoCgroup2)?;
    let path = mount
        .mount_point
        .join(relative.trim().trim_start_matches('/'));
    // In a cgroup namespace of its own (a container's, by default on cgroup v2), the process
    // sees its cgroup as "/": then the hierarchy mounted from the host is searched for the
    // cgroup that really lists it.
    let pid = std::process::id();
    let path = if lists(&path, pid) {
        path
    } else {
        find_listing(&mount.mount_point, pid).unwrap_or(path)
    };
    Cgroup::resolve_with("the agent's own cgroup", &path, &mounts)
}

/// The cgroup v2 id of process `pid` (the inode of its cgroup's directory, which
/// `bpf_get_current_cgroup_id` returns in its context), from `/proc/PID/cgroup` on the
/// hierarchy the agent sees; a process listed elsewhere (the agent in a cgroup namespace of its
/// own) is looked for below the mount. `None` when it cannot be told (the process is gone).
#[must_use]
pub fn id_of_process(pid: u32) -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let relative = text.lines().find_map(|line| line.strip_prefix("0::"))?;
    let mounts = mounts().ok()?;
    let mount = mounts
        .iter()
        .find(|mount| mount.root == Path::new("/"))
        .or_else(|| mounts.first())?;
    let path = mount
        .mount_point
        .join(relative.trim().trim_start_matches('/'));
    let path = if lists(&path, pid) {
        path
    } else {
        find_listing(&mount.mount_point, pid)?
    };
    std::fs::metadata(path).ok().map(|metadata| metadata.ino())
}

/// Whether the cgroup at `path` lists process `pid` in `cgroup.procs`.
fn lists(path: &Path, pid: u32) -> bool {
    std::fs::read_to_string(path.join("cgroup.procs"))
        .is_ok_and(|procs| procs.lines().any(|line| line.trim().parse() == Ok(pid)))
}

/// The cgroup below `root` whose `cgroup.procs` lists `pid` (a breadth-first walk, bounded).
fn find_listing(root: &Path, pid: u32) -> Option<PathBuf> {
    const MAX_CGROUPS: usize = 100_000;
    let mut queue = std::collections::VecDeque::from([root.to_owned()]);
    let mut seen = 0;
    while let Some(dir) = queue.pop_front() {
        seen += 1;
        if seen > MAX_CGROUPS {
            return None;
        }
        if lists(&dir, pid) {
            return Some(dir);
        }
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        queue.extend(
            entries
                .filter_map(Result::ok)
                .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
                .map(|entry| entry.path()),
        );
    }
    None
}

impl Cgroup {
    /// Resolves the cgroup v2 directory `path`, named by configuration key `key`.
    pub fn resolve(key: &str, path: &Path) -> Result<Self, CgroupError> {
        let mounts = mounts()?;
        Self::resolve_with(key, path, &mounts)
    }

    fn resolve_with(key: &str, path: &Path, mounts: &[Cgroup2Mount]) -> Result<Self, CgroupError> {
        let metadata = std::fs::metadata(path).map_err(|source| CgroupError::Missing {
            key: key.to_owned(),
            path: path.to_owned(),
            source,
        })?;
        let statfs = nix::sys::statfs::statfs(path).map_err(|source| CgroupError::Statfs {
            key: key.to_owned(),
            path: path.to_owned(),
            source,
        })?;
        let not_cgroup2 = || {
            if mounts.is_empty() {
                return CgroupError::NoCgroup2;
            }
            CgroupError::NotCgroup2 {
                key: key.to_owned(),
                path: path.to_owned(),
                hint: mounts
                    .first()
                    .map(|mount| format!(" ({})", mount.mount_point.display()))
                    .unwrap_or_default(),
            }
        };
        if statfs.filesystem_type() != nix::sys::statfs::CGROUP2_SUPER_MAGIC || !metadata.is_dir() {
            return Err(not_cgroup2());
        }
        let canonical = path.canonicalize().map_err(|source| CgroupError::Missing {
            key: key.to_owned(),
            path: path.to_owned(),
            source,
        })?;
        // The deepest cgroup2 mount containing the directory decides its level.
        let (mount, relative) = mounts
            .iter()
            .filter_map(|mount| {
                canonical
                    .strip_prefix(&mount.mount_point)
                    .ok()
                    .map(|relative| (mount, relative.to_owned()))
            })
            .max_by_key(|(mount, _)| mount.mount_point.components().count())
            .ok_or_else(not_cgroup2)?;
        let level = depth(&mount.root) + depth(&relative);
        Ok(Self {
            path: canonical,
            id: metadata.ino(),
            level,
        })
    }
}

fn depth(path: &Path) -> u32 {
    path.components()
        .filter(|component| matches!(component, Component::Normal(_)))
        .count() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
32 31 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
33 31 0:28 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,xattr,name=systemd
";
    const V1_ONLY: &str = "\
31 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
33 31 0:28 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,xattr,name=systemd
34 31 0:29 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:12 - cgroup cgroup rw,memory
";
    const NAMESPACED: &str = "\
1200 1100 0:27 /kubepods.slice/pod1 /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw
";

    #[test]
    fn finds_the_v2_mount_of_a_hybrid_host() {
        assert_eq!(
            cgroup2_mounts(HYBRID),
            vec![Cgroup2Mount {
                mount_point: PathBuf::from("/sys/fs/cgroup/unified"),
                root: PathBuf::from("/"),
            }]
        );
    }

    #[test]
    fn a_v1_only_host_has_no_v2_mount() {
        assert!(cgroup2_mounts(V1_ONLY).is_empty());
    }

    #[test]
    fn keeps_the_root_of_a_namespaced_mount() {
        let mounts = cgroup2_mounts(NAMESPACED);
        assert_eq!(mounts[0].root, PathBuf::from("/kubepods.slice/pod1"));
        assert_eq!(depth(&mounts[0].root), 2);
    }

    #[test]
    fn unescapes_spaces_in_mount_points() {
        let mounts = cgroup2_mounts("1 2 0:1 / /mnt/my\\040cgroup rw - cgroup2 cgroup2 rw\n");
        assert_eq!(mounts[0].mount_point, PathBuf::from("/mnt/my cgroup"));
    }

    #[test]
    fn a_missing_directory_is_named_with_its_key() {
        let error = Cgroup::resolve_with(
            "listener[0].skip_cgroups[0]",
            Path::new("/nonexistent/cg"),
            &[],
        )
        .unwrap_err();
        assert!(matches!(error, CgroupError::Missing { .. }));
        assert!(error.to_string().starts_with(
            "listener[0].skip_cgroups[0]: the cgroup directory /nonexistent/cg does not exist"
        ));
    }

    #[test]
    fn a_directory_outside_cgroup2_is_refused() {
        let mounts = cgroup2_mounts(HYBRID);
        let error = Cgroup::resolve_with("cgroup", Path::new("/tmp"), &mounts).unwrap_err();
        assert!(matches!(error, CgroupError::NotCgroup2 { .. }), "{error}");
        assert!(error.to_string().contains("/sys/fs/cgroup/unified"));
    }

    #[test]
    fn without_any_v2_mount_the_refusal_says_v1_only() {
        let error = Cgroup::resolve_with("cgroup", Path::new("/tmp"), &cgroup2_mounts(V1_ONLY))
            .unwrap_err();
        assert!(matches!(error, CgroupError::NoCgroup2), "{error}");
        assert!(error.to_string().contains("cgroup v1 only"));
    }
}
