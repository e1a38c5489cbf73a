//! Kernel launches: counted per process and phase epoch (never sent one by one), with
//! the launch totals that phase marks carry and the kernel names `cudaRegisterFunction`
//! registers.
use aya_ebpf::bindings::BPF_NOEXIST;
use aya_ebpf::helpers::bpf_probe_read_user;
use aya_ebpf::programs::ProbeContext;
use core::intrinsics::{AtomicOrdering, atomic_xadd};
use lens_common::record::LaunchMark;
use lens_common::{
    CODE_RANGES, HandleKey, KernelKey, LossCause, ProbeId, TargetState, launch_slot, limits,
};

use crate::api_calls::graph_launch_entered;
use crate::ctx::{arg_u64, count_call, count_loss, now_ns, probe_id, read_user_u64, traced};
use crate::maps::{
    CAPTURING_STREAMS, KERNEL_COUNTS, KERNEL_REGISTRY, LAUNCH_NOTES, LaunchNote, RUNTIME_RANGES,
    kernel_names,
};

/// Adds `value` to `*counter`, shared with other CPUs. (The old value is not used: BPF's
/// plain atomic add, without fetch, is what the `generic` CPU has.)
#[inline(always)]
pub(crate) fn atomic_add(counter: *mut u64, value: u64) {
    // SAFETY: a live map value; threads of one process on other CPUs add to it too.
    unsafe {
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counter, value);
    }
}

/// Counts one launch of the current process (its `TARGETS` entry): per launch probe
/// and, when kernel names are on, per (epoch, kernel) under the epoch it runs in.
#[inline(always)]
pub(crate) fn count_launch(
    ctx: &ProbeContext,
    pid_tgid: u64,
    target: *mut TargetState,
    probe: u32,
    driver: bool,
) {
    let Some(slot) = launch_slot(probe) else {
        // Not a launch probe: counted as any other call.
        count_call(target, probe);
        return;
    };
    // SAFETY: a live map value, read as it is now.
    let capturing = unsafe { core::ptr::read_volatile(&raw const (*target).capturing) };
    if capturing != 0 && on_capturing_stream(ctx, pid_tgid, probe) {
        // Recorded into a graph, not run.
        // SAFETY: as below; the slot is checked again for the verifier.
        if let Some(count) = unsafe { (*target).captured.get_mut(slot) } {
            atomic_add(count, 1);
        }
        return;
    }
    // SAFETY: a live map value (see `atomic_add`); the epoch is read as it is now. The
    // slot is below the array's length (`launch_slot`), checked again for the verifier.
    let epoch = unsafe {
        if let Some(count) = (*target).launches.get_mut(slot) {
            atomic_add(count, 1);
        }
        core::ptr::read_volatile(&raw const (*target).epoch)
    };
    if !kernel_names() {
        return;
    }
    // The kernel argument (`ProbeId::kernel_argument`), compared as plain integers.
    const RUNTIME_KERNEL: u32 = ProbeId::CudaLaunchKernel as u32;
    const RUNTIME_KERNEL_EX: u32 = ProbeId::CudaLaunchKernelExC as u32;
    const DRIVER_KERNEL: u32 = ProbeId::CuLaunchKernel as u32;
    const DRIVER_KERNEL_EX: u32 = ProbeId::CuLaunchKernelEx as u32;
    // Both registers read first, volatile: a context read at a computed offset (the
    // compiler folding the two) is one the verifier refuses.
    // SAFETY: reads of the probe's saved registers.
    let (first, second) = unsafe {
        (
            core::ptr::read_volatile(&(*ctx.regs).rdi),
            core::ptr::read_volatile(&(*ctx.regs).rsi),
        )
    };
    let function = match probe {
        RUNTIME_KERNEL | DRIVER_KERNEL => first,
        RUNTIME_KERNEL_EX | DRIVER_KERNEL_EX => second,
        _ => return,
    };
    let key = KernelKey {
        tgid: (pid_tgid >> 32) as u32,
        epoch: epoch as u32,
        function: if driver {
            function | KernelKey::DRIVER
        } else {
            function
        },
    };
    if let Some(count) = KERNEL_COUNTS.get_ptr_mut(&key) {
        atomic_add(count, 1);
        return;
    }
    if KERNEL_COUNTS.insert(&key, &1, BPF_NOEXIST as u64).is_ok() {
        return;
    }
    match KERNEL_COUNTS.get_ptr_mut(&key) {
        Some(count) => atomic_add(count, 1),
        None => count_loss(LossCause::KernelMapFull),
    }
}

/// Whether this launch goes to a stream capturing a graph. Its stream: `cudaLaunchKernel`'s
/// 6th argument (the 8th word: each `dim3` takes two registers), `cuLaunchKernel`'s 9th,
/// a graph launch's 2nd, and at offset 32 of the `cudaLaunchConfig_t` / `CUlaunchConfig`
/// the `Ex` launches take first.
#[inline(always)]
fn on_capturing_stream(ctx: &ProbeContext, pid_tgid: u64, probe: u32) -> bool {
    const RUNTIME_KERNEL: u32 = ProbeId::CudaLaunchKernel as u32;
    const DRIVER_KERNEL: u32 = ProbeId::CuLaunchKernel as u32;
    const RUNTIME_KERNEL_EX: u32 = ProbeId::CudaLaunchKernelExC as u32;
    const DRIVER_KERNEL_EX: u32 = ProbeId::CuLaunchKernelEx as u32;
    let stream = match probe {
        RUNTIME_KERNEL => arg_u64(ctx, 7),
        DRIVER_KERNEL => arg_u64(ctx, 8),
        RUNTIME_KERNEL_EX | DRIVER_KERNEL_EX => read_user_u64(arg_u64(ctx, 0) + 32),
        _ => arg_u64(ctx, 1),
    };
    let key = HandleKey {
        tgid: (pid_tgid >> 32) as u32,
        _pad: 0,
        handle: stream,
    };
    // SAFETY: a lookup; the value is not read.
    unsafe { CAPTURING_STREAMS.get(&key) }.is_some()
}

/// A capture began on `stream` (its call returned 0): launches on it are captured.
#[inline(always)]
pub(crate) fn capture_began(target: *mut TargetState, pid_tgid: u64, stream: u64) {
    let key = HandleKey {
        tgid: (pid_tgid >> 32) as u32,
        _pad: 0,
        handle: stream,
    };
    if CAPTURING_STREAMS
        .insert(&key, &1, BPF_NOEXIST as u64)
        .is_ok()
    {
        // SAFETY: a live map value (see `atomic_add`).
        atomic_add(unsafe { &raw mut (*target).capturing }, 1);
    }
}

/// The capture on `stream` ends.
#[inline(always)]
pub(crate) fn capture_ended(target: *mut TargetState, pid_tgid: u64, stream: u64) {
    let key = HandleKey {
        tgid: (pid_tgid >> 32) as u32,
        _pad: 0,
        handle: stream,
    };
    if CAPTURING_STREAMS.remove(&key).is_ok() {
        // SAFETY: as above; adding 2^64 - 1 takes one away.
        atomic_add(unsafe { &raw mut (*target).capturing }, u64::MAX);
    }
}

uprobe_and_multi! {
    /// Entry-only functions whose calls are counted, not sent (runtime kernel and graph
    /// launches).
    count_only, count_only_m => count_only_body
}

#[inline(always)]
fn count_only_body(ctx: ProbeContext) -> u32 {
    if let Some((pid_tgid, target)) = traced() {
        let probe = probe_id(&ctx);
        count_launch(&ctx, pid_tgid, target, probe, false);
        if launch_slot(probe).is_some() {
            runtime_launch_entered(&ctx, pid_tgid);
        }
        if probe == ProbeId::CudaGraphLaunch as u32 {
            graph_launch_entered(&ctx, pid_tgid, probe, true);
        }
    }
    0
}

uprobe_and_multi! {
    /// The driver's launch functions (`cuLaunchKernel`, `cuLaunchKernelEx`, `cuGraphLaunch`).
    /// The runtime launches through them too: the driver launch a runtime launch makes is
    /// left out (counted at the runtime already), so each launch counts once. Calls from
    /// anywhere else (cuBLAS, cuDNN, NCCL's static runtime, compiled graphs) are counted
    /// here.
    driver_launch, driver_launch_m => driver_launch_body
}

#[inline(always)]
fn driver_launch_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    let probe = probe_id(&ctx);
    let graph = probe == ProbeId::CuGraphLaunch as u32;
    if made_by_runtime(&ctx, pid_tgid) {
        // SAFETY: a live map value (see `atomic_add`).
        atomic_add(unsafe { &raw mut (*target).runtime_driver_hits }, 1);
        if graph {
            graph_launch_entered(&ctx, pid_tgid, probe, false);
        }
        return 0;
    }
    count_launch(&ctx, pid_tgid, target, probe, true);
    if graph {
        graph_launch_entered(&ctx, pid_tgid, probe, true);
    }
    0
}

/// How much deeper than a runtime launch's entry its driver call may be: the runtime's own
/// frames between the two (a few hundred bytes in libcudart; a generous bound).
const RUNTIME_FRAMES_BYTES: u64 = 64 * 1024;

/// The current thread's slot in `LAUNCH_NOTES`.
#[inline(always)]
fn launch_note(pid_tgid: u64) -> Option<*mut LaunchNote> {
    LAUNCH_NOTES.get_ptr_mut(pid_tgid as u32 & (limits::LAUNCH_NOTES - 1))
}

/// Notes in the thread's slot that it entered a runtime launch: its driver launch comes
/// next, deeper in the same stack.
#[inline(always)]
fn runtime_launch_entered(ctx: &ProbeContext, pid_tgid: u64) {
    if let Some(note) = launch_note(pid_tgid) {
        // SAFETY: a live map value; only this thread writes its slot (a thread whose tid
        // shares it overwrites it whole, see `LaunchNote`). The probe's saved registers
        // are readable.
        unsafe {
            *note = LaunchNote {
                pid_tgid,
                stack: (*ctx.regs).rsp,
            };
        }
    }
}

/// Whether this driver launch is one the runtime made, from the thread's note, most often
/// without reading memory: its note says it runs a runtime launch and this call is deeper
/// in the same stack (yes: the note is then marked done), or says it runs none (no).
/// Otherwise (no note of this thread's: its first driver launch, or a thread sharing the
/// slot wrote since) whether the caller's return address (`[rsp]`) lies in the process's
/// libcudart: exact, but a `bpf_probe_read_user` (~140 ns a hit here, more than all the
/// rest); the thread's note then says what it found, so its next direct launch is cheap.
/// (One case the note gets wrong: a runtime launch that failed before reaching the driver,
/// then a driver launch of the same thread from deeper in the stack, before any other
/// runtime launch of the thread: the latter is taken for the runtime's.)
#[inline(always)]
fn made_by_runtime(ctx: &ProbeContext, pid_tgid: u64) -> bool {
    // SAFETY: reads of the probe's saved registers.
    let stack = unsafe { (*ctx.regs).rsp };
    let note = launch_note(pid_tgid);
    if let Some(note) = note {
        // SAFETY: the thread's slot, as in `runtime_launch_entered`.
        unsafe {
            let seen = *note;
            if seen.pid_tgid == pid_tgid {
                if seen.stack == 0 {
                    return false;
                }
                if stack < seen.stack && seen.stack - stack <= RUNTIME_FRAMES_BYTES {
                    (*note).stack = 0;
                    return true;
                }
            }
        }
    }
    let from_runtime = called_from_runtime(stack, pid_tgid);
    if let Some(note) = note {
        // SAFETY: as above.
        unsafe {
            *note = LaunchNote { pid_tgid, stack: 0 };
        }
    }
    from_runtime
}

/// Whether the return address on top of `stack` lies in the process's libcudart.
#[inline(always)]
pub(crate) fn called_from_runtime(stack: u64, pid_tgid: u64) -> bool {
    let tgid = (pid_tgid >> 32) as u32;
    let Some(runtime) = RUNTIME_RANGES.get_ptr(&tgid) else {
        return false;
    };
    // SAFETY: reading the traced thread's stack through the checked helper.
    let caller = unsafe { bpf_probe_read_user(stack as *const u64) }.unwrap_or(0);
    let mut i = 0;
    while i < CODE_RANGES {
        // SAFETY: a live map value; the loader writes a process's ranges whole.
        let [start, end] = unsafe { (*runtime).ranges[i] };
        if caller >= start && caller < end {
            return true;
        }
        i += 1;
    }
    false
}

/// A mark taken now that opens no epoch: it passes the epoch of the mark before it (a
/// held grad-mode change, sent later, if at all).
#[inline(always)]
pub(crate) fn mark_in_epoch(target: *mut TargetState) -> LaunchMark {
    let at_ns = now_ns();
    // SAFETY: a live map value (see `atomic_add`).
    unsafe {
        LaunchMark {
            at_ns,
            launches: (*target).launches_total(),
            epoch: core::ptr::read_volatile(&raw const (*target).epoch),
        }
    }
}

/// A mark taken now in the process whose `TARGETS` entry is `target` (the caller's target
/// check found it): the clock, the epoch it opens (1 for the process's first mark) and
/// the process's launches so far. (Two marks of two threads at the same instant may both
/// read the later epoch: the earlier one's launches, none between them, are not
/// misplaced.)
///
/// The thread's held grad-mode changes go first (`grad_mode`): every other phase mark is
/// taken here.
#[inline(always)]
pub(crate) fn mark_now(target: *mut TargetState) -> LaunchMark {
    crate::grad_mode::flush_held_changes();
    open_epoch(target)
}

/// [`mark_now`] without the held grad-mode changes: the grad-mode program's own mark.
#[inline(always)]
pub(crate) fn open_epoch(target: *mut TargetState) -> LaunchMark {
    // SAFETY: a live map value (see `atomic_add`).
    unsafe { atomic_add(&raw mut (*target).epoch, 1) };
    mark_in_epoch(target)
}

uprobe_and_multi! {
    /// `__cudaRegisterFunction(handle, hostFun, deviceFun, deviceName, …)`: remember which
    /// name the host stub `hostFun` launches, for kernel names.
    cuda_register_function, cuda_register_function_m => cuda_register_function_body
}

#[inline(always)]
fn cuda_register_function_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    count_call(target, probe_id(&ctx));
    if !kernel_names() {
        return 0;
    }
    let stub = HandleKey {
        tgid: (pid_tgid >> 32) as u32,
        _pad: 0,
        handle: arg_u64(&ctx, 1),
    };
    let _ = KERNEL_REGISTRY.insert(&stub, &arg_u64(&ctx, 2), 0);
    0
}
