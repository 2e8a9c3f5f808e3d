//! Builds the test clients written in C: `clients/musl-getaddrinfo.c`, linked statically against
//! musl with `musl-gcc` (Debian's musl-tools), into `$OUT_DIR`. The tests find it through
//! `env!("MUSL_GETADDRINFO")`.
//!
//! Without `musl-gcc` the build goes on, with a warning, and `MUSL_GETADDRINFO` is empty: the
//! tests that need the client fail and say to run `cargo xtask setup`; the others run. This
//! script runs again on every build until `musl-gcc` appears.
//!
//! A build for another architecture (`--target aarch64-unknown-linux-musl` on an x86_64 machine)
//! leaves the client out the same way: Debian's `musl-gcc` makes the machine's own binaries only,
//! and clang cannot stand in without musl's headers for the target, which Debian ships only
//! through a foreign dpkg architecture. `MUSL_GETADDRINFO_MISSING` says why it is missing, for the
//! tests' message. A build for the machine's own architecture on another libc (x86_64 musl on
//! x86_64 glibc) still builds it: the client is static.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

/// The C client and the environment variable naming the binary built from it.
const MUSL_CLIENT: (&str, &str) = ("clients/musl-getaddrinfo.c", "MUSL_GETADDRINFO");

fn find_on_path(program: &str) -> Option<PathBuf> {
    env::split_paths(&env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

fn main() {
    let (source, variable) = MUSL_CLIENT;
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed=PATH");
    let host = env::var("HOST").expect("cargo sets HOST");
    let host_arch = host.split('-').next().unwrap_or_default();
    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").expect("cargo sets CARGO_CFG_TARGET_ARCH");
    if target_arch != host_arch {
        let target = env::var("TARGET").expect("cargo sets TARGET");
        let why = format!(
            "bpf-tests was built for {target} on this {host_arch} machine, whose musl-gcc builds \
             {host_arch} binaries only, so the musl client was left out: the musl resolver tests \
             need bpf-tests built on a {target_arch} machine"
        );
        println!("cargo:warning={why}");
        println!("cargo:rustc-env={variable}=");
        println!("cargo:rustc-env={variable}_MISSING={why}");
        return;
    }
    let Some(compiler) = find_on_path("musl-gcc") else {
        // A path that does not exist makes cargo run this script on every build.
        println!("cargo:rerun-if-changed=/usr/bin/musl-gcc");
        println!(
            "cargo:warning=musl-gcc is missing: the musl client is not built and its tests will \
             fail; run `cargo xtask setup` (it installs musl-tools)"
        );
        println!("cargo:rustc-env={variable}=");
        println!(
            "cargo:rustc-env={variable}_MISSING=bpf-tests was built without musl-gcc, so the musl \
             client is missing: run `cargo xtask setup` (it installs musl-tools) and build again"
        );
        return;
    };
    println!("cargo:rerun-if-changed={}", compiler.display());
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let binary = out_dir.join(
        Path::new(source)
            .file_stem()
            .expect("the client's source has a file name"),
    );
    let status = Command::new(&compiler)
        .args(["-static", "-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&binary)
        .arg(source)
        .status()
        .unwrap_or_else(|error| panic!("running {}: {error}", compiler.display()));
    assert!(
        status.success(),
        "{} {source} failed ({status}): see the compiler's messages above",
        compiler.display()
    );
    println!("cargo:rustc-env={variable}={}", binary.display());
    println!("cargo:rustc-env={variable}_MISSING=");
}
