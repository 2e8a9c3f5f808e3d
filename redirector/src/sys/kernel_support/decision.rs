//! What the agent found: the running kernel feature by feature, each decided by a probe, by its
//! release number or by the tests' override, and the refusal of a kernel that lacks a required
//! feature.

use aya::{programs::ProgramError, util::KernelVersion};
use tracing::warn;

use super::{FEATURES, FLOOR, KernelFeature, Need, Probe, mainline};

/// How a feature's presence was decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// By aya's probe of the running kernel.
    Probe,
    /// By the release number: the feature has no probe, or its probe failed (logged).
    Release,
    /// By [`ABSENT_FOR_TESTS_VARIABLE`](super::ABSENT_FOR_TESTS_VARIABLE).
    TestOverride,
}

/// What the agent found for one feature.
#[derive(Clone, Copy, Debug)]
pub struct Finding {
    /// The feature.
    pub feature: &'static KernelFeature,
    /// Whether the running kernel has it.
    pub present: bool,
    /// How that was decided.
    pub decided_by: Decision,
}

/// The running kernel, feature by feature.
#[derive(Clone, Debug)]
pub struct KernelSupport {
    /// `uname -r`.
    pub release: String,
    /// One per feature decided before the load ([`Probe::AtUse`] features are left out).
    pub findings: Vec<Finding>,
}

impl KernelSupport {
    /// Decides every feature for the kernel `release` (its version `version`, `None` when it
    /// cannot be read), with `probe` answering for the features that have one (`Err`: the probe
    /// failed, and the version decides).
    pub fn decide(
        release: &str,
        version: Option<KernelVersion>,
        absent: &[&str],
        mut probe: impl FnMut(&KernelFeature) -> Result<bool, ProgramError>,
    ) -> Self {
        // A version that cannot be read lacks nothing by its number: the verifier has the last
        // word.
        let by_release =
            |feature: &KernelFeature| version.is_none_or(|version| version >= feature.since);
        let findings = FEATURES
            .iter()
            .filter(|feature| feature.probe != Probe::AtUse)
            .map(|feature| {
                let (present, decided_by) = if absent.contains(&feature.id) {
                    (false, Decision::TestOverride)
                } else if feature.probe == Probe::Release {
                    (by_release(feature), Decision::Release)
                } else {
                    match probe(feature) {
                        Ok(present) => (present, Decision::Probe),
                        Err(error) => {
                            warn!(feature = feature.name, error = %crate::error_chain(&error), "the kernel probe failed: the release number decides");
                            (by_release(feature), Decision::Release)
                        }
                    }
                };
                Finding {
                    feature,
                    present,
                    decided_by,
                }
            })
            .collect();
        Self {
            release: release.to_owned(),
            findings,
        }
    }

    /// The features the kernel lacks.
    pub fn missing(&self) -> impl Iterator<Item = &Finding> + '_ {
        self.findings.iter().filter(|finding| !finding.present)
    }

    /// The optional features the kernel lacks: what the agent runs without.
    pub fn degraded(&self) -> impl Iterator<Item = &Finding> + '_ {
        self.missing()
            .filter(|finding| matches!(finding.feature.need, Need::Optional { .. }))
    }

    /// Whether the kernel has the feature `id` (features decided at use count as present).
    #[must_use]
    pub fn has(&self, id: &str) -> bool {
        self.findings
            .iter()
            .find(|finding| finding.feature.id == id)
            .is_none_or(|finding| finding.present)
    }
}

/// The running kernel lacks a required feature.
#[derive(Debug, thiserror::Error)]
#[error(
    "Linux {release} lacks {missing}, which redirector needs: run it on Linux {} or later \
     (or on a kernel with these backported) (nothing was loaded or attached)",
    mainline(*.floor)
)]
pub struct KernelLacks {
    /// `uname -r`.
    pub release: String,
    /// The missing features with the release of each and how it was decided, joined.
    pub missing: String,
    /// The oldest release redirector supports.
    pub floor: KernelVersion,
}

/// Refuses a kernel without a required feature.
///
/// # Errors
/// [`KernelLacks`], naming every missing feature.
pub fn require(support: &KernelSupport) -> Result<(), KernelLacks> {
    let missing: Vec<String> = support
        .missing()
        .filter(|finding| finding.feature.need == Need::Required)
        .map(|finding| {
            let how = match finding.decided_by {
                Decision::Probe => "probed",
                Decision::Release => "by release",
                Decision::TestOverride => "forced by the test override",
            };
            format!(
                "{} ({}, {how})",
                finding.feature.name.replace('`', ""),
                mainline(finding.feature.since)
            )
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(KernelLacks {
        release: support.release.clone(),
        missing: missing.join(", "),
        floor: FLOOR,
    })
}
