//! The clock of the cache's activity stamps (`redirector_common::activity::StallTiming` has why):
//! the kernel's tick count, converted to coarse monotonic ns with the tick the agent measured.
//!
//! Kernel features: `bpf_jiffies64` 5.5 (with the JIT on a 64-bit kernel the verifier replaces
//! the call by a load of `jiffies_64`), `bpf_ktime_get_coarse_ns` 5.11 where the agent has not
//! measured the tick, `BPF_PROG_TEST_RUN` of raw tracepoint programs 5.10 for [`ticks_half`].

use aya_ebpf::{
    helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns},
    programs::RawTracePointContext,
};
use redirector_common::activity::StallTiming;

/// Coarse monotonic ns now, on the clock of `timing`.
#[inline(always)]
pub fn coarse_now(timing: &StallTiming) -> u64 {
    if timing.tick_ns == 0 {
        // SAFETY: a plain helper call.
        return unsafe { bpf_ktime_get_coarse_ns() };
    }
    // SAFETY: a plain helper call (a load once inlined).
    timing.ticks_to_ns(unsafe { bpf_jiffies64() })
}

/// Half of the tick count, for the agent that runs this by `BPF_PROG_TEST_RUN` (a program's
/// return value is 32 bits): the high half when argument 0 is 1, else the low.
#[inline(always)]
pub fn ticks_half(ctx: &RawTracePointContext) -> u32 {
    let high: u64 = ctx.arg(0);
    // SAFETY: a plain helper call.
    let ticks = unsafe { bpf_jiffies64() };
    if high == 1 {
        (ticks >> 32) as u32
    } else {
        ticks as u32
    }
}
