//! Returns of calls whose duration matters: the entry kept in `INFLIGHT` paired with its
//! return into one event.
use aya_ebpf::bindings::BPF_RB_FORCE_WAKEUP;
use aya_ebpf::helpers::{bpf_ktime_get_ns, bpf_probe_read_user};
use aya_ebpf::macros::{uprobe, uretprobe};
use aya_ebpf::programs::{ProbeContext, RetProbeContext};
use lens_common::{EventKind, InflightKey, LossCause};

use crate::ctx::{begin_call, count_loss, emit, probe_id, remember_entry, submit_flags, traced};
use crate::maps::INFLIGHT;
use crate::python::sample_if_saving;

/// Return of any call with entry state: pair it, stamp the end and the result, send it.
#[uretprobe]
pub fn call_return(ctx: RetProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let key = InflightKey {
        pid_tgid,
        probe: probe_id(&ctx),
        _pad: 0,
    };
    // SAFETY: copied out before the entry is removed.
    let Some(mut event) = (unsafe { INFLIGHT.get(&key) }).copied() else {
        count_loss(LossCause::UnmatchedReturn);
        return 0;
    };
    let _ = INFLIGHT.remove(&key);
    // SAFETY: plain helper call.
    event.end_ns = unsafe { bpf_ktime_get_ns() };
    event.ret = ctx.ret::<i64>() as i32 as i64;
    let mut flags = submit_flags();
    if event.kind == EventKind::CommInit as u32 {
        // SAFETY: the out-pointer the caller passed; read through the checked helper.
        event.comm = unsafe { bpf_probe_read_user(event.comm as *const u64) }.unwrap_or(0);
        // Rare and needed to name every later collective's communicator: deliver now.
        flags = BPF_RB_FORCE_WAKEUP as u64;
    }
    emit(&event, flags);
    0
}

/// Entry of a call whose duration is wanted but whose arguments are not decoded
/// (gloo collectives: the tensors live behind C++ vectors). The first argument, the
/// `ProcessGroupGloo` object of a member function, is kept in `comm`: it tells the
/// process's groups apart (hang detection numbers each group's collectives).
#[uprobe]
pub fn timed_call_entry(ctx: ProbeContext) -> u32 {
    sample_if_saving();
    let Some((pid_tgid, mut event)) = begin_call(&ctx, EventKind::Collective) else {
        return 0;
    };
    event.comm = ctx.arg::<u64>(0).unwrap_or(0);
    remember_entry(&ctx, pid_tgid, &event);
    0
}
