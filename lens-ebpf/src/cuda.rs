//! CUDA's event and sync calls: an event recorded after a collective, queried until it
//! completes, and the synchronizations that wait for streams, events or the device.
use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use aya_ebpf::programs::{ProbeContext, RetProbeContext};
use lens_common::record::{EventQuery, EventRecord, SyncCall};
use lens_common::{HandleKey, ProbeId};

use crate::ctx::{
    arg_u64, begin_call, call_starting_now, count_call, new_record, now_ns, probe_id,
    remember_entry, send, take_entry, traced,
};
use crate::maps::{COLLECTIVE_EVENTS, COLLECTIVE_STREAMS, INFLIGHT_QUERIES, INFLIGHT_SYNCS};
use crate::python::{python_caller, sample_if_saving};

uprobe_and_multi! {
    /// `cudaEventRecord[WithFlags](event, stream)`: sent only when it binds an event to the
    /// collectives on `stream` (or unbinds a re-recorded one); every call is counted.
    cuda_event_record, cuda_event_record_m => cuda_event_record_body
}

#[inline(always)]
fn cuda_event_record_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    let probe = probe_id(&ctx);
    count_call(target, probe);
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
    let mut record = new_record::<EventRecord>(probe, pid_tgid);
    record.body = EventRecord {
        at_ns: now_ns(),
        event: cuda_event.handle,
        stream: stream.handle,
    };
    send(&record);
    0
}

uprobe_and_multi! {
    /// Entry of `cudaEventQuery(event)`: remembered only for events watched after a
    /// collective (PyTorch's allocator and others query many more).
    cuda_event_query_entry, cuda_event_query_entry_m => cuda_event_query_entry_body
}

#[inline(always)]
fn cuda_event_query_entry_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    let probe = probe_id(&ctx);
    count_call(target, probe);
    let key = HandleKey {
        tgid: (pid_tgid >> 32) as u32,
        _pad: 0,
        handle: arg_u64(&ctx, 0),
    };
    // SAFETY: only presence is read.
    if unsafe { COLLECTIVE_EVENTS.get(&key) }.is_none() {
        return 0;
    }
    let mut record = new_record::<EventQuery>(probe, pid_tgid);
    record.body.times = call_starting_now();
    record.body.event = key.handle;
    remember_entry(&ctx, &INFLIGHT_QUERIES, pid_tgid, &record);
    0
}

/// `cudaErrorNotReady`: the event's work has not completed yet.
pub(crate) const CUDA_ERROR_NOT_READY: i64 = 600;

uretprobe_and_multi! {
    /// Return of `cudaEventQuery` on a watched event: not ready → remember when it was asked
    /// (a lower bound of the completion); success → send it once, with that lower bound.
    cuda_event_query_return, cuda_event_query_return_m => cuda_event_query_return_body
}

#[inline(always)]
fn cuda_event_query_return_body(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(mut record) = take_entry(&ctx, &INFLIGHT_QUERIES, pid_tgid) else {
        // An event nobody watches: its entry was not remembered.
        return 0;
    };
    let watched = HandleKey {
        tgid: record.header.tgid,
        _pad: 0,
        handle: record.body.event,
    };
    let result = ctx.ret::<i64>() as i32 as i64;
    if result == CUDA_ERROR_NOT_READY {
        let _ = COLLECTIVE_EVENTS.insert(&watched, &record.body.times.start_ns, 0);
        return 0;
    }
    // SAFETY: copied out before the entry is removed.
    let Some(not_ready_ns) = (unsafe { COLLECTIVE_EVENTS.get(&watched) }).copied() else {
        return 0;
    };
    let _ = COLLECTIVE_EVENTS.remove(&watched);
    if result != 0 {
        return 0;
    }
    record.body.times.end_ns = now_ns();
    record.body.not_ready_ns = not_ready_ns;
    send(&record);
    0
}

uprobe_and_multi! {
    /// Entry of a CUDA synchronisation call; `handle` is the stream or event waited on.
    cuda_sync_entry, cuda_sync_entry_m => cuda_sync_entry_body
}

#[inline(always)]
fn cuda_sync_entry_body(ctx: ProbeContext) -> u32 {
    sample_if_saving();
    let Some((pid_tgid, _, mut record, _)) = begin_call::<SyncCall>(&ctx) else {
        return 0;
    };
    record.body.times = call_starting_now();
    if record.header.probe != ProbeId::CudaDeviceSynchronize as u32 {
        record.body.handle = arg_u64(&ctx, 0);
    }
    record.body.python_caller = python_caller(pid_tgid);
    remember_entry(&ctx, &INFLIGHT_SYNCS, pid_tgid, &record);
    0
}
