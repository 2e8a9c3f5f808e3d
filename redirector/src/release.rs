//! What this build is: its release (the workspace's semantic version, one per release in
//! CHANGELOG.md), the commit it was built from, and the layout of pins it reads. `--version`,
//! `status` and `redirector_build_info` all say it from here.

use std::sync::LazyLock;

/// The release, `MAJOR.MINOR.PATCH`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit the build is from (12 hex digits), or `unknown` for a build outside a git checkout
/// that was not told (`build.rs`).
pub const COMMIT: &str = env!("REDIRECTOR_COMMIT");

/// The layout of pins this build reads and records (the layout rule of ARCHITECTURE.md).
pub const LAYOUT: u32 = redirector_common::LAYOUT_VERSION;

/// `0.2.0 (commit 0123456789ab, layout 5)`.
#[must_use]
pub fn describe() -> &'static str {
    static TEXT: LazyLock<String> =
        LazyLock::new(|| format!("{VERSION} (commit {COMMIT}, layout {LAYOUT})"));
    &TEXT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_description_names_the_release_the_commit_and_the_layout() {
        let text = describe();
        assert!(text.starts_with(VERSION), "{text}");
        let [major, minor, patch] = VERSION
            .split('.')
            .map(|part| part.parse::<u32>().expect("a number"))
            .collect::<Vec<_>>()[..]
        else {
            panic!("{VERSION} is not MAJOR.MINOR.PATCH")
        };
        assert!((major, minor, patch) > (0, 1, 0), "{VERSION}");
        assert!(text.contains(&format!("layout {LAYOUT})")), "{text}");
        // Built in this checkout, the commit is git's.
        assert!(
            COMMIT.len() == 12 && COMMIT.bytes().all(|byte| byte.is_ascii_hexdigit()),
            "{COMMIT}"
        );
    }
}
