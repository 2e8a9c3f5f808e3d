//! The kernel features redirector uses, the mainline release that introduced each, how the agent
//! decides whether the running kernel has it, and the check it runs before it loads anything: a
//! kernel without a required feature is refused with the features' names instead of a verifier
//! log, and one without an optional feature degrades by name.
//!
//! The decision is a probe of the running kernel wherever aya has one (program types, map types,
//! helpers per program type: `aya::sys::is_*_supported`), because distribution kernels backport
//! features and release numbers lie in both directions. The rest (attach types, map flags, bpf
//! links, instructions, a socket option) has no probe short of loading the programs; for those the
//! release number stands, all of them at or below [`FLOOR`].
//!
//! The table is `docs/kernels.md`'s (a test keeps the two equal), and a test
//! reads the embedded object and checks every helper call and fetching atomic in it against this
//! table: a new one cannot land without its row, nor one newer than [`FLOOR`] without a switch.
//!
//! One idea a module: the table (`table`), the probes of the running kernel (`probes`, with
//! `atomics` for the fetching atomics), what was found and the refusal of a kernel that lacks a
//! required feature (`decision`), the tests' override (`test_override`); the tests of the table
//! and the decision (`tests`) and the audit of the object against the table (`audit`).

mod atomics;
#[cfg(test)]
mod audit;
mod decision;
mod probes;
mod table;
mod test_override;
#[cfg(test)]
mod tests;

pub use decision::{Decision, Finding, KernelLacks, KernelSupport, require};
pub use table::{
    ATOMIC_FETCH, FEATURES, FLOOR, KernelFeature, Need, Probe, SET_RETVAL, TICK_TEST_RUN, Uses,
    mainline,
};
pub use test_override::{ABSENT_FOR_TESTS_VARIABLE, UnknownFeature, parse_absent};
