//! `redirector uninstall`: leave nothing behind.

use redirector::config::Config;

use super::{LogFormat, init_logging, runtime};

pub(crate) fn uninstall(path: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    init_logging(
        config.log_level.as_deref().unwrap_or("warn"),
        LogFormat::Human,
    )?;
    let runtime = runtime()?;
    let report = runtime.block_on(redirector::agent::uninstall(&config))?;
    println!(
        "uninstalled: {}; pins under {} removed{}{}",
        if report.detached {
            "programs detached"
        } else {
            "no programs were attached"
        },
        config.pin_dir.display(),
        report
            .interface
            .map(|name| format!("; listener addresses removed from {name}"))
            .unwrap_or_default(),
        if report.conntrack_table_removed {
            "; nftables table inet redirector removed"
        } else {
            ""
        }
    );
    Ok(())
}
