//! The tests' override: the variable that makes the agent take features as absent whatever the
//! probes say, and the parsing of its list.

use super::FEATURES;

/// The variable that makes the agent (and `status`) take features as absent whatever the probes
/// say: a comma-separated list of [`KernelFeature::id`](super::KernelFeature::id)s. For tests
/// only: it exists so that the degraded paths run on the kernels the tests can boot, all of which
/// have every feature.
pub const ABSENT_FOR_TESTS_VARIABLE: &str = "REDIRECTOR_TEST_ABSENT_FEATURES";

/// [`ABSENT_FOR_TESTS_VARIABLE`] names a feature the table does not have.
#[derive(Debug, thiserror::Error)]
#[error(
    "{variable} names {id:?}, which is no kernel feature of redirector's: give a comma-separated \
     list of {known} (it exists for tests; unset it in production)"
)]
pub struct UnknownFeature {
    /// The variable.
    pub variable: &'static str,
    /// The unknown id.
    pub id: String,
    /// The ids there are, joined.
    pub known: String,
}

/// The features [`ABSENT_FOR_TESTS_VARIABLE`]'s value `list` names.
///
/// # Errors
/// [`UnknownFeature`] for an id the table does not have.
pub fn parse_absent(list: &str) -> Result<Vec<&'static str>, UnknownFeature> {
    list.split(',')
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .map(|id| {
            FEATURES
                .iter()
                .find(|feature| feature.id == id)
                .map(|feature| feature.id)
                .ok_or_else(|| UnknownFeature {
                    variable: ABSENT_FOR_TESTS_VARIABLE,
                    id: id.to_owned(),
                    known: FEATURES
                        .iter()
                        .map(|feature| feature.id)
                        .collect::<Vec<_>>()
                        .join(", "),
                })
        })
        .collect()
}
