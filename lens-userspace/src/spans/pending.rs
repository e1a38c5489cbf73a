//! Pending spans: where a process's spans wait before they go out, and the one rule for
//! how long they may.
//!
//! A span can go out only once three things are known: where it ends (a collective's
//! completion, told later by what the host does on its stream), where it hangs (a call
//! made while its thread's phase was not known yet: between phases, while an
//! `Optimizer.step` may still run a closure), and whether its process is a training job
//! at all (a launcher, a shell never shows training activity). The first is the
//! collective tracker's (`collectives`: it matches calls across processes, so it holds
//! them for every process at once); the other two are this per-process store's.
//!
//! The rule, for both: a span waits for what it lacks until it is known, at most
//! [`MAX_WAIT_NS`] (its call's start for a placement, its return for a completion), and
//! past a bound in number ([`MAX_UNPLACED_CALLS`] per process, [`MAX_HELD_COLLECTIVES`]
//! across processes) the oldest stop waiting at once; a span that stops waiting goes out
//! with what is known (where it was shown when it arrived, the end at its call's
//! return). When its process exits, each of its spans stops waiting the same way; then
//! those of a process that never showed training activity are dropped. Until that
//! activity shows, finished spans wait for it without a bound of their own: they are the
//! process's spans of start-up, bounded by what the process does before it trains.
use std::collections::HashMap;

use super::{SpanExporter, SpanId, SpanRecord, arena::Placement};

/// How long a span waits for its placement or its completion before it goes out with
/// what is known (a phase that never resolves: a step whose backward never comes; a
/// collective nothing completes).
pub const MAX_WAIT_NS: u64 = 30_000_000_000;

/// Calls waiting for their placement per process, at most: past it the oldest quarter
/// is placed where it would be shown now (memory stays bounded whatever the job does).
pub const MAX_UNPLACED_CALLS: usize = 4096;

/// Collective spans held for their completion or the other ranks, across processes, at
/// most: past it the oldest goes out.
pub const MAX_HELD_COLLECTIVES: usize = 16_384;

/// A call whose phase was not known when it arrived.
#[derive(Clone, Copy, Debug)]
pub struct UnplacedCall {
    /// The thread whose phases place it (its own, or the loop thread's).
    pub owner: u32,
    pub start_ns: u64,
}

/// One process's pending spans (see the module doc).
#[derive(Debug)]
pub struct PendingSpans {
    /// The process has shown training activity: its finished spans go to the exporter.
    exporting: bool,
    /// Finished spans waiting for the process's training activity, in export order.
    untrained: Vec<SpanRecord>,
    /// Calls waiting for their placement, by span id.
    unplaced: HashMap<SpanId, UnplacedCall>,
    /// The earliest start among `unplaced` (`u64::MAX` when none): the per-call bound
    /// check reads this instead of walking every waiting call.
    oldest_unplaced_ns: u64,
    /// Finished spans of `unplaced` calls (released by the collective tracker, or never
    /// held there), in arrival order.
    finished_unplaced: Vec<SpanRecord>,
    /// Placements decided for calls whose spans the collective tracker still holds.
    placed: HashMap<SpanId, Placement>,
}

impl Default for PendingSpans {
    fn default() -> Self {
        PendingSpans {
            exporting: false,
            untrained: Vec::new(),
            unplaced: HashMap::new(),
            oldest_unplaced_ns: u64::MAX,
            finished_unplaced: Vec::new(),
            placed: HashMap::new(),
        }
    }
}

impl PendingSpans {
    pub fn exporting(&self) -> bool {
        self.exporting
    }

    /// A finished, placed span: out now once the process is exporting, else it waits.
    pub fn route(&mut self, span: SpanRecord, out: &mut dyn SpanExporter) {
        if self.exporting {
            out.export(span);
        } else {
            self.untrained.push(span);
        }
    }

    /// The process showed training activity: what waited for it, in order.
    pub fn start_exporting(&mut self) -> Vec<SpanRecord> {
        self.exporting = true;
        std::mem::take(&mut self.untrained)
    }

    /// Call `id` waits for its placement.
    pub fn hold_call(&mut self, id: SpanId, call: UnplacedCall) {
        self.unplaced.insert(id, call);
        self.oldest_unplaced_ns = self.oldest_unplaced_ns.min(call.start_ns);
    }

    pub fn has_unplaced(&self) -> bool {
        !self.unplaced.is_empty()
    }

    /// A finished span: ready to route (placed, if its placement was decided), or `None`
    /// while it waits for its placement.
    pub fn arrive(&mut self, mut span: SpanRecord) -> Option<SpanRecord> {
        if self.unplaced.contains_key(&span.id) {
            self.finished_unplaced.push(span);
            return None;
        }
        if let Some(placement) = self.placed.remove(&span.id) {
            placement.apply(&mut span);
        }
        Some(span)
    }

    /// Stops the wait of the calls `which` selects (owner thread, start): each takes the
    /// placement `phase_of` finds, else stays where it was shown when it arrived.
    /// Returns the finished spans that no longer wait, to arrive again.
    pub fn place(
        &mut self,
        which: impl Fn(u32, u64) -> bool,
        phase_of: impl Fn(&UnplacedCall) -> Option<Placement>,
    ) -> Vec<SpanRecord> {
        let chosen: Vec<(SpanId, UnplacedCall)> = self
            .unplaced
            .iter()
            .filter(|(_, call)| which(call.owner, call.start_ns))
            .map(|(id, call)| (*id, *call))
            .collect();
        if chosen.is_empty() {
            return Vec::new();
        }
        for (id, call) in &chosen {
            self.unplaced.remove(id);
            if let Some(placement) = phase_of(call) {
                self.placed.insert(*id, placement);
            }
        }
        self.oldest_unplaced_ns = self
            .unplaced
            .values()
            .map(|call| call.start_ns)
            .min()
            .unwrap_or(u64::MAX);
        let (ready, still): (Vec<SpanRecord>, Vec<SpanRecord>) = self
            .finished_unplaced
            .drain(..)
            .partition(|span| !self.unplaced.contains_key(&span.id));
        self.finished_unplaced = still;
        ready
    }

    /// The latest start at or before which calls have waited too long at `now_ns`
    /// ([`MAX_WAIT_NS`], or past [`MAX_UNPLACED_CALLS`] the oldest quarter), when some
    /// have.
    pub fn overdue(&self, now_ns: u64) -> Option<u64> {
        let mut threshold = now_ns.saturating_sub(MAX_WAIT_NS);
        if self.unplaced.len() > MAX_UNPLACED_CALLS {
            let mut starts: Vec<u64> = self.unplaced.values().map(|c| c.start_ns).collect();
            starts.sort_unstable();
            threshold = threshold.max(starts[starts.len() / 4]);
        }
        (self.oldest_unplaced_ns <= threshold).then_some(threshold)
    }
}

/// A process's span output: finished spans through its [`PendingSpans`] to `out`.
pub struct ProcessOutput<'a> {
    pub pending: &'a mut PendingSpans,
    pub out: &'a mut dyn SpanExporter,
}

impl SpanExporter for ProcessOutput<'_> {
    fn export(&mut self, span: SpanRecord) {
        self.pending.route(span, self.out);
    }
}
