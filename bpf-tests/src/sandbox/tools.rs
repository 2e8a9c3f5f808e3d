//! The binaries the sandbox runs: the test crate's helpers (`dns-server`, `dns-query`,
//! `dns-stream`) and the `redirector` binary under test.

use std::path::PathBuf;

use anyhow::Context as _;

/// Where the helper binaries are (tests pass `env!("CARGO_BIN_EXE_...")`).
#[derive(Clone, Debug)]
pub struct Tools {
    /// The test DNS server.
    pub dns_server: PathBuf,
    /// The test DNS client.
    pub dns_query: PathBuf,
    /// The continuous DNS client.
    pub dns_stream: PathBuf,
}

/// The helper binaries of the calling test crate (`env!("CARGO_BIN_EXE_...")`, which cargo sets
/// for integration tests of this package).
#[macro_export]
macro_rules! tools {
    () => {
        $crate::sandbox::Tools {
            dns_server: env!("CARGO_BIN_EXE_dns-server").into(),
            dns_query: env!("CARGO_BIN_EXE_dns-query").into(),
            dns_stream: env!("CARGO_BIN_EXE_dns-stream").into(),
        }
    };
}

impl Tools {
    /// The helpers next to the running executable (how the demo finds them), unless
    /// `DNS_SERVER_BIN` / `DNS_QUERY_BIN` say otherwise.
    pub fn beside_current_exe() -> anyhow::Result<Self> {
        let dir = std::env::current_exe()
            .context("locating the running executable")?
            .parent()
            .context("the executable has a directory")?
            .to_owned();
        let pick = |variable: &str, name: &str| {
            std::env::var_os(variable).map_or_else(|| dir.join(name), PathBuf::from)
        };
        Ok(Self {
            dns_server: pick("DNS_SERVER_BIN", "dns-server"),
            dns_query: pick("DNS_QUERY_BIN", "dns-query"),
            dns_stream: pick("DNS_STREAM_BIN", "dns-stream"),
        })
    }
}

/// The `redirector` binary under test: `$REDIRECTOR_BIN`, or the one cargo built next to the
/// test executable (`cargo xtask test` builds it first).
#[must_use]
pub fn redirector_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("REDIRECTOR_BIN") {
        return PathBuf::from(path);
    }
    let beside_tests = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("redirector")));
    match beside_tests {
        Some(path) if path.exists() => path,
        _ => panic!(
            "the redirector binary is not built: run `cargo build -p redirector` first, or \
             `cargo xtask test`, which does (or set REDIRECTOR_BIN)"
        ),
    }
}
