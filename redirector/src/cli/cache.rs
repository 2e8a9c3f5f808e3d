//! `redirector cache`: the embedded cache (the `embedded-cache` feature).

#[cfg(feature = "embedded-cache")]
pub(crate) fn cache(path: &std::path::Path, log_level: &str) -> anyhow::Result<()> {
    use super::{LogFormat, init_logging, runtime, stop_signal};

    let config = dns_cache::CacheConfig::load(path)?;
    init_logging(log_level, LogFormat::Human)?;
    runtime()?.block_on(async {
        let stop = stop_signal()?;
        // It logs when it serves (the tests wait for that line) and when it has stopped.
        dns_cache::run(config, async {
            stop.await;
        })
        .await?;
        anyhow::Ok(())
    })
}

/// The agent's production build leaves the embedded cache out: no deployment runs it.
#[cfg(not(feature = "embedded-cache"))]
pub(crate) fn cache(_path: &std::path::Path, _log_level: &str) -> anyhow::Result<()> {
    anyhow::bail!(
        "this redirector was built without the embedded cache (a tool for dev boxes, demos and \
         tests, left out of the agent's production build); build one that has it with \
         `cargo build --package redirector --features embedded-cache`"
    )
}
