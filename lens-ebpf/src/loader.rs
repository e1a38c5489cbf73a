//! The dynamic loader's `_dl_debug_state`: a library mapped or unmapped, and a
//! single-threaded target stopped there until its new library's probes are in.
use aya_ebpf::bindings::BPF_RB_FORCE_WAKEUP;
use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, generated};
use aya_ebpf::programs::ProbeContext;
use aya_log_ebpf::debug;
use lens_common::record::LinkMapChange;
use lens_common::{LossCause, ProbeId, Record, TARGET_STOP_ON_LINK_MAP_CHANGE};

use crate::ctx::{count_loss, new_record};
use crate::maps::{STOPPED, TARGETS, node_mode};
use crate::ring::{EVENTS, submit_flags};
use crate::task::has_other_threads;

pub(crate) const SIGSTOP: u32 = 19;

uprobe_and_multi! {
    /// glibc's `_dl_debug_state`: the target's set of loaded objects changed. Tell the loader
    /// at once; for processes it started, stop them until it has attached to new libraries.
    dl_debug_state, dl_debug_state_m => dl_debug_state_body
}

#[inline(always)]
fn dl_debug_state_body(ctx: ProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: the value is copied out before the map can change under us.
    let flags = unsafe { TARGETS.get(&tgid) }.map(|target| target.flags);
    if flags.is_none() && !node_mode() {
        return 0;
    }
    let mut record = new_record::<LinkMapChange>(ProbeId::DlDebugState as u32, pid_tgid);
    // Job-control stops make some blocking calls of *other* threads fail with EINTR
    // (epoll_wait, semtimedop...; see signal(7)), which libraries such as gloo treat as
    // fatal: only a single-threaded process is stopped. A multi-threaded one runs on
    // while its new libraries are attached (a few ms).
    let stop = flags.is_some_and(|flags| flags & TARGET_STOP_ON_LINK_MAP_CHANGE != 0)
        && !has_other_threads();
    record.body = LinkMapChange {
        stopped: stop as u32,
        traced: flags.is_some() as u32,
    };
    // Reserve first: without room for the record nobody would resume a stopped target.
    let Some(mut entry) = EVENTS.reserve::<Record<LinkMapChange>>(0) else {
        count_loss(LossCause::RingBufferFull);
        return 0;
    };
    entry.write(record);
    if stop {
        // The stop is queued before the loader can see the event, so its SIGCONT always
        // comes after it (a SIGCONT discards a pending stop).
        debug!(&ctx, "lens: stopping {} for attach", tgid);
        // SAFETY: the helper only reads the clock.
        let _ = STOPPED.insert(&tgid, &unsafe { bpf_ktime_get_ns() }, 0);
        // SAFETY: signals the current process, which is the traced target.
        unsafe { generated::bpf_send_signal(SIGSTOP) };
    }
    let send_flags = if flags.is_some() {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        submit_flags(Record::<LinkMapChange>::RING_BYTES)
    };
    entry.submit(send_flags);
    0
}
