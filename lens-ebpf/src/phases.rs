//! PyTorch's phase marks: `record_function` scopes, backward passes, grad mode, and the
//! checkpoint files written or read (libc's `open`, safetensors, torch's file writers).
use aya_ebpf::helpers::{
    bpf_get_current_pid_tgid, bpf_probe_read_user, bpf_probe_read_user_str_bytes,
};
use aya_ebpf::macros::map;
use aya_ebpf::maps::PerCpuArray;
use aya_ebpf::programs::{ProbeContext, RetProbeContext};
use lens_common::record::{PhaseEntry, PhaseReturn, ScopeEnter};
use lens_common::{ProbeId, saving};

use crate::ctx::{arg_u64, begin_call, new_record, probe_id, send, traced};
use crate::launches::mark_now;
use crate::maps::PY_SAVING;
use crate::python::send_python_stack;

uprobe_and_multi! {
    /// Entry of a function that marks a phase boundary (torch scope exit, backward, grad
    /// mode, checkpoint writer/reader): sent at once with the first integer argument
    /// (`set_enabled`'s flag).
    phase_mark, phase_mark_m => phase_mark_body
}

#[inline(always)]
fn phase_mark_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, target, mut record, _)) = begin_call::<PhaseEntry>(&ctx) else {
        return 0;
    };
    record.body = PhaseEntry {
        mark: mark_now(target),
        argument: arg_u64(&ctx, 0),
    };
    send(&record);
    if record.header.probe == ProbeId::TorchInferenceMode as u32 {
        crate::grad_mode::forget_thread(pid_tgid);
    }
    0
}

uprobe_and_multi! {
    /// libc's `open(path, flags)` / `openat(dirfd, path, flags)` entered: a file created
    /// (`O_CREAT`) is sent as a mark (a checkpoint's file), and so is a file opened for
    /// reading while the process is in a framework load (`PY_SAVING`); any other open sends
    /// nothing and counts nothing, nor does one under `/dev/` or `/proc/` (POSIX semaphores
    /// in `/dev/shm`, which progress bars create, are no checkpoint files).
    file_open_entry, file_open_entry_m => file_open_entry_body
}

#[inline(always)]
fn file_open_entry_body(ctx: ProbeContext) -> u32 {
    use lens_common::open_flags::{ACCMODE, CREAT, DIRECTORY};
    // Both registers are read, then one chosen: the verifier takes context loads at
    // constant offsets only, which a branch between two loads can be merged out of.
    let (open_path, open_flags) = (ctx.arg::<u64>(0), ctx.arg::<u64>(1));
    let (openat_path, openat_flags) = (ctx.arg::<u64>(1), ctx.arg::<u64>(2));
    let (path, flags) = if probe_id(&ctx) == ProbeId::FileOpenAt as u32 {
        (openat_path, openat_flags)
    } else {
        (open_path, open_flags)
    };
    let flags = flags.unwrap_or(0);
    if flags & CREAT == 0 {
        // A file opened for reading counts only inside a framework load (DCP's reader
        // opens each file once; the per-item `torch.load`s read from streams).
        let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
        // SAFETY: the value is copied out.
        let loading = unsafe { PY_SAVING.get(&tgid) }.is_some_and(|v| *v & saving::LOAD != 0);
        if !loading || flags & ACCMODE != 0 || flags & DIRECTORY != 0 {
            return 0;
        }
    }
    // SAFETY: reading the traced thread's memory through the checked helper.
    let prefix =
        unsafe { bpf_probe_read_user(path.unwrap_or(0) as *const [u8; 6]) }.unwrap_or([0; 6]);
    if prefix[..5] == *b"/dev/" || prefix == *b"/proc/" {
        return 0;
    }
    let Some((pid_tgid, target, mut record, _)) = begin_call::<PhaseEntry>(&ctx) else {
        return 0;
    };
    // The Python stack first (stamped before the mark): the loader knows whether the
    // framework save that may have created it is still running.
    send_python_stack(pid_tgid, true);
    record.body = PhaseEntry {
        mark: mark_now(target),
        // The flags tell the loader a file created from one opened for reading; the
        // path's hash, above them, one file opened twice from two.
        argument: (flags & 0xffff_ffff) | (u64::from(path_hash(path.unwrap_or(0))) << 32),
    };
    send(&record);
    0
}

/// Path bytes hashed: a checkpoint's paths differ at their end (a step number, a
/// temporary suffix), rarely past this.
const PATH_BYTES: usize = 256;

/// Where a path is read to be hashed (a program's stack is too small for it).
#[map(name = "PATH_SCRATCH")]
static PATH_SCRATCH: PerCpuArray<[u8; PATH_BYTES]> = PerCpuArray::with_max_entries(1, 0);

/// FNV-1a of the path string at `path` (its first [`PATH_BYTES`]); 0 when unreadable.
#[inline(always)]
fn path_hash(path: u64) -> u32 {
    let Some(buf) = PATH_SCRATCH.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's scratch slot, used by this program alone while it runs.
    let buf = unsafe { &mut *buf };
    // SAFETY: reading the traced thread's memory through the checked helper.
    let len = match unsafe { bpf_probe_read_user_str_bytes(path as *const u8, buf) } {
        Ok(bytes) => bytes.len(),
        Err(_) => return 0,
    };
    let mut hash: u32 = 0x811c_9dc5;
    for i in 0..PATH_BYTES {
        if i >= len {
            break;
        }
        if let Some(byte) = buf.get(i) {
            hash = (hash ^ u32::from(*byte)).wrapping_mul(0x0100_0193);
        }
    }
    // 0 means "not read".
    hash.max(1)
}

uretprobe_and_multi! {
    /// Return of a phase-marking function (end of a backward, of a checkpoint file).
    phase_mark_return, phase_mark_return_m => phase_mark_return_body
}

#[inline(always)]
fn phase_mark_return_body(ctx: RetProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    let mut record = new_record::<PhaseReturn>(probe_id(&ctx), pid_tgid);
    record.body.mark = mark_now(target);
    send(&record);
    0
}

uprobe_and_multi! {
    /// `torch::autograd::Engine::execute(roots, inputs, keep_graph, create_graph,
    /// accumulate_grad, outputs)` entered: sent at once with `accumulate_grad`, which tells
    /// a backward pass (`.backward()`) from `torch.autograd.grad` (graph capture). The
    /// function returns a vector by value, so the hidden return pointer takes rdi and
    /// `accumulate_grad` is the seventh integer argument, the first on the stack.
    torch_backward_entry, torch_backward_entry_m => torch_backward_entry_body
}

#[inline(always)]
fn torch_backward_entry_body(ctx: ProbeContext) -> u32 {
    let Some((_, target, mut record, _)) = begin_call::<PhaseEntry>(&ctx) else {
        return 0;
    };
    record.body = PhaseEntry {
        mark: mark_now(target),
        argument: arg_u64(&ctx, 6) & 0xff,
    };
    send(&record);
    0
}

uprobe_and_multi! {
    /// `record_function_enter_new(const std::string& name, ...)`: the name is read here, in
    /// the kernel, while the string is alive. The function returns a class by value, so the
    /// hidden return pointer takes rdi and `name` is the second argument. libstdc++'s
    /// `std::string` starts with its data pointer and length.
    torch_scope_enter, torch_scope_enter_m => torch_scope_enter_body
}

#[inline(always)]
fn torch_scope_enter_body(ctx: ProbeContext) -> u32 {
    let Some((_, target, mut record, _)) = begin_call::<ScopeEnter>(&ctx) else {
        return 0;
    };
    record.body.mark = mark_now(target);
    let string = arg_u64(&ctx, 1);
    // SAFETY: reads of the traced thread's memory through the checked helpers.
    unsafe {
        let data = bpf_probe_read_user(string as *const u64).unwrap_or(0);
        if let Ok(name) = bpf_probe_read_user_str_bytes(data as *const u8, &mut record.body.name) {
            record.body.name_len = name.len() as u32;
        }
    }
    send(&record);
    0
}
