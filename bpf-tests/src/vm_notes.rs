//! Notes for the VM report: a test run in a systemd guest (`systemd_boot`, `node`) leaves what
//! it measured in `/run/vm-test-notes`, one line a note, and the guest sends each line to the
//! host after the tests (xtask/src/vm/guest-systemd.sh): a passing test's own output is not
//! shown, and output under `--nocapture` would hide libtest's result lines from the report.

use std::io::Write as _;

/// The file the guest reads after the tests.
const NOTES: &str = "/run/vm-test-notes";

/// Leaves `text` (one line) for the VM report.
///
/// # Panics
/// When the file cannot be written: a test's measurement must not be lost silently.
pub fn note(text: &str) {
    let mut notes = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(NOTES)
        .unwrap_or_else(|error| panic!("opening {NOTES}: {error}"));
    writeln!(notes, "{text}").unwrap_or_else(|error| panic!("writing {NOTES}: {error}"));
}
