//! Kernel launches: counted per process and phase epoch (never sent one by one), with
//! the launch totals that phase marks carry and the kernel names `cudaRegisterFunction`
//! registers.
use aya_ebpf::bindings::BPF_NOEXIST;
use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user};
use aya_ebpf::programs::ProbeContext;
use core::intrinsics::{AtomicOrdering, atomic_xadd};
use lens_common::record::LaunchMark;
use lens_common::{
    CODE_RANGES, HandleKey, KernelKey, LossCause, ProbeId, TargetState, launch_slot,
};

use crate::ctx::{arg_u64, count_call, count_loss, now_ns, probe_id, traced};
use crate::maps::{KERNEL_COUNTS, KERNEL_REGISTRY, RUNTIME_RANGES, kernel_names};

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
        count_call(pid_tgid, probe);
        return;
    };
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
        function,
        driver: driver as u32,
        _pad: 0,
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

uprobe_and_multi! {
    /// Entry-only functions whose calls are counted, not sent (runtime kernel and graph
    /// launches).
    count_only, count_only_m => count_only_body
}

#[inline(always)]
fn count_only_body(ctx: ProbeContext) -> u32 {
    if let Some((pid_tgid, target)) = traced() {
        count_launch(&ctx, pid_tgid, target, probe_id(&ctx), false);
    }
    0
}

uprobe_and_multi! {
    /// The driver's launch functions (`cuLaunchKernel`, `cuLaunchKernelEx`, `cuGraphLaunch`).
    /// The runtime launches through them too: a call whose return address (`[rsp]` at entry)
    /// lies in the process's libcudart was counted by `count_only` already and is left out,
    /// so each launch counts once. Calls from anywhere else (cuBLAS, cuDNN, NCCL's static
    /// runtime, compiled graphs) are counted here.
    driver_launch, driver_launch_m => driver_launch_body
}

#[inline(always)]
fn driver_launch_body(ctx: ProbeContext) -> u32 {
    // Only targets have ranges: the runtime's own launches, the commonest calls here,
    // are left out after this one lookup, before the target check.
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if let Some(runtime) = RUNTIME_RANGES.get_ptr_mut(&tgid) {
        // SAFETY: reading the traced thread's stack through the checked helper.
        let caller = unsafe { bpf_probe_read_user((*ctx.regs).rsp as *const u64) }.unwrap_or(0);
        let mut i = 0;
        while i < CODE_RANGES {
            // SAFETY: a live map value; the loader writes a process's ranges whole.
            let [start, end] = unsafe { (*runtime).ranges[i] };
            if caller >= start && caller < end {
                // SAFETY: as above; other threads of the process add to it too.
                atomic_add(unsafe { &raw mut (*runtime).runtime_launches }, 1);
                return 0;
            }
            i += 1;
        }
    }
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    count_launch(&ctx, pid_tgid, target, probe_id(&ctx), true);
    0
}

/// A mark taken now in the process whose `TARGETS` entry is `target` (the caller's target
/// check found it): the clock, the epoch it opens (1 for the process's first mark) and
/// the process's launches so far. (Two marks of two threads at the same instant may both
/// read the later epoch: the earlier one's launches, none between them, are not
/// misplaced.)
#[inline(always)]
pub(crate) fn mark_now(target: *mut TargetState) -> LaunchMark {
    let at_ns = now_ns();
    // SAFETY: a live map value (see `atomic_add`).
    unsafe {
        atomic_add(&raw mut (*target).epoch, 1);
        LaunchMark {
            at_ns,
            launches: (*target).launches_total(),
            epoch: core::ptr::read_volatile(&raw const (*target).epoch),
        }
    }
}

uprobe_and_multi! {
    /// `__cudaRegisterFunction(handle, hostFun, deviceFun, deviceName, …)`: remember which
    /// name the host stub `hostFun` launches, for kernel names.
    cuda_register_function, cuda_register_function_m => cuda_register_function_body
}

#[inline(always)]
fn cuda_register_function_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    count_call(pid_tgid, probe_id(&ctx));
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
