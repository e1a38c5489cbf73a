//! CUDA's event and sync calls: an event recorded after a collective, queried until it
//! completes, and the synchronizations that wait for streams, events or the device.
use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns};
use aya_ebpf::macros::{uprobe, uretprobe};
use aya_ebpf::programs::{ProbeContext, RetProbeContext};
use lens_common::{EventKind, HandleKey, InflightKey, ProbeId};

use crate::ctx::{
    arg_u64, begin_call, count_call, emit, new_event, probe_id, remember_entry, submit_flags,
    traced,
};
use crate::maps::{COLLECTIVE_EVENTS, COLLECTIVE_STREAMS, INFLIGHT};
use crate::python::{python_caller, sample_if_saving};

/// `cudaEventRecord[WithFlags](event, stream)`: sent only when it binds an event to the
/// collectives on `stream` (or unbinds a re-recorded one); every call is counted.
#[uprobe]
pub fn cuda_event_record(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let probe = probe_id(&ctx);
    count_call(pid_tgid, probe);
    let tgid = (pid_tgid >> 32) as u32;
    let stream = HandleKey {
        tgid,
        _pad: 0,
        handle: arg_u64(&ctx, 1),
    };
    let cuda_event = HandleKey {
        tgid,
        _pad: 0,
        handle: arg_u64(&ctx, 0),
    };
    // SAFETY: only presence is read.
    let binds = unsafe { COLLECTIVE_STREAMS.get(&stream) }.is_some();
    if binds {
        let _ = COLLECTIVE_STREAMS.remove(&stream);
        let _ = COLLECTIVE_EVENTS.insert(&cuda_event, &0, 0);
    } else if COLLECTIVE_EVENTS.remove(&cuda_event).is_err() {
        // Neither after a collective nor a watched event re-recorded: nothing to say.
        return 0;
    }
    let mut event = new_event(EventKind::CudaEvent, probe, pid_tgid);
    event.handle = cuda_event.handle;
    event.stream = stream.handle;
    emit(&event, submit_flags());
    0
}

/// Entry of `cudaEventQuery(event)`: remembered only for events watched after a
/// collective (PyTorch's allocator and others query many more).
#[uprobe]
pub fn cuda_event_query_entry(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let probe = probe_id(&ctx);
    count_call(pid_tgid, probe);
    let key = HandleKey {
        tgid: (pid_tgid >> 32) as u32,
        _pad: 0,
        handle: arg_u64(&ctx, 0),
    };
    // SAFETY: only presence is read.
    if unsafe { COLLECTIVE_EVENTS.get(&key) }.is_none() {
        return 0;
    }
    let mut event = new_event(EventKind::CudaEvent, probe, pid_tgid);
    event.handle = key.handle;
    remember_entry(&ctx, pid_tgid, &event);
    0
}

/// `cudaErrorNotReady`: the event's work has not completed yet.
pub(crate) const CUDA_ERROR_NOT_READY: i64 = 600;

/// Return of `cudaEventQuery` on a watched event: not ready → remember when it was asked
/// (a lower bound of the completion); success → send it once, with that lower bound.
#[uretprobe]
pub fn cuda_event_query_return(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let key = InflightKey {
        pid_tgid,
        probe: probe_id(&ctx),
        _pad: 0,
    };
    // SAFETY: copied out before the entry is removed.
    let Some(mut event) = (unsafe { INFLIGHT.get(&key) }).copied() else {
        // An event nobody watches: its entry was not remembered.
        return 0;
    };
    let _ = INFLIGHT.remove(&key);
    let watched = HandleKey {
        tgid: event.tgid,
        _pad: 0,
        handle: event.handle,
    };
    event.ret = ctx.ret::<i64>() as i32 as i64;
    if event.ret == CUDA_ERROR_NOT_READY {
        let _ = COLLECTIVE_EVENTS.insert(&watched, &event.start_ns, 0);
        return 0;
    }
    // SAFETY: copied out before the entry is removed.
    let Some(not_ready_ns) = (unsafe { COLLECTIVE_EVENTS.get(&watched) }).copied() else {
        return 0;
    };
    let _ = COLLECTIVE_EVENTS.remove(&watched);
    if event.ret != 0 {
        return 0;
    }
    // SAFETY: plain helper call.
    event.end_ns = unsafe { bpf_ktime_get_ns() };
    event.not_ready_ns = not_ready_ns;
    emit(&event, submit_flags());
    0
}

/// Entry of a CUDA synchronisation call; `handle` is the stream or event waited on.
#[uprobe]
pub fn cuda_sync_entry(ctx: ProbeContext) -> u32 {
    sample_if_saving();
    let Some((pid_tgid, mut event)) = begin_call(&ctx, EventKind::SyncWait) else {
        return 0;
    };
    if event.probe != ProbeId::CudaDeviceSynchronize as u32 {
        event.handle = arg_u64(&ctx, 0);
    }
    event.python_caller = python_caller(pid_tgid);
    remember_entry(&ctx, pid_tgid, &event);
    0
}
