//! The workspace xtask works on: its root, its target directory, and the cargo arguments that
//! select its userspace crates.

use std::path::PathBuf;

/// The workspace's root directory (xtask's parent).
pub fn workspace_root() -> PathBuf {
    let xtask = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask
        .parent()
        .map_or_else(|| xtask.join(".."), std::path::Path::to_path_buf)
}

/// The workspace's target directory.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

/// `cargo` arguments that select every userspace crate, bpf-tests with its privileged tests
/// included (it is not a default member, so that a plain `cargo test` needs no root).
pub const USERSPACE: [&str; 3] = ["--workspace", "--exclude", "redirector-ebpf"];
