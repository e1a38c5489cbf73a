//! NCCL's calls: group start/end, collectives (their argument layout from the attach
//! cookie) and communicator init.
use aya_ebpf::helpers::bpf_probe_read_user;
use aya_ebpf::macros::uprobe;
use aya_ebpf::programs::ProbeContext;
use lens_common::{
    EventKind, HandleKey, NCCL_UNIQUE_ID_WORDS, NcclArgs, ProbeId, comm_id_hash, cookie_shape,
};

use crate::ctx::{
    arg_i32, arg_u64, begin_call, begin_call_with_cookie, emit, remember_entry, submit_flags,
};
use crate::maps::COLLECTIVE_STREAMS;
use crate::python::{python_caller, sample_if_saving};

/// `ncclGroupStart` / `ncclGroupEnd`: counted and sent, they bracket fused collectives.
#[uprobe]
pub fn nccl_group(ctx: ProbeContext) -> u32 {
    let Some((_, mut event)) = begin_call(&ctx, EventKind::Group) else {
        return 0;
    };
    event.group_open = (event.probe == ProbeId::NcclGroupStart as u32) as u32;
    emit(&event, submit_flags());
    0
}

/// Entry of an NCCL collective or point-to-point call: decode its arguments by shape.
#[uprobe]
pub fn nccl_collective_entry(ctx: ProbeContext) -> u32 {
    sample_if_saving();
    let Some((pid_tgid, mut event, cookie)) = begin_call_with_cookie(&ctx, EventKind::Collective)
    else {
        return 0;
    };
    event.count = arg_u64(&ctx, 2);
    event.datatype = arg_i32(&ctx, 3);
    // The cookie's shape says where the rest is. Compared as plain integers: a table
    // lookup would give the verifier an index to distrust.
    const OP_COMM_STREAM: u32 = NcclArgs::OpCommStream as u32;
    const ROOT_COMM_STREAM: u32 = NcclArgs::RootCommStream as u32;
    const OP_ROOT_COMM_STREAM: u32 = NcclArgs::OpRootCommStream as u32;
    const COMM_STREAM: u32 = NcclArgs::CommStream as u32;
    const POINT_TO_POINT: u32 = NcclArgs::PointToPoint as u32;
    match cookie_shape(cookie) {
        OP_COMM_STREAM => {
            event.redop = arg_i32(&ctx, 4);
            event.comm = arg_u64(&ctx, 5);
            event.handle = arg_u64(&ctx, 6);
        }
        ROOT_COMM_STREAM => {
            event.peer = arg_i32(&ctx, 4);
            event.comm = arg_u64(&ctx, 5);
            event.handle = arg_u64(&ctx, 6);
        }
        OP_ROOT_COMM_STREAM => {
            event.redop = arg_i32(&ctx, 4);
            event.peer = arg_i32(&ctx, 5);
            event.comm = arg_u64(&ctx, 6);
            event.handle = arg_u64(&ctx, 7);
        }
        COMM_STREAM => {
            event.comm = arg_u64(&ctx, 4);
            event.handle = arg_u64(&ctx, 5);
        }
        POINT_TO_POINT => {
            event.count = arg_u64(&ctx, 1);
            event.datatype = arg_i32(&ctx, 2);
            event.peer = arg_i32(&ctx, 3);
            event.comm = arg_u64(&ctx, 4);
            event.handle = arg_u64(&ctx, 5);
        }
        _ => return 0,
    }
    // The next event recorded on this stream tells when the collective completed.
    let stream = HandleKey {
        tgid: event.tgid,
        _pad: 0,
        handle: event.handle,
    };
    // Marked once: an LRU update allocates a new element even for a key already there.
    // SAFETY: only presence is read.
    if unsafe { COLLECTIVE_STREAMS.get(&stream) }.is_none() {
        let _ = COLLECTIVE_STREAMS.insert(&stream, &1, 0);
    }
    event.python_caller = python_caller(pid_tgid);
    remember_entry(&ctx, pid_tgid, &event);
    0
}

/// Entry of `ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)`.
/// The 128-byte id is passed by value in memory, so `rank` takes the third register.
#[uprobe]
pub fn nccl_comm_init_entry(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, mut event)) = begin_call(&ctx, EventKind::CommInit) else {
        return 0;
    };
    // Where the call will write the new handle; read back at return.
    event.comm = arg_u64(&ctx, 0);
    event.nranks = arg_i32(&ctx, 1);
    event.rank = arg_i32(&ctx, 2);
    let mut words = [0u64; NCCL_UNIQUE_ID_WORDS];
    // SAFETY: reading the traced thread's stack through the checked helper.
    unsafe {
        let id = ((*ctx.regs).rsp + 8) as *const [u64; NCCL_UNIQUE_ID_WORDS];
        if let Ok(read) = bpf_probe_read_user(id) {
            words = read;
        }
    }
    event.comm_id_hash = comm_id_hash(&words);
    remember_entry(&ctx, pid_tgid, &event);
    0
}
