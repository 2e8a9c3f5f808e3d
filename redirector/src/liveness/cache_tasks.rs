//! Which processes are the caches (`CACHE_TASKS`), for the signal program, the exempt set and
//! drains. The programs record them in the kernel: the process that binds a cache socket
//! (`post_bind`) and the one that reads it (`recvmsg`, at each socket's first read after every
//! agent start), which covers a cache that was running before the programs, one that daemonized
//! after binding and one whose pid namespace the agent cannot see, with the shipped capabilities
//! (see `redirector-ebpf/src/activity.rs`). Here the agent adds what only it can see, where it
//! may read other processes' descriptors (`CAP_SYS_PTRACE`, more than shipped): the processes
//! that hold a counted cache socket (by the socket's inode, in `/proc/PID/fd`), which includes a
//! cache outside the attach cgroup, whose reads the programs do not see; at its start, at the
//! socket reconcile passes that follow a change of the caches' sockets, and now and then. And it
//! keeps the record to the caches that live (`forget_gone`).
//!
//! Only processes in the caches' network namespace are looked into (a socket belongs to the
//! namespace it was made in; one passed to a process of another namespace is missed). A cache
//! that takes its stop signals through `signalfd` or `sigwaitinfo` is never seen by the signal
//! program, known or not: its sockets' last close moves it.

use std::{
    collections::HashMap,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use crate::{
    datapath::{DatapathError, Maps},
    sys::cgroup,
    workloads::cgroups,
};

/// A process that holds cache sockets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Its pid (the thread group's).
    pub tgid: u32,
    /// Its cgroup v2 id, as `bpf_get_current_cgroup_id` gives it.
    pub cgroup_id: u64,
    /// The listeners whose cache sockets it holds (`listener_bit`s).
    pub listeners: u64,
}

/// The processes of the network namespace at `netns` (`None`: the agent's own) that hold a
/// socket of `sockets` (socket inode → the listeners it is a cache of). Blocking: run it off the
/// control loop.
#[must_use]
pub fn holders(sockets: &HashMap<u64, u64>, netns: Option<&Path>) -> Vec<Holder> {
    if sockets.is_empty() {
        return Vec::new();
    }
    let netns = netns.map_or_else(|| PathBuf::from("/proc/self/ns/net"), Path::to_owned);
    let Ok(namespace) = std::fs::metadata(&netns).map(|metadata| metadata.ino()) else {
        return Vec::new();
    };
    let Ok(processes) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in processes.filter_map(Result::ok) {
        let Some(tgid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse().ok())
        else {
            continue;
        };
        let process = entry.path();
        // One stat a process; only those of the caches' namespace have their descriptors read.
        if std::fs::metadata(process.join("ns/net"))
            .map(|metadata| metadata.ino())
            .ok()
            != Some(namespace)
        {
            continue;
        }
        let listeners = held(&process, sockets);
        if listeners == 0 {
            continue;
        }
        // A process gone meanwhile has no cgroup left to name: nothing to record.
        if let Some(cgroup_id) = cgroup::id_of_process(tgid) {
            found.push(Holder {
                tgid,
                cgroup_id,
                listeners,
            });
        }
    }
    found
}

/// The processes the programs know as caches (`CACHE_TASKS`: the binders and readers of cache
/// sockets), each with those of its listeners among `listeners` (the listeners whose cache
/// sockets are open): what the agent knows of the caches' processes where it cannot read theirs.
#[must_use]
pub fn recorded(maps: &Maps, listeners: u64) -> Vec<Holder> {
    maps.known_cache_tasks()
        .into_iter()
        .filter(|(_, task)| task.listeners & listeners != 0)
        .map(|(tgid, task)| Holder {
            tgid,
            cgroup_id: task.cgroup_id,
            listeners: task.listeners & listeners,
        })
        .collect()
}

/// Forgets the processes known as caches (`CACHE_TASKS`) whose cgroup is gone, so that the
/// record, and the exempt cgroups the agent writes from it, hold the caches that live rather than
/// every cache that ever ran: a cache whose container a kubelet restarts runs in a new cgroup at
/// every restart. A process always lives in a cgroup that exists, so an entry whose cgroup is
/// gone stands for no process. Only entries read before the walk of the hierarchy (on a blocking
/// thread) are judged, since a cgroup made during the walk may be missed by it; none when the
/// walk could not see the whole hierarchy. Returns how many went.
///
/// # Errors
///
/// A map that cannot be read or written.
pub async fn forget_gone(maps: &mut Maps) -> Result<usize, DatapathError> {
    let known = maps.cache_task_cgroups();
    if known.is_empty() {
        return Ok(0);
    }
    // A walk that could not finish judges nothing.
    let Ok(Some(existing)) = tokio::task::spawn_blocking(cgroups::every_id).await else {
        return Ok(0);
    };
    let gone: Vec<(u32, u64)> = known
        .into_iter()
        .filter(|(_, cgroup)| !existing.contains(cgroup))
        .collect();
    maps.forget_cache_tasks_of(&gone)
}

/// The listeners of the cache sockets among the descriptors of `process` (`/proc/PID`).
fn held(process: &Path, sockets: &HashMap<u64, u64>) -> u64 {
    let Ok(descriptors) = std::fs::read_dir(process.join("fd")) else {
        return 0;
    };
    descriptors
        .filter_map(Result::ok)
        .filter_map(|descriptor| std::fs::read_link(descriptor.path()).ok())
        .filter_map(|target| socket_inode(&target.to_string_lossy()))
        .filter_map(|inode| sockets.get(&inode))
        .fold(0, |bits, listeners| bits | listeners)
}

/// The inode of a descriptor's link text `socket:[INODE]`.
fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd as _;

    use super::*;

    #[test]
    fn a_descriptors_link_names_its_socket() {
        assert_eq!(socket_inode("socket:[123456]"), Some(123_456));
        assert_eq!(socket_inode("pipe:[123456]"), None);
        assert_eq!(socket_inode("/dev/null"), None);
    }

    #[test]
    fn this_process_is_found_holding_its_own_socket() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("a loopback socket");
        let link = std::fs::read_link(format!("/proc/self/fd/{}", socket.as_raw_fd()))
            .expect("its descriptor");
        let inode = socket_inode(&link.to_string_lossy()).expect("a socket link");
        let found = holders(&HashMap::from([(inode, 0b101)]), None);
        let me = found
            .iter()
            .find(|holder| holder.tgid == std::process::id())
            .unwrap_or_else(|| panic!("this process is not among {found:?}"));
        assert_eq!(me.listeners, 0b101);
        assert!(me.cgroup_id != 0);
    }
}
