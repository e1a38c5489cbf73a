//! The ring buffer every record goes through, and its wakeup policy. Shared by the
//! programs' object and the bench generator's (`bench.rs`), so the bench writes records
//! exactly as the probes do.
use aya_ebpf::bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP};
use aya_ebpf::macros::map;
use aya_ebpf::maps::RingBuf;
use lens_common::limits;

#[map(name = "EVENTS")]
pub(crate) static EVENTS: RingBuf = RingBuf::with_byte_size(limits::RING_BUFFER_BYTES, 0);

/// Batched wakeups: the reader is woken each time the data waiting crosses a multiple of
/// the threshold, so once per 256 KiB however far it lags; it also drains on a timer,
/// so nothing stays behind. (A wakeup is an interrupt raised on the probed thread's CPU,
/// a VM exit on a virtual machine: woken on every event past the threshold, a lagging
/// reader made each probed collective cost ~5 µs more.)
#[inline(always)]
pub(crate) fn submit_flags(ring_bytes: u64) -> u64 {
    let waiting = EVENTS.query(BPF_RB_AVAIL_DATA as u64);
    let threshold = limits::WAKEUP_THRESHOLD_BYTES;
    if (waiting + ring_bytes) / threshold != waiting / threshold {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    }
}
