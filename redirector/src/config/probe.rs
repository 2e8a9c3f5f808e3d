//! How the agent probes caches and checks upstreams (`[probe]`): the settings, their defaults,
//! and the checks that refuse timings that cannot work; the DNS name a probe asks for.

use std::time::Duration;

use super::{ConfigError, raw::RawProbe};

/// What probes ask unless told otherwise: caches answer `localhost` themselves (unbound, dnsmasq
/// and CoreDNS with its hosts file do), and NXDOMAIN counts as alive anyway.
pub const DEFAULT_PROBE_NAME: &str = "localhost.";
/// `probe.stall_after_ms` unless configured.
pub const DEFAULT_STALL_AFTER_MS: u64 = 80;
/// The shortest `probe.stall_after_ms` accepted.
const MIN_STALL_AFTER_MS: u64 = 20;
/// `probe.upstream_interval_ms` unless configured: CoreDNS's `forward` checks its upstreams
/// every 0.5 s too.
pub const DEFAULT_UPSTREAM_INTERVAL_MS: u64 = 500;
/// The shortest `probe.upstream_interval_ms` accepted: every node that routes upstream checks
/// every target of its pool at this pace.
const MIN_UPSTREAM_INTERVAL_MS: u64 = 100;
/// `probe.upstream_timeout_ms` unless configured: a check fails only when nothing answers, and a
/// kube-dns pod loaded by a fleet's failover can take hundreds of milliseconds to answer while it
/// serves. 2 s is well above that, and below the 5 s a glibc client waits for an answer: a target
/// silent that long fails its clients too.
pub const DEFAULT_UPSTREAM_TIMEOUT_MS: u64 = 2000;
/// A probe is sent every `probe.interval_ms` whether or not the earlier ones answered: at most
/// this many of one cache may wait for their answer at once. The same bound holds for the checks
/// of one upstream target (`probe.upstream_timeout_ms` against `probe.upstream_interval_ms`).
const MAX_PROBES_IN_FLIGHT: u32 = 10;

/// How the agent probes caches with real DNS queries, and how the kernel's own judgements of a
/// cache (a stall, a signal) are weighed.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ProbeSettings {
    /// The name asked for (A); any answer or NXDOMAIN means alive.
    pub name: String,
    /// Time between probes of one cache (sent whether or not the earlier ones answered).
    pub interval: Duration,
    /// How long a probe waits for its answer (may exceed the interval).
    pub timeout: Duration,
    /// Consecutive failures that fail a listener over.
    pub failures_to_fail_over: u32,
    /// Consecutive successes that fail it back.
    pub successes_to_fail_back: u32,
    /// How long a cache may leave a query unread before the programs move its listener upstream
    /// (`None`: never).
    pub stall_after: Option<Duration>,
    /// How long after a terminating signal to the cache its probes' answers are not trusted to
    /// bring DNS back (a cache shutting down answers until it closes its sockets).
    pub signal_hold: Duration,
    /// Time between checks of each upstream target of a listener while it routes upstream, on
    /// average: each wait is drawn within ± 20 % of it (`None`: never checked).
    pub upstream_interval: Option<Duration>,
    /// How long a check of an upstream target waits for its answer: any answer by then keeps the
    /// target (slow is not dead), none fails the check.
    pub upstream_timeout: Duration,
}

impl Default for ProbeSettings {
    fn default() -> Self {
        Self {
            name: DEFAULT_PROBE_NAME.to_owned(),
            // A probe every 100 ms, each given 250 ms, two failures in a row: a hung cache is
            // failed over 350 to 450 ms after it stopped answering.
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(250),
            failures_to_fail_over: 2,
            successes_to_fail_back: 3,
            // Above the 50 ms a cache under a half-core CPU quota can sit throttled in a 100 ms
            // period; the flip comes within about 85 ms of the first unread query (the kernel's
            // coarse clock ticks every 4 ms at HZ=250).
            stall_after: Some(Duration::from_millis(DEFAULT_STALL_AFTER_MS)),
            // Above CoreDNS's `lameduck 5s`, the longest shutdown a shipped cache is told to take.
            signal_hold: Duration::from_secs(6),
            // With `failures_to_fail_over` failures in a row, a dead target leaves the kernel's
            // pool within about a second of the first check that finds it.
            upstream_interval: Some(Duration::from_millis(DEFAULT_UPSTREAM_INTERVAL_MS)),
            upstream_timeout: Duration::from_millis(DEFAULT_UPSTREAM_TIMEOUT_MS),
        }
    }
}

pub(super) fn validate_probe(raw: RawProbe) -> Result<ProbeSettings, ConfigError> {
    let defaults = ProbeSettings::default();
    let name = match raw.name {
        Some(name) => checked_dns_name("probe.name", name)?,
        None => defaults.name,
    };
    let interval = raw
        .interval_ms
        .map_or(defaults.interval, Duration::from_millis);
    let timeout = raw
        .timeout_ms
        .map_or(defaults.timeout, Duration::from_millis);
    if timeout.is_zero() {
        return Err(ConfigError::BadTiming {
            key: "probe.timeout_ms",
            problem: "0 would fail every probe; give milliseconds, e.g. 300".to_owned(),
        });
    }
    if interval.is_zero() {
        return Err(ConfigError::BadTiming {
            key: "probe.interval_ms",
            problem: "0 would probe without pause; give milliseconds, e.g. 100".to_owned(),
        });
    }
    if timeout > interval * MAX_PROBES_IN_FLIGHT {
        return Err(ConfigError::BadTiming {
            key: "probe.timeout_ms",
            problem: format!(
                "{} ms would keep more than {MAX_PROBES_IN_FLIGHT} probes of a cache in flight \
                 (one is sent every interval_ms, {} ms): shorten it or lengthen interval_ms",
                timeout.as_millis(),
                interval.as_millis()
            ),
        });
    }
    let failures_to_fail_over = raw
        .failures_to_fail_over
        .unwrap_or(defaults.failures_to_fail_over);
    let successes_to_fail_back = raw
        .successes_to_fail_back
        .unwrap_or(defaults.successes_to_fail_back);
    for (key, value) in [
        ("probe.failures_to_fail_over", failures_to_fail_over),
        ("probe.successes_to_fail_back", successes_to_fail_back),
    ] {
        if value == 0 {
            return Err(ConfigError::BadTiming {
                key,
                problem: "0 would decide without a single probe; give at least 1".to_owned(),
            });
        }
    }
    let stall_after = match raw.stall_after_ms {
        None => defaults.stall_after,
        Some(0) => None,
        Some(ms) if ms < MIN_STALL_AFTER_MS => {
            return Err(ConfigError::BadTiming {
                key: "probe.stall_after_ms",
                problem: format!(
                    "{ms} ms is within a busy cache's scheduling jitter and would move its DNS \
                     upstream while it serves; give at least {MIN_STALL_AFTER_MS} (the default is \
                     {DEFAULT_STALL_AFTER_MS}), or 0 to turn stall detection off"
                ),
            });
        }
        Some(ms) => Some(Duration::from_millis(ms)),
    };
    let signal_hold = raw
        .signal_hold_ms
        .map_or(defaults.signal_hold, Duration::from_millis);
    let upstream_interval = match raw.upstream_interval_ms {
        None => defaults.upstream_interval,
        Some(0) => None,
        Some(ms) if ms < MIN_UPSTREAM_INTERVAL_MS => {
            return Err(ConfigError::BadTiming {
                key: "probe.upstream_interval_ms",
                problem: format!(
                    "{ms} ms: every node routing upstream would check every target {} times a \
                     second; give at least {MIN_UPSTREAM_INTERVAL_MS} (the default is \
                     {DEFAULT_UPSTREAM_INTERVAL_MS}), or 0 to never check upstreams",
                    1000 / ms.max(1)
                ),
            });
        }
        Some(ms) => Some(Duration::from_millis(ms)),
    };
    let upstream_timeout = raw
        .upstream_timeout_ms
        .map_or(defaults.upstream_timeout, Duration::from_millis);
    if upstream_timeout.is_zero() {
        return Err(ConfigError::BadTiming {
            key: "probe.upstream_timeout_ms",
            problem: format!(
                "0 would fail every check and take every answering target out; give \
                 milliseconds above the slowest answer of a serving upstream (the default is \
                 {DEFAULT_UPSTREAM_TIMEOUT_MS})"
            ),
        });
    }
    if let Some(upstream_interval) = upstream_interval
        && upstream_timeout > upstream_interval * MAX_PROBES_IN_FLIGHT
    {
        return Err(ConfigError::BadTiming {
            key: "probe.upstream_timeout_ms",
            problem: format!(
                "{} ms would keep more than {MAX_PROBES_IN_FLIGHT} checks of a target in flight \
                 (one is sent about every upstream_interval_ms, {} ms): shorten it or lengthen \
                 upstream_interval_ms",
                upstream_timeout.as_millis(),
                upstream_interval.as_millis()
            ),
        });
    }
    Ok(ProbeSettings {
        name,
        interval,
        timeout,
        stall_after,
        signal_hold,
        upstream_interval,
        upstream_timeout,
        failures_to_fail_over,
        successes_to_fail_back,
    })
}

/// A DNS name as probes send it (fully qualified, with the trailing dot).
pub(super) fn checked_dns_name(key: &str, name: String) -> Result<String, ConfigError> {
    let labels_ok = name.trim_end_matches('.').split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_')
    });
    if name.is_empty() || name.len() > 253 || !labels_ok {
        return Err(ConfigError::BadProbeName {
            key: key.to_owned(),
            name,
        });
    }
    Ok(if name.ends_with('.') {
        name
    } else {
        format!("{name}.")
    })
}
