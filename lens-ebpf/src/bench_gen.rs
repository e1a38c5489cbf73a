//! A load generator for the event path, for `cargo xtask bench` and its test only, in
//! a BPF object of its own (`bench.rs`): lens-probe's object does not contain it. A real
//! uprobe costs ~1 µs per hit, so no traced program can send a million events a second
//! on a small machine; this program writes records straight into a ring buffer defined
//! and woken as the probes' is (`ring.rs`), so everything after the kernel (wakeups, the
//! ring buffer reader, decoding, the span builder) is measured as it runs.
//!
//! User space runs it with `BPF_PROG_TEST_RUN` (a raw tracepoint program can be run
//! with fake tracepoint arguments; it is never attached). Arguments, as `u64`s:
//!
//! | # | meaning |
//! |---|---|
//! | 0 | tgid the events carry |
//! | 1 | tid the events carry |
//! | 2 | events to write in this run, at most [`MAX_EVENTS_PER_RUN`] |
//! | 3 | the collectives' element count |
//!
//! Each event is an `ncclAllReduce` as its return probe would send it (float32, sum, a
//! communicator and a stream, start and end stamps). The program returns how many of
//! them did not fit in the ring buffer (lost); the caller adds those up.
use aya_ebpf::{helpers::bpf_ktime_get_ns, macros::raw_tracepoint, programs::RawTracePointContext};
use lens_common::record::CollectiveCall;
use lens_common::{ProbeId, Record};

use crate::ring::{EVENTS, submit_flags};

/// Events one run writes at most (the loop's bound for the verifier).
const MAX_EVENTS_PER_RUN: u64 = 64;
/// The communicator and stream handles of the fake trainer (tests/README.md).
const COMM: u64 = 0xC0FF_EE00;
const STREAM: u64 = 0x5000;
const FLOAT32: i32 = 7;
const SUM: i32 = 0;

#[raw_tracepoint(tracepoint = "lens_bench")]
pub fn bench_emit(ctx: RawTracePointContext) -> i32 {
    let tgid: u64 = ctx.arg(0);
    let tid: u64 = ctx.arg(1);
    let wanted: u64 = ctx.arg(2);
    let count: u64 = ctx.arg(3);
    let mut record =
        Record::<CollectiveCall>::new(ProbeId::NcclAllReduce as u32, tgid as u32, tid as u32);
    record.body.count = count;
    record.body.datatype = FLOAT32;
    record.body.redop = SUM;
    record.body.comm = COMM;
    record.body.stream = STREAM;
    let mut lost = 0;
    let mut i = 0;
    while i < MAX_EVENTS_PER_RUN && i < wanted {
        // SAFETY: plain helper calls (entry and return stamps, as a probe pair takes).
        record.body.times.start_ns = unsafe { bpf_ktime_get_ns() };
        record.body.times.end_ns = unsafe { bpf_ktime_get_ns() };
        let flags = submit_flags(Record::<CollectiveCall>::RING_BYTES);
        if EVENTS
            .output::<Record<CollectiveCall>>(&record, flags)
            .is_err()
        {
            lost += 1;
        }
        i += 1;
    }
    lost
}
