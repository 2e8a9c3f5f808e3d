//! The host's side of the suite's node (`bpf_tests::node`), run by `cargo xtask vm-test` before
//! it boots the `+node` guest: builds the node's images, starts its control plane, writes the
//! node's directory (its `ready` file last), and keeps the control plane up until its standard
//! input closes (the VM has powered off, or xtask is gone), then stops it.

use std::{io::Read as _, path::PathBuf};

use anyhow::Context as _;
use bpf_tests::{
    container::Podman,
    node::{NodeDir, control_plane::ControlPlane, images},
};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// The node's directory (made anew).
    #[arg(long)]
    node_dir: PathBuf,
    /// The podman storage the images are built in (kept between runs: the base image is made
    /// once).
    #[arg(long)]
    podman_dir: PathBuf,
    /// The workspace (its Containerfile and deploy/).
    #[arg(long)]
    workspace: PathBuf,
    /// The agent to put in its image.
    #[arg(long)]
    redirector: PathBuf,
    /// The DNS client to put in the client's image.
    #[arg(long)]
    dns_stream: PathBuf,
    /// The previous release's version.
    #[arg(long)]
    previous_version: String,
    /// The previous release's commit, as its agent names it.
    #[arg(long)]
    previous_commit: String,
    /// The previous release's agent.
    #[arg(long)]
    previous_redirector: PathBuf,
    /// The previous release's source tree (its prepare-node and seccomp profile).
    #[arg(long)]
    previous_tree: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.node_dir.exists() {
        std::fs::remove_dir_all(&args.node_dir)
            .with_context(|| format!("removing {}", args.node_dir.display()))?;
    }
    std::fs::create_dir_all(&args.node_dir)
        .with_context(|| format!("creating {}", args.node_dir.display()))?;
    let node = NodeDir::new(&args.node_dir);
    let started = std::time::Instant::now();
    let podman = Podman::new(&args.podman_dir)?;
    let previous = images::Release {
        version: args.previous_version,
        commit: args.previous_commit,
        redirector: args.previous_redirector,
        tree: args.previous_tree,
    };
    images::build(
        &podman,
        &args.workspace,
        &args.redirector,
        &args.dns_stream,
        &previous,
        &node,
    )
    .context("building the node's images")?;
    eprintln!(
        "node-host: images built in {} s",
        started.elapsed().as_secs()
    );
    let control_plane = ControlPlane::start(&node).context("starting the control plane")?;
    eprintln!(
        "node-host: control plane up on 127.0.0.1:{} after {} s",
        control_plane.apiserver().port(),
        started.elapsed().as_secs()
    );
    std::fs::write(node.ready(), b"").context("writing the ready file")?;
    // Until xtask closes the pipe (or is gone).
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    drop(control_plane);
    Ok(())
}
