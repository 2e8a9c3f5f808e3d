//! Atomic adds on shared map memory.
//!
//! BPF has an atomic add (`BPF_ATOMIC | BPF_ADD`, "lock xadd") on every CPU version the kernel
//! accepts, but the `bpfel` target declares no compare-and-swap, so Rust's `Atomic*::fetch_add`
//! is not available. The intrinsic lowers to that instruction; its result is never used, so no
//! `BPF_FETCH` (5.12+) is needed.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

/// Atomically adds `delta` to `*target`.
///
/// # Safety
///
/// `target` must point to a live, 8-byte aligned `i64` in map memory.
#[inline(always)]
pub unsafe fn add_i64(target: *mut i64, delta: i64) {
    // SAFETY: the caller guarantees a valid, aligned target.
    let _ = unsafe { atomic_xadd::<i64, i64, { AtomicOrdering::Relaxed }>(target, delta) };
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
