//! The images the node runs, built on the host with podman (`crate::container`'s storage) and
//! saved as one archive the guest imports into containerd: the agent's, from the shipped
//! Containerfile; and, each a layer on the agent's (its Debian root file system is all they need:
//! the archive holds it once, and the guest unpacks it once), the previous release's agent (its
//! binary, prepare-node and seccomp profile in place of this build's), a pause, a node-local-dns
//! around the CoreDNS the suite builds (under two tags, for a rollout), and a client that asks
//! DNS every millisecond (`dns-stream`).

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context as _;

use super::NodeDir;
use crate::{
    container::{IMAGE, Podman, build_image},
    go_peers,
};

/// The agent's image: the shipped Containerfile with this build's binary.
pub const AGENT: &str = IMAGE;
/// The agent's image under a new tag: a rollout's.
pub const AGENT_NEXT: &str = "localhost/redirector:next";
/// The previous release's agent ([`Release`]).
pub const PREVIOUS: &str = "localhost/redirector:previous";
/// The sandbox ("pause") image, containerd's `pinned_images.sandbox`.
pub const PAUSE: &str = "localhost/pause:node";
/// node-local-dns, as installed first.
pub const NODE_LOCAL_DNS: &str = "localhost/node-local-dns:1";
/// The same node-local-dns under a new tag: a rollout's.
pub const NODE_LOCAL_DNS_NEXT: &str = "localhost/node-local-dns:2";
/// The DNS client.
pub const CLIENT: &str = "localhost/dns-client:node";

/// A release of the agent the node's image is made of.
#[derive(Debug)]
pub struct Release {
    /// Its version.
    pub version: String,
    /// Its commit as its `--version` names it (12 hex digits).
    pub commit: String,
    /// Its agent.
    pub redirector: PathBuf,
    /// Its source tree (deploy/: prepare-node and the seccomp profile).
    pub tree: PathBuf,
}

/// One image on the agent's: its name, the files copied in (host path, path in the image, whether
/// it is a program to strip of its debug information) and its entrypoint (the agent's where
/// `None`).
struct OnAgent {
    name: &'static str,
    files: Vec<(PathBuf, &'static str, bool)>,
    entrypoint: Option<&'static str>,
}

/// Builds every image and saves them to `node`'s archive.
///
/// # Errors
/// When podman fails, with what it printed.
pub fn build(
    podman: &Podman,
    workspace: &Path,
    redirector: &Path,
    dns_stream: &Path,
    previous: &Release,
    node: &NodeDir,
) -> anyhow::Result<()> {
    build_image(podman, workspace, redirector).context("building the agent's image")?;
    let images = [
        OnAgent {
            name: PAUSE,
            files: Vec::new(),
            // Holds the pod's namespaces; stopped by SIGKILL, as containerd stops a sandbox.
            entrypoint: Some(r#"["/bin/sleep", "infinity"]"#),
        },
        OnAgent {
            name: NODE_LOCAL_DNS,
            files: vec![(go_peers::binary("coredns")?, "/usr/local/bin/coredns", true)],
            entrypoint: Some(r#"["/usr/local/bin/coredns"]"#),
        },
        OnAgent {
            name: CLIENT,
            files: vec![(dns_stream.to_owned(), "/usr/local/bin/dns-stream", true)],
            entrypoint: Some(r#"["/usr/local/bin/dns-stream"]"#),
        },
        // Where the Containerfile puts them.
        OnAgent {
            name: PREVIOUS,
            files: vec![
                (
                    previous.redirector.clone(),
                    "/usr/local/bin/redirector",
                    true,
                ),
                (
                    previous.tree.join("deploy/container/prepare-node.sh"),
                    "/usr/local/bin/prepare-node",
                    false,
                ),
                (
                    previous.tree.join("deploy/seccomp/redirector.json"),
                    "/usr/share/redirector/seccomp.json",
                    false,
                ),
            ],
            entrypoint: None,
        },
    ];
    let context = node.path().join("image-context");
    for image in &images {
        let _ = std::fs::remove_dir_all(&context);
        std::fs::create_dir_all(&context)
            .with_context(|| format!("creating {}", context.display()))?;
        let mut containerfile = format!("FROM {AGENT}\n");
        for (index, (from, to, program)) in image.files.iter().enumerate() {
            let name = format!("file-{index}");
            let copy = context.join(&name);
            if *program {
                // Without its debug information (the client is a debug build, 200 MB with it).
                crate::command::run(
                    "objcopy",
                    [
                        "--strip-debug".to_owned(),
                        from.display().to_string(),
                        copy.display().to_string(),
                    ],
                )
                .map(drop)
            } else {
                std::fs::copy(from, &copy).map(drop).map_err(Into::into)
            }
            .with_context(|| format!("copying {} into the build context", from.display()))?;
            // COPY keeps the mode: a program's, prepare-node's (0755 in git) and the profile's.
            containerfile.push_str(&format!("COPY {name} {to}\n"));
        }
        // The agent's CMD (its `run` arguments) is not theirs.
        if let Some(entrypoint) = image.entrypoint {
            containerfile.push_str(&format!("ENTRYPOINT {entrypoint}\nCMD []\n"));
        }
        std::fs::write(context.join("Containerfile"), containerfile)
            .context("writing a Containerfile")?;
        podman.run(
            &[
                "build",
                "--network",
                "none",
                "--tag",
                image.name,
                &context.display().to_string(),
            ],
            Duration::from_secs(300),
        )?;
    }
    let _ = std::fs::remove_dir_all(&context);
    for (image, tag) in [(NODE_LOCAL_DNS, NODE_LOCAL_DNS_NEXT), (AGENT, AGENT_NEXT)] {
        podman.run(&["tag", image, tag], Duration::from_secs(30))?;
    }
    std::fs::write(
        node.previous_release(),
        format!("{} {}", previous.version, previous.commit),
    )
    .context("writing the previous release's version")?;
    let names = [
        AGENT,
        AGENT_NEXT,
        PREVIOUS,
        PAUSE,
        NODE_LOCAL_DNS,
        NODE_LOCAL_DNS_NEXT,
        CLIENT,
    ];
    let archive = node.images();
    let _ = std::fs::remove_file(&archive);
    let mut save = vec![
        "save",
        "--multi-image-archive",
        "--format",
        "docker-archive",
        "--output",
    ];
    let archive_path = archive.display().to_string();
    save.push(&archive_path);
    save.extend(names);
    podman.run(&save, Duration::from_secs(300))?;
    Ok(())
}
