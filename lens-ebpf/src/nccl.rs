//! NCCL's calls: group start/end, collectives (their argument layout from the attach
//! cookie) and communicator init.
use aya_ebpf::helpers::bpf_probe_read_user;
use aya_ebpf::programs::ProbeContext;
use lens_common::record::{CollectiveCall, CommInitCall, GroupCall};
use lens_common::{HandleKey, NCCL_UNIQUE_ID_WORDS, NcclArgs, ProbeId, comm_id_hash, cookie_shape};

use crate::ctx::{arg_i32, arg_u64, begin_call, call_starting_now, now_ns, remember_entry, send};
use crate::maps::{COLLECTIVE_STREAMS, INFLIGHT_COLLECTIVES, INFLIGHT_COMM_INITS};
use crate::python::{python_caller, sample_if_saving};

uprobe_and_multi! {
    /// `ncclGroupStart` / `ncclGroupEnd`: counted and sent, they bracket fused collectives.
    nccl_group, nccl_group_m => nccl_group_body
}

#[inline(always)]
fn nccl_group_body(ctx: ProbeContext) -> u32 {
    let Some((_, _, mut record, _)) = begin_call::<GroupCall>(&ctx) else {
        return 0;
    };
    record.body.at_ns = now_ns();
    record.body.open = (record.header.probe == ProbeId::NcclGroupStart as u32) as u32;
    send(&record);
    0
}

uprobe_and_multi! {
    /// Entry of an NCCL collective or point-to-point call: decode its arguments by shape.
    nccl_collective_entry, nccl_collective_entry_m => nccl_collective_entry_body
}

#[inline(always)]
fn nccl_collective_entry_body(ctx: ProbeContext) -> u32 {
    sample_if_saving();
    let Some((pid_tgid, _, mut record, cookie)) = begin_call::<CollectiveCall>(&ctx) else {
        return 0;
    };
    let call = &mut record.body;
    call.times = call_starting_now();
    call.count = arg_u64(&ctx, 2);
    call.datatype = arg_i32(&ctx, 3);
    // The cookie's shape says where the rest is. Compared as plain integers: a table
    // lookup would give the verifier an index to distrust.
    const OP_COMM_STREAM: u32 = NcclArgs::OpCommStream as u32;
    const ROOT_COMM_STREAM: u32 = NcclArgs::RootCommStream as u32;
    const OP_ROOT_COMM_STREAM: u32 = NcclArgs::OpRootCommStream as u32;
    const COMM_STREAM: u32 = NcclArgs::CommStream as u32;
    const POINT_TO_POINT: u32 = NcclArgs::PointToPoint as u32;
    match cookie_shape(cookie) {
        OP_COMM_STREAM => {
            call.redop = arg_i32(&ctx, 4);
            call.comm = arg_u64(&ctx, 5);
            call.stream = arg_u64(&ctx, 6);
        }
        ROOT_COMM_STREAM => {
            call.peer = arg_i32(&ctx, 4);
            call.comm = arg_u64(&ctx, 5);
            call.stream = arg_u64(&ctx, 6);
        }
        OP_ROOT_COMM_STREAM => {
            call.redop = arg_i32(&ctx, 4);
            call.peer = arg_i32(&ctx, 5);
            call.comm = arg_u64(&ctx, 6);
            call.stream = arg_u64(&ctx, 7);
        }
        COMM_STREAM => {
            call.comm = arg_u64(&ctx, 4);
            call.stream = arg_u64(&ctx, 5);
        }
        POINT_TO_POINT => {
            call.count = arg_u64(&ctx, 1);
            call.datatype = arg_i32(&ctx, 2);
            call.peer = arg_i32(&ctx, 3);
            call.comm = arg_u64(&ctx, 4);
            call.stream = arg_u64(&ctx, 5);
        }
        _ => return 0,
    }
    // The next event recorded on this stream tells when the collective completed.
    let stream = HandleKey {
        tgid: record.header.tgid,
        _pad: 0,
        handle: record.body.stream,
    };
    // Marked once: an LRU update allocates a new element even for a key already there.
    // SAFETY: only presence is read.
    if unsafe { COLLECTIVE_STREAMS.get(&stream) }.is_none() {
        let _ = COLLECTIVE_STREAMS.insert(&stream, &1, 0);
    }
    record.body.python_caller = python_caller(pid_tgid);
    remember_entry(&ctx, &INFLIGHT_COLLECTIVES, pid_tgid, &record);
    0
}

uprobe_and_multi! {
    /// Entry of `ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)`.
    /// The 128-byte id is passed by value in memory, so `rank` takes the third register.
    nccl_comm_init_entry, nccl_comm_init_entry_m => nccl_comm_init_entry_body
}

#[inline(always)]
fn nccl_comm_init_entry_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, _, mut record, _)) = begin_call::<CommInitCall>(&ctx) else {
        return 0;
    };
    let call = &mut record.body;
    call.times = call_starting_now();
    call.comm_out = arg_u64(&ctx, 0);
    call.nranks = arg_i32(&ctx, 1);
    call.rank = arg_i32(&ctx, 2);
    let mut words = [0u64; NCCL_UNIQUE_ID_WORDS];
    // SAFETY: reading the traced thread's stack through the checked helper.
    unsafe {
        let id = ((*ctx.regs).rsp + 8) as *const [u64; NCCL_UNIQUE_ID_WORDS];
        if let Ok(read) = bpf_probe_read_user(id) {
            words = read;
        }
    }
    call.comm_id_hash = comm_id_hash(&words);
    remember_entry(&ctx, &INFLIGHT_COMM_INITS, pid_tgid, &record);
    0
}
