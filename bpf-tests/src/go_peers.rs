//! The Go programs the tests run as peers (CoreDNS, kube-apiserver, kubectl, etcd): built from
//! the Go modules under `bpf-tests/go/` by `cargo xtask setup` (and `cargo xtask test`) into
//! `target/go/bin`. A test that needs one and finds it missing fails and says how to build it.

use std::path::PathBuf;

/// The path of the Go program `name`: in `$REDIRECTOR_GO_BIN`, or in `target/go/bin` beside the
/// test executable's `target/<profile>/deps`.
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let folder = match std::env::var_os("REDIRECTOR_GO_BIN") {
        Some(folder) => PathBuf::from(folder),
        None => std::env::current_exe()?
            .ancestors()
            .nth(3)
            .map(|target| target.join("go/bin"))
            .ok_or_else(|| anyhow::anyhow!("the test executable has no target folder"))?,
    };
    let path = folder.join(name);
    anyhow::ensure!(
        path.exists(),
        "{} is not built: run `cargo xtask setup` (it builds the tests' Go peers from \
         bpf-tests/go into target/go/bin), or set REDIRECTOR_GO_BIN to a folder that has it",
        path.display()
    );
    Ok(path)
}
