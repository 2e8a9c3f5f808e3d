//! Where an agent's start spends its time, phase by phase, for the log line that ends it.

/// Where an agent's start spends its time, phase by phase: logged with "redirector is steering"
/// as comma-separated `name=ms` pairs, in order (the bench reads them).
pub(super) struct StartPhases {
    last: std::time::Instant,
    ended: Vec<(&'static str, std::time::Duration)>,
}

impl StartPhases {
    pub(super) fn new() -> Self {
        Self {
            last: std::time::Instant::now(),
            ended: Vec::new(),
        }
    }

    /// Ends the phase `name`, begun where the previous one ended.
    pub(super) fn end(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.ended.push((name, now - self.last));
        self.last = now;
    }

    /// Ends a phase that ran alongside the previous one: its `parts` as they were timed where
    /// they ran, and `name` for what it took beyond the previous phase's end.
    pub(super) fn end_parts(
        &mut self,
        name: &'static str,
        parts: &[(&'static str, std::time::Duration)],
    ) {
        self.ended.extend_from_slice(parts);
        self.end(name);
    }
}

impl std::fmt::Display for StartPhases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (position, (name, took)) in self.ended.iter().enumerate() {
            let separator = if position == 0 { "" } else { "," };
            write!(f, "{separator}{name}={:.1}", took.as_secs_f64() * 1000.0)?;
        }
        Ok(())
    }
}
