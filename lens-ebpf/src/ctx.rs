//! What every program does first and last: is this process traced, which probe fired
//! (the attach cookie), the call's arguments, a new record, its entry kept for the
//! return, and the record sent (with batched wakeups) or its loss counted.
use aya_ebpf::EbpfContext;
use aya_ebpf::bindings::BPF_RB_FORCE_WAKEUP;
use aya_ebpf::helpers::{
    bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user, generated,
};
use aya_ebpf::maps::LruHashMap;
use aya_ebpf::programs::ProbeContext;
use aya_log_ebpf::warn;
use lens_common::record::{CallTimes, RETURNED_KIND};
use lens_common::{Body, CALL_SLOTS, InflightKey, LossCause, ProbeId, Record, TargetState};

use crate::maps::{LOSSES, TARGETS};
use crate::ring::{EVENTS, submit_flags};

#[inline(always)]
pub(crate) fn count_loss(cause: LossCause) {
    if let Some(counter) = LOSSES.get_ptr_mut(cause as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while we run.
        unsafe { *counter += 1 };
    }
}

/// `bpf_get_current_pid_tgid()` and the process's `TARGETS` entry, if it is traced. The
/// entry stays valid while the program runs (the map's memory is freed only after an RCU
/// grace period); its counters are shared with the process's other threads.
#[inline(always)]
pub(crate) fn traced() -> Option<(u64, *mut TargetState)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let target = TARGETS.get_ptr_mut(&((pid_tgid >> 32) as u32))?;
    Some((pid_tgid, target))
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

/// Counts one call of catalog probe `probe` in the process's `TARGETS` entry (a
/// configured rule's calls are not counted: each is sent).
#[inline(always)]
pub(crate) fn count_call(target: *mut TargetState, probe: u32) {
    if probe as usize >= ProbeId::COUNT {
        return;
    }
    // SAFETY: a live map value; other threads of the process add to it too (atomic). The
    // mask keeps the index below the array's length where the verifier can see it.
    unsafe {
        let count = &raw mut (*target).calls[probe as usize & (CALL_SLOTS - 1)];
        crate::launches::atomic_add(count, 1);
    }
}

#[inline(always)]
fn emit<B: Body>(record: &Record<B>, flags: u64) {
    if EVENTS.output::<Record<B>>(record, flags).is_err() {
        count_loss(LossCause::RingBufferFull);
    }
}

/// Sends a record, waking the reader only past the batching threshold.
#[inline(always)]
pub(crate) fn send<B: Body>(record: &Record<B>) {
    emit(record, submit_flags(Record::<B>::RING_BYTES));
}

/// Sends a record and wakes the reader now: rare records the loader must act on at once.
#[inline(always)]
pub(crate) fn send_now<B: Body>(record: &Record<B>) {
    emit(record, BPF_RB_FORCE_WAKEUP as u64);
}

/// A record of `B`'s kind for the current thread, its body empty.
#[inline(always)]
pub(crate) fn new_record<B: Body>(probe: u32, pid_tgid: u64) -> Record<B> {
    Record::new(probe, (pid_tgid >> 32) as u32, pid_tgid as u32)
}

#[inline(always)]
pub(crate) fn now_ns() -> u64 {
    // SAFETY: the helper only reads the clock.
    unsafe { bpf_ktime_get_ns() }
}

/// A call's times at its entry: both stamps now, the end replaced at the return.
#[inline(always)]
pub(crate) fn call_starting_now() -> CallTimes {
    let now = now_ns();
    CallTimes {
        start_ns: now,
        end_ns: now,
    }
}

/// Keeps a call's entry record in `inflight` until its return pairs it: over the slot the
/// thread's last call of the function left, or in a new one.
#[inline(always)]
pub(crate) fn remember_entry<C: EbpfContext, B: Body>(
    ctx: &C,
    inflight: &LruHashMap<InflightKey, Record<B>>,
    pid_tgid: u64,
    record: &Record<B>,
) {
    let key = InflightKey {
        pid_tgid,
        probe: record.header.probe,
        _pad: 0,
    };
    if let Some(slot) = inflight.get_ptr_mut(&key) {
        // The kind last: a reader (the hang checks) that sees this call's kind sees its
        // body too (stores are not reordered on x86, nor by the compiler across the
        // volatile write).
        // SAFETY: a live map value, written only by this thread.
        unsafe {
            core::ptr::write_volatile(&raw mut (*slot).body, record.body);
            core::ptr::write_volatile(&raw mut (*slot).header, record.header);
        }
        return;
    }
    if inflight.insert(&key, record, 0).is_err() {
        count_loss(LossCause::InflightMapFull);
        warn!(
            ctx,
            "lens: inflight map full, call of probe {} lost", record.header.probe
        );
    }
}

/// The entry record of the call returning on this thread; its slot is marked returned.
#[inline(always)]
pub(crate) fn take_entry<C: EbpfContext, B: Body>(
    ctx: &C,
    inflight: &LruHashMap<InflightKey, Record<B>>,
    pid_tgid: u64,
) -> Option<Record<B>> {
    match entry_of(ctx, inflight, pid_tgid) {
        Entry::Taken(record) => Some(record),
        Entry::NotInFlight | Entry::Missing => None,
    }
}

/// What a return finds in its thread's slot.
pub(crate) enum Entry<B> {
    /// The call's entry record (the slot is now marked returned).
    Taken(Record<B>),
    /// A slot that holds no call: its entry chose not to record this one.
    NotInFlight,
    /// No slot: the entry was never seen (attached mid-call) or its slot was lost.
    Missing,
}

/// The entry of the call returning on this thread, told apart from a slot that holds
/// none and from no slot at all.
#[inline(always)]
pub(crate) fn entry_of<C: EbpfContext, B: Body>(
    ctx: &C,
    inflight: &LruHashMap<InflightKey, Record<B>>,
    pid_tgid: u64,
) -> Entry<B> {
    let key = InflightKey {
        pid_tgid,
        probe: probe_id(ctx),
        _pad: 0,
    };
    let Some(slot) = inflight.get_ptr_mut(&key) else {
        return Entry::Missing;
    };
    // SAFETY: a live map value, written only by this thread.
    unsafe {
        if (*slot).header.kind == RETURNED_KIND {
            return Entry::NotInFlight;
        }
        let record = *slot;
        core::ptr::write_volatile(&raw mut (*slot).header.kind, RETURNED_KIND);
        Entry::Taken(record)
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

/// Common start of the entry programs: skip untraced processes, count the call, and a
/// new record of `B`'s kind; with the process's `TARGETS` entry (for a phase mark) and
/// the whole attach cookie (an NCCL call's argument layout), read once.
#[inline(always)]
pub(crate) fn begin_call<B: Body>(
    ctx: &ProbeContext,
) -> Option<(u64, *mut TargetState, Record<B>, u64)> {
    let (pid_tgid, target) = traced()?;
    let cookie = attach_cookie(ctx);
    let probe = cookie as u32;
    count_call(target, probe);
    Some((pid_tgid, target, new_record(probe, pid_tgid), cookie))
}

#[inline(always)]
pub(crate) fn read_user_u64(address: u64) -> u64 {
    // SAFETY: reading the sampled thread's memory through the checked helper.
    unsafe { bpf_probe_read_user(address as *const u64) }.unwrap_or(0)
}
