//! Removes what sandboxes of dead test runs left behind: network namespaces, cgroups, bpffs
//! mounts and files named with the sandbox prefix, but only when the process that created them
//! is gone (a concurrent run's sandboxes are left alone).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context as _;

/// Keep in sync with `bpf_tests::sandbox::PREFIX`.
const PREFIX: &str = "rdt";

/// The tag of a sandbox resource name `rdt-TAG...`.
fn tag_of(name: &str) -> Option<&str> {
    let rest = name.strip_prefix(PREFIX)?.strip_prefix('-')?;
    let tag = rest.get(..6)?;
    tag.chars().all(|c| c.is_ascii_hexdigit()).then_some(tag)
}

/// True when the sandbox `tag` belongs to a live process.
fn owner_alive(tag: &str) -> bool {
    let owner = std::env::temp_dir().join(format!("{PREFIX}-{tag}-files/owner"));
    std::fs::read_to_string(owner)
        .ok()
        .and_then(|pid| pid.trim().parse::<u32>().ok())
        .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
}

/// Sweeps stale sandboxes; reports what it removed.
pub fn run() -> anyhow::Result<()> {
    let mut removed = Vec::new();

    let netns = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .context("ip netns list")?;
    for line in String::from_utf8_lossy(&netns.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        if tag_of(name).is_some_and(|tag| !owner_alive(tag)) {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
            let _ = std::fs::remove_dir_all(Path::new("/etc/netns").join(name));
            removed.push(format!("netns {name}"));
        }
    }

    // Containers of the image tests (bpf-tests/src/container.rs), before their cgroups go.
    removed.extend(sweep_containers());

    // The v2 hierarchy, and the v1 ones of a hybrid layout (runc makes the image tests'
    // container cgroups there too).
    let v2 = cgroup2_root();
    let v1 = std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| Some(path) != v2.as_ref() && path.is_dir());
    for root in v2.clone().into_iter().chain(v1) {
        for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if tag_of(&name).is_some_and(|tag| !owner_alive(tag)) {
                remove_cgroup_tree(&entry.path());
                removed.push(format!("cgroup {}", entry.path().display()));
            }
        }
    }

    for entry in std::fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        if tag_of(&name).is_some_and(|tag| !owner_alive(tag)) {
            let path = entry.path();
            if name.ends_with("-bpffs") {
                let _ = nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH);
            }
            let _ = std::fs::remove_dir_all(&path);
            removed.push(format!("{}", path.display()));
        }
    }

    for item in &removed {
        eprintln!("xtask sweep: removed stale {item}");
    }
    Ok(())
}

/// The image tests' podman storage and state (keep in sync with `bpf_tests::container`).
fn podman() -> Option<Command> {
    let dir = crate::workspace::target_dir().join("tmp/containers");
    if !dir.join("storage").is_dir() {
        return None;
    }
    let storage = dir.join("storage");
    // The tests write where they keep podman's runtime state beside the storage.
    let run_root = std::fs::read_to_string(dir.join("runroot")).ok()?;
    let mut command = Command::new("podman");
    command
        .env("CONTAINERS_CONF", dir.join("containers.conf"))
        .arg("--root")
        .arg(&storage)
        .args(["--runroot", run_root.trim(), "--storage-driver", "overlay"]);
    Some(command)
}

/// Removes the containers that sandboxes of dead test runs started (their names carry the tag).
fn sweep_containers() -> Vec<String> {
    let Some(mut list) = podman() else {
        return Vec::new();
    };
    let Ok(output) = list
        .args(["ps", "--all", "--format", "{{.Names}}"])
        .output()
    else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for name in String::from_utf8_lossy(&output.stdout).lines() {
        if tag_of(name).is_some_and(|tag| !owner_alive(tag))
            && let Some(mut remove) = podman()
        {
            let _ = remove.args(["rm", "--force", "--time", "0", name]).status();
            removed.push(format!("container {name}"));
        }
    }
    removed
}

fn cgroup2_root() -> Option<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        let (before, after) = line.split_once(" - ")?;
        (after.split_whitespace().next()? == "cgroup2")
            .then(|| before.split_whitespace().nth(4).map(PathBuf::from))?
    })
}

/// Kills the processes of a stale sandbox cgroup (all started by that dead test run) and removes
/// it, children first.
fn remove_cgroup_tree(path: &Path) {
    for child in std::fs::read_dir(path).into_iter().flatten().flatten() {
        if child.path().is_dir() {
            remove_cgroup_tree(&child.path());
        }
    }
    for _ in 0..50 {
        let _ = std::fs::write(path.join("cgroup.kill"), "1");
        if std::fs::remove_dir(path).is_ok() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_sandbox_names_only() {
        assert_eq!(tag_of("rdt-0a1b2c-node"), Some("0a1b2c"));
        assert_eq!(tag_of("rdt-0a1b2c"), Some("0a1b2c"));
        assert_eq!(tag_of("rdt-0a1b2c-bpffs"), Some("0a1b2c"));
        assert_eq!(tag_of("rdt-zzzzzz-node"), None);
        assert_eq!(tag_of("cni-0a1b2c"), None);
        assert_eq!(tag_of("rdt"), None);
    }
}
