//! The probe of the fetching atomics: whether the running kernel loads a program that uses each
//! one the programs use (`atomic_fetch_add`, `_or`, `_and`, `cmpxchg`).
//!
//! The verifier accepts them from 5.12 on every architecture, but a program runs only once the
//! JIT has compiled it (or, without `CONFIG_BPF_JIT_ALWAYS_ON`, in the interpreter): arm64's JIT
//! compiles them only from 5.18 ("arm64, bpf: support more atomic operations"), so an arm64 5.15
//! node (Ubuntu 22.04, which sets `JIT_ALWAYS_ON`) refuses them at load, whatever its release
//! number says. Loading the instructions themselves is the only true answer.

use std::os::fd::{FromRawFd as _, OwnedFd};

use aya_obj::generated::{
    BPF_ADD, BPF_ALU64, BPF_AND, BPF_ATOMIC, BPF_CMPXCHG, BPF_DW, BPF_EXIT, BPF_FETCH, BPF_JMP,
    BPF_K, BPF_MEM, BPF_MOV, BPF_OR, BPF_STX, bpf_cmd, bpf_insn, bpf_prog_type,
};

/// The frame pointer, `r10`.
const FRAME: u8 = 10;
/// The stack slot the atomics work on.
const SLOT: i16 = -8;

/// One instruction.
fn insn(code: u32, dst: u8, src: u8, off: i16, imm: i32) -> bpf_insn {
    bpf_insn {
        code: u8::try_from(code).unwrap_or_default(),
        off,
        imm,
        _bitfield_align_1: [],
        _bitfield_1: bpf_insn::new_bitfield_1(dst, src),
    }
}

/// `dst = imm`.
fn mov(dst: u8, imm: i32) -> bpf_insn {
    insn(BPF_ALU64 | BPF_MOV | BPF_K, dst, 0, 0, imm)
}

/// The atomic `op` (with `BPF_FETCH` in it, or `BPF_CMPXCHG`) on the stack slot, with `src`.
fn atomic(op: u32, src: u8) -> bpf_insn {
    insn(
        BPF_STX | BPF_ATOMIC | BPF_DW,
        FRAME,
        src,
        SLOT,
        i32::try_from(op).unwrap_or_default(),
    )
}

/// The probe program: a stack slot set to 0, then each fetching atomic on it, then `exit` with
/// 0.
fn program() -> Vec<bpf_insn> {
    vec![
        mov(1, 0),
        insn(BPF_STX | BPF_MEM | BPF_DW, FRAME, 1, SLOT, 0),
        mov(1, 1),
        atomic(BPF_ADD | BPF_FETCH, 1),
        mov(1, 1),
        atomic(BPF_OR | BPF_FETCH, 1),
        mov(1, 1),
        atomic(BPF_AND | BPF_FETCH, 1),
        // `cmpxchg` compares with r0 and returns into it.
        mov(0, 0),
        mov(1, 1),
        atomic(BPF_CMPXCHG, 1),
        mov(0, 0),
        insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),
    ]
}

/// The head of the `bpf_attr` member of `BPF_PROG_LOAD` (the kernel zero-extends the rest).
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
}

/// Whether the kernel loads a socket filter that uses every fetching atomic: `Err` when the
/// load failed for another reason than the instructions (no `bpf(2)` for this process, say),
/// in which case the caller falls back to the release number.
///
/// # Errors
/// The load's error when it says nothing of the instructions (`EPERM`, `ENOMEM`).
pub fn probe() -> std::io::Result<bool> {
    let program = program();
    let license = c"GPL";
    let attr = ProgLoadAttr {
        prog_type: bpf_prog_type::BPF_PROG_TYPE_SOCKET_FILTER as u32,
        insn_cnt: u32::try_from(program.len()).unwrap_or_default(),
        insns: program.as_ptr() as u64,
        license: license.as_ptr() as u64,
    };
    // SAFETY: `attr` is a valid `bpf_attr` head of the size passed, and the instructions and the
    // license it points to outlive the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_PROG_LOAD as libc::c_int,
            &raw const attr,
            size_of::<ProgLoadAttr>(),
        )
    };
    if fd >= 0 {
        // SAFETY: a descriptor the kernel just returned to this process, owned here only.
        drop(unsafe { OwnedFd::from_raw_fd(i32::try_from(fd).unwrap_or(-1)) });
        return Ok(true);
    }
    let error = std::io::Error::last_os_error();
    match error.raw_os_error() {
        // The verifier refused an instruction (before 5.12), or the JIT could not compile one
        // and the kernel has no interpreter to fall back on (`ENOTSUPP`, 524: arm64 before
        // 5.18 with `JIT_ALWAYS_ON`).
        Some(libc::EINVAL | libc::ENOTSUP | 524) => Ok(false),
        _ => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_program_holds_each_fetching_atomic_once() {
        let program = program();
        let ops: Vec<i32> = program
            .iter()
            .filter(|insn| u32::from(insn.code) == BPF_STX | BPF_ATOMIC | BPF_DW)
            .map(|insn| insn.imm)
            .collect();
        let expected: Vec<i32> = [
            BPF_ADD | BPF_FETCH,
            BPF_OR | BPF_FETCH,
            BPF_AND | BPF_FETCH,
            BPF_CMPXCHG,
        ]
        .iter()
        .map(|op| i32::try_from(*op).unwrap_or_default())
        .collect();
        assert_eq!(ops, expected);
        assert_eq!(
            program.last().map(|insn| u32::from(insn.code)),
            Some(BPF_JMP | BPF_EXIT)
        );
    }
}
