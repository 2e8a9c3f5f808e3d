//! The few bpf(2) commands aya 0.14 does not offer for our purpose: a map's entries as bytes of
//! the sizes the kernel reports (to copy a map of any type into its successor without a Rust type
//! per map), a pinned object's descriptor, and `BPF_LINK_UPDATE` on a cgroup link (5.7), which
//! aya performs only for its XDP and tc links.

use std::{
    ffi::CString,
    os::fd::{AsFd, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::Path,
};

use aya_obj::generated::{bpf_cmd, bpf_map_type};

/// `BPF_ANY`: create or update.
pub const BPF_ANY: u64 = aya_obj::generated::BPF_ANY as u64;
/// `BPF_NOEXIST`: create only.
pub const BPF_NOEXIST: u64 = aya_obj::generated::BPF_NOEXIST as u64;

/// The `bpf_attr` member of the element commands.
#[repr(C)]
#[derive(Default)]
struct ElemAttr {
    map_fd: u32,
    _padding: u32,
    key: u64,
    /// `value`, or `next_key` for `BPF_MAP_GET_NEXT_KEY`.
    value: u64,
    flags: u64,
}

/// The `bpf_attr` member of `BPF_OBJ_GET`.
#[repr(C)]
#[derive(Default)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    _padding: u32,
}

/// The head of the `bpf_attr` member of `BPF_MAP_CREATE` (the kernel zero-extends the rest).
#[repr(C)]
#[derive(Default)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

/// The `bpf_attr` member of `BPF_LINK_UPDATE`.
#[repr(C)]
#[derive(Default)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

fn sys_bpf<T>(command: bpf_cmd, attr: &mut T) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised `bpf_attr` member of the size passed; the kernel
    // reads (and for lookups writes through) the pointers it holds, which the callers keep
    // alive and sized as the map's key and value sizes.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command as libc::c_long,
            std::ptr::from_mut(attr).cast::<libc::c_void>(),
            size_of::<T>(),
        )
    };
    if result < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// A path for the kernel.
fn c_path(path: &Path) -> std::io::Result<CString> {
    use std::os::unix::ffi::OsStrExt as _;
    CString::new(path.as_os_str().as_bytes())
        .map_err(|error| std::io::Error::new(std::io::ErrorKind::InvalidInput, error))
}

/// The descriptor a bpf(2) command returned, owned.
fn owned(fd: libc::c_long) -> std::io::Result<OwnedFd> {
    let fd = i32::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A map's key after `key` (the first with `None`), or `None` past the last.
pub fn next_key(
    map: BorrowedFd<'_>,
    key: Option<&[u8]>,
    key_size: usize,
) -> std::io::Result<Option<Vec<u8>>> {
    let mut next = vec![0u8; key_size];
    let mut attr = ElemAttr {
        map_fd: map.as_raw_fd().cast_unsigned(),
        key: key.map_or(0, |key| key.as_ptr() as u64),
        value: next.as_mut_ptr() as u64,
        ..ElemAttr::default()
    };
    match sys_bpf(bpf_cmd::BPF_MAP_GET_NEXT_KEY, &mut attr) {
        Ok(_) => Ok(Some(next)),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The value under `key` into `value` (sized as the kernel copies it: for a per-CPU map, the
/// value rounded up to 8 bytes, once per possible CPU); `false` when there is none.
pub fn lookup(map: BorrowedFd<'_>, key: &[u8], value: &mut [u8]) -> std::io::Result<bool> {
    let mut attr = ElemAttr {
        map_fd: map.as_raw_fd().cast_unsigned(),
        key: key.as_ptr() as u64,
        value: value.as_mut_ptr() as u64,
        ..ElemAttr::default()
    };
    match sys_bpf(bpf_cmd::BPF_MAP_LOOKUP_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Writes `value` under `key` with `flags` (`BPF_ANY`, `BPF_NOEXIST`).
pub fn update(map: BorrowedFd<'_>, key: &[u8], value: &[u8], flags: u64) -> std::io::Result<()> {
    let mut attr = ElemAttr {
        map_fd: map.as_raw_fd().cast_unsigned(),
        key: key.as_ptr() as u64,
        value: value.as_ptr() as u64,
        flags,
        ..ElemAttr::default()
    };
    sys_bpf(bpf_cmd::BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
}

/// A descriptor of the object pinned at `path` (a map, a program or a link).
pub fn open_pinned(path: &Path) -> std::io::Result<OwnedFd> {
    let path = c_path(path)?;
    let mut attr = ObjAttr {
        pathname: path.as_ptr() as u64,
        ..ObjAttr::default()
    };
    owned(sys_bpf(bpf_cmd::BPF_OBJ_GET, &mut attr)?)
}

/// Creates a one-entry array of `value_size`-byte values and pins it at `path` (the stand-in for
/// a newer release's map, in tests of rollbacks).
pub fn pin_new_array(path: &Path, value_size: u32) -> std::io::Result<()> {
    let mut create = MapCreateAttr {
        map_type: bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
        key_size: 4,
        value_size,
        max_entries: 1,
        ..MapCreateAttr::default()
    };
    let map = owned(sys_bpf(bpf_cmd::BPF_MAP_CREATE, &mut create)?)?;
    let path = c_path(path)?;
    let mut pin = ObjAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: map.as_raw_fd().cast_unsigned(),
        ..ObjAttr::default()
    };
    sys_bpf(bpf_cmd::BPF_OBJ_PIN, &mut pin).map(drop)
}

/// Puts `program` in place of the program `link` runs, atomically for the hook: every run of
/// the hook from then on is the new program's; the link (its attachment, its pin) stays.
pub fn update_link(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> std::io::Result<()> {
    let mut attr = LinkUpdateAttr {
        link_fd: link.as_raw_fd().cast_unsigned(),
        new_prog_fd: program.as_raw_fd().cast_unsigned(),
        ..LinkUpdateAttr::default()
    };
    sys_bpf(bpf_cmd::BPF_LINK_UPDATE, &mut attr).map(drop)
}

/// The cgroup id a cgroup link is attached to, from its fdinfo (`cgroup_id:`, 5.8); `None` for
/// another kind of link or a kernel that does not say.
pub fn link_cgroup_id(link: impl AsFd) -> Option<u64> {
    let fdinfo =
        std::fs::read_to_string(format!("/proc/self/fdinfo/{}", link.as_fd().as_raw_fd())).ok()?;
    fdinfo.lines().find_map(|line| {
        line.strip_prefix("cgroup_id:")
            .and_then(|id| id.trim().parse().ok())
    })
}
