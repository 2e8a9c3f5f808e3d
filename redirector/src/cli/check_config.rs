//! `redirector check-config`.

use redirector::config::Config;

pub(crate) fn check_config(path: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    println!(
        "{}: valid, {} listener(s): {}",
        path.display(),
        config.listeners.len(),
        config
            .listeners
            .iter()
            .map(|listener| format!("{} ({})", listener.name, listener.address))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
