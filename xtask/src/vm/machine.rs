//! One boot: virtiofsd sharing the host's root read-only, qemu (TCG; no network device, or for
//! the node a user network that reaches one port of the host's loopback) running the guest, its
//! two serial ports in files, a hard deadline, and every process started here killed by its pid.

use std::{
    fs::File,
    io::{Read as _, Seek as _, SeekFrom},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::kernel::Kernel;
use crate::arch::Arch;

/// QEMU 7.2's virtiofsd (package qemu-system-common, which qemu-system-x86 depends on).
const VIRTIOFSD: &str = "/usr/lib/qemu/virtiofsd";
/// Guest memory: the tests' processes, the overlay's tmpfs and the page cache of the shared
/// files.
pub const MEMORY_MIB: u32 = 2048;
/// The node's: containerd, the kubelet and the pods (their state is on the node's disk).
pub const NODE_MEMORY_MIB: u32 = 4096;
/// The virtiofs tag stage 1 mounts.
const ROOT_TAG: &str = "hostroot";

/// The qemu that boots `arch`'s kernels.
#[must_use]
pub const fn qemu_binary(arch: Arch) -> &'static str {
    match arch {
        Arch::X86_64 => "qemu-system-x86_64",
        Arch::Aarch64 => "qemu-system-aarch64",
    }
}

/// A boot to run.
#[derive(Debug)]
pub struct Boot<'a> {
    /// The kernel.
    pub kernel: &'a Kernel,
    /// Its initramfs.
    pub initramfs: &'a Path,
    /// The boot's own directory: the share's mount point, the socket, the logs.
    pub dir: &'a Path,
    /// From qemu's start until it is killed.
    pub timeout: Duration,
    /// Guest memory, MiB.
    pub memory_mib: u32,
    /// The node's network: this port of the host's loopback, which the guest reaches at
    /// `API_HOST` (`bpf_tests::node`, the API server); nothing else.
    pub forward: Option<u16>,
    /// The node's disk (a raw image, `/dev/vda` in the guest), which its boots share.
    pub disk: Option<&'a Path>,
}

/// The address the node reaches the forwarded port at (bpf_tests::node::API_HOST).
const FORWARDED_HOST: &str = "10.0.2.100";

/// qemu's `-nic`: none, or for the node a user network (slirp) that lets the guest reach
/// nothing (`restrict=on`) but the forward: each connection to FORWARDED_HOST:PORT runs the
/// static busybox's `nc` to the host's loopback port (a chardev forward would carry one
/// connection for qemu's life).
fn network(forward: Option<u16>) -> String {
    match forward {
        None => "none".to_owned(),
        Some(port) => format!(
            "user,model=virtio-net-pci,restrict=on,net=10.0.2.0/24,\
             guestfwd=tcp:{FORWARDED_HOST}:{port}-cmd:/bin/busybox nc 127.0.0.1 {port}"
        ),
    }
}

/// How a boot ended.
#[derive(Debug)]
pub struct Outcome {
    /// qemu's exit status, `None` when it hit the deadline and was killed.
    pub status: Option<ExitStatus>,
    /// From qemu's start to its end.
    pub elapsed: Duration,
    /// The kernel's console (ttyS0).
    pub console: PathBuf,
}

/// A process started here, killed (SIGKILL, by pid) and reaped when dropped if still running.
#[derive(Debug)]
struct Started {
    name: &'static str,
    child: Child,
}

impl Started {
    fn spawn(name: &'static str, command: &mut Command) -> anyhow::Result<Self> {
        let child = command
            .spawn()
            .with_context(|| format!("starting {name} ({command:?})"))?;
        Ok(Self { name, child })
    }

    fn running(&mut self) -> anyhow::Result<bool> {
        Ok(self
            .child
            .try_wait()
            .with_context(|| format!("waiting for {}", self.name))?
            .is_none())
    }

    /// Waits up to `limit` for the process to end by itself.
    fn wait_for(&mut self, limit: Duration) -> anyhow::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self
                .child
                .try_wait()
                .with_context(|| format!("waiting for {}", self.name))?
            {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // Child::kill is kill(pid, SIGKILL) on this very process, nothing else.
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Follows a file another process appends to, handing over complete lines.
#[derive(Debug)]
struct Follower {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl Follower {
    fn read_lines(&mut self, on_line: &mut dyn FnMut(&str)) -> anyhow::Result<()> {
        let Ok(mut file) = File::open(&self.path) else {
            // qemu creates it when it starts.
            return Ok(());
        };
        file.seek(SeekFrom::Start(self.offset))
            .with_context(|| format!("reading {}", self.path.display()))?;
        let mut fresh = Vec::new();
        file.read_to_end(&mut fresh)
            .with_context(|| format!("reading {}", self.path.display()))?;
        self.offset += fresh.len() as u64;
        self.partial.extend_from_slice(&fresh);
        while let Some(end) = self.partial.iter().position(|&byte| byte == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            let text = String::from_utf8_lossy(&line);
            on_line(text.trim_end_matches(['\n', '\r']));
        }
        Ok(())
    }

    fn flush(&mut self, on_line: &mut dyn FnMut(&str)) {
        if !self.partial.is_empty() {
            let text = String::from_utf8_lossy(&self.partial).into_owned();
            self.partial.clear();
            on_line(text.trim_end_matches('\r'));
        }
    }
}

/// Boots `boot`, handing every line of the results port to `on_line` as it arrives, until the
/// guest powers off or the deadline passes.
pub fn run(boot: &Boot<'_>, on_line: &mut dyn FnMut(&str)) -> anyhow::Result<Outcome> {
    let dir = boot.dir;
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let share = dir.join("root");
    std::fs::create_dir_all(&share).with_context(|| format!("creating {}", share.display()))?;
    let socket = dir.join("virtiofsd.sock");
    // A unix socket's path has room for 107 bytes.
    if socket.as_os_str().len() > 100 {
        bail!(
            "{} is too long for a unix socket: use a shorter target directory (CARGO_TARGET_DIR)",
            socket.display()
        );
    }
    let console = dir.join("console.log");
    let results = dir.join("results.log");
    // One file for a process's stdout and stderr (two handles would overwrite each other).
    let log = |name: &str| -> anyhow::Result<(File, File)> {
        let path = dir.join(name);
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let copy = file
            .try_clone()
            .with_context(|| format!("opening {} again", path.display()))?;
        Ok((file, copy))
    };

    // cache=always: the guest keeps what it looked up and read instead of asking virtiofsd
    // again after a second; every exec of a dynamically linked program (the tests start
    // hundreds) took 5 times longer without it under TCG. The guest's overlay does not allow its
    // lower layer to change anyway, and what the tests run is frozen in the snapshot.
    //
    // The share is a read-only bind of the host's root file system made in a mount namespace
    // of virtiofsd's own: virtiofsd (QEMU 7.2's) has no read-only mode, and the guest, root
    // in its own kernel, must not be able to write to the host. Non-recursive, so the host's
    // /proc, /sys, /dev and other mounts are not shared at all.
    let (virtiofsd_out, virtiofsd_err) = log("virtiofsd.log")?;
    let mut virtiofsd = Started::spawn(
        "virtiofsd",
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(
                "mount --bind / \"$1\" && mount -o remount,bind,ro \"$1\" && \
                 exec \"$2\" --socket-path=\"$3\" -o source=\"$1\" -o cache=always \
                 -o sandbox=chroot -o log_level=warn",
            )
            .arg("sh")
            .arg(&share)
            .arg(VIRTIOFSD)
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(virtiofsd_out)
            .stderr(virtiofsd_err),
    )?;
    let ready_by = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        if !virtiofsd.running()? {
            bail!(
                "virtiofsd exited before serving the host's root; see {}",
                dir.join("virtiofsd.log").display()
            );
        }
        if Instant::now() >= ready_by {
            bail!(
                "virtiofsd did not create {} within 10 s; see {}",
                socket.display(),
                dir.join("virtiofsd.log").display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    let (qemu_out, qemu_err) = log("qemu.log")?;
    let memory = format!("{}M", boot.memory_mib);
    let mut qemu_command = Command::new(qemu_binary(boot.kernel.arch));
    // KVM cannot boot a stock kernel on these hosts, nor another architecture's: TCG, one host
    // thread per vCPU.
    qemu_command.args(["-accel", "tcg,thread=multi", "-smp", "2"]);
    match boot.kernel.arch {
        Arch::X86_64 => {
            qemu_command
                .args(["-cpu", "max"])
                .args(["-serial", &format!("file:{}", console.display())])
                .args(["-serial", &format!("file:{}", results.display())]);
        }
        Arch::Aarch64 => {
            qemu_command
                .args(["-machine", "virt"])
                // Without pointer authentication: TCG emulates its QARMA5 cipher at a third of
                // the guest's speed, and nothing here tests it.
                .args(["-cpu", "max,pauth=off"])
                .args(["-serial", &format!("file:{}", console.display())])
                // The virt machine has one UART: the results go to a virtio console (hvc0).
                .args(["-device", "virtio-serial-pci"])
                .args([
                    "-chardev",
                    &format!("file,id=results,path={}", results.display()),
                ])
                .args(["-device", "virtconsole,chardev=results"]);
        }
    }
    qemu_command
        .args(["-m", &memory])
        // vhost-user (virtiofsd) needs the guest's memory shared with it.
        .args([
            "-object",
            &format!("memory-backend-memfd,id=mem,size={memory},share=on"),
            "-numa",
            "node,memdev=mem",
        ])
        .args([
            "-chardev",
            &format!("socket,id=root,path={}", socket.display()),
        ])
        .args([
            "-device",
            &format!("vhost-user-fs-pci,chardev=root,tag={ROOT_TAG}"),
        ])
        .args(["-nic", &network(boot.forward)]);
    if let Some(disk) = boot.disk {
        // cache=unsafe: the guest's flushes stop at the host's page cache, which outlives qemu;
        // the image is scratch, gone with the run.
        qemu_command.args([
            "-drive",
            &format!("file={},format=raw,if=virtio,cache=unsafe", disk.display()),
        ]);
    }
    qemu_command
        // A panic (panic=-1 reboots at once) or any reboot ends qemu instead of booting again (the
        // node's reboot is a new boot of the host's, with the same disk).
        .arg("-no-reboot")
        .args(["-nographic", "-monitor", "none"])
        .arg("-kernel")
        .arg(&boot.kernel.vmlinuz)
        .arg("-initrd")
        .arg(boot.initramfs)
        .args([
            "-append",
            &format!(
                "console={} panic=-1 rdinit=/init",
                match boot.kernel.arch {
                    Arch::X86_64 => "ttyS0",
                    Arch::Aarch64 => "ttyAMA0",
                }
            ),
        ])
        .stdin(Stdio::null())
        .stdout(qemu_out)
        .stderr(qemu_err);
    let started = Instant::now();
    let mut qemu = Started::spawn("qemu", &mut qemu_command)?;
    let mut follower = Follower {
        path: results.clone(),
        offset: 0,
        partial: Vec::new(),
    };
    let status = loop {
        follower.read_lines(on_line)?;
        if let Some(status) = qemu.child.try_wait().context("waiting for qemu")? {
            break Some(status);
        }
        if started.elapsed() >= boot.timeout {
            let _ = qemu.child.kill();
            let _ = qemu.child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let elapsed = started.elapsed();
    follower.read_lines(on_line)?;
    follower.flush(on_line);
    // virtiofsd ends when qemu disconnects; drop kills it if it does not.
    let _ = virtiofsd.wait_for(Duration::from_secs(5))?;
    drop(virtiofsd);
    drop(qemu);
    let _ = std::fs::remove_file(&socket);
    let _ = std::fs::remove_dir(&share);
    Ok(Outcome {
        status,
        elapsed,
        console,
    })
}

/// Makes the node's disk at `path`: a sparse raw image of `size_gib` GiB with an ext4 file
/// system (what a node keeps across a reboot; the guest mounts it, node-boot.sh).
pub fn make_disk(path: &Path, size_gib: u64) -> anyhow::Result<()> {
    let disk = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    disk.set_len(size_gib << 30)
        .with_context(|| format!("sizing {}", path.display()))?;
    drop(disk);
    // Few inodes, none zeroed ahead: the guest writes the tables it uses through TCG's disk.
    let output = Command::new("/sbin/mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-i",
            "65536",
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
        ])
        .arg(path)
        .output()
        .context("running mkfs.ext4 (e2fsprogs)")?;
    if !output.status.success() {
        bail!(
            "mkfs.ext4 {} failed ({}): {}",
            path.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}
