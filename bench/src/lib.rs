//! The bench behind `cargo xtask bench` (its entry point is `src/bin/bench.rs`), on the sandbox of
//! `bpf-tests`: `benchmarks` measures, `program_cost` reads the kernel's per-program accounting.
//! `src/bin/` also holds the clients it drives: `dns-load` (closed-loop load from connected
//! sockets) and `hook-cost` (one syscall kind, many times).

pub mod benchmarks;
pub mod program_cost;
