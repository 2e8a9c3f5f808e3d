//! `redirector cache`: the embedded cache (the `embedded-cache` feature).

#[cfg(feature = "embedded-cache")]
pub(crate) fn cache(path: &std::path::Path, log_level: &str) -> anyhow::Result<()> {
    use dns_cache::{CacheConfig, CacheServer};

    use super::{LogFormat, init_logging, runtime, stop_signal};

    let config = CacheConfig::load(path)?;
    init_logging(log_level, LogFormat::Human)?;
    let runtime = runtime()?;
    runtime.block_on(async {
        let stop = stop_signal()?;
        let server = CacheServer::bind(config).await?;
        tracing::info!(
            listen = ?server.local_addrs(),
            "embedded cache serving"
        );
        server
            .serve(async {
                stop.await;
            })
            .await;
        tracing::info!("embedded cache stopped");
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
