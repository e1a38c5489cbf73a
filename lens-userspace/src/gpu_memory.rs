//! GPU memory: what each traced process holds on the device, counted from its allocation
//! calls (`calls::MemoryOp`: the runtime's and the driver's, docs/memory.md), and what a
//! failed allocation asked for. The session's [`GpuMemory`] keeps one [`MemoryLedger`]
//! per process and writes what each call did into its event ([`MemoryChange`]) before
//! any sink sees it: the spans, the summary and the metrics read it from there
//! (`events::MemoryChange`).
use std::collections::HashMap;

use lens_common::ProbeId;

pub use crate::events::{MemoryChange, OutOfMemory};
use crate::{
    calls::MemoryOp,
    events::{CallTiming, ProbeEvent},
    hangs::location,
    settings::format_size,
};

/// `cudaErrorMemoryAllocation` and `CUDA_ERROR_OUT_OF_MEMORY`: both 2.
pub const OUT_OF_MEMORY: i64 = 2;

/// A memory call at least this long (an allocation that had to synchronise or map, a free
/// that waited for the device) gets a span of its own; the rest are counted.
pub const SLOW_CALL_NS: u64 = 100_000;

/// One process's device memory, from its calls.
#[derive(Debug, Default)]
pub struct MemoryLedger {
    /// Live allocations: address → bytes.
    allocations: HashMap<u64, u64>,
    /// Live physical memory of the virtual-memory API: handle → bytes.
    physical: HashMap<u64, u64>,
    held: u64,
    peak: u64,
}

impl MemoryLedger {
    /// Applies one call: `args` as the probe kept them, `out` what it wrote through its
    /// out-pointer, `result` its return value.
    pub fn apply(&mut self, op: MemoryOp, args: &[u64], out: u64, result: i64) -> MemoryChange {
        let arg = |i: usize| args.get(i).copied().unwrap_or(0);
        let ok = result == 0;
        let bytes = match op {
            MemoryOp::Alloc if ok && out != 0 => {
                let missed = self.allocations.insert(out, arg(1));
                self.forget_missed(missed);
                arg(1)
            }
            MemoryOp::Create if ok && out != 0 => {
                let missed = self.physical.insert(out, arg(1));
                self.forget_missed(missed);
                arg(1)
            }
            MemoryOp::Free if ok => self.allocations.remove(&arg(0)).unwrap_or(0),
            MemoryOp::Release if ok => self.physical.remove(&arg(0)).unwrap_or(0),
            // Asked for (a failure), or mapped: what the call was about, held unchanged.
            MemoryOp::Alloc | MemoryOp::Create | MemoryOp::Map | MemoryOp::Unmap => arg(1),
            MemoryOp::Free | MemoryOp::Release => 0,
        };
        if ok {
            match op {
                // Only what the ledger holds (an address it could read) can be freed.
                MemoryOp::Alloc | MemoryOp::Create if out != 0 => self.held += bytes,
                MemoryOp::Alloc | MemoryOp::Create => {}
                MemoryOp::Free | MemoryOp::Release => self.held -= bytes.min(self.held),
                MemoryOp::Map | MemoryOp::Unmap => {}
            }
        }
        self.peak = self.peak.max(self.held);
        MemoryChange {
            op,
            bytes,
            held: self.held,
            peak: self.peak,
            out_of_memory: None,
        }
    }

    /// An address (or handle) allocated again while the ledger still holds it: its free
    /// was missed (a call lens-probe lost), so its old bytes are no longer held.
    fn forget_missed(&mut self, missed: Option<u64>) {
        self.held -= missed.unwrap_or(0).min(self.held);
    }
}

/// The session's component: a ledger per traced process.
#[derive(Debug, Default)]
pub struct GpuMemory {
    ledgers: HashMap<u32, MemoryLedger>,
}

impl GpuMemory {
    /// Writes what a memory call did into its event; a failed allocation also gets the
    /// thread's Python stack and one console line, at once.
    pub fn on_event(&mut self, event: &mut ProbeEvent, rank: Option<i64>) {
        let ProbeEvent::ApiCall {
            timing,
            probe,
            args,
            out,
            result,
            memory,
        } = event
        else {
            return;
        };
        let Some(op) = MemoryOp::from_probe(*probe) else {
            return;
        };
        let ledger = self.ledgers.entry(timing.tgid).or_default();
        let mut change = ledger.apply(op, args, *out, *result);
        if op.takes_memory() && *result == OUT_OF_MEMORY {
            let python = location::python(timing.tgid, timing.tid)
                .iter()
                .map(ToString::to_string)
                .collect();
            change.out_of_memory = Some(OutOfMemory { python });
            crate::say!("{}", out_of_memory_line(timing, *probe, rank, &change));
        }
        *memory = Some(change);
    }

    /// The process ended: its ledger goes.
    pub fn forget(&mut self, pid: u32) {
        self.ledgers.remove(&pid);
    }
}

/// The console line of a failed allocation: who, what it asked, what it held, where.
pub fn out_of_memory_line(
    timing: &CallTiming,
    probe: ProbeId,
    rank: Option<i64>,
    change: &MemoryChange,
) -> String {
    let rank = rank.map_or_else(String::new, |rank| format!(" (rank {rank})"));
    let place = change
        .out_of_memory
        .as_ref()
        .and_then(|oom| oom.python.first())
        .map_or_else(
            || "no Python stack read".to_string(),
            |frame| format!("in {frame}"),
        );
    format!(
        "lens-probe: out of GPU memory: pid {}{rank} thread {}: {} of {} failed, {} held (peak {}), {place}",
        timing.tgid,
        timing.tid,
        crate::probes::catalog::symbol(probe),
        format_size(change.bytes),
        format_size(change.held),
        format_size(change.peak),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_and_frees_give_held_and_peak() {
        let mut ledger = MemoryLedger::default();
        let a = ledger.apply(MemoryOp::Alloc, &[0x10, 1000], 0xa000, 0);
        assert_eq!((a.bytes, a.held, a.peak), (1000, 1000, 1000));
        let b = ledger.apply(MemoryOp::Alloc, &[0x10, 500], 0xb000, 0);
        assert_eq!((b.held, b.peak), (1500, 1500));
        let freed = ledger.apply(MemoryOp::Free, &[0xa000], 0, 0);
        assert_eq!((freed.bytes, freed.held, freed.peak), (1000, 500, 1500));
        // A free of an address never seen allocated (made before tracing began).
        let unknown = ledger.apply(MemoryOp::Free, &[0xdead], 0, 0);
        assert_eq!((unknown.bytes, unknown.held), (0, 500));
    }

    #[test]
    fn a_failed_allocation_holds_nothing_and_says_what_it_asked() {
        let mut ledger = MemoryLedger::default();
        ledger.apply(MemoryOp::Alloc, &[0x10, 100], 0xa000, 0);
        let failed = ledger.apply(MemoryOp::Alloc, &[0x10, 1 << 40], 0, OUT_OF_MEMORY);
        assert_eq!(
            (failed.bytes, failed.held, failed.peak),
            (1 << 40, 100, 100)
        );
        // A failed free changes nothing either.
        let bad_free = ledger.apply(MemoryOp::Free, &[0xa000], 0, 1);
        assert_eq!((bad_free.bytes, bad_free.held), (0, 100));
        // Nor does an allocation whose address could not be read: it could never be
        // freed from the ledger.
        let unread = ledger.apply(MemoryOp::Alloc, &[0x10, 4096], 0, 0);
        assert_eq!(unread.held, 100);
    }

    #[test]
    fn physical_memory_counts_at_create_and_release_not_at_map() {
        let mut ledger = MemoryLedger::default();
        let created = ledger.apply(MemoryOp::Create, &[0x10, 2 << 20, 0, 0], 7, 0);
        assert_eq!(created.held, 2 << 20);
        let mapped = ledger.apply(MemoryOp::Map, &[0x7000_0000, 2 << 20, 0, 7], 0, 0);
        assert_eq!((mapped.bytes, mapped.held), (2 << 20, 2 << 20));
        ledger.apply(MemoryOp::Unmap, &[0x7000_0000, 2 << 20], 0, 0);
        let released = ledger.apply(MemoryOp::Release, &[7], 0, 0);
        assert_eq!(
            (released.bytes, released.held, released.peak),
            (2 << 20, 0, 2 << 20)
        );
    }

    #[test]
    fn an_address_reused_without_its_free_seen_is_counted_once() {
        let mut ledger = MemoryLedger::default();
        ledger.apply(MemoryOp::Alloc, &[0x10, 100], 0xa000, 0);
        let again = ledger.apply(MemoryOp::Alloc, &[0x10, 300], 0xa000, 0);
        // The device cannot give one address twice: the old 100 bytes were freed.
        assert_eq!((again.held, again.peak), (300, 300));
        let freed = ledger.apply(MemoryOp::Free, &[0xa000], 0, 0);
        assert_eq!(freed.held, 0);
    }
}
