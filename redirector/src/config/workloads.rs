//! `[workloads]`: DNS per workload (each cgroup's queries by route and replies by rcode class),
//! how many cgroups the kernel tracks, how many the metrics name, and which are never counted.

use std::{path::PathBuf, time::Duration};

use redirector_common::workloads::{
    MAX_LISTED_EXEMPT_CGROUPS, RCODE_CLASSES, ROUTES, WORKLOADS_DEFAULT_ENTRIES,
};

use super::{ConfigError, raw::RawWorkloads};

/// Series a named workload has on every node: a query rate per route, a reply rate per class.
const SERIES_PER_WORKLOAD: usize = ROUTES + RCODE_CLASSES;

/// Fewest cgroups `workloads.tracked` accepts: fewer would evict a node's busy workloads.
const MIN_TRACKED: u32 = 64;
/// Most cgroups `workloads.tracked` accepts (168 MiB of kernel memory: 168 bytes an entry, the
/// 96-byte value, 8-byte key, 48-byte element header and a 16-byte hash bucket).
const MAX_TRACKED: u32 = 1 << 20;
/// Most workloads `workloads.top` names in the metrics: each is 10 series on every node (5 routes,
/// 5 rcode classes).
pub const MAX_TOP: usize = 100;
/// The default `workloads.top`.
pub const DEFAULT_TOP: usize = 5;
/// The default `workloads.interval_ms`: how often the agent reads the counts for its rates.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

/// The per-workload accounting.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct WorkloadSettings {
    /// Count DNS per cgroup in the kernel (false: the programs carry no counting at all).
    pub accounting: bool,
    /// Cgroups tracked at once (the `WORKLOADS` LRU's entries).
    pub tracked: u32,
    /// Workloads the metrics name, by query rate; the rest are summed under `other`.
    pub top: usize,
    /// How often the agent reads the counts (the window of its rates).
    pub interval: Duration,
    /// cgroup v2 directories whose DNS, with their descendants', is not counted, besides the
    /// caches' (`listener.skip_cgroups`) and the agent's own.
    pub exempt_cgroups: Vec<PathBuf>,
    /// The per-workload rate limit, if on.
    pub rate_limit: Option<RateLimit>,
    /// cgroup v2 directories counted but never held to the rate limit (with their descendants).
    pub rate_limit_exempt_cgroups: Vec<PathBuf>,
}

/// A rate every workload is held to at the syscall.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RateLimit {
    /// Queries per second, sustained.
    pub qps: u32,
    /// Queries at once after a quiet moment.
    pub burst: u32,
}

impl RateLimit {
    /// The programs' schedule: one query's interval (1 s / qps) and how far ahead of it a query
    /// may come ((burst - 1) intervals), in ns.
    #[must_use]
    pub fn schedule_ns(&self) -> (u64, u64) {
        let interval = 1_000_000_000 / u64::from(self.qps.max(1));
        (interval, interval * u64::from(self.burst.max(1) - 1))
    }
}

/// Most queries per second a limit may allow (a higher one holds nothing back).
const MAX_RATE: u32 = 1_000_000;

impl Default for WorkloadSettings {
    fn default() -> Self {
        Self {
            accounting: true,
            tracked: WORKLOADS_DEFAULT_ENTRIES,
            top: DEFAULT_TOP,
            interval: DEFAULT_INTERVAL,
            exempt_cgroups: Vec::new(),
            rate_limit: None,
            rate_limit_exempt_cgroups: Vec::new(),
        }
    }
}

pub(super) fn validate_workloads(raw: RawWorkloads) -> Result<WorkloadSettings, ConfigError> {
    let defaults = WorkloadSettings::default();
    let tracked = match raw.tracked {
        Some(value) if !(MIN_TRACKED..=MAX_TRACKED).contains(&value) => {
            return Err(ConfigError::BadWorkloads {
                key: "workloads.tracked",
                problem: format!(
                    "{value} cgroups cannot be tracked; give {MIN_TRACKED} to {MAX_TRACKED} \
                     (the default is {WORKLOADS_DEFAULT_ENTRIES})"
                ),
            });
        }
        Some(value) => value,
        None => defaults.tracked,
    };
    let top = match raw.top {
        Some(value) if value > MAX_TOP => {
            return Err(ConfigError::BadWorkloads {
                key: "workloads.top",
                problem: format!(
                    "{value} workloads would be {} series on every node; give at most {MAX_TOP} \
                     (the default is {DEFAULT_TOP}; 0 names none)",
                    value * SERIES_PER_WORKLOAD
                ),
            });
        }
        Some(value) => value,
        None => defaults.top,
    };
    let interval = match raw.interval_ms {
        Some(ms) if ms < 1000 => {
            return Err(ConfigError::BadWorkloads {
                key: "workloads.interval_ms",
                problem: format!(
                    "{ms} ms would read every tracked cgroup's counts too often; give at least \
                     1000 (the default is {})",
                    DEFAULT_INTERVAL.as_millis()
                ),
            });
        }
        Some(ms) => Duration::from_millis(ms),
        None => defaults.interval,
    };
    let room = MAX_LISTED_EXEMPT_CGROUPS;
    if raw.exempt_cgroups.len() > room {
        return Err(ConfigError::BadWorkloads {
            key: "workloads.exempt_cgroups",
            problem: format!(
                "{} cgroups given; at most {room} can be exempt (a parent exempts its \
                 descendants: list it instead)",
                raw.exempt_cgroups.len()
            ),
        });
    }
    let listed = raw.exempt_cgroups.len() + raw.rate_limit_exempt_cgroups.len();
    if listed > room {
        return Err(ConfigError::BadWorkloads {
            key: "workloads.rate_limit_exempt_cgroups",
            problem: format!(
                "{listed} cgroups given in exempt_cgroups and rate_limit_exempt_cgroups \
                 together; at most {room} can be exempt (a parent exempts its descendants: list \
                 it instead)"
            ),
        });
    }
    let accounting = raw.accounting.unwrap_or(defaults.accounting);
    let rate_limit = validate_rate_limit(raw.rate_limit_qps, raw.rate_limit_burst, accounting)?;
    Ok(WorkloadSettings {
        accounting,
        tracked,
        top,
        interval,
        exempt_cgroups: raw.exempt_cgroups,
        rate_limit,
        rate_limit_exempt_cgroups: raw.rate_limit_exempt_cgroups,
    })
}

/// The rate limit: off unless `rate_limit_qps` is given and not 0; the burst defaults to one
/// second's worth.
fn validate_rate_limit(
    qps: Option<u32>,
    burst: Option<u32>,
    accounting: bool,
) -> Result<Option<RateLimit>, ConfigError> {
    let qps = match qps {
        None | Some(0) => {
            if burst.is_some() {
                return Err(ConfigError::BadWorkloads {
                    key: "workloads.rate_limit_burst",
                    problem: "a burst without a rate limits nothing; set rate_limit_qps too, \
                              or remove it"
                        .to_owned(),
                });
            }
            return Ok(None);
        }
        Some(qps) if qps > MAX_RATE => {
            return Err(ConfigError::BadWorkloads {
                key: "workloads.rate_limit_qps",
                problem: format!(
                    "{qps} is more than any workload sends; give at most {MAX_RATE}, or 0 for no limit"
                ),
            });
        }
        Some(qps) => qps,
    };
    if !accounting {
        return Err(ConfigError::BadWorkloads {
            key: "workloads.rate_limit_qps",
            problem: "the rate limit keeps its schedule in the per-workload counts, which \
                      workloads.accounting = false turns off; turn accounting on, or remove \
                      rate_limit_qps"
                .to_owned(),
        });
    }
    let burst = match burst {
        Some(0) => {
            return Err(ConfigError::BadWorkloads {
                key: "workloads.rate_limit_burst",
                problem: "0 would refuse every query; give at least 1 (the default is the \
                          rate: one second's worth)"
                    .to_owned(),
            });
        }
        Some(burst) if burst > MAX_RATE => {
            return Err(ConfigError::BadWorkloads {
                key: "workloads.rate_limit_burst",
                problem: format!(
                    "{burst} is more than any workload sends at once; give at most {MAX_RATE}"
                ),
            });
        }
        Some(burst) => burst,
        None => qps,
    };
    Ok(Some(RateLimit { qps, burst }))
}
