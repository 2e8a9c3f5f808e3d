//! The sizing table of `cargo xtask bench` alone (needs root): the agent's memory and each map's
//! kernel memory per `reverse_nat_entries`. Build the release binaries as `cargo xtask bench`
//! does, then run `REDIRECTOR_BIN=target/release/redirector target/release/sizing`.

use redirector_bench::benchmarks::{rig::Rig, sizing};

fn main() -> anyhow::Result<()> {
    let rig = Rig::new()?;
    let rows = sizing::measure(&rig)?;
    println!("{}", sizing::markdown(&rows));
    Ok(())
}
