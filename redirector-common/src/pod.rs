//! `aya::Pod` for every type the agent reads from or writes to a map.

use crate::{
    activity::{CacheActivity, StallTiming},
    addr::NetAddr,
    binds::{BindKey, BindListeners, CacheSocket, CacheTask},
    counters::ListenerCounters,
    datapath::{DatapathConfig, SkipCgroup},
    listener::{CacheHealth, ListenerConfig, ListenerInfo, ListenerMode, SocketCounts},
    pool::{Pool, Target},
    reverse::{ReverseKey, ReverseValue, SteeredSocket},
    workloads::{ExemptCgroup, WorkloadCounters},
};

macro_rules! impl_pod {
    ($($ty:ty),+ $(,)?) => {
        $(
            // SAFETY: `#[repr(C)]`, only integer fields, padding spelled out as fields and
            // checked by the size assertion next to the type: every bit pattern is valid.
            unsafe impl aya::Pod for $ty {}
        )+
    };
}

impl_pod!(
    NetAddr,
    Target,
    Pool,
    ListenerConfig,
    ListenerMode,
    CacheHealth,
    SocketCounts,
    BindKey,
    BindListeners,
    CacheSocket,
    CacheTask,
    ListenerInfo,
    ReverseKey,
    ReverseValue,
    SteeredSocket,
    ListenerCounters,
    DatapathConfig,
    SkipCgroup,
    CacheActivity,
    StallTiming,
    WorkloadCounters,
    ExemptCgroup,
);
