//! What every program does first and last: is this process traced, which probe fired
//! (the attach cookie), the call's arguments, a new event, its entry kept for the
//! return, and the event sent (with batched wakeups) or its loss counted.
use aya_ebpf::EbpfContext;
use aya_ebpf::bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP};
use aya_ebpf::helpers::{
    bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user, generated,
};
use aya_ebpf::programs::ProbeContext;
use aya_log_ebpf::warn;
use lens_common::{CallKey, Event, EventKind, InflightKey, LossCause, TargetConfig, limits};

use crate::maps::{CALL_COUNTS, EVENTS, INFLIGHT, LOSSES, TARGETS};

#[inline(always)]
pub(crate) fn count_loss(cause: LossCause) {
    if let Some(counter) = LOSSES.get_ptr_mut(cause as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while we run.
        unsafe { *counter += 1 };
    }
}

/// The target's settings if the current process is traced.
#[inline(always)]
pub(crate) fn traced() -> Option<(u64, TargetConfig)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: the value is copied out before the map can change under us.
    let config = unsafe { TARGETS.get(&tgid) }.copied()?;
    Some((pid_tgid, config))
}

/// The running program's attach cookie: the probe (low 32 bits) and, for some, a detail
/// of its shape (`lens_common::probe_cookie`, `rule_cookie`).
#[inline(always)]
pub(crate) fn attach_cookie<C: EbpfContext>(ctx: &C) -> u64 {
    // SAFETY: the helper only reads the attach cookie of the running program.
    unsafe { generated::bpf_get_attach_cookie(ctx.as_ptr()) }
}

#[inline(always)]
pub(crate) fn probe_id<C: EbpfContext>(ctx: &C) -> u32 {
    attach_cookie(ctx) as u32
}

#[inline(always)]
pub(crate) fn count_call(pid_tgid: u64, probe: u32) {
    let key = CallKey {
        tgid: (pid_tgid >> 32) as u32,
        probe,
    };
    match CALL_COUNTS.get_ptr_mut(&key) {
        // SAFETY: per-CPU value, only this CPU writes it.
        Some(count) => unsafe { *count += 1 },
        None => {
            if CALL_COUNTS.insert(&key, &1, 0).is_err() {
                count_loss(LossCause::CounterMapFull);
            }
        }
    }
}

/// Bytes one event takes in the ring buffer (its 8-byte record header included).
pub(crate) const EVENT_RECORD_BYTES: u64 = (core::mem::size_of::<Event>() as u64 + 8 + 7) & !7;

/// Batched wakeups: the reader is woken each time the data waiting crosses a multiple of
/// the threshold, so once per 256 KiB however far it lags; it also drains on a timer,
/// so nothing stays behind. (A wakeup is an interrupt raised on the probed thread's CPU,
/// a VM exit on a virtual machine: woken on every event past the threshold, a lagging
/// reader made each probed collective cost ~5 µs more.)
#[inline(always)]
pub(crate) fn submit_flags() -> u64 {
    let waiting = EVENTS.query(BPF_RB_AVAIL_DATA as u64);
    let threshold = limits::WAKEUP_THRESHOLD_BYTES;
    if (waiting + EVENT_RECORD_BYTES) / threshold != waiting / threshold {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    }
}

#[inline(always)]
pub(crate) fn emit(event: &Event, flags: u64) {
    if EVENTS.output::<Event>(event, flags).is_err() {
        count_loss(LossCause::RingBufferFull);
    }
}

#[inline(always)]
pub(crate) fn new_event(kind: EventKind, probe: u32, pid_tgid: u64) -> Event {
    let mut event = Event::zeroed();
    event.kind = kind as u32;
    event.probe = probe;
    event.tgid = (pid_tgid >> 32) as u32;
    event.tid = pid_tgid as u32;
    // SAFETY: plain helper call.
    event.start_ns = unsafe { bpf_ktime_get_ns() };
    event.end_ns = event.start_ns;
    event
}

#[inline(always)]
pub(crate) fn remember_entry<C: EbpfContext>(ctx: &C, pid_tgid: u64, event: &Event) {
    let key = InflightKey {
        pid_tgid,
        probe: event.probe,
        _pad: 0,
    };
    if INFLIGHT.insert(&key, event, 0).is_err() {
        count_loss(LossCause::InflightMapFull);
        warn!(
            ctx,
            "lens: inflight map full, call of probe {} lost", event.probe
        );
    }
}

/// The `n`th integer argument at function entry on x86-64: six in registers, the rest on
/// the stack above the return address.
#[inline(always)]
pub(crate) fn arg_u64(ctx: &ProbeContext, n: usize) -> u64 {
    if n < 6 {
        return ctx.arg::<u64>(n).unwrap_or(0);
    }
    // SAFETY: reading the traced thread's stack through the checked helper.
    unsafe {
        let rsp = (*ctx.regs).rsp;
        bpf_probe_read_user((rsp + 8 * (n as u64 - 5)) as *const u64).unwrap_or(0)
    }
}

#[inline(always)]
pub(crate) fn arg_i32(ctx: &ProbeContext, n: usize) -> i32 {
    arg_u64(ctx, n) as i32
}

/// Common start of the entry programs: skip untraced processes, count the call, stamp
/// a new event of `kind`.
#[inline(always)]
pub(crate) fn begin_call(ctx: &ProbeContext, kind: EventKind) -> Option<(u64, Event)> {
    begin_call_with_cookie(ctx, kind).map(|(pid_tgid, event, _)| (pid_tgid, event))
}

/// [`begin_call`], also giving the whole attach cookie (an NCCL call's argument layout),
/// read once.
#[inline(always)]
pub(crate) fn begin_call_with_cookie(
    ctx: &ProbeContext,
    kind: EventKind,
) -> Option<(u64, Event, u64)> {
    let (pid_tgid, _) = traced()?;
    let cookie = attach_cookie(ctx);
    let probe = cookie as u32;
    count_call(pid_tgid, probe);
    Some((pid_tgid, new_event(kind, probe, pid_tgid), cookie))
}

#[inline(always)]
pub(crate) fn read_user_u64(address: u64) -> u64 {
    // SAFETY: reading the sampled thread's memory through the checked helper.
    unsafe { bpf_probe_read_user(address as *const u64) }.unwrap_or(0)
}
