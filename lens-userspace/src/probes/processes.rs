//! Following process trees: the scheduler's fork and exec tracepoints (raw tracepoints:
//! no tracefs needed), with the `task_struct` field offsets they need read from the
//! running kernel's BTF.
use aya::{Ebpf, EbpfLoader, programs::RawTracePoint};
use btf_rs::{Btf, Type};
use log::warn;

use crate::error::{LensError, Result};

/// The kernel's own type information.
const KERNEL_BTF: &str = "/sys/kernel/btf/vmlinux";

/// (program in lens-ebpf, tracepoint it attaches to)
const TRACEPOINTS: [(&str, &str); 2] = [
    ("process_fork", "sched_process_fork"),
    ("process_exec", "sched_process_exec"),
];

/// Byte offset of `task_struct.tgid` in this kernel.
pub fn task_tgid_offset() -> Result<u32> {
    let btf_error = |reason: String| LensError::KernelBtf { reason };
    let btf = Btf::from_file(KERNEL_BTF).map_err(|e| btf_error(e.to_string()))?;
    let types = btf
        .resolve_types_by_name("task_struct")
        .map_err(|e| btf_error(e.to_string()))?;
    for ty in types {
        let Type::Struct(task) = ty else {
            continue;
        };
        for member in &task.members {
            if btf.resolve_name(member).is_ok_and(|name| name == "tgid") {
                return Ok(member.bit_offset() / 8);
            }
        }
    }
    Err(btf_error("struct task_struct has no field tgid".into()))
}

/// Sets the offset the fork tracepoint reads.
pub fn configure<'a>(loader: &mut EbpfLoader<'a>, tgid_offset: &'a u32) {
    loader.override_global(lens_common::globals::TASK_TGID_OFFSET, tgid_offset, true);
}

/// Loads and attaches the fork and exec tracepoints. Without them, children of traced
/// processes are not traced: a warning, not an error.
pub fn attach(ebpf: &mut Ebpf) -> Result<()> {
    for (name, tracepoint) in TRACEPOINTS {
        let program: &mut RawTracePoint = ebpf
            .program_mut(name)
            .ok_or(LensError::MissingInObject {
                kind: "program",
                name,
            })?
            .try_into()
            .map_err(|source| LensError::Program {
                program: name,
                source,
            })?;
        program
            .load()
            .and_then(|()| program.attach(tracepoint).map(|_| ()))
            .map_err(|source| LensError::Program {
                program: name,
                source,
            })?;
    }
    Ok(())
}

/// The offsets, or a warning that child processes will not be followed.
pub fn tgid_offset_or_warn() -> Option<u32> {
    match task_tgid_offset() {
        Ok(offset) => Some(offset),
        Err(error) => {
            warn!("{error}: child processes of targets will not be traced");
            None
        }
    }
}
