//! Returns of calls whose duration matters: each kind's entry, kept in its own
//! `INFLIGHT_*` map, paired with its return into one record.
use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use aya_ebpf::helpers::bpf_probe_read_user;
use aya_ebpf::maps::LruHashMap;
use aya_ebpf::programs::{ProbeContext, RetProbeContext};
use lens_common::record::{CollectiveCall, CommInitCall, SyncCall, TimedCall};
use lens_common::{Body, InflightKey, LossCause, Record};

use crate::ctx::{
    begin_call, call_starting_now, count_loss, now_ns, send, send_now, take_entry, traced,
};
use crate::maps::{INFLIGHT_COLLECTIVES, INFLIGHT_COMM_INITS, INFLIGHT_SYNCS};
use crate::python::sample_if_saving;

/// A body timed entry to return, with the call's result.
pub(crate) trait Returning: Body {
    fn returned(&mut self, end_ns: u64, result: i32);
}

macro_rules! returning {
    ($($body:ty),+) => {
        $(
            impl Returning for $body {
                #[inline(always)]
                fn returned(&mut self, end_ns: u64, result: i32) {
                    self.times.end_ns = end_ns;
                    self.result = result;
                }
            }
        )+
    };
}

returning!(CollectiveCall, SyncCall, CommInitCall);

/// The return paired with its entry in `inflight`: the end stamped and the result read.
/// (Only a traced process has entries: the target check is needed only without one.)
#[inline(always)]
fn finish<B: Returning>(
    ctx: &RetProbeContext,
    inflight: &LruHashMap<InflightKey, Record<B>>,
) -> Option<Record<B>> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(mut record) = take_entry(ctx, inflight, pid_tgid) else {
        if traced().is_some() {
            count_loss(LossCause::UnmatchedReturn);
        }
        return None;
    };
    record.body.returned(now_ns(), ctx.ret::<i64>() as i32);
    Some(record)
}

uretprobe_and_multi! {
    /// Return of an NCCL collective or point-to-point call.
    nccl_collective_return, nccl_collective_return_m => nccl_collective_return_body
}

#[inline(always)]
fn nccl_collective_return_body(ctx: RetProbeContext) -> u32 {
    if let Some(record) = finish(&ctx, &INFLIGHT_COLLECTIVES) {
        send(&record);
    }
    0
}

uretprobe_and_multi! {
    /// Return of a CUDA synchronisation call.
    cuda_sync_return, cuda_sync_return_m => cuda_sync_return_body
}

#[inline(always)]
fn cuda_sync_return_body(ctx: RetProbeContext) -> u32 {
    if let Some(record) = finish(&ctx, &INFLIGHT_SYNCS) {
        send(&record);
    }
    0
}

uretprobe_and_multi! {
    /// Return of `ncclCommInitRank`: the handle it wrote read back.
    nccl_comm_init_return, nccl_comm_init_return_m => nccl_comm_init_return_body
}

#[inline(always)]
fn nccl_comm_init_return_body(ctx: RetProbeContext) -> u32 {
    if let Some(mut record) = finish(&ctx, &INFLIGHT_COMM_INITS) {
        // SAFETY: the out-pointer the caller passed; read through the checked helper.
        record.body.comm =
            unsafe { bpf_probe_read_user(record.body.comm_out as *const u64) }.unwrap_or(0);
        // Rare and needed to name every later collective's communicator: deliver now.
        send_now(&record);
    }
    0
}

uprobe_and_multi! {
    /// Entry of a call seen at its entry only, arguments not decoded (gloo collectives:
    /// the tensors live behind C++ vectors, and the methods throw, so no return probe may
    /// go on them). The first argument, the `ProcessGroupGloo` object of a member
    /// function, is kept: it tells the process's groups apart (hang detection numbers
    /// each group's collectives). Sent at once, its end its start.
    timed_call_entry, timed_call_entry_m => timed_call_entry_body
}

#[inline(always)]
fn timed_call_entry_body(ctx: ProbeContext) -> u32 {
    sample_if_saving();
    let Some((_, _, mut record, _)) = begin_call::<TimedCall>(&ctx) else {
        return 0;
    };
    record.body.times = call_starting_now();
    record.body.object = ctx.arg::<u64>(0).unwrap_or(0);
    send(&record);
    0
}
