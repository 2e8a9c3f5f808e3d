//! A real API server for the agent's Kubernetes side: etcd and kube-apiserver, built from
//! `bpf-tests/go/kube` (`go_peers`), on the host's loopback with RBAC on. The test acts as an
//! administrator (a static token in `system:masters`) through kubectl; the agent gets a token of
//! the shipped ServiceAccount, so it holds exactly the verbs the shipped Roles grant, and every
//! request it makes is in the audit log. The fake server (`fake_kube`) stays for the faults a
//! real one cannot be made to produce.

use std::{
    io::Write as _,
    net::{Ipv4Addr, TcpListener},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};
use serde::Deserialize;

use crate::{command::TestProcess, go_peers, pace::wait_until};

/// The namespace of the agent's ServiceAccount in the shipped overlay.
pub const AGENT_NAMESPACE: &str = "kube-system";
/// The ServiceAccount's name (`deploy/kubernetes/base/serviceaccount.yaml`).
pub const AGENT_ACCOUNT: &str = "redirector";

/// The shipped Kubernetes manifests, `deploy/kubernetes`.
#[must_use]
pub fn manifests() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// etcd and kube-apiserver, stopped (by pid) and their data removed when dropped.
#[derive(Debug)]
pub struct KubeApiserver {
    dir: PathBuf,
    etcd_port: u16,
    port: u16,
    advertise: Option<Ipv4Addr>,
    _etcd: TestProcess,
    apiserver: Option<TestProcess>,
    admin_kubeconfig: PathBuf,
}

/// One request of the agent's, from the audit log.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct AuditedRequest {
    /// `get`, `list`, `watch`, `create`, `patch`, ...
    pub verb: String,
    /// What it asked about.
    #[serde(rename = "objectRef", default)]
    pub object: Option<AuditedObject>,
    /// The answer's code (403: refused by RBAC).
    #[serde(rename = "responseStatus", default)]
    pub status: Option<AuditedStatus>,
}

/// The object of an audited request.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct AuditedObject {
    /// The resource (`endpointslices`, `events`).
    #[serde(default)]
    pub resource: String,
    /// Its API group (empty for the core group).
    #[serde(rename = "apiGroup", default)]
    pub group: String,
    /// Its namespace.
    #[serde(default)]
    pub namespace: String,
}

/// The answer's status of an audited request.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct AuditedStatus {
    /// The HTTP code.
    #[serde(default)]
    pub code: u16,
}

/// A free port on the loopback (bound and let go: nothing else on this machine takes ports from
/// the ephemeral range for listening).
fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The admin's static token: the apiserver reads it from a file in the test's own folder, on a
/// server that listens on the loopback only and lives as long as the test.
const ADMIN_TOKEN: &str = "redirector-test-admin";

impl KubeApiserver {
    /// Starts etcd, then kube-apiserver, in `dir` (the sandbox's scratch folder), and waits until
    /// the API server is ready (its bootstrap RBAC roles and namespaces made).
    pub fn start(dir: &Path) -> anyhow::Result<Self> {
        Self::start_advertising(dir, None)
    }

    /// [`Self::start`], with the API server advertising `advertise` (still listening on the
    /// loopback only): the `kubernetes` Service's endpoint, written by the server's own lease
    /// reconciler, and an address of its serving certificate, for clients that reach the
    /// loopback through a forward of that address (the suite's node, `crate::node`).
    pub fn start_advertising(dir: &Path, advertise: Option<Ipv4Addr>) -> anyhow::Result<Self> {
        let dir = dir.join("kube");
        std::fs::create_dir_all(dir.join("pki"))?;
        let etcd_port = free_port()?;
        let peer_port = free_port()?;
        let mut etcd = Command::new(go_peers::binary("etcd")?);
        etcd.args([
            "--name=test",
            &format!("--data-dir={}", dir.join("etcd").display()),
            &format!("--listen-client-urls=http://127.0.0.1:{etcd_port}"),
            &format!("--advertise-client-urls=http://127.0.0.1:{etcd_port}"),
            &format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
            &format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
            &format!("--initial-cluster=test=http://127.0.0.1:{peer_port}"),
        ]);
        let etcd = TestProcess::start(
            "etcd",
            etcd,
            "ready to serve client requests",
            Duration::from_secs(30),
        )?;

        // The service account tokens' signing key.
        let key = dir.join("pki/sa.key");
        let public = dir.join("pki/sa.pub");
        openssl(&["genrsa", "-out", &path(&key), "2048"])?;
        openssl(&["rsa", "-in", &path(&key), "-pubout", "-out", &path(&public)])?;
        std::fs::write(
            dir.join("tokens.csv"),
            format!("{ADMIN_TOKEN},admin,admin,system:masters\n"),
        )?;
        // Every request of the agent's ServiceAccount, with its answer; nothing else.
        std::fs::write(
            dir.join("audit.yaml"),
            format!(
                "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [\"RequestReceived\"]\nrules:\n- level: Metadata\n  users: [\"system:serviceaccount:{AGENT_NAMESPACE}:{AGENT_ACCOUNT}\"]\n- level: None\n"
            ),
        )?;
        let port = free_port()?;
        let admin_kubeconfig = dir.join("admin.kubeconfig");
        let mut server = Self {
            dir,
            etcd_port,
            port,
            advertise,
            _etcd: etcd,
            apiserver: None,
            admin_kubeconfig,
        };
        server.start_apiserver()?;
        let ca = server.dir.join("pki/apiserver.crt");
        anyhow::ensure!(ca.exists(), "the API server wrote no serving certificate");
        std::fs::write(&server.admin_kubeconfig, kubeconfig(port, &ca, ADMIN_TOKEN))?;
        server.wait_ready()?;
        Ok(server)
    }

    fn start_apiserver(&mut self) -> anyhow::Result<()> {
        let dir = &self.dir;
        let mut apiserver = Command::new(go_peers::binary("kube-apiserver")?);
        match self.advertise {
            Some(address) => apiserver.args([
                format!("--advertise-address={address}"),
                "--endpoint-reconciler-type=lease".to_owned(),
            ]),
            // On the loopback only: the `kubernetes` Service's endpoints (which may not be a
            // loopback address) are left unwritten.
            None => apiserver.args([
                "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none",
            ]),
        };
        apiserver.args([
            &format!("--etcd-servers=http://127.0.0.1:{}", self.etcd_port),
            "--bind-address=127.0.0.1",
            &format!("--secure-port={}", self.port),
            &format!("--cert-dir={}", dir.join("pki").display()),
            "--authorization-mode=RBAC",
            &format!("--token-auth-file={}", dir.join("tokens.csv").display()),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            &format!(
                "--service-account-key-file={}",
                dir.join("pki/sa.pub").display()
            ),
            &format!(
                "--service-account-signing-key-file={}",
                dir.join("pki/sa.key").display()
            ),
            "--service-cluster-ip-range=10.96.0.0/16",
            &format!("--audit-policy-file={}", dir.join("audit.yaml").display()),
            &format!("--audit-log-path={}", dir.join("audit.log").display()),
            "--audit-log-mode=blocking",
        ]);
        self.apiserver = Some(TestProcess::start(
            "kube-apiserver",
            apiserver,
            "Serving securely on",
            Duration::from_secs(60),
        )?);
        Ok(())
    }

    fn wait_ready(&self) -> anyhow::Result<()> {
        wait_until(
            "the API server is ready",
            Duration::from_secs(60),
            Duration::from_millis(200),
            || Ok(self.kubectl(&["get", "--raw", "/readyz"]).is_ok()),
        )
    }

    /// Stops the API server (SIGKILL, by pid; etcd goes on): its clients' watches are cut.
    pub fn stop(&mut self) {
        self.apiserver = None;
    }

    /// Starts a stopped API server again, on the same port and etcd, and waits until it is ready.
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        self.start_apiserver()?;
        self.wait_ready()
    }

    /// Runs kubectl as the administrator; its output, or an error with what it printed.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        self.kubectl_with_input(args, None)
    }

    /// `kubectl apply -f -` of `manifest` (YAML or JSON) as the administrator.
    pub fn apply(&self, manifest: &str) -> anyhow::Result<String> {
        self.kubectl_with_input(&["apply", "-f", "-"], Some(manifest))
    }

    fn kubectl_with_input(&self, args: &[&str], input: Option<&str>) -> anyhow::Result<String> {
        kubectl(&self.admin_kubeconfig, args, input)
    }

    /// A kubeconfig for the agent: a fresh token of the shipped ServiceAccount (TokenRequest,
    /// one hour), the API server's own certificate as the CA.
    pub fn agent_kubeconfig(&self) -> anyhow::Result<String> {
        let token = self.kubectl(&[
            "create",
            "token",
            AGENT_ACCOUNT,
            "--namespace",
            AGENT_NAMESPACE,
            "--duration=1h",
        ])?;
        Ok(kubeconfig(
            self.port,
            &self.dir.join("pki/apiserver.crt"),
            token.trim(),
        ))
    }

    /// The port it listens on, on the loopback.
    #[must_use]
    pub const fn port(&self) -> u16 {
        self.port
    }

    /// Its self-signed serving certificate, the CA of its clients.
    #[must_use]
    pub fn ca(&self) -> PathBuf {
        self.dir.join("pki/apiserver.crt")
    }

    /// The administrator's kubeconfig for a Go client that reaches the server at `host` (the
    /// loopback, or a forward of the advertised address to it).
    #[must_use]
    pub fn admin_kubeconfig_at(&self, host: Ipv4Addr) -> String {
        kubeconfig_at(&host.to_string(), self.port, &self.ca(), ADMIN_TOKEN)
    }

    /// Every request of the agent's ServiceAccount so far.
    pub fn agent_requests(&self) -> anyhow::Result<Vec<AuditedRequest>> {
        let log = std::fs::read_to_string(self.dir.join("audit.log")).unwrap_or_default();
        log.lines()
            .map(|line| {
                serde_json::from_str(line).with_context(|| format!("an audit line: {line}"))
            })
            .collect()
    }
}

impl Drop for KubeApiserver {
    fn drop(&mut self) {
        // The API server before etcd (fields drop in order after this; etcd's data goes with the
        // sandbox's scratch folder).
        self.apiserver = None;
    }
}

/// Runs kubectl with `kubeconfig`, `args` and `input` on its standard input; its output, or an
/// error with what it printed.
pub fn kubectl(kubeconfig: &Path, args: &[&str], input: Option<&str>) -> anyhow::Result<String> {
    let mut command = Command::new(go_peers::binary("kubectl")?);
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().context("running kubectl")?;
    if let Some(input) = input {
        child
            .stdin
            .take()
            .context("kubectl's stdin")?
            .write_all(input.as_bytes())?;
    }
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "kubectl {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn path(path: &Path) -> String {
    path.display().to_string()
}

fn openssl(args: &[&str]) -> anyhow::Result<()> {
    let output = Command::new("openssl")
        .args(args)
        .output()
        .context("running openssl")?;
    anyhow::ensure!(
        output.status.success(),
        "openssl {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// A kubeconfig for the API server on the loopback's `port` with `token`, trusting the
/// certificate at `ca`.
fn kubeconfig(port: u16, ca: &Path, token: &str) -> String {
    kubeconfig_for("127.0.0.1", port, "", ca, token)
}

/// A kubeconfig for the API server at `host`:`port`, for Go clients: the server's name is
/// checked as `kubernetes` (`tls-server-name`), which every certificate the server makes itself
/// names, whatever address it advertises.
fn kubeconfig_at(host: &str, port: u16, ca: &Path, token: &str) -> String {
    kubeconfig_for(host, port, "    tls-server-name: kubernetes\n", ca, token)
}

/// A kubeconfig of one cluster (`server` `host`:`port`, with the `cluster` lines `extra`), one
/// user (`token`) and one context.
fn kubeconfig_for(host: &str, port: u16, extra: &str, ca: &Path, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://{host}:{port}\n{extra}    certificate-authority: {}\nusers:\n- name: test\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\ncurrent-context: test\n",
        ca.display()
    )
}
