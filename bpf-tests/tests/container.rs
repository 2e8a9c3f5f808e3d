//! The image, built from the Containerfile, run as deploy/kubernetes/base/daemonset.yaml runs its
//! two containers: the agent with host networking (the sandbox's node namespace stands for the
//! node's), only CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN, a read-only root, no new privileges,
//! the shipped seccomp profile and the DaemonSet's mounts; and the init container's
//! `prepare-node` with its own capabilities. `bpf_tests::container` says how the image is built
//! here.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use bpf_tests::{
    command::{TestProcess, kill_pid},
    container::{Image, MountedImage, Named, Platform, Podman, build_image, build_image_for},
    harness::standard_listeners,
    pace::paced,
    sandbox::{CacheSpec, Ns, Query, Sandbox, Transport, redirector_bin},
    stream::{Stream, StreamReport},
    tools,
    topology::{NODE_LISTENER, dns, who},
};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn podman() -> anyhow::Result<Podman> {
    Podman::new(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("containers"))
}

fn image(podman: &Podman) -> anyhow::Result<Image> {
    let image = build_image(podman, &workspace(), &redirector_bin())?;
    eprintln!("image {}: {} bytes", image.name, image.size);
    Ok(image)
}

fn answered_by(sandbox: &Sandbox) -> anyhow::Result<&'static str> {
    let outcome = sandbox.query(Ns::Pod, Query::new(dns(NODE_LISTENER), Transport::Udp))?;
    Ok(match who(outcome.answer()) {
        "upstream A" | "upstream B" => "upstream",
        other => other,
    })
}

/// Polls until the node listener is answered by `expected`.
fn wait_answered_by(sandbox: &Sandbox, expected: &str, limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + paced(limit);
    loop {
        let now = answered_by(sandbox)?;
        if now == expected {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the node listener is still answered by {now}, not {expected}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The sandbox's standard configuration as the container sees it: the cgroup v2 hierarchy at
/// /sys/fs/cgroup, the pins below /sys/fs/bpf, the lock in /run/redirector, and no cache_netns
/// (the container is in the node's namespace, as a hostNetwork pod is).
fn container_config(sandbox: &Sandbox) -> anyhow::Result<String> {
    let hierarchy = redirector::sys::cgroup::default_attach_cgroup()?;
    let inside = |path: &Path| -> anyhow::Result<String> {
        let relative = path.strip_prefix(&hierarchy)?;
        Ok(Path::new("/sys/fs/cgroup")
            .join(relative)
            .display()
            .to_string())
    };
    let listeners = standard_listeners(sandbox).replace(
        &format!(
            "{:?}",
            sandbox.skipped_cgroup().path().display().to_string()
        ),
        &format!("{:?}", inside(sandbox.skipped_cgroup().path())?),
    );
    Ok(format!(
        "cgroup = {:?}\npin_dir = \"/sys/fs/bpf/redirector\"\nlock_file = \"/run/redirector/agent.lock\"\n\
         socket_reconcile_interval_ms = 500\n\n[probe]\ninterval_ms = {}\ntimeout_ms = {}\n\n\
         [metrics]\naddress = \"127.0.0.1:0\"\n\n{}\n{listeners}",
        inside(sandbox.cgroup().path())?,
        paced(Duration::from_millis(250)).as_millis(),
        paced(Duration::from_millis(200)).as_millis(),
        bpf_tests::sandbox::UNMANAGED_INTERFACE,
    ))
}

/// The agent container's capabilities and seccomp profile.
struct Privileges<'a> {
    capabilities: &'a str,
    seccomp: &'a str,
}

/// The DaemonSet's agent container: the capabilities redirector/tests/deploy.rs asserts
/// `daemonset.yaml` adds (and no others), and the profile it names as `Localhost`.
const DAEMONSET: Privileges<'static> = Privileges {
    capabilities: "BPF,PERFMON,NET_ADMIN",
    seccomp: "deploy/seccomp/redirector.json",
};

/// `podman run` of the agent container in the sandbox's node namespace, in a cgroup below the
/// sandbox's (below the attach point, as a pod is below the node's root: the agent must skip
/// itself).
fn agent_container(
    podman: &Podman,
    sandbox: &Sandbox,
    dirs: &AgentDirs,
    name: &str,
    privileges: &Privileges<'_>,
    redirector_args: &[&str],
) -> anyhow::Result<Command> {
    image_container(
        podman,
        sandbox,
        dirs,
        name,
        privileges,
        bpf_tests::container::IMAGE,
        redirector_args,
    )
}

/// The same, of `image`.
fn image_container(
    podman: &Podman,
    sandbox: &Sandbox,
    dirs: &AgentDirs,
    name: &str,
    privileges: &Privileges<'_>,
    image: &str,
    redirector_args: &[&str],
) -> anyhow::Result<Command> {
    let seccomp = if privileges.seccomp.contains('/') {
        workspace().join(privileges.seccomp).display().to_string()
    } else {
        privileges.seccomp.to_owned()
    };
    let hierarchy = redirector::sys::cgroup::default_attach_cgroup()?;
    let mut command = podman.command();
    command
        .args(["run", "--rm", "--name", name])
        .arg(format!(
            "--network=ns:{}",
            sandbox.node_netns_path().display()
        ))
        .arg(format!("--cgroup-parent={}", dirs.cgroup.parent))
        .args(["--cgroups=no-conmon", "--cap-drop=all"])
        .arg(format!("--cap-add={}", privileges.capabilities))
        .args(["--read-only", "--security-opt=no-new-privileges"])
        .arg(format!("--security-opt=seccomp={seccomp}"))
        .arg(format!(
            "--mount=type=bind,src={},dst=/sys/fs/bpf,bind-propagation=rslave",
            dirs.bpffs.display()
        ))
        .arg(format!(
            "--mount=type=bind,src={},dst=/sys/fs/cgroup,ro=true",
            hierarchy.display()
        ))
        .arg(format!(
            "--mount=type=bind,src={},dst=/run/redirector",
            dirs.run.display()
        ))
        .arg(format!(
            "--mount=type=bind,src={},dst=/etc/redirector,ro=true",
            dirs.config.display()
        ))
        .arg(format!(
            "--mount=type=bind,src={},dst=/run/systemd/resolve,ro=true",
            dirs.resolve.display()
        ))
        .args(["--env=NODE_NAME=node-a", image])
        .args(redirector_args);
    Ok(command)
}

/// The DaemonSet's command of the agent container.
const RUN: &[&str] = &[
    "run",
    "--config",
    "/etc/redirector/config.toml",
    "--log-format",
    "json",
];

/// Where runc puts a container the test starts: `--cgroup-parent` below the sandbox's cgroup.
/// runc (cgroupfs) creates the parent in the v2 hierarchy, below the sandbox's cgroup, and in
/// every v1 hierarchy of a hybrid layout; it removes its container's own cgroup when the
/// container goes, and this removes what is left below the parent (children first) and, in the
/// v1 hierarchies, the sandbox-named directory above it. (`cargo xtask sweep` removes what a
/// test that died left.)
struct ContainerCgroups {
    /// The path below each hierarchy's root.
    parent: String,
}

impl ContainerCgroups {
    fn below(sandbox: &Sandbox, name: &str) -> anyhow::Result<Self> {
        let hierarchy = redirector::sys::cgroup::default_attach_cgroup()?;
        let sandbox_cgroup = sandbox.cgroup().path().strip_prefix(&hierarchy)?;
        Ok(Self {
            parent: Path::new("/")
                .join(sandbox_cgroup)
                .join(name)
                .display()
                .to_string(),
        })
    }
}

/// Removes the empty cgroup directories of `dir`'s tree, children first (every container is
/// gone by now: `Named` removes each one before this drops).
fn remove_empty_tree(dir: &Path) {
    for child in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if child.path().is_dir() {
            remove_empty_tree(&child.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
}

impl Drop for ContainerCgroups {
    fn drop(&mut self) {
        let Ok(hierarchy) = redirector::sys::cgroup::default_attach_cgroup() else {
            return;
        };
        let relative = Path::new(self.parent.trim_start_matches('/'));
        // In the v2 hierarchy only the parent's tree: the sandbox's cgroup above it is the
        // sandbox's to remove.
        remove_empty_tree(&hierarchy.join(relative));
        let Some(top) = relative.components().next() else {
            return;
        };
        for entry in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            let root = entry.path();
            if root != hierarchy && root.join(top).is_dir() {
                remove_empty_tree(&root.join(top));
            }
        }
    }
}

/// The host directories the agent container mounts.
struct AgentDirs {
    bpffs: PathBuf,
    run: PathBuf,
    config: PathBuf,
    resolve: PathBuf,
    cgroup: ContainerCgroups,
}

impl AgentDirs {
    fn new(sandbox: &Sandbox) -> anyhow::Result<Self> {
        let config = sandbox.write_file("config.toml", &container_config(sandbox)?)?;
        let config_dir = config.with_file_name("etc-redirector");
        std::fs::create_dir_all(&config_dir)?;
        std::fs::rename(&config, config_dir.join("config.toml"))?;
        let run = config.with_file_name("run-redirector");
        let resolve = config.with_file_name("run-systemd-resolve");
        for dir in [&run, &resolve] {
            std::fs::create_dir_all(dir)?;
        }
        Ok(Self {
            bpffs: sandbox
                .pin_dir()
                .parent()
                .ok_or_else(|| anyhow::anyhow!("the pin directory has no parent"))?
                .to_owned(),
            run,
            config: config_dir,
            resolve,
            cgroup: ContainerCgroups::below(sandbox, "agent")?,
        })
    }
}

fn start_agent_container(
    podman: &Podman,
    sandbox: &Sandbox,
    dirs: &AgentDirs,
    name: &str,
) -> anyhow::Result<TestProcess> {
    start_image_container(podman, sandbox, dirs, name, bpf_tests::container::IMAGE)
}

/// The DaemonSet's agent container of `image`, started and steering.
fn start_image_container(
    podman: &Podman,
    sandbox: &Sandbox,
    dirs: &AgentDirs,
    name: &str,
    image: &str,
) -> anyhow::Result<TestProcess> {
    let command = image_container(podman, sandbox, dirs, name, &DAEMONSET, image, RUN)?;
    TestProcess::start(
        "the agent's container",
        command,
        "redirector is steering",
        Duration::from_secs(60),
    )
}

#[test]
fn the_image_steers_fails_over_and_is_adopted_by_its_next_container() -> anyhow::Result<()> {
    let podman = podman()?;
    image(&podman)?;
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let dirs = AgentDirs::new(&sandbox)?;
    let first = Named::new(&podman, &format!("rdt-{}-agent", sandbox.tag()));
    let mut agent = start_agent_container(&podman, &sandbox, &dirs, &first.name)?;
    assert!(!sandbox.attached_programs()?.is_empty());
    assert_eq!(answered_by(&sandbox)?, "cache");

    // The container holds exactly what the DaemonSet grants.
    let pid = podman.run(
        &["inspect", "--format", "{{.State.Pid}}", &first.name],
        Duration::from_secs(30),
    )?;
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid.trim()))?;
    let field = |key: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(key))
            .map(|value| value.trim().to_owned())
            .unwrap_or_default()
    };
    // CAP_NET_ADMIN (12), CAP_PERFMON (38), CAP_BPF (39); no_new_privs; a seccomp filter.
    assert_eq!(field("CapEff:"), "000000c000001000", "{status}");
    assert_eq!(field("CapBnd:"), "000000c000001000", "{status}");
    assert_eq!(field("NoNewPrivs:"), "1", "{status}");
    assert_eq!(field("Seccomp:"), "2", "{status}");
    assert!(
        !std::fs::read_to_string(format!("/proc/{}/mountinfo", pid.trim()))?
            .lines()
            .any(|line| line.split_whitespace().nth(4) == Some("/")
                && line
                    .split_whitespace()
                    .nth(5)
                    .is_some_and(|options| options.starts_with("rw"))),
        "the root is read-only"
    );

    // The nftables table went in through the container's nft.
    let tables = sandbox.netns(Ns::Node).run("nft", &["list", "tables"])?;
    assert!(tables.contains("redirector"), "{tables}");

    // The cache was running before the agent, whose container sees no host process: the
    // programs know it all the same, from its reads of the agent's probes.
    let cache_pid = sandbox.process("cache")?.pid();
    let maps = redirector::datapath::Maps::open_pinned(&sandbox.pin_dir())?;
    assert!(
        maps.known_cache_tasks()
            .iter()
            .any(|(tgid, _)| *tgid == cache_pid),
        "the cache {cache_pid} is not known: {:?}",
        maps.known_cache_tasks()
    );
    // A dead cache fails over in the kernel (at its SIGKILL, the signal program); its successor
    // is probed back from the container.
    sandbox.stop_server("cache")?;
    assert_eq!(answered_by(&sandbox)?, "upstream", "failed over");
    assert_eq!(
        maps.cache_activity(bpf_tests::harness::NODE_ID)?.signalled,
        1,
        "the cache's SIGKILL moved its DNS"
    );
    sandbox.start_cache("cache", &CacheSpec::standard())?;
    wait_answered_by(&sandbox, "cache", Duration::from_secs(10))?;

    // The container dies (SIGKILL: no goodbye); steering stays; the next container adopts it.
    podman.run(
        &["kill", "--signal", "KILL", &first.name],
        Duration::from_secs(30),
    )?;
    let _ = agent.wait_exit(Duration::from_secs(30))?;
    first.remove();
    assert!(
        !sandbox.attached_programs()?.is_empty(),
        "the pins outlive the container"
    );
    assert_eq!(answered_by(&sandbox)?, "cache");
    let second = Named::new(&podman, &format!("rdt-{}-agent2", sandbox.tag()));
    let mut agent = start_agent_container(&podman, &sandbox, &dirs, &second.name)?;
    assert!(
        agent
            .printed()
            .iter()
            .any(|line| line.contains("adopting the maps an earlier agent pinned")),
        "{:?}",
        agent.printed()
    );
    assert_eq!(answered_by(&sandbox)?, "cache");
    sandbox.stop_server("cache")?;
    assert_eq!(
        answered_by(&sandbox)?,
        "upstream",
        "the adopted programs fail over"
    );

    podman.run(
        &["stop", "--time", "10", &second.name],
        Duration::from_secs(30),
    )?;
    let status = agent.wait_exit(Duration::from_secs(30))?;
    assert!(status.success(), "{status:?}: {:?}", agent.printed());
    // Removing it from the node is `redirector uninstall` in the same container.
    uninstall_in_container(&podman, &sandbox, &dirs)?;
    assert!(!sandbox.pin_dir().exists(), "pins left behind");
    Ok(())
}

/// The image of "the next release": the image, with `REDIRECTOR_TEST_LAYOUT_BUMP` set (every map
/// migrates, the pins record the next layout and hold a map the first release does not know).
const NEXT_IMAGE: &str = "localhost/redirector-next:test";

fn next_image(podman: &Podman) -> anyhow::Result<()> {
    let context = Path::new(env!("CARGO_TARGET_TMPDIR")).join("next-image");
    std::fs::create_dir_all(&context)?;
    std::fs::write(
        context.join("Containerfile"),
        format!(
            "FROM {}\nENV REDIRECTOR_TEST_LAYOUT_BUMP=1\n",
            bpf_tests::container::IMAGE
        ),
    )?;
    podman.run(
        &["build", "--tag", NEXT_IMAGE, &context.display().to_string()],
        Duration::from_secs(120),
    )?;
    Ok(())
}

/// Stops the last of `containers` as the kubelet does (SIGTERM, 10 s grace) and checks that its
/// agent exited cleanly.
fn stop_container(
    podman: &Podman,
    agent: &mut TestProcess,
    containers: &[Named],
) -> anyhow::Result<()> {
    let current = containers
        .last()
        .ok_or_else(|| anyhow::anyhow!("no container to stop"))?;
    podman.run(
        &["stop", "--time", "10", &current.name],
        Duration::from_secs(30),
    )?;
    let status = agent.wait_exit(Duration::from_secs(30))?;
    anyhow::ensure!(status.success(), "{status:?}: {:?}", agent.printed());
    Ok(())
}

/// A rollout of the next release's image and its rollback, each container stopped and started as
/// the DaemonSet does it (SIGTERM, then the next pod), under a query stream to a listener forced
/// upstream (an unsteered query would reach the cache): no query fails or is answered by the
/// cache, and the layout each release records is on the pins it leaves.
#[test]
fn a_rollout_of_the_next_release_and_its_rollback_lose_no_query() -> anyhow::Result<()> {
    let podman = podman()?;
    image(&podman)?;
    next_image(&podman)?;
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let dirs = AgentDirs::new(&sandbox)?;
    let mut containers = vec![Named::new(&podman, &format!("rdt-{}-agent", sandbox.tag()))];
    let mut agent = start_agent_container(&podman, &sandbox, &dirs, &containers[0].name)?;
    let state = bpf_tests::cli::set_state(&sandbox, "node", "upstream")?;
    assert_eq!(state.code, 0, "{state:?}");
    let stream = Stream::start_with(
        &sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        Duration::from_secs(600),
        &["--kinds", "fresh,connected,long"],
    )?;
    let mut last = 0;
    for (image, name, recorded) in [
        (NEXT_IMAGE, "next", redirector_common::LAYOUT_VERSION + 1),
        (
            bpf_tests::container::IMAGE,
            "back",
            redirector_common::LAYOUT_VERSION,
        ),
    ] {
        std::thread::sleep(paced(Duration::from_millis(800)));
        stop_container(&podman, &mut agent, &containers)?;
        containers.push(Named::new(
            &podman,
            &format!("rdt-{}-{name}", sandbox.tag()),
        ));
        let current = &containers[containers.len() - 1].name;
        agent = start_image_container(&podman, &sandbox, &dirs, current, image)?;
        last = bpf_tests::dns::now_ms();
        assert_eq!(sandbox.pinned_layout()?, recorded, "{image}");
    }
    let report = stream.stop_once(
        "queries after the rollback",
        Duration::from_secs(30),
        |report| {
            report
                .records
                .iter()
                .filter(|record| record.begun_ms > last)
                .count()
                > 30
        },
    )?;
    println!("rollout and rollback: {}", report.summary());
    assert!(report.records.len() > 100, "{}", report.summary());
    for record in &report.records {
        assert!(
            StreamReport::answered_by(record).starts_with("upstream"),
            "a query was not answered by the listener's route: {}",
            report.summary()
        );
    }
    let state = bpf_tests::cli::set_state(&sandbox, "node", "auto")?;
    assert!(state.stdout.contains("(was upstream)"), "{state:?}");
    stop_container(&podman, &mut agent, &containers)?;
    uninstall_in_container(&podman, &sandbox, &dirs)
}

/// `redirector uninstall` in the agent's container, which must detach everything.
fn uninstall_in_container(
    podman: &Podman,
    sandbox: &Sandbox,
    dirs: &AgentDirs,
) -> anyhow::Result<()> {
    let uninstall = Named::new(podman, &format!("rdt-{}-uninstall", sandbox.tag()));
    let mut command = agent_container(
        podman,
        sandbox,
        dirs,
        &uninstall.name,
        &DAEMONSET,
        &["uninstall", "--config", "/etc/redirector/config.toml"],
    )?;
    let output = bpf_tests::command::output_within(&mut command, Duration::from_secs(60))?;
    assert!(output.status.success(), "{output:?}");
    assert_eq!(sandbox.attached_programs()?, "");
    Ok(())
}

#[test]
fn under_the_runtimes_default_seccomp_profile_the_agent_names_what_refuses_bpf()
-> anyhow::Result<()> {
    let podman = podman()?;
    image(&podman)?;
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let dirs = AgentDirs::new(&sandbox)?;
    let named = Named::new(&podman, &format!("rdt-{}-default", sandbox.tag()));
    let mut command = agent_container(
        &podman,
        &sandbox,
        &dirs,
        &named.name,
        &Privileges {
            capabilities: DAEMONSET.capabilities,
            // podman's default (containers-common's): bpf(2) only with CAP_SYS_ADMIN.
            seccomp: "/usr/share/containers/seccomp.json",
        },
        RUN,
    )?;
    let output = bpf_tests::command::output_within(&mut command, Duration::from_secs(60))?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(output.status.code(), Some(1), "{said}");
    assert!(said.contains("seccomp"), "names seccomp: {said}");
    assert!(
        said.contains("deploy/seccomp/redirector.json"),
        "names the profile to use: {said}"
    );
    assert_eq!(sandbox.attached_programs()?, "", "nothing attached");
    assert!(!sandbox.pin_dir().join("maps").exists(), "nothing pinned");
    Ok(())
}

/// The node as prepare-node sees it, made by the test: a PID namespace whose PID 1 (a `sleep`)
/// holds a mount namespace copied from this one with a tmpfs over /sys/fs/bpf, so that no bpf
/// filesystem is there. The init container joins the PID namespace and reads its own /proc
/// where the DaemonSet's reads the host's (`HOST_PROC`), so `1/ns/mnt` is this namespace and
/// never the machine's.
struct FakeNode {
    /// `unshare`, in the new mount namespace; PID 1 of the new PID namespace is its child.
    holder: std::process::Child,
}

impl FakeNode {
    fn new() -> anyhow::Result<Self> {
        let mut holder = Command::new("unshare")
            .args([
                "--pid",
                "--fork",
                "--kill-child",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                "mount -t tmpfs tmpfs /sys/fs/bpf && echo ready && exec sleep 300",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        let stdout = holder.stdout.take();
        let node = Self { holder };
        let mut line = String::new();
        if let Some(stdout) = stdout {
            std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
        }
        anyhow::ensure!(
            line.trim() == "ready",
            "the node's mount namespace: {line:?}"
        );
        Ok(node)
    }

    /// The PID namespace to run the init container in.
    fn pid_namespace(&self) -> String {
        format!("/proc/{}/ns/pid_for_children", self.holder.id())
    }

    /// What the node's mount namespace has at /sys/fs/bpf (`stat -f -c %T`).
    fn bpf_fs_type(&self) -> anyhow::Result<String> {
        Ok(bpf_tests::command::run(
            "nsenter",
            [
                format!("--mount=/proc/{}/ns/mnt", self.holder.id()),
                "--".to_owned(),
                "stat".to_owned(),
                "-f".to_owned(),
                "-c".to_owned(),
                "%T".to_owned(),
                "/sys/fs/bpf".to_owned(),
            ],
        )?
        .trim()
        .to_owned())
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        // --kill-child: the namespace's PID 1 goes with it.
        kill_pid(self.holder.id());
        let _ = self.holder.wait();
    }
}

/// What the DaemonSet grants the init container.
const PREPARE_NODE_CAPABILITIES: [&str; 3] = ["SYS_ADMIN", "SYS_CHROOT", "SYS_PTRACE"];

/// `prepare-node` in the image, with `capabilities` (the init container's), its seccomp and AppArmor
/// settings, read-only root and mounts, and no network; in `node`'s PID namespace.
fn prepare_node(
    podman: &Podman,
    cgroups: &ContainerCgroups,
    capabilities: &str,
    name: &str,
    bpffs: &Path,
    node: &FakeNode,
    seccomp_dir: &Path,
) -> anyhow::Result<String> {
    let _named = Named::new(podman, name);
    podman.run(
        &[
            "run",
            "--rm",
            "--name",
            name,
            "--network=none",
            &format!("--cgroup-parent={}", cgroups.parent),
            "--cgroups=no-conmon",
            &format!("--pid=ns:{}", node.pid_namespace()),
            "--env=HOST_PROC=/proc",
            "--cap-drop=all",
            &format!("--cap-add={capabilities}"),
            "--read-only",
            "--security-opt=seccomp=unconfined",
            "--security-opt=apparmor=unconfined",
            &format!(
                "--mount=type=bind,src={},dst=/sys/fs/bpf,bind-propagation=rslave",
                bpffs.display()
            ),
            &format!(
                "--mount=type=bind,src={},dst=/host/seccomp",
                seccomp_dir.display()
            ),
            "--entrypoint=/usr/local/bin/prepare-node",
            bpf_tests::container::IMAGE,
        ],
        Duration::from_secs(60),
    )
}

#[test]
fn prepare_node_mounts_a_missing_bpffs_on_the_node_and_installs_the_seccomp_profile()
-> anyhow::Result<()> {
    let podman = podman()?;
    image(&podman)?;
    let sandbox = Sandbox::new(tools!())?;
    let scratch = sandbox
        .write_file("prepare-node", "")?
        .with_file_name("prepare-node.d");
    let seccomp_dir = scratch.join("var-lib-kubelet-seccomp");
    let not_bpffs = scratch.join("sys-fs-bpf");
    for dir in [&seccomp_dir, &not_bpffs] {
        std::fs::create_dir_all(dir)?;
    }
    let node = FakeNode::new()?;
    assert_eq!(node.bpf_fs_type()?, "tmpfs", "no bpffs on the node yet");
    let name = format!("rdt-{}-prepare", sandbox.tag());
    let cgroups = ContainerCgroups::below(&sandbox, "prepare")?;

    // Each capability it is granted is needed: without any one of them the mount fails.
    for dropped in PREPARE_NODE_CAPABILITIES {
        let fewer: Vec<&str> = PREPARE_NODE_CAPABILITIES
            .into_iter()
            .filter(|capability| *capability != dropped)
            .collect();
        let refused = prepare_node(
            &podman,
            &cgroups,
            &fewer.join(","),
            &name,
            &not_bpffs,
            &node,
            &seccomp_dir,
        );
        assert!(refused.is_err(), "without {dropped}: {refused:?}");
        assert_eq!(node.bpf_fs_type()?, "tmpfs", "without {dropped}");
    }
    let all = PREPARE_NODE_CAPABILITIES.join(",");
    let printed = prepare_node(
        &podman,
        &cgroups,
        &all,
        &name,
        &not_bpffs,
        &node,
        &seccomp_dir,
    )?;
    assert!(
        printed.contains("no bpf filesystem at /sys/fs/bpf: mounting one"),
        "{printed}"
    );
    assert_eq!(
        node.bpf_fs_type()?,
        "bpf_fs",
        "mounted in the node's namespace"
    );
    let shipped = std::fs::read(workspace().join("deploy/seccomp/redirector.json"))?;
    assert_eq!(
        std::fs::read(seccomp_dir.join("redirector.json"))?,
        shipped,
        "the profile the kubelet will read is the shipped one"
    );

    // On a node with a bpffs it mounts nothing.
    std::fs::remove_file(seccomp_dir.join("redirector.json"))?;
    let bpffs = sandbox
        .pin_dir()
        .parent()
        .ok_or_else(|| anyhow::anyhow!("no parent"))?
        .to_owned();
    let printed = prepare_node(&podman, &cgroups, &all, &name, &bpffs, &node, &seccomp_dir)?;
    assert!(
        printed.contains("a bpf filesystem is mounted at /sys/fs/bpf"),
        "{printed}"
    );
    assert_eq!(std::fs::read(seccomp_dir.join("redirector.json"))?, shipped);
    Ok(())
}

/// The agent cross-built for `platform`: what `cargo xtask build --target ARCH` built (`cargo
/// xtask test` builds it first and names it in `REDIRECTOR_BIN_X86_64` or `REDIRECTOR_BIN_AARCH64`).
fn cross_built_agent(platform: Platform) -> anyhow::Result<PathBuf> {
    let (arch, triple) = match platform {
        Platform::Amd64 => ("x86_64", "x86_64-unknown-linux-musl"),
        Platform::Arm64 => ("aarch64", "aarch64-unknown-linux-musl"),
    };
    let agent = std::env::var_os(format!("REDIRECTOR_BIN_{}", arch.to_uppercase())).map_or_else(
        || Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("../{triple}/release/redirector")),
        PathBuf::from,
    );
    anyhow::ensure!(
        agent.is_file(),
        "{} is missing: build the {arch} agent with `cargo xtask build --target {arch}` (`cargo \
         xtask test` builds it)",
        agent.display()
    );
    Ok(agent)
}

/// What an ELF file says of itself: its machine, its program interpreter, the libraries it needs.
struct ElfFile {
    machine: u16,
    interpreter: Option<String>,
    needed: Vec<String>,
}

fn read_elf(path: &Path) -> anyhow::Result<ElfFile> {
    use object::read::elf::{FileHeader as _, ProgramHeader as _};
    let data = std::fs::read(path)?;
    let file = object::read::elf::ElfFile64::<object::Endianness>::parse(&*data)
        .map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
    let endian = file.endian();
    let mut interpreter = None;
    for header in file.elf_program_headers() {
        if let Some(path) = header
            .interpreter(endian, &*data)
            .map_err(|error| anyhow::anyhow!("{error}"))?
        {
            interpreter = Some(String::from_utf8_lossy(path).into_owned());
        }
    }
    let dynamic = file
        .elf_section_table()
        .dynamic_table(endian, &*data)
        .map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
    let mut needed = Vec::new();
    for entry in &dynamic {
        if entry.tag == object::elf::DT_NEEDED {
            let name = dynamic
                .string(entry)
                .map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
            needed.push(String::from_utf8_lossy(name).into_owned());
        }
    }
    Ok(ElfFile {
        machine: file.elf_header().e_machine(endian),
        interpreter,
        needed,
    })
}

/// The ELF machine of `platform`'s binaries and Debian's multiarch directory of its libraries.
const fn machine_of(platform: Platform) -> (u16, &'static str) {
    match platform {
        Platform::Amd64 => (object::elf::EM_X86_64, "x86_64-linux-gnu"),
        Platform::Arm64 => (object::elf::EM_AARCH64, "aarch64-linux-gnu"),
    }
}

/// Checks that `binary` in the mounted image, its interpreter, and every library it needs (and
/// they need), found where the image's dynamic linker looks, are `platform`'s; returns them.
fn check_closure(
    image: &MountedImage,
    binary: &str,
    platform: Platform,
) -> anyhow::Result<Vec<String>> {
    let (machine, multiarch) = machine_of(platform);
    let dirs = [
        format!("/lib/{multiarch}"),
        format!("/usr/lib/{multiarch}"),
        "/lib".to_owned(),
        "/usr/lib".to_owned(),
    ];
    let mut checked: Vec<String> = Vec::new();
    let mut pending = vec![binary.to_owned()];
    while let Some(file) = pending.pop() {
        if checked.contains(&file) {
            continue;
        }
        let elf = read_elf(&image.resolve(&file)?)?;
        anyhow::ensure!(
            elf.machine == machine,
            "{file} in the {} image is for ELF machine {}, not {machine}",
            platform.debian(),
            elf.machine
        );
        pending.extend(elf.interpreter);
        for library in elf.needed {
            let found = dirs
                .iter()
                .map(|dir| format!("{dir}/{library}"))
                .find(|path| image.resolve(path).is_ok_and(|found| found.is_file()))
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "{file} needs {library}, which is in none of {dirs:?} in the {} image",
                        platform.debian()
                    )
                })?;
            pending.push(found);
        }
        checked.push(file);
    }
    Ok(checked)
}

/// What the packages' maintainer scripts would have made, which the image makes without running
/// them (deploy/container/rootfs.sh): the CA bundle, root's account, the package records.
fn check_made_without_maintainer_scripts(image: &MountedImage) -> anyhow::Result<()> {
    let bundle = std::fs::read_to_string(image.resolve("/etc/ssl/certs/ca-certificates.crt")?)?;
    let certificates = bundle.matches("-----BEGIN CERTIFICATE-----").count();
    anyhow::ensure!(
        certificates > 100,
        "the CA bundle holds {certificates} certificates"
    );
    // Every .pem link points at a certificate in the image.
    for entry in std::fs::read_dir(image.resolve("/etc/ssl/certs")?)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.ends_with(".pem") {
            image.resolve(&format!("/etc/ssl/certs/{name}"))?;
        }
    }
    let passwd = std::fs::read_to_string(image.resolve("/etc/passwd")?)?;
    anyhow::ensure!(
        passwd.starts_with("root:x:0:0:") || passwd.starts_with("root:*:0:0:"),
        "{passwd}"
    );
    let status = std::fs::read_to_string(image.resolve("/var/lib/dpkg/status")?)?;
    for package in ["nftables", "ca-certificates", "libc6"] {
        anyhow::ensure!(
            status.contains(&format!(
                "Package: {package}\nStatus: install ok installed\n"
            )),
            "/var/lib/dpkg/status lacks {package}"
        );
    }
    Ok(())
}

/// The image for the other architecture (arm64 on an x86_64 machine) beside this machine's,
/// assembled with no emulation: the agent cross-built, the root filesystem made by mmdebstrap's
/// extract variant on this machine. Nothing of it can run here, so what it holds is read: its
/// platform, a static agent of its architecture, nft and every library it loads of its
/// architecture, what the maintainer scripts would have made; and one manifest list names both
/// images, so that the DaemonSet's one image name serves every node.
#[test]
fn the_other_architectures_image_is_made_without_emulation_and_one_list_names_both()
-> anyhow::Result<()> {
    let started = Instant::now();
    let podman = podman()?;
    let host = image(&podman)?;
    let other_platform = match Platform::host() {
        Platform::Amd64 => Platform::Arm64,
        Platform::Arm64 => Platform::Amd64,
    };
    let other = build_image_for(
        &podman,
        &workspace(),
        other_platform,
        &cross_built_agent(other_platform)?,
    )?;
    eprintln!(
        "image {}: {} bytes ({:.0?} for both images)",
        other.name,
        other.size,
        started.elapsed()
    );
    let handlers: Vec<String> = std::fs::read_dir("/proc/sys/fs/binfmt_misc")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name != "register" && name != "status")
        .collect();
    // With none, the build above could not have run a program of the other architecture.
    eprintln!("binfmt_misc handlers on this machine: {handlers:?}");

    for (image, platform) in [(&host, Platform::host()), (&other, other_platform)] {
        let said = podman.run(
            &[
                "image",
                "inspect",
                "--format",
                "{{.Os}}/{{.Architecture}}",
                image.name,
            ],
            Duration::from_secs(30),
        )?;
        assert_eq!(said.trim(), platform.oci(), "{}", image.name);
        let mounted = MountedImage::new(&podman, image.name)?;
        let agent = read_elf(&mounted.resolve("/usr/local/bin/redirector")?)?;
        assert_eq!(
            agent.machine,
            machine_of(platform).0,
            "the agent in {} is for ELF machine {}, not {}'s",
            image.name,
            agent.machine,
            platform.debian()
        );
        if platform != Platform::host() {
            // Cross-built: static musl (the host's image holds the tests' debug build).
            assert_eq!(agent.interpreter, None, "a static agent");
            assert!(agent.needed.is_empty(), "{:?}", agent.needed);
        }
        let nft = check_closure(&mounted, "/usr/sbin/nft", platform)?;
        for library in ["libnftables.so.1", "libc.so.6", "libmnl.so.0"] {
            assert!(
                nft.iter().any(|file| file.ends_with(library)),
                "{library} among nft's: {nft:?}"
            );
        }
        // prepare-node's tools run from the same libraries.
        for tool in ["/bin/sh", "/usr/bin/stat", "/usr/bin/nsenter", "/bin/mount"] {
            check_closure(&mounted, tool, platform)?;
        }
        check_made_without_maintainer_scripts(&mounted)?;
        eprintln!(
            "{} ({}): the agent and nft with {} files it loads, all {}",
            image.name,
            platform.oci(),
            nft.len() - 1,
            platform.debian()
        );
    }

    // One name for both: the DaemonSet's image.
    let list = "localhost/redirector:test-list";
    let _ = podman.run(&["manifest", "rm", list], Duration::from_secs(30));
    podman.run(&["manifest", "create", list], Duration::from_secs(30))?;
    for image in [&host, &other] {
        podman.run(
            &[
                "manifest",
                "add",
                list,
                &format!("containers-storage:{}", image.name),
            ],
            Duration::from_secs(60),
        )?;
    }
    let manifest: serde_json::Value = serde_json::from_str(
        &podman.run(&["manifest", "inspect", list], Duration::from_secs(30))?,
    )?;
    let mut listed: Vec<(String, String)> = manifest["manifests"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("no manifests in {manifest}"))?
        .iter()
        .map(|entry| {
            (
                format!(
                    "{}/{}",
                    entry["platform"]["os"].as_str().unwrap_or_default(),
                    entry["platform"]["architecture"]
                        .as_str()
                        .unwrap_or_default()
                ),
                entry["digest"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    listed.sort();
    let mut expected = Vec::new();
    for (image, platform) in [(&host, Platform::host()), (&other, other_platform)] {
        let digest = podman.run(
            &["image", "inspect", "--format", "{{.Digest}}", image.name],
            Duration::from_secs(30),
        )?;
        expected.push((platform.oci(), digest.trim().to_owned()));
    }
    expected.sort();
    assert_eq!(listed, expected, "{manifest}");
    let _ = podman.run(&["manifest", "rm", list], Duration::from_secs(30));
    Ok(())
}
