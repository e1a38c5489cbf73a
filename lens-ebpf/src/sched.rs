//! The scheduler's fork, exec and exit tracepoints: process trees followed from the
//! kernel, and how each traced process ended.
use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use aya_ebpf::macros::raw_tracepoint;
use aya_ebpf::programs::RawTracePointContext;
use lens_common::record::{Exec, Exit, Fork, NO_PROBE};
use lens_common::{LossCause, Record, TARGET_CALIBRATION};

use crate::ctx::{count_loss, new_record, send, send_now, traced};
use crate::maps::{NEW_TARGET, TARGETS, node_mode};
use crate::task::{EXIT_HAS_GROUP_DEAD, TASK_EXIT_CODE_OFFSET, TASK_TGID_OFFSET};

/// `sched_process_fork(parent, child)`: a traced process created another. A new process
/// (not a thread) is traced from here, with its parent's settings, before it runs.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn process_fork(ctx: RawTracePointContext) -> i32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    // SAFETY: a live map value; the flags never change after the entry is made.
    let flags = unsafe { (*target).flags };
    if flags & TARGET_CALIBRATION != 0 {
        return 0;
    }
    let child: u64 = ctx.arg(1);
    // SAFETY: reads of kernel memory through the checked helper; the offsets come from
    // the running kernel's BTF.
    let child_tgid = unsafe {
        let offset = core::ptr::read_volatile(&TASK_TGID_OFFSET) as u64;
        aya_ebpf::helpers::bpf_probe_read_kernel((child + offset) as *const i32).unwrap_or(0)
    } as u32;
    let parent_tgid = (pid_tgid >> 32) as u32;
    if child_tgid == 0 || child_tgid == parent_tgid {
        // A new thread of the same process: already traced.
        return 0;
    }
    // A new entry is built in a per-CPU slot, not on the stack: it is larger than the
    // stack BPF allows. Only its flags are ever written there; its counters stay 0.
    let Some(new_entry) = NEW_TARGET.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's slot; nothing else runs on this CPU while we do.
    let inserted = unsafe {
        (*new_entry).flags = flags;
        TARGETS.insert(&child_tgid, &*new_entry, 0)
    };
    if inserted.is_err() {
        count_loss(LossCause::TargetMapFull);
        return 0;
    }
    let mut record = Record::<Fork>::new(NO_PROBE, child_tgid, child_tgid);
    record.body.parent = parent_tgid;
    send_now(&record);
    0
}

/// `sched_process_exec`: a traced process now runs another program.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn process_exec(_ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: the flags are copied out before the map can change.
    let flags = unsafe { TARGETS.get(&tgid) }.map(|target| target.flags);
    if flags.is_some_and(|flags| flags & TARGET_CALIBRATION != 0) {
        return 0;
    }
    let traced = flags.is_some();
    if traced {
        // A new program: its grad mode starts afresh (on), whatever the old one's was.
        crate::grad_mode::forget_thread(pid_tgid);
    }
    if !traced && !node_mode() {
        return 0;
    }
    let mut record = new_record::<Exec>(NO_PROBE, pid_tgid);
    record.body.traced = traced as u32;
    // A target's at once; any other process's (node-wide discovery) batched.
    if traced {
        send_now(&record);
    } else {
        send(&record);
    }
    0
}

/// `sched_process_exit(task[, group_dead])`: a thread of a traced process exits. The last
/// one (or, on kernels without `group_dead`, the leader) reports the process's wait
/// status, which only its parent could otherwise collect.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn process_exit(ctx: RawTracePointContext) -> i32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    // The thread's held grad-mode changes go out before it does (a helper thread that
    // toggled grad mode and ended would otherwise be left with grad mode off).
    crate::grad_mode::flush_held_changes();
    crate::grad_mode::forget_thread(pid_tgid);
    // SAFETY: a live map value; the flags never change after the entry is made.
    let flags = unsafe { (*target).flags };
    if flags & TARGET_CALIBRATION != 0 {
        return 0;
    }
    crate::python::send_thread_exit(pid_tgid, target);
    let task: u64 = ctx.arg(0);
    // SAFETY: reads of placeholders the loader set (volatile: not folded) and of kernel
    // memory through the checked helper, at offsets from the running kernel's BTF.
    let (last, code) = unsafe {
        let last = if core::ptr::read_volatile(&EXIT_HAS_GROUP_DEAD) != 0 {
            ctx.arg::<u64>(1) & 0xff != 0
        } else {
            pid_tgid as u32 == (pid_tgid >> 32) as u32
        };
        let offset = core::ptr::read_volatile(&TASK_EXIT_CODE_OFFSET) as u64;
        let code =
            aya_ebpf::helpers::bpf_probe_read_kernel((task + offset) as *const i32).unwrap_or(0);
        (last, code)
    };
    if !last {
        return 0;
    }
    let mut record = new_record::<Exit>(NO_PROBE, pid_tgid);
    record.body.wait_status = code;
    send_now(&record);
    0
}
