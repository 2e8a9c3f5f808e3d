//! The audit of the embedded object against the table: every helper call and fetching atomic in
//! it has its row, none newer than the floor runs without its switch, and no loop closes in a way
//! the floor's verifier refuses.

use std::collections::{BTreeMap, BTreeSet};

use aya::programs::ProgramType;
use aya_obj::generated::{
    BPF_ATOMIC, BPF_CALL, BPF_EXIT, BPF_FETCH, BPF_JA, BPF_JMP, BPF_STX, bpf_insn,
};
use redirector_common::names;

use super::{FEATURES, FLOOR, KernelFeature, Need, Uses, mainline};

/// The program type of each program in the object, by the shared names.
fn program_type(name: &str) -> ProgramType {
    if names::SOCK_ADDR_PROGRAMS.contains(&name) {
        ProgramType::CgroupSockAddr
    } else if names::SOCK_PROGRAMS.contains(&name) {
        ProgramType::CgroupSock
    } else if names::SKB_PROGRAMS.contains(&name) {
        ProgramType::CgroupSkb
    } else if names::RAW_TRACEPOINT_PROGRAMS.contains(&name) || name == names::PROG_TICKS {
        ProgramType::RawTracePoint
    } else {
        panic!("the object holds a program the shared names do not: {name}")
    }
}

/// What the audit finds in one program.
#[derive(Default)]
struct Found {
    helpers: BTreeSet<i32>,
    kfuncs: BTreeSet<i32>,
    atomic_fetch: bool,
}

fn scan(found: &mut Found, instructions: &[bpf_insn]) -> bool {
    let call = u8::try_from(BPF_JMP | BPF_CALL).expect("an opcode is a byte");
    let mut calls_functions = false;
    for insn in instructions {
        if insn.code == call {
            // src_reg: 0 a helper, 1 a bpf-to-bpf call, 2 a kfunc (BPF_PSEUDO_*).
            match insn.src_reg() {
                0 => {
                    found.helpers.insert(insn.imm);
                }
                1 => calls_functions = true,
                _ => {
                    found.kfuncs.insert(insn.imm);
                }
            }
        }
        let class_and_mode = u32::from(insn.code) & 0xe7;
        let fetch = u32::try_from(insn.imm).is_ok_and(|imm| imm & BPF_FETCH != 0);
        if class_and_mode == (BPF_STX | BPF_ATOMIC) && fetch {
            found.atomic_fetch = true;
        }
    }
    calls_functions
}

/// Every helper call, kfunc call and fetching atomic in the embedded object, by program.
fn audit_object() -> BTreeMap<String, (ProgramType, Found)> {
    let object = aya_obj::Object::parse(crate::datapath::OBJECT).expect("the object parses");
    let program_sections: BTreeSet<usize> = object
        .programs
        .values()
        .map(|program| program.section_index)
        .collect();
    object
        .programs
        .iter()
        .map(|(name, program)| {
            let mut found = Found::default();
            let mut calls_functions = false;
            // A program's section can hold subprograms of its own; calls to shared code go
            // to `.text`. Conservatively, a program that makes any bpf-to-bpf call is
            // charged with every function outside the programs' sections.
            for ((section, _), function) in &object.functions {
                if *section == program.section_index {
                    calls_functions |= scan(&mut found, &function.instructions);
                }
            }
            if calls_functions {
                for ((section, _), function) in &object.functions {
                    if !program_sections.contains(section) {
                        scan(&mut found, &function.instructions);
                    }
                }
            }
            (name.clone(), (program_type(name), found))
        })
        .collect()
}

/// The instructions a depth-first walk of `instructions` finds entered by falling through a
/// non-jump instruction while on the walk's own path: a loop closed that way. The floor's
/// verifier (5.15, and 6.1 as the VM test saw: "back-edge from insn N to N+1") accepts a
/// loop's back edge only from a jump, and walks as this does (a conditional jump's fall-through
/// first); newer ones accept either, so the host's verifier never shows it.
fn fall_through_back_edges(instructions: &[bpf_insn]) -> Vec<usize> {
    const BPF_JMP32: u8 = 0x06;
    const BPF_LD_IMM64: u8 = 0x18;
    let jump_class = |code: u8| code & 0x07 == BPF_JMP as u8 || code & 0x07 == BPF_JMP32;
    // (target, whether it is a non-jump instruction's fall-through).
    let edges = |at: usize| -> Vec<(usize, bool)> {
        let insn = &instructions[at];
        let op = insn.code & 0xf0;
        if !jump_class(insn.code) || op == BPF_CALL as u8 {
            let width = if insn.code == BPF_LD_IMM64 { 2 } else { 1 };
            return vec![(at + width, true)];
        }
        if op == BPF_EXIT as u8 {
            return Vec::new();
        }
        let target = usize::try_from(at as i64 + 1 + i64::from(insn.off)).unwrap_or(usize::MAX);
        if op == BPF_JA as u8 {
            vec![(target, false)]
        } else {
            vec![(at + 1, false), (target, false)]
        }
    };
    let (mut state, mut closed) = (vec![0u8; instructions.len()], Vec::new());
    let mut path = vec![(0usize, edges(0), 0usize)];
    state[0] = 1;
    while let Some((at, out, next)) = path.last_mut() {
        let Some(&(target, fell)) = out.get(*next) else {
            state[*at] = 2;
            path.pop();
            continue;
        };
        *next += 1;
        match state.get(target) {
            Some(1) if fell => closed.push(target),
            Some(0) => {
                state[target] = 1;
                path.push((target, edges(target), 0));
            }
            _ => {}
        }
    }
    closed
}

#[test]
fn no_loop_in_the_object_closes_by_falling_through() {
    let object = aya_obj::Object::parse(crate::datapath::OBJECT).expect("the object parses");
    let mut closed = Vec::new();
    for ((section, offset), function) in &object.functions {
        for at in fall_through_back_edges(&function.instructions) {
            closed.push(format!(
                "{} (section {section}, offset {offset}): insn {at}",
                function.name
            ));
        }
    }
    assert!(
        closed.is_empty(),
        "loops that 5.15 and 6.1 refuse (\"back-edge from insn\"); restructure the loop (a \
         constant trip count the compiler unrolls, or the exit test at its bottom):\n{}",
        closed.join("\n")
    );
}

#[test]
fn every_helper_call_in_the_object_has_its_row_and_none_is_newer_than_the_floor_unswitched() {
    let audit = audit_object();
    let mut unlisted = Vec::new();
    let mut used: BTreeSet<(&str, i32)> = BTreeSet::new();
    for (name, (program, found)) in &audit {
        assert!(
            found.kfuncs.is_empty(),
            "{name} calls kfuncs {:?}: kfuncs need a row and a probe of their own (BTF), \
             which this table does not have yet",
            found.kfuncs
        );
        for helper in &found.helpers {
            let rows: Vec<&KernelFeature> = FEATURES
                .iter()
                .filter(|feature| match feature.uses {
                    Uses::Helpers { programs, helpers } => {
                        programs.contains(program)
                            && helpers.iter().any(|listed| *listed as i32 == *helper)
                    }
                    _ => false,
                })
                .collect();
            if rows.is_empty() {
                unlisted.push(format!("{name} ({program:?}) calls helper #{helper}"));
            }
            for row in rows {
                used.insert((row.id, *helper));
                if row.since > FLOOR {
                    let switch = match row.need {
                        Need::Optional { switch, .. } => switch,
                        Need::Required => None,
                    };
                    let switch = switch.unwrap_or_else(|| {
                        panic!(
                            "{name} calls helper #{helper} ({}, {}) above the floor {} \
                             without a switch",
                            row.name,
                            mainline(row.since),
                            mainline(FLOOR)
                        )
                    });
                    assert!(
                        crate::datapath::OBJECT
                            .windows(switch.len())
                            .any(|window| window == switch.as_bytes()),
                        "the switch {switch} of {} is not in the object",
                        row.name
                    );
                }
            }
        }
        if found.atomic_fetch {
            // Above the floor on arm64 (5.18): behind its switch, which the object has.
            let switch = FEATURES
                .iter()
                .find(|feature| feature.uses == Uses::AtomicFetch)
                .and_then(|feature| match feature.need {
                    Need::Optional { switch, .. } => switch,
                    Need::Required => None,
                })
                .unwrap_or_else(|| {
                    panic!("{name} uses a fetching atomic without its switched row")
                });
            assert!(
                crate::datapath::OBJECT
                    .windows(switch.len())
                    .any(|window| window == switch.as_bytes()),
                "the switch {switch} of the fetching atomics is not in the object"
            );
        }
    }
    assert!(
        unlisted.is_empty(),
        "helper calls without a row in FEATURES (add one, with its release and probe):\n{}",
        unlisted.join("\n")
    );
    // And no row lists a helper the object no longer calls.
    for feature in FEATURES {
        if let Uses::Helpers { helpers, .. } = feature.uses {
            for helper in helpers {
                assert!(
                    used.contains(&(feature.id, *helper as i32)),
                    "{} lists {helper:?}, which no program of its types calls",
                    feature.name
                );
            }
        }
    }
    assert!(
        audit.values().any(|(_, found)| found.atomic_fetch),
        "the fetching atomic row has no use left"
    );
}
