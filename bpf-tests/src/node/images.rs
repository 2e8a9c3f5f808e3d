//! The images the node runs, built on the host with podman (`crate::container`'s storage) and
//! saved as one archive the guest imports into containerd: the agent's, from the shipped
//! Containerfile; and, each a layer on the agent's (its Debian root file system is all they need:
//! the archive holds it once, and the guest unpacks it once), a pause, a node-local-dns around
//! the CoreDNS the suite builds (under two tags, for a rollout), and a client that asks DNS every
//! millisecond (`dns-stream`).

use std::{path::Path, time::Duration};

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
/// The sandbox ("pause") image, containerd's `pinned_images.sandbox`.
pub const PAUSE: &str = "localhost/pause:node";
/// node-local-dns, as installed first.
pub const NODE_LOCAL_DNS: &str = "localhost/node-local-dns:1";
/// The same node-local-dns under a new tag: a rollout's.
pub const NODE_LOCAL_DNS_NEXT: &str = "localhost/node-local-dns:2";
/// The DNS client.
pub const CLIENT: &str = "localhost/dns-client:node";

/// One image on the agent's: its name, the files copied in (host path, name in the image's
/// /usr/local/bin) and its entrypoint.
struct OnAgent {
    name: &'static str,
    files: Vec<(std::path::PathBuf, &'static str)>,
    entrypoint: &'static str,
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
    node: &NodeDir,
) -> anyhow::Result<()> {
    build_image(podman, workspace, redirector).context("building the agent's image")?;
    let images = [
        OnAgent {
            name: PAUSE,
            files: Vec::new(),
            // Holds the pod's namespaces; stopped by SIGKILL, as containerd stops a sandbox.
            entrypoint: r#"["/bin/sleep", "infinity"]"#,
        },
        OnAgent {
            name: NODE_LOCAL_DNS,
            files: vec![(go_peers::binary("coredns")?, "coredns")],
            entrypoint: r#"["/usr/local/bin/coredns"]"#,
        },
        OnAgent {
            name: CLIENT,
            files: vec![(dns_stream.to_owned(), "dns-stream")],
            entrypoint: r#"["/usr/local/bin/dns-stream"]"#,
        },
    ];
    let context = node.path().join("image-context");
    for image in &images {
        let _ = std::fs::remove_dir_all(&context);
        std::fs::create_dir_all(&context)
            .with_context(|| format!("creating {}", context.display()))?;
        let mut containerfile = format!("FROM {AGENT}\n");
        for (from, name) in &image.files {
            // Without its debug information (the client is a debug build, 200 MB with it).
            crate::command::run(
                "objcopy",
                [
                    "--strip-debug".to_owned(),
                    from.display().to_string(),
                    context.join(name).display().to_string(),
                ],
            )
            .with_context(|| format!("copying {} into the build context", from.display()))?;
            containerfile.push_str(&format!("COPY {name} /usr/local/bin/{name}\n"));
        }
        // The agent's CMD (its `run` arguments) is not theirs.
        containerfile.push_str(&format!("ENTRYPOINT {}\nCMD []\n", image.entrypoint));
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
    let names = [
        AGENT,
        AGENT_NEXT,
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
