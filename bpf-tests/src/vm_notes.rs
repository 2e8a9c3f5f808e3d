//! Notes for the VM report, and a reboot asked of the guest: a test run in a systemd guest
//! (`systemd_boot`, `node`) leaves what it measured in `/run/vm-test-notes`, one line a note, and
//! the guest sends each line to the host after the tests (xtask/src/vm/guest-systemd.sh): a
//! passing test's own output is not shown, and output under `--nocapture` would hide libtest's
//! result lines from the report.

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

/// The file whose presence asks the guest's test runner for a reboot once the boot's tests pass.
const REBOOT: &str = "/run/vm-test-reboot";

/// Asks the guest (a node boot) to reboot once this boot's tests have passed: the runner then
/// runs `systemctl reboot`, and the host boots the node again with its disk, where the next
/// test measures what the reboot did.
///
/// # Panics
/// When the file cannot be written: the reboot's test would not run.
pub fn ask_reboot() {
    std::fs::write(REBOOT, b"").unwrap_or_else(|error| panic!("writing {REBOOT}: {error}"));
}
