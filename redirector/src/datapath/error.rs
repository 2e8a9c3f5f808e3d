//! What can go wrong between the agent and the kernel.

use std::path::{Path, PathBuf};

use aya::{EbpfError, maps::MapError, pin::PinError, programs::ProgramError};
use redirector_common::listener::MAX_LISTENERS;

/// Why the datapath could not be set up or used. In every variant `name` is the program's or
/// map's name in the object, `path` the pin, cgroup or directory the message names, and
/// `source` what aya or the kernel said.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The programs' log could not be read (`kernel_log`).
    #[error("cannot read the programs' log records (kernel_log); run without kernel_log")]
    KernelLog {
        /// What aya-log said.
        #[source]
        source: aya_log::Error,
    },
    /// The object could not be loaded (maps created); usually missing privileges or BTF.
    #[error(
        "loading the eBPF object failed; redirector needs root (CAP_BPF, CAP_PERFMON and \
         CAP_NET_ADMIN) and a kernel with BTF and cgroup v2 BPF support"
    )]
    Load {
        /// What aya reported.
        #[source]
        source: EbpfError,
    },
    /// The embedded object could not be parsed: a build mismatch.
    #[error("the embedded eBPF object cannot be parsed; rebuild redirector")]
    Object {
        /// What aya-obj said.
        #[source]
        source: aya_obj::ParseError,
    },
    /// A pinned map could not be inspected.
    #[error("cannot inspect the pinned map {path}; remove it or run `redirector uninstall`")]
    InspectPin {
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: MapError,
    },
    /// The object lacks a program this build expects: a build mismatch.
    #[error("the embedded eBPF object has no program {name}; rebuild redirector")]
    MissingProgram { name: &'static str },
    /// The object lacks a map this build expects: a build mismatch.
    #[error("the eBPF object has no map {name}; rebuild redirector")]
    MissingMap { name: &'static str },
    /// A program is not of the expected type.
    #[error("the eBPF program {name} is not of the type this build expects; rebuild redirector")]
    ProgramType { name: &'static str },
    /// An attachment could not be turned into a pinnable link.
    #[error(
        "the attachment of {name} is not a bpf_link (kernel before 5.7?); redirector needs bpf_link attachments"
    )]
    Link {
        name: &'static str,
        /// What aya reported.
        #[source]
        source: aya::programs::links::LinkError,
    },
    /// The verifier refused a program.
    #[error("the kernel refused the eBPF program {name} (the cause holds the verifier's log)")]
    Verify {
        name: &'static str,
        /// What aya reported, with the verifier log.
        #[source]
        source: ProgramError,
    },
    /// The attach cgroup could not be opened.
    #[error("cannot open the cgroup directory {path}")]
    OpenCgroup {
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// Attaching a program failed.
    #[error("attaching the eBPF program {name} to the cgroup {path} failed")]
    Attach {
        name: &'static str,
        path: PathBuf,
        /// What aya reported.
        #[source]
        source: ProgramError,
    },
    /// Pinning an attachment failed.
    #[error("pinning the attachment of {name} at {path} failed")]
    PinLink {
        name: &'static str,
        path: PathBuf,
        /// What aya reported.
        #[source]
        source: PinError,
    },
    /// A map is of an unexpected type or size.
    #[error(
        "the map {name} does not have the layout this build expects; rebuild redirector or remove stale pins"
    )]
    MapLayout {
        name: &'static str,
        /// What aya reported.
        #[source]
        source: MapError,
    },
    /// A map read or write failed.
    #[error("{action} the map {name} failed")]
    MapAccess {
        /// What was being done.
        action: &'static str,
        name: &'static str,
        /// What aya reported.
        #[source]
        source: MapError,
    },
    /// An mmapable map is not the one this build expects.
    #[error(
        "the {name} map has {value_size}-byte values, {max_entries} entries and flags \
         {map_flags:#x}, not what this build expects; it belongs to a release that broke the \
         layout rule: remove the pins (redirector uninstall) or start with --replace"
    )]
    MappedLayout {
        name: &'static str,
        /// Its value size.
        value_size: u32,
        /// Its entries.
        max_entries: u32,
        /// Its flags.
        map_flags: u32,
    },
    /// An mmapable map could not be mapped into memory.
    #[error("mapping the {name} map into memory failed")]
    Mmap {
        name: &'static str,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// There is no pinned state at all.
    #[error(
        "no redirector state under {pin_dir}: no agent has run here since boot, it was \
         uninstalled, or its pins are elsewhere (give --pin-dir)"
    )]
    NoPinnedState { pin_dir: PathBuf },
    /// The pins exist but may not be opened by this user.
    #[error(
        "reading the pinned maps under {pin_dir} needs root (CAP_BPF): run it \
         with sudo"
    )]
    PinsNeedRoot {
        pin_dir: PathBuf,
        /// What the kernel said (opening the directory, or a map in it).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The pins lack a map this release reads: an earlier release's pins (releases only add
    /// maps, and keep the layout number), or incomplete ones.
    #[error(
        "the pins under {pin_dir} have no {name} map, which this release ({release}) reads: \
         they are an earlier release's (the running agent, or the last one, is an older \
         binary than this one) or incomplete. Run the redirector of the release the agent runs \
         (the binary its unit started, or `kubectl exec` into its pod); this release's agent \
         adds the map when it starts, with DNS steered throughout"
    )]
    OlderPins {
        pin_dir: PathBuf,
        name: String,
        release: &'static str,
    },
    /// A pinned map could not be opened while others are there.
    #[error(
        "cannot open the pinned map {path}: the pins are incomplete or of another redirector \
         version; start the agent (`redirector run`), which adopts or migrates them"
    )]
    OpenPin {
        path: PathBuf,
        /// What aya reported.
        #[source]
        source: MapError,
    },
    /// A map could not be pinned.
    #[error("pinning the map {name} at {path} failed; is {dir} on a bpf filesystem?", dir = parent(path))]
    Pin {
        name: &'static str,
        path: PathBuf,
        /// What aya reported.
        #[source]
        source: PinError,
    },
    /// The pin directory could not be prepared.
    #[error("cannot prepare the pin directory {path}")]
    PinDir {
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// Copying a pinned map into the one beside it failed.
    #[error(
        "migrating the map {name} ({path}) failed; the programs that ran keep running on the \
         pinned maps"
    )]
    Migrate {
        name: &'static str,
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// Putting the new program in a pinned link failed.
    #[error("replacing the program of the pinned attachment {path} with the new {name} failed")]
    UpdateLink {
        name: &'static str,
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// A failure a test asked for (`REDIRECTOR_TEST_FAIL_AFTER_LOAD`).
    #[error(
        "failing the start after the load, as REDIRECTOR_TEST_FAIL_AFTER_LOAD asks (tests only)"
    )]
    InjectedFailure,
    /// No listener of that name in the maps.
    #[error("there is no listener {name:?}; the running agent has: {known}")]
    UnknownListener {
        /// The name asked for.
        name: String,
        /// The names there are, comma-separated.
        known: String,
    },
    /// A listener id past the maps' size.
    #[error("listener id {id} is out of range (at most {max} listeners)", max = MAX_LISTENERS)]
    ListenerId { id: u32 },
}

fn parent(path: &Path) -> String {
    path.parent()
        .map(|dir| dir.display().to_string())
        .unwrap_or_default()
}

/// Maps a failed write of `name`.
pub(super) fn write(name: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    move |source| DatapathError::MapAccess {
        action: "writing",
        name,
        source,
    }
}

/// Maps a failed read of `name`.
pub(super) fn read(name: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    move |source| DatapathError::MapAccess {
        action: "reading",
        name,
        source,
    }
}
