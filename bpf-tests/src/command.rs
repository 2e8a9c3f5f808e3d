//! Running commands, in the test's own namespaces and cgroups, with time limits.

use std::{
    ffi::OsStr,
    io::{BufRead as _, BufReader},
    os::fd::{AsRawFd as _, OwnedFd},
    os::unix::process::CommandExt as _,
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::pace::paced;

/// Runs `program args` to completion (for at most 30 s, stretched by [`crate::pace`]) and returns
/// its stdout; fails with its stderr otherwise.
pub fn run<I, S>(program: &str, args: I) -> anyhow::Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut command = Command::new(program);
    command.args(args);
    let output = output_within(&mut command, Duration::from_secs(30))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs `command` and collects its output, killing it (by pid) after `limit` stretched by
/// [`crate::pace`] (give the host's figure).
pub fn output_within(command: &mut Command, limit: Duration) -> anyhow::Result<Output> {
    let limit = paced(limit);
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = command
        .spawn()
        .with_context(|| format!("cannot start {command:?} (is it installed? `cargo xtask setup` installs the test tools)"))?;
    let pid = child.id();
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(child.wait_with_output());
    });
    match receiver.recv_timeout(limit) {
        Ok(output) => output.with_context(|| format!("waiting for {command:?}")),
        Err(_) => {
            kill_pid(pid);
            let _ = receiver.recv_timeout(Duration::from_secs(5));
            bail!("{command:?} did not finish within {limit:?} and was killed")
        }
    }
}

/// Sends SIGKILL to a process this test started.
pub fn kill_pid(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Makes `command` move itself into the cgroup whose `cgroup.procs` is open as `procs` before it
/// executes (so that it is steered from its first syscall). The descriptor must stay open until
/// the command is spawned.
pub fn join_cgroup_before_exec(command: &mut Command, procs: &OwnedFd) {
    let fd = procs.as_raw_fd();
    // SAFETY: the closure runs between fork and exec and only calls write(2), which is
    // async-signal-safe; "0" moves the writing process itself.
    unsafe {
        command.pre_exec(move || {
            if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A long-running process the test started. Killed (by pid) when dropped.
#[derive(Debug)]
pub struct TestProcess {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Lines taken from `lines` by [`Self::wait_output_closed`] that [`Self::drain`] has not
    /// returned yet.
    unread: Vec<String>,
    /// Every line consumed from `lines` so far.
    printed: Vec<String>,
}

impl TestProcess {
    /// Starts `command` and waits until it prints (on stdout or stderr) a line containing
    /// `ready`, for at most `limit` stretched by [`crate::pace`] (give the host's figure).
    pub fn start(
        name: &str,
        mut command: Command,
        ready: &str,
        limit: Duration,
    ) -> anyhow::Result<Self> {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .with_context(|| format!("cannot start {name} ({command:?})"))?;
        let (sender, lines) = mpsc::channel();
        let stdout = child.stdout.take().context("stdout is piped")?;
        let stderr = child.stderr.take().context("stderr is piped")?;
        forward_lines(stdout, sender.clone());
        forward_lines(stderr, sender);
        let mut process = Self {
            name: name.to_owned(),
            child,
            lines,
            unread: Vec::new(),
            printed: Vec::new(),
        };
        process.wait_for_line(ready, limit)?;
        Ok(process)
    }

    /// Every line printed so far and not yet consumed.
    pub fn drain(&mut self) -> Vec<String> {
        let mut fresh = std::mem::take(&mut self.unread);
        fresh.extend(self.lines.try_iter());
        self.printed.extend(fresh.iter().cloned());
        fresh
    }

    /// Every line the process printed so far, from its start.
    pub fn printed(&mut self) -> &[String] {
        self.drain();
        &self.printed
    }

    /// Waits until the process prints a line containing `needle`, for at most `limit` stretched by
    /// [`crate::pace`] (give the host's figure); returns that line. On failure the error quotes
    /// what it printed.
    pub fn wait_for_line(&mut self, needle: &str, limit: Duration) -> anyhow::Result<String> {
        let limit = paced(limit);
        let deadline = std::time::Instant::now() + limit;
        let mut seen = self.drain();
        if let Some(line) = seen.iter().find(|line| line.contains(needle)) {
            return Ok(line.clone());
        }
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let received = self.lines.recv_timeout(left);
            if let Ok(line) = &received {
                self.printed.push(line.clone());
            }
            match received {
                Ok(line) if line.contains(needle) => return Ok(line),
                Ok(line) => seen.push(line),
                Err(mpsc::RecvTimeoutError::Timeout) => bail!(
                    "{} did not print {needle:?} within {limit:?}; it printed:\n{}",
                    self.name,
                    seen.join("\n")
                ),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait().ok();
                    bail!(
                        "{} exited ({status:?}) before printing {needle:?}; it printed:\n{}",
                        self.name,
                        seen.join("\n")
                    )
                }
            }
        }
    }

    /// The process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = i32::try_from(self.child.id()).context("pid out of range")?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal)
            .with_context(|| format!("sending {signal} to {}", self.name))
    }

    /// Whether the process has exited, and how (without waiting).
    pub fn exited(&mut self) -> anyhow::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait().context("checking on the process")
    }

    /// Waits for the process to exit, for at most `limit` stretched by [`crate::pace`] (give the
    /// host's figure).
    pub fn wait_exit(&mut self, limit: Duration) -> anyhow::Result<std::process::ExitStatus> {
        let limit = paced(limit);
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().context("waiting for the process")? {
                return Ok(status);
            }
            if std::time::Instant::now() >= deadline {
                bail!("{} did not exit within {limit:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Once the process has exited, waits until its output has been read to the end (the reader
    /// threads deliver its last lines after the exit), for at most `limit` stretched by
    /// [`crate::pace`]: past it (a child of its own still holds the pipes), what came is kept.
    pub fn wait_output_closed(&mut self, limit: Duration) {
        let deadline = std::time::Instant::now() + paced(limit);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.unread.push(line),
                Err(_) => return,
            }
        }
    }
}

/// Sends every line `reader` produces to `sender`, from a thread, until either side closes.
fn forward_lines(reader: impl std::io::Read + Send + 'static, sender: mpsc::Sender<String>) {
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                break;
            }
        }
    });
}

impl Drop for TestProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            kill_pid(self.child.id());
        }
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(script: &str) -> Command {
        let mut command = Command::new("sh");
        command.args(["-c", script]);
        command
    }

    /// With the factor at 4, a command's time limit, a wait for a ready line and a wait for an
    /// exit each give up after four times the limit they were given, and say so.
    #[test]
    fn the_process_waits_stretch_by_the_factor() {
        if !crate::pace::rerun_with_slowdown(
            "command::tests::the_process_waits_stretch_by_the_factor",
            4,
        ) {
            return;
        }
        let limit = Duration::from_millis(10);

        let begun = std::time::Instant::now();
        let error =
            output_within(&mut shell("exec sleep 5"), limit).expect_err("sleep outlasts it");
        assert!(begun.elapsed() >= paced(limit), "{:?}", begun.elapsed());
        assert!(error.to_string().contains("within 40ms"), "{error}");

        let error = TestProcess::start("silent", shell("exec sleep 5"), "ready", limit)
            .expect_err("it never prints");
        assert!(error.to_string().contains("within 40ms"), "{error}");

        let mut process = TestProcess::start(
            "lingering",
            shell("echo ready; exec sleep 5"),
            "ready",
            Duration::from_secs(10),
        )
        .expect("it prints ready");
        let begun = std::time::Instant::now();
        let error = process.wait_exit(limit).expect_err("it sleeps on");
        assert!(begun.elapsed() >= paced(limit), "{:?}", begun.elapsed());
        assert!(error.to_string().contains("within 40ms"), "{error}");
    }

    /// The lines a process printed just before it exited are all read once its output closes.
    #[test]
    fn every_line_printed_before_the_exit_is_read_once_the_output_closes() {
        let mut process = TestProcess::start(
            "printer",
            shell("echo ready; seq 1 500"),
            "ready",
            Duration::from_secs(10),
        )
        .expect("it prints ready");
        let status = process
            .wait_exit(Duration::from_secs(10))
            .expect("it exits");
        assert!(status.success(), "{status}");
        process.wait_output_closed(Duration::from_secs(10));
        let lines = process.drain();
        assert_eq!(lines.len(), 500, "{lines:?}");
        assert_eq!(lines.last().map(String::as_str), Some("500"));
        assert_eq!(process.printed().len(), 501);
    }
}
