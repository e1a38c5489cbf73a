//! Following process trees: the scheduler's fork, exec and exit tracepoints (raw
//! tracepoints: no tracefs needed), with the `task_struct` field offsets they need read
//! from the running kernel's BTF.
use aya::{Ebpf, EbpfLoader, programs::RawTracePoint};
use btf_rs::{Backend, Btf, Type};
use log::warn;

use crate::error::{LensError, Result};

/// The kernel's own type information.
const KERNEL_BTF: &str = "/sys/kernel/btf/vmlinux";

/// (program in lens-ebpf, tracepoint it attaches to)
const TRACEPOINTS: [(&str, &str); 3] = [
    ("process_fork", "sched_process_fork"),
    ("process_exec", "sched_process_exec"),
    ("process_exit", "sched_process_exit"),
];

/// What the tracepoint programs need to know about this kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLayout {
    /// Byte offset of `task_struct.tgid`.
    pub tgid_offset: u32,
    /// Byte offset of `task_struct.exit_code`.
    pub exit_code_offset: u32,
    /// 1 when `sched_process_exit` passes `group_dead` (Linux 6.16 and later), else 0.
    pub exit_has_group_dead: u32,
    /// Byte offsets of `task_struct.signal` and `signal_struct.nr_threads`.
    pub signal_offset: u32,
    pub nr_threads_offset: u32,
    /// Byte offset of `task_struct.thread.fsbase` (x86-64: the thread pointer, which is
    /// what `pthread_self()` returns; CPython 3.10 names its threads by it).
    pub fsbase_offset: u32,
    /// Byte offset of `task_struct.nvcsw` (voluntary context switches: a Python sample
    /// bounds when a call began only if the thread has not slept since the one before).
    pub nvcsw_offset: u32,
}

fn btf_error(reason: String) -> LensError {
    LensError::KernelBtf { reason }
}

fn member_offset(btf: &Btf, structure: &str, field: &str) -> Result<u32> {
    let types = btf
        .resolve_types_by_name(structure)
        .map_err(|e| btf_error(e.to_string()))?;
    for ty in types {
        let Type::Struct(found) = ty else {
            continue;
        };
        for member in &found.members {
            if btf.resolve_name(member).is_ok_and(|name| name == field) {
                return Ok(member.bit_offset() / 8);
            }
        }
    }
    Err(btf_error(format!(
        "struct {structure} has no field {field}"
    )))
}

/// Parameters of a tracepoint's probe function (`btf_trace_NAME` is a pointer to it; the
/// first parameter is the tracepoint's context).
fn tracepoint_parameters(btf: &Btf, tracepoint: &str) -> Option<usize> {
    let types = btf
        .resolve_types_by_name(&format!("btf_trace_{tracepoint}"))
        .ok()?;
    let Some(Type::Typedef(typedef)) = types.into_iter().next() else {
        return None;
    };
    let Type::Ptr(pointer) = btf.resolve_chained_type(&typedef).ok()? else {
        return None;
    };
    let Type::FuncProto(proto) = btf.resolve_chained_type(&pointer).ok()? else {
        return None;
    };
    Some(proto.parameters.len())
}

/// Reads the layout from the running kernel's BTF.
pub fn kernel_layout() -> Result<KernelLayout> {
    let btf = Btf::from_file_with_backend(KERNEL_BTF, Backend::Mmap)
        .map_err(|e| btf_error(e.to_string()))?;
    Ok(KernelLayout {
        tgid_offset: member_offset(&btf, "task_struct", "tgid")?,
        exit_code_offset: member_offset(&btf, "task_struct", "exit_code")?,
        // (context, task, group_dead)
        exit_has_group_dead: u32::from(
            tracepoint_parameters(&btf, "sched_process_exit").is_some_and(|n| n >= 3),
        ),
        signal_offset: member_offset(&btf, "task_struct", "signal")?,
        nr_threads_offset: member_offset(&btf, "signal_struct", "nr_threads")?,
        fsbase_offset: member_offset(&btf, "task_struct", "thread")?
            + member_offset(&btf, "thread_struct", "fsbase")?,
        nvcsw_offset: member_offset(&btf, "task_struct", "nvcsw")?,
    })
}

/// Sets what the tracepoint programs read.
pub fn configure<'a>(loader: &mut EbpfLoader<'a>, layout: &'a KernelLayout) {
    use lens_common::globals;
    loader.override_global(globals::TASK_TGID_OFFSET, &layout.tgid_offset, true);
    loader.override_global(
        globals::TASK_EXIT_CODE_OFFSET,
        &layout.exit_code_offset,
        true,
    );
    loader.override_global(
        globals::EXIT_HAS_GROUP_DEAD,
        &layout.exit_has_group_dead,
        true,
    );
    loader.override_global(globals::TASK_SIGNAL_OFFSET, &layout.signal_offset, true);
    loader.override_global(globals::TASK_FSBASE_OFFSET, &layout.fsbase_offset, true);
    loader.override_global(globals::TASK_NVCSW_OFFSET, &layout.nvcsw_offset, true);
    loader.override_global(
        globals::SIGNAL_NR_THREADS_OFFSET,
        &layout.nr_threads_offset,
        true,
    );
}

/// Loads and attaches the fork, exec and exit tracepoints. Without them, children of
/// traced processes are not traced: a warning, not an error.
pub fn attach(ebpf: &mut Ebpf) -> Result<()> {
    for (name, tracepoint) in TRACEPOINTS {
        let program: &mut RawTracePoint = crate::bpf::program_mut(ebpf, name)?;
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

/// The layout, or a warning that child processes will not be followed.
pub fn kernel_layout_or_warn() -> Option<KernelLayout> {
    match kernel_layout() {
        Ok(layout) => Some(layout),
        Err(error) => {
            warn!("{error}: child processes of targets will not be traced");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_kernel_passes_group_dead_and_has_the_fields() {
        if !std::path::Path::new(KERNEL_BTF).exists() {
            return;
        }
        let layout = kernel_layout().unwrap();
        assert!(layout.tgid_offset > 0 && layout.exit_code_offset > 0);
        assert_ne!(layout.tgid_offset, layout.exit_code_offset);
        // The tracepoint's format (tracefs) lists group_dead from 6.16 on.
        let format =
            std::fs::read_to_string("/sys/kernel/tracing/events/sched/sched_process_exit/format");
        if let Ok(format) = format {
            assert_eq!(
                layout.exit_has_group_dead,
                u32::from(format.contains("group_dead"))
            );
        }
    }
}
