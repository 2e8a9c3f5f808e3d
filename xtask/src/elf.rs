//! What a built binary is, read from its ELF header and program headers: its machine and whether
//! it is static (no program interpreter). Enough to refuse a build for the wrong architecture or a
//! dynamically linked one before it goes into an image or a VM.

use std::path::Path;

use anyhow::{Context as _, bail, ensure};

use crate::arch::Arch;

/// `p_type` of the program header naming the dynamic linker.
const PT_INTERP: u32 = 3;

/// What an ELF file says of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Elf {
    /// `e_machine`.
    pub machine: u16,
    /// 64-bit (ELFCLASS64).
    pub is_64: bool,
    /// The program interpreter (`PT_INTERP`), which a static binary has none of.
    pub interpreter: Option<String>,
}

impl Elf {
    /// Parses the headers of `bytes`.
    pub fn parse(bytes: &[u8]) -> anyhow::Result<Self> {
        ensure!(
            bytes.len() >= 52 && bytes[..4] == *b"\x7fELF",
            "not an ELF file"
        );
        let is_64 = match bytes[4] {
            1 => false,
            2 => true,
            class => bail!("unknown ELF class {class}"),
        };
        let little = match bytes[5] {
            1 => true,
            2 => false,
            data => bail!("unknown ELF data encoding {data}"),
        };
        let read = |offset: usize, size: usize| -> anyhow::Result<u64> {
            let field = bytes
                .get(offset..offset + size)
                .context("the ELF headers are cut short")?;
            let mut value = 0_u64;
            for (index, byte) in field.iter().enumerate() {
                let shift = if little { index } else { size - 1 - index };
                value |= u64::from(*byte) << (8 * shift);
            }
            Ok(value)
        };
        let machine = u16::try_from(read(18, 2)?)?;
        let (phoff, phentsize, phnum) = if is_64 {
            (read(32, 8)?, read(54, 2)?, read(56, 2)?)
        } else {
            (read(28, 4)?, read(42, 2)?, read(44, 2)?)
        };
        let mut interpreter = None;
        for index in 0..phnum {
            let header = usize::try_from(phoff + index * phentsize)?;
            if read(header, 4)? != u64::from(PT_INTERP) {
                continue;
            }
            let (offset, size) = if is_64 {
                (read(header + 8, 8)?, read(header + 32, 8)?)
            } else {
                (read(header + 4, 4)?, read(header + 16, 4)?)
            };
            let (offset, size) = (usize::try_from(offset)?, usize::try_from(size)?);
            let path = bytes
                .get(offset..offset + size)
                .context("the program interpreter lies past the end of the file")?;
            interpreter = Some(
                String::from_utf8_lossy(path)
                    .trim_end_matches('\0')
                    .to_owned(),
            );
        }
        Ok(Self {
            machine,
            is_64,
            interpreter,
        })
    }

    /// The architecture it is for, by name, for messages.
    #[must_use]
    pub fn machine_name(&self) -> String {
        Arch::of_elf_machine(self.machine).map_or_else(
            || format!("ELF machine {}", self.machine),
            |arch| arch.name().to_owned(),
        )
    }
}

/// Checks that `binary` is a static 64-bit ELF executable for `arch`; says what it is otherwise.
pub fn check_static_binary(binary: &Path, arch: Arch) -> anyhow::Result<Elf> {
    let bytes = std::fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    let elf = Elf::parse(&bytes).with_context(|| format!("reading {}", binary.display()))?;
    if elf.machine != arch.elf_machine() || !elf.is_64 {
        bail!(
            "{} is built for {}, not {}: the build used the wrong target (it should be {})",
            binary.display(),
            elf.machine_name(),
            arch.name(),
            arch.musl_target()
        );
    }
    if let Some(interpreter) = &elf.interpreter {
        bail!(
            "{} is dynamically linked (its interpreter is {interpreter}), not static: it was not \
             built for {}",
            binary.display(),
            arch.musl_target()
        );
    }
    Ok(elf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{EM_AARCH64, EM_X86_64};

    /// A 64-bit little-endian ELF header with one program header, of `p_type`, pointing at
    /// `payload`.
    fn elf64(machine: u16, p_type: u32, payload: &[u8]) -> Vec<u8> {
        let mut bytes = vec![0_u8; 64 + 56];
        bytes[..4].copy_from_slice(b"\x7fELF");
        bytes[4] = 2;
        bytes[5] = 1;
        bytes[18..20].copy_from_slice(&machine.to_le_bytes());
        bytes[32..40].copy_from_slice(&64_u64.to_le_bytes());
        bytes[54..56].copy_from_slice(&56_u16.to_le_bytes());
        bytes[56..58].copy_from_slice(&1_u16.to_le_bytes());
        bytes[64..68].copy_from_slice(&p_type.to_le_bytes());
        let offset = bytes.len() as u64;
        bytes[72..80].copy_from_slice(&offset.to_le_bytes());
        bytes[96..104].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        bytes.extend_from_slice(payload);
        bytes
    }

    #[test]
    fn the_machine_and_the_interpreter_are_read() {
        let dynamic = elf64(EM_AARCH64, PT_INTERP, b"/lib/ld-linux-aarch64.so.1\0");
        let elf = Elf::parse(&dynamic).expect("parses");
        assert_eq!(elf.machine, EM_AARCH64);
        assert!(elf.is_64);
        assert_eq!(
            elf.interpreter.as_deref(),
            Some("/lib/ld-linux-aarch64.so.1")
        );
        assert_eq!(elf.machine_name(), "aarch64");

        // PT_LOAD only: static.
        let fixed = elf64(EM_X86_64, 1, b"");
        let elf = Elf::parse(&fixed).expect("parses");
        assert_eq!(elf.machine, EM_X86_64);
        assert_eq!(elf.interpreter, None);
    }

    #[test]
    fn what_is_not_an_elf_file_is_refused() {
        assert!(Elf::parse(b"#!/bin/sh\necho hello\n").is_err());
        let mut cut = elf64(EM_X86_64, PT_INTERP, b"/lib64/ld-linux-x86-64.so.2\0");
        cut.truncate(100);
        assert!(Elf::parse(&cut).is_err());
    }

    #[test]
    fn a_binary_for_another_machine_or_dynamically_linked_is_named_as_such() {
        let dir = std::env::temp_dir().join(format!("xtask-elf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let other = dir.join("other");
        std::fs::write(&other, elf64(EM_X86_64, 1, b"")).expect("written");
        let error = check_static_binary(&other, Arch::Aarch64).expect_err("wrong machine");
        assert!(
            format!("{error:#}").contains("built for x86_64, not aarch64"),
            "{error:#}"
        );
        let dynamic = dir.join("dynamic");
        std::fs::write(&dynamic, elf64(EM_AARCH64, PT_INTERP, b"/lib/ld.so\0")).expect("written");
        let error = check_static_binary(&dynamic, Arch::Aarch64).expect_err("dynamic");
        assert!(
            format!("{error:#}").contains("dynamically linked"),
            "{error:#}"
        );
        let fine = dir.join("static");
        std::fs::write(&fine, elf64(EM_AARCH64, 1, b"")).expect("written");
        check_static_binary(&fine, Arch::Aarch64).expect("a static aarch64 binary");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The binary this test runs in is an ELF file of the host's architecture.
    #[test]
    fn this_test_binary_reads_as_the_host() {
        let me = std::env::current_exe().expect("the test binary's path");
        let elf = Elf::parse(&std::fs::read(me).expect("readable")).expect("parses");
        assert_eq!(Arch::of_elf_machine(elf.machine), Some(Arch::host()));
    }
}
