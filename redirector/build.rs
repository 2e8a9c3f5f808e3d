//! Builds the kernel programs (`redirector-ebpf`) for the BPF target and leaves the object in
//! `$OUT_DIR/redirector-ebpf`, where `src/datapath.rs` embeds it.

use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    let ebpf_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the redirector crate sits inside the workspace")?
        .join("redirector-ebpf");
    let ebpf_dir = ebpf_dir
        .to_str()
        .context("the workspace path is not UTF-8")?;
    let package = aya_build::Package {
        name: "redirector-ebpf",
        root_dir: ebpf_dir,
        ..Default::default()
    };
    aya_build::build_ebpf([package], aya_build::Toolchain::Nightly).context(
        "building the eBPF object failed; it needs the nightly toolchain with rust-src and \
         bpf-linker: run `cargo xtask setup`, which installs what is missing",
    )
}
