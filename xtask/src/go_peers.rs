//! The Go programs the tests run as peers: CoreDNS (the cache NodeLocal DNSCache and AKS
//! LocalDNS run), kube-apiserver, kubectl and etcd (a real API server for the agent's
//! Kubernetes side), helm (the chart's lint and rendering), and for the suite's node its
//! kubelet, kube-controller-manager, kube-scheduler and containerd.
//! Each is built from a Go module of ours under `bpf-tests/go/`, whose go.mod and go.sum pin
//! every version, with the machine's Go and the Go module proxy; by `setup`, `test` and
//! `vm-test` (not by `demo` or `build`, which need none), once per machine and again only when a
//! module's go.mod, go.sum or Go files or the Go version change, into `target/go/bin`, with the
//! fetched modules under `target/go/mod` (the build cache, `target/go/cache`, is removed once the
//! last build of a run is done: about 5 GiB on a shared disk, for a rebuild a few minutes faster).

use std::{
    hash::{Hash as _, Hasher as _},
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, bail};

/// One build of programs of a Go module of ours.
struct Module {
    /// Its folder under `bpf-tests/go`.
    folder: &'static str,
    /// The build's name (its stamp's): a module's programs may be built in two builds.
    name: &'static str,
    /// Only the suite's node runs them: `cargo xtask test` builds them beside the host's tests,
    /// which do not wait for them.
    node_only: bool,
    /// Its programs' Go packages; each binary takes its package's last element as its name.
    programs: &'static [&'static str],
}

const MODULES: &[Module] = &[
    Module {
        folder: "coredns",
        name: "coredns",
        node_only: false,
        // Its own main: CoreDNS with the node caches' plugins (main.go says which).
        programs: &["redirector.test/coredns"],
    },
    Module {
        folder: "kube",
        name: "kube",
        node_only: false,
        programs: &[
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kubectl",
            "redirector.test/kube/etcd",
        ],
    },
    Module {
        folder: "helm",
        name: "helm",
        node_only: false,
        programs: &["helm.sh/helm/v4/cmd/helm"],
    },
    // The node's: its kubelet and the control plane's other two (their shared packages are in
    // the build cache when the build above ran before it, `Cache::Keep`), and containerd.
    Module {
        folder: "kube",
        name: "kube-node",
        node_only: true,
        programs: &[
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler",
            "k8s.io/kubernetes/cmd/kubelet",
        ],
    },
    Module {
        folder: "containerd",
        name: "containerd",
        node_only: true,
        programs: &[
            "github.com/containerd/containerd/v2/cmd/containerd",
            "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
            "github.com/containerd/containerd/v2/cmd/ctr",
        ],
    },
];

/// `go build`'s flags: paths of the build machine left out; no version-control stamp (the
/// modules sit in this repository's checkout, whose state says nothing of them); no symbol table
/// or DWARF (smaller binaries and shorter links: test peers, not debugged).
const BUILD_FLAGS: [&str; 3] = ["-trimpath", "-buildvcs=false", "-ldflags=-s -w"];

/// Where Go is: `/usr/local/go/bin/go` (where this machine kind has it), else the PATH's.
fn go() -> PathBuf {
    let local = PathBuf::from("/usr/local/go/bin/go");
    if local.exists() {
        local
    } else {
        PathBuf::from("go")
    }
}

/// `target/go`, the binaries' and the caches' folder.
fn root() -> PathBuf {
    crate::workspace::target_dir().join("go")
}

/// Which of the programs a build makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peers {
    /// Those the host's tests run.
    Host,
    /// The node's alone.
    Node,
    /// Every one.
    Every,
}

impl Peers {
    fn builds(self, module: &Module) -> bool {
        match self {
            Self::Host => !module.node_only,
            Self::Node => module.node_only,
            Self::Every => true,
        }
    }
}

/// What becomes of Go's build cache after a build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cache {
    /// Kept for a build that follows: the node's shares most of its packages with the host's
    /// (its kubelet and the API server are one module).
    Keep,
    /// Removed: about 5 GiB once every module is built, on a shared disk, for a rebuild after a
    /// module changes a few minutes faster. The fetched modules stay.
    Remove,
}

/// Builds every program of `peers` whose module, or Go, changed since it was last built.
pub fn ensure(peers: Peers, cache: Cache) -> anyhow::Result<()> {
    let go_version = go_version()?;
    for module in MODULES.iter().filter(|module| peers.builds(module)) {
        ensure_module(module, &go_version)?;
    }
    let dir = root().join("cache");
    if cache == Cache::Remove && dir.exists() {
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("removing Go's build cache {}", dir.display()))?;
    }
    Ok(())
}

fn go_version() -> anyhow::Result<String> {
    let output = Command::new(go())
        .args(["env", "GOVERSION"])
        .output()
        .with_context(|| {
            format!(
                "running {} (the tests build CoreDNS, kube-apiserver and etcd with Go; this \
                 machine kind has it in /usr/local/go)",
                go().display()
            )
        })?;
    if !output.status.success() {
        bail!(
            "`go env GOVERSION` failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// What a build depends on: the module's go.mod and go.sum, its Go sources, Go's version and the
/// build's flags.
fn stamp(folder: &Path, go_version: &str) -> anyhow::Result<String> {
    let mut hasher = std::hash::DefaultHasher::new();
    go_version.hash(&mut hasher);
    BUILD_FLAGS.hash(&mut hasher);
    let mut files = Vec::new();
    collect_sources(folder, &mut files)?;
    files.sort();
    for file in files {
        // By its path in the module: a checkout elsewhere has the same stamp.
        file.strip_prefix(folder).unwrap_or(&file).hash(&mut hasher);
        std::fs::read(&file)
            .with_context(|| format!("reading {}", file.display()))?
            .hash(&mut hasher);
    }
    Ok(format!("{go_version} {:016x}\n", hasher.finish()))
}

fn collect_sources(folder: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in
        std::fs::read_dir(folder).with_context(|| format!("reading {}", folder.display()))?
    {
        let path = entry?.path();
        if path.is_dir() {
            collect_sources(&path, files)?;
        } else if path
            .file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name == "go.mod" || name == "go.sum" || name.ends_with(".go"))
        {
            files.push(path);
        }
    }
    Ok(())
}

/// Builds `module`'s programs unless they are current.
fn ensure_module(module: &Module, go_version: &str) -> anyhow::Result<()> {
    let folder = crate::workspace::workspace_root()
        .join("bpf-tests/go")
        .join(module.folder);
    let bin = root().join("bin");
    let stamp_file = bin.join(format!(".{}.stamp", module.name));
    let wanted = stamp(&folder, go_version)?;
    let names: Vec<&str> = module
        .programs
        .iter()
        .map(|package| package.rsplit('/').next().unwrap_or(package))
        .collect();
    let built = names.iter().all(|name| bin.join(name).exists());
    if built && std::fs::read_to_string(&stamp_file).is_ok_and(|stamp| stamp == wanted) {
        return Ok(());
    }
    eprintln!(
        "xtask: building {} with {go_version} from bpf-tests/go/{} (once per machine; the first \
         build fetches the modules and takes minutes)",
        names.join(", "),
        module.folder
    );
    let started = Instant::now();
    std::fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    // One build of them all: the packages they share compile once, in parallel.
    let mut build = Command::new(go());
    build
        .current_dir(&folder)
        .arg("build")
        .args(BUILD_FLAGS)
        .arg("-o")
        // A folder (the trailing slash): each binary in it under its package's name.
        .arg(format!("{}/", bin.display()))
        .args(module.programs)
        .env("GOCACHE", root().join("cache"))
        .env("GOMODCACHE", root().join("mod"))
        // Fetched modules read-only in target/ would stop `cargo clean`; the go.sum is the
        // check, and go.mod may not change under the build.
        .env("GOFLAGS", "-modcacherw -mod=readonly")
        // Go as the machine has it: a toolchain line may not fetch another one.
        .env("GOTOOLCHAIN", "local")
        // Static, for the VMs' and the image's root filesystems as well as the host.
        .env("CGO_ENABLED", "0");
    let status = build
        .status()
        .with_context(|| format!("running {build:?}"))?;
    if !status.success() {
        bail!(
            "building {} in bpf-tests/go/{} failed; see go's output above. The modules come \
             from the Go module proxy: check that `go env GOPROXY` reaches it, and that go.mod \
             and go.sum there agree (`go mod tidy` in that folder)",
            names.join(", "),
            module.folder
        );
    }
    std::fs::write(&stamp_file, wanted)
        .with_context(|| format!("writing {}", stamp_file.display()))?;
    eprintln!(
        "xtask: built {} in {:.0} s",
        names.join(", "),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every module has its go.mod and go.sum, and names each program it builds: its own
    /// packages by the module path (its root's too), the others as `tool` lines (the Go version they were tidied
    /// with is the one the machines have).
    #[test]
    fn every_module_pins_what_it_builds() {
        for module in MODULES {
            let folder = crate::workspace::workspace_root()
                .join("bpf-tests/go")
                .join(module.folder);
            let go_mod = std::fs::read_to_string(folder.join("go.mod"))
                .unwrap_or_else(|error| panic!("{}: {error}", module.folder));
            assert!(
                folder.join("go.sum").exists(),
                "{}: no go.sum",
                module.folder
            );
            let path = go_mod
                .lines()
                .find_map(|line| line.strip_prefix("module "))
                .unwrap_or_else(|| panic!("{}: no module line", module.folder));
            for package in module.programs {
                let own = *package == path || package.starts_with(&format!("{path}/"));
                let tool = go_mod
                    .lines()
                    .any(|line| line.trim().trim_start_matches("tool ").trim() == *package);
                assert!(
                    own || tool,
                    "{}: {package} is not a tool of its go.mod",
                    module.folder
                );
            }
            assert!(
                go_mod.contains("\ngo 1.26"),
                "{}: not for go 1.26",
                module.folder
            );
        }
    }
}
