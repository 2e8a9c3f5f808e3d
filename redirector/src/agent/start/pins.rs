//! What the start does with the pins it finds: adopt them, remove stale ones, or refuse them.

use tracing::{info, warn};

use crate::{
    agent::{AgentError, StartOptions, environment},
    config::Config,
    datapath::{self, MapAction, Plan, Verdict, pins::MapSizes},
};

/// The entries of the maps `config` sizes.
pub(super) fn map_sizes(config: &Config) -> MapSizes {
    MapSizes {
        reverse_nat: config.reverse_nat_entries,
        workloads: config.workloads.tracked,
    }
}

/// Decides what the start does with the pins: adopt them (reusing, migrating or creating each
/// map), remove stale ones no program uses, or refuse pins no release of the rule wrote. Nothing
/// that runs is changed here (but with `--replace`, which removes everything).
pub(super) fn plan_pins(config: &Config, options: &StartOptions) -> Result<Plan, AgentError> {
    let pin_dir = &config.pin_dir;
    let plan = || datapath::pins::plan(pin_dir, map_sizes(config), options.layout_bump);
    let first = plan()?;
    match first.verdict() {
        Verdict::Empty => Ok(first),
        Verdict::Adopt if !options.replace => {
            let migrating = first.differences(false);
            info!(
                pin_dir = %pin_dir.display(),
                layout = first.layout,
                reused = first.count(|action| *action == MapAction::Reuse),
                migrated = first.count(|action| matches!(action, MapAction::Migrate { .. })),
                created = first.count(|action| *action == MapAction::Create),
                retired = first.unknown.len(),
                migrating = %migrating,
                "adopting the maps an earlier agent pinned"
            );
            Ok(first)
        }
        Verdict::Stale => {
            // No attachment uses them: nothing steers through these maps, so nothing is lost.
            warn!(pin_dir = %pin_dir.display(), layout = first.layout, "removing maps no program uses (an earlier start failed before it attached)");
            datapath::remove_pins(pin_dir)?;
            environment::prepare_pin_dir(pin_dir)?;
            Ok(plan()?)
        }
        _ if options.replace => {
            warn!(pin_dir = %pin_dir.display(), "removing every pinned program and map (--replace): DNS to the listeners passes unsteered until the new programs are attached");
            datapath::remove_pins(pin_dir)?;
            environment::prepare_pin_dir(pin_dir)?;
            Ok(plan()?)
        }
        _ => Err(AgentError::IncompatiblePins {
            pin_dir: pin_dir.clone(),
            found: first.layout,
            unreadable: first.differences(true),
        }),
    }
}

/// The map `REDIRECTOR_TEST_LAYOUT_BUMP` pins.
pub const NEXT_LAYOUT_MAP: &str = "NEXT_LAYOUT";
