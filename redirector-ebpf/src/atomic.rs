//! Atomic operations on shared map memory.
//!
//! The `bpfel` target declares no compare-and-swap, so Rust's `Atomic*::fetch_add` is not
//! available. A plain add uses the intrinsic, which lowers to `lock xadd`. The fetching add
//! (`BPF_ADD | BPF_FETCH`, 5.12+), which makes "this release took the count to zero" one atomic
//! decision, is written in assembly: through bpf-linker and LLVM 22 the intrinsic with its result
//! used was compiled to a non-fetching add whose source register was then read as if it held the
//! old value (seen here, in the disassembly), a silent miscompile.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use crate::maps::ATOMIC_FETCH_OK;

/// Whether the kernel runs the fetching atomics (`ATOMIC_FETCH_OK`, a constant to the verifier):
/// every caller of `fetch_*` and `compare_exchange_u64` asks first and has a path without them,
/// which is all that remains of the program on a kernel whose JIT cannot compile them (arm64
/// before 5.18).
#[inline(always)]
pub fn fetching() -> bool {
    ATOMIC_FETCH_OK.load() != 0
}

/// Adds `delta` to `*target` with a plain atomic add (`BPF_ADD` without `BPF_FETCH`, which every
/// JIT compiles), then reads the sum back: the fetching add's answer where that cannot be had.
/// Not one decision: an add on another CPU between the two may be seen in the sum, so two
/// closes may both see zero (an epoch twice: harmless) and a bind just after a last close may
/// hide it (the agent's reconcile pass records what the kernel missed).
///
/// # Safety
///
/// `target` must point to a live, 8-byte aligned `i64` in map memory.
#[inline(always)]
pub unsafe fn add_then_read_i64(target: *mut i64, delta: i64) -> i64 {
    // SAFETY: the caller guarantees a valid, aligned target.
    unsafe {
        add_u64(target.cast(), delta as u64);
        core::ptr::read_volatile(target)
    }
}

/// `BPF_ATOMIC | BPF_FETCH` of operation `$op` with operand `$operand` on the 8 bytes at
/// `$target`; evaluates to the value they held. The instruction reads and writes only
/// `*$target` and its operand's register. Needs an `unsafe` block whose caller guarantees a
/// live, 8-byte aligned target in map memory.
macro_rules! fetch {
    ($op:literal, $target:expr, $operand:expr) => {{
        let mut value = $operand;
        core::arch::asm!(
            concat!("{value} = ", $op, "((u64 *)({target} + 0), {value})"),
            target = in(reg) $target,
            value = inout(reg) value,
            options(nostack),
        );
        value
    }};
}

/// Atomically adds `delta` to `*target` and returns the value before.
///
/// # Safety
///
/// `target` must point to a live, 8-byte aligned `i64` in map memory.
#[inline(always)]
pub unsafe fn fetch_add_i64(target: *mut i64, delta: i64) -> i64 {
    // SAFETY: the caller guarantees a valid, aligned target.
    unsafe { fetch!("atomic_fetch_add", target, delta) }
}

/// Atomically adds `delta` to `*target`.
///
/// # Safety
///
/// `target` must point to a live, 8-byte aligned `u64` in map memory.
#[inline(always)]
pub unsafe fn add_u64(target: *mut u64, delta: u64) {
    // SAFETY: the caller guarantees a valid, aligned target.
    let _ = unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(target, delta) };
}

/// Atomically replaces `*target` with `new` if it holds `expected` (`BPF_CMPXCHG`, 5.12+), and
/// returns the value it held: `expected` when this call made the change.
///
/// # Safety
///
/// `target` must point to a live, 8-byte aligned `u64` in map memory.
#[inline(always)]
pub unsafe fn compare_exchange_u64(target: *mut u64, expected: u64, new: u64) -> u64 {
    let mut held = expected;
    // SAFETY: the caller guarantees a valid, aligned target; the instruction compares with and
    // returns into r0, and reads and writes only `*target`.
    unsafe {
        core::arch::asm!(
            "r0 = cmpxchg_64({target} + 0, r0, {new})",
            target = in(reg) target,
            new = in(reg) new,
            inout("r0") held,
            options(nostack),
        );
    }
    held
}

/// Atomically sets `bits` in `*target` (`BPF_OR | BPF_FETCH`, 5.12+), fully ordered: what this
/// CPU stored before is visible to whoever sees the bits. Returns the value before.
///
/// # Safety
///
/// `target` must point to a live, 8-byte aligned `u64` in map memory.
#[inline(always)]
pub unsafe fn fetch_or_u64(target: *mut u64, bits: u64) -> u64 {
    // SAFETY: the caller guarantees a valid, aligned target.
    unsafe { fetch!("atomic_fetch_or", target, bits) }
}

/// Atomically clears `bits` in `*target` (`BPF_AND | BPF_FETCH`, 5.12+), fully ordered: what
/// this CPU loads after sees what was stored before the bits were set. Returns the value before.
///
/// # Safety
///
/// `target` must point to a live, 8-byte aligned `u64` in map memory.
#[inline(always)]
pub unsafe fn fetch_clear_u64(target: *mut u64, bits: u64) -> u64 {
    // SAFETY: the caller guarantees a valid, aligned target.
    unsafe { fetch!("atomic_fetch_and", target, !bits) }
}
