//! A workload's name for the metrics, from its cgroup id.

use super::Name;

/// Names workloads by cgroup id.
#[derive(Debug, Default)]
pub struct Namer {}

impl Namer {
    /// A namer with nothing resolved yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The name of the workload in cgroup `id`.
    pub fn name(&mut self, id: u64) -> Name {
        Name {
            workload: format!("cgroup/{id}"),
            ..Name::default()
        }
    }
}
