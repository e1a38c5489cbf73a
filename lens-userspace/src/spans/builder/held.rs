//! Calls whose phase is not known yet when they arrive: held per process, bounded
//! in number and age, and placed once their thread's phases say where.

use crate::spans::{SpanExporter, SpanId, SpanRecord, phases::ProcessContext};

use super::*;

/// A call whose phase was not known when it arrived.
#[derive(Clone, Copy, Debug)]
pub(super) struct HeldCall {
    /// The thread whose phases place it (its own, or the loop thread's).
    pub(super) owner: u32,
    pub(super) start_ns: u64,
}

/// Calls held for placement per process, at most: past it the oldest are placed where
/// they would be shown now (memory stays bounded whatever the job does).
pub(super) const MAX_HELD_CALLS: usize = 4096;
/// A call held this long is placed with what is known (a phase that never resolves:
/// a step whose backward never comes).
pub(super) const HELD_CALL_TIMEOUT_NS: u64 = 30_000_000_000;

impl<E: SpanExporter> SpanBuilder<E> {
    /// Sends spans the collective tracker released, each through its process (held
    /// there while the process has not shown training).
    pub(super) fn send_released(&mut self, spans: Vec<SpanRecord>) {
        for mut span in spans {
            let Some(process) = self.processes.get_mut(&span.pid) else {
                continue;
            };
            if process.unplaced.contains_key(&span.id) {
                process.waiting.push(span);
                continue;
            }
            if let Some(placement) = process.placed.remove(&span.id) {
                placement.apply(&mut span);
            }
            let mut output = ProcessOutput {
                exporting: process.exporting,
                held: &mut process.held,
                out: &mut self.exporter,
            };
            output.export(span);
            process.export_if_training(&mut self.exporter, &self.groups);
        }
    }

    /// Places the held calls of `pid` that `which` selects (owner thread, start), each in
    /// the phase of its owner thread that holds its start, else where it was shown when
    /// it arrived; those already released go out.
    pub(super) fn place_held(&mut self, pid: u32, which: impl Fn(u32, u64) -> bool) {
        let Some(process) = self.processes.get_mut(&pid) else {
            return;
        };
        let chosen: Vec<(SpanId, HeldCall)> = process
            .unplaced
            .iter()
            .filter(|(_, call)| which(call.owner, call.start_ns))
            .map(|(id, call)| (*id, *call))
            .collect();
        if chosen.is_empty() {
            return;
        }
        for (id, call) in &chosen {
            process.unplaced.remove(id);
            let placement = process
                .threads
                .get(&call.owner)
                .and_then(|thread| thread.phase_at(call.start_ns));
            if let Some(placement) = placement {
                process.placed.insert(*id, placement);
            }
        }
        process.oldest_held_ns = process
            .unplaced
            .values()
            .map(|call| call.start_ns)
            .min()
            .unwrap_or(u64::MAX);
        let (ready, still): (Vec<SpanRecord>, Vec<SpanRecord>) = process
            .waiting
            .drain(..)
            .partition(|span| !process.unplaced.contains_key(&span.id));
        process.waiting = still;
        self.send_released(ready);
    }

    /// Past [`MAX_HELD_CALLS`] held in `pid`, the oldest quarter is placed now; past
    /// [`HELD_CALL_TIMEOUT_NS`], any.
    pub(super) fn bound_held(&mut self, pid: u32, now_ns: u64) {
        let Some(process) = self.processes.get(&pid) else {
            return;
        };
        let mut threshold = now_ns.saturating_sub(HELD_CALL_TIMEOUT_NS);
        if process.unplaced.len() > MAX_HELD_CALLS {
            let mut starts: Vec<u64> = process.unplaced.values().map(|c| c.start_ns).collect();
            starts.sort_unstable();
            threshold = threshold.max(starts[starts.len() / 4]);
        }
        if process.oldest_held_ns <= threshold {
            self.place_held(pid, |_, start| start <= threshold);
        }
    }

    /// The held calls of `tid` (as owner) go to their phases once its phase is known.
    pub(super) fn place_when_known(&mut self, pid: u32, tid: u32) {
        let known = self.processes.get_mut(&pid).is_some_and(|process| {
            if process.unplaced.is_empty() {
                // Nothing held: the phase signals' common case costs nothing more.
                return false;
            }
            let Some(thread) = process.threads.get(&tid) else {
                return true;
            };
            let ctx = ProcessContext {
                arena: &mut process.arena,
                ids: &mut self.ids,
                out: &mut crate::spans::SpanLog::default(),
                job: process.job,
                model_init: &mut process.model_init,
                ruled: &process.ruled,
            };
            thread.current_phase(&ctx, None).is_some()
        });
        if known {
            self.place_held(pid, |owner, _| owner == tid);
        }
    }
}
