//! What the tests of the shipped files share: the repository's files, scratch directories and
//! promtool.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// The workspace's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate lives in the workspace")
        .to_owned()
}

/// A file of the repository, by its path from the root.
pub fn read(relative: &str) -> String {
    let path = repo().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

/// A fresh scratch directory for one test of the test binary `binary`.
pub fn scratch(binary: &str, tag: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("redirector-{binary}-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// Runs `promtool ARGS` in `dir` and returns what it printed; fails when it fails.
pub fn promtool(dir: &Path, args: &[&str]) -> String {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|error| {
            panic!("running promtool (install prometheus; `cargo xtask test` does): {error}")
        });
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "promtool {args:?}: {said}");
    said
}
