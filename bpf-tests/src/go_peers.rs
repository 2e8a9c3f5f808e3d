//! The Go programs the tests run as peers (CoreDNS, kube-apiserver, kubectl, etcd): built from
//! the Go modules under `bpf-tests/go/` by `cargo xtask setup` (and `cargo xtask test`) into
//! `target/go/bin`. A test that needs one and finds it missing fails and says how to build it.

use std::path::PathBuf;

/// The path of the Go program `name`: in `$REDIRECTOR_GO_BIN`, or in `target/go/bin` of the
/// target folder the executable is in (a test's `target/<profile>/deps`, a program's
/// `target/<profile>`).
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let folder = match std::env::var_os("REDIRECTOR_GO_BIN") {
        Some(folder) => PathBuf::from(folder),
        None => {
            let exe = std::env::current_exe()?;
            exe.ancestors()
                .skip(2)
                .take(2)
                .map(|target| target.join("go/bin"))
                .find(|folder| folder.is_dir())
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "no go/bin in the target folder of {}: run `cargo xtask setup` (it \
                         builds the tests' Go peers from bpf-tests/go into target/go/bin)",
                        exe.display()
                    )
                })?
        }
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
