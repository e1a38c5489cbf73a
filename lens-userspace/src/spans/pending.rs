//! Pending spans: the one store where spans wait before they go out, and the one rule
//! for how long they may.
//!
//! A span can go out only once three things are known: where it ends (a collective's
//! completion, told later by what the host does on its stream, and the same collective
//! on the other ranks), where it hangs (a call made while its thread's phase was not
//! known yet: between phases, while an `Optimizer.step` may still run a closure), and
//! whether its process is a training job at all (a launcher, a shell never shows
//! training activity). Each span waits here, once, for what it lacks ([`Waits`]); the
//! components that learn the answers say so by key (the collective tracker: the end is
//! known; the span builder: the placement is) and never hold a span themselves.
//!
//! The rule: a span waits for its end or its placement until it is known, at most
//! [`MAX_WAIT_NS`] (from its call's return for an end, its call's start for a
//! placement), and past a bound in number ([`MAX_UNPLACED_CALLS`] per process,
//! [`MAX_HELD_COLLECTIVES`] across processes) the oldest stop waiting at once; a span
//! that stops waiting goes out with what is known (where it was shown when it arrived,
//! the end at its call's return). When its process exits, each of its spans stops
//! waiting the same way (the collective tracker first, then the placements); then those
//! of a process that never showed training activity are dropped. Until that activity
//! shows, finished spans wait for it without a bound of their own: they are the
//! process's spans of start-up, bounded by what the process does before it trains.
use foldhash::HashMap;
use slab::Slab;

use super::{SpanExporter, SpanRecord, arena::Placement};

/// How long a span waits for its placement or its completion before it goes out with
/// what is known (a phase that never resolves: a step whose backward never comes; a
/// collective nothing completes).
pub const MAX_WAIT_NS: u64 = 30_000_000_000;

/// Calls waiting for their placement per process, at most: past it the oldest quarter
/// is placed where it would be shown now (memory stays bounded whatever the job does).
pub const MAX_UNPLACED_CALLS: usize = 4096;

/// Collective spans waiting for their completion or the other ranks, across processes,
/// at most: past it the oldest goes out.
pub const MAX_HELD_COLLECTIVES: usize = 16_384;

/// Whether a wait that began at `since_ns` has lasted too long at `now_ns`.
pub fn waited_too_long(since_ns: u64, now_ns: u64) -> bool {
    since_ns < now_ns.saturating_sub(MAX_WAIT_NS)
}

/// A span's place in the store while it waits.
pub type PendingKey = usize;

/// A call whose phase was not known when it arrived.
#[derive(Clone, Copy, Debug)]
pub struct UnplacedCall {
    /// The thread whose phases place it (its own, or the loop thread's).
    pub owner: u32,
    pub start_ns: u64,
}

/// What a span waits for before it can go out (besides its process's training).
#[derive(Clone, Copy, Debug, Default)]
pub struct Waits {
    /// Its end: the collective tracker holds its key until the completion and the
    /// other ranks are known.
    pub end: bool,
    /// Its placement, when its phase was not known as it arrived.
    pub placement: Option<UnplacedCall>,
}

impl Waits {
    fn none(&self) -> bool {
        !self.end && self.placement.is_none()
    }
}

struct Waiting {
    record: SpanRecord,
    waits: Waits,
}

/// What waits in one process: its finished spans until it trains, and which of the
/// store's spans wait for their placement.
#[derive(Default)]
struct ProcessWaits {
    /// The process has shown training activity: its finished spans go to the exporter.
    exporting: bool,
    /// Finished spans waiting for the process's training activity, in export order.
    untrained: Vec<SpanRecord>,
    /// Its calls waiting for their placement, in arrival order.
    unplaced: Vec<PendingKey>,
    /// The earliest start among `unplaced` (`u64::MAX` when none): the per-call bound
    /// check reads this instead of walking every waiting call.
    oldest_unplaced_ns: u64,
}

/// Every pending span of every traced process (see the module doc).
#[derive(Default)]
pub struct PendingSpans {
    waiting: Slab<Waiting>,
    processes: HashMap<u32, ProcessWaits>,
}

impl PendingSpans {
    /// `pid` starts (or runs a new program): nothing of it waits, it has not trained.
    /// What its earlier program left waiting for a placement only is dropped with it.
    pub fn start_process(&mut self, pid: u32) {
        let old = self.processes.insert(
            pid,
            ProcessWaits {
                oldest_unplaced_ns: u64::MAX,
                ..ProcessWaits::default()
            },
        );
        for key in old.into_iter().flat_map(|process| process.unplaced) {
            if let Some(waiting) = self.waiting.get_mut(key) {
                waiting.waits.placement = None;
                if waiting.waits.none() {
                    self.waiting.remove(key);
                }
            }
        }
    }

    /// `pid` is gone: what still waits for its training goes with it. Its ends and
    /// placements were given up first (`SpanBuilder::end_process_with_calls`).
    pub fn end_process(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    pub fn exporting(&self, pid: u32) -> bool {
        self.processes.get(&pid).is_some_and(|p| p.exporting)
    }

    /// A finished span that waits for nothing else: out now once its process is
    /// exporting, else it waits for that (dropped if its process is not traced).
    pub fn route(&mut self, span: SpanRecord, out: &mut dyn SpanExporter) {
        match self.processes.get_mut(&span.pid) {
            Some(process) if process.exporting => out.export(span),
            Some(process) => process.untrained.push(span),
            None => {}
        }
    }

    /// `pid` showed training activity: what waited for it, in order.
    pub fn start_exporting(&mut self, pid: u32) -> Vec<SpanRecord> {
        let Some(process) = self.processes.get_mut(&pid) else {
            return Vec::new();
        };
        process.exporting = true;
        std::mem::take(&mut process.untrained)
    }

    /// `record` waits for what `waits` names (something: a span that waits for nothing
    /// is routed).
    pub fn hold(&mut self, record: SpanRecord, waits: Waits) -> PendingKey {
        debug_assert!(!waits.none(), "a span held for nothing would never leave");
        let pid = record.pid;
        let key = self.waiting.insert(Waiting { record, waits });
        if let Some(call) = waits.placement
            && let Some(process) = self.processes.get_mut(&pid)
        {
            process.unplaced.push(key);
            process.oldest_unplaced_ns = process.oldest_unplaced_ns.min(call.start_ns);
        }
        key
    }

    /// The span waiting under `key`, to complete what it carries.
    pub fn record_mut(&mut self, key: PendingKey) -> Option<&mut SpanRecord> {
        self.waiting.get_mut(key).map(|w| &mut w.record)
    }

    /// The end of the span under `key` is known (it is in its record): the span, when
    /// nothing else keeps it waiting.
    pub fn end_known(&mut self, key: PendingKey) -> Option<SpanRecord> {
        let waiting = self.waiting.get_mut(key)?;
        waiting.waits.end = false;
        waiting
            .waits
            .none()
            .then(|| self.waiting.remove(key).record)
    }

    pub fn has_unplaced(&self, pid: u32) -> bool {
        self.processes
            .get(&pid)
            .is_some_and(|p| !p.unplaced.is_empty())
    }

    /// Stops the wait of `pid`'s calls that `which` selects (owner thread, start): each
    /// takes the placement `phase_of` finds, else stays where it was shown when it
    /// arrived. Returns the spans that no longer wait for anything, in arrival order.
    pub fn place(
        &mut self,
        pid: u32,
        which: impl Fn(u32, u64) -> bool,
        phase_of: impl Fn(&UnplacedCall) -> Option<Placement>,
    ) -> Vec<SpanRecord> {
        let Some(process) = self.processes.get_mut(&pid) else {
            return Vec::new();
        };
        let mut ready = Vec::new();
        let mut oldest = u64::MAX;
        process.unplaced.retain(|&key| {
            let Some(waiting) = self.waiting.get_mut(key) else {
                return false;
            };
            let Some(call) = waiting.waits.placement else {
                return false;
            };
            if !which(call.owner, call.start_ns) {
                oldest = oldest.min(call.start_ns);
                return true;
            }
            if let Some(placement) = phase_of(&call) {
                placement.apply(&mut waiting.record);
            }
            waiting.waits.placement = None;
            if waiting.waits.none() {
                ready.push(self.waiting.remove(key).record);
            }
            false
        });
        process.oldest_unplaced_ns = oldest;
        ready
    }

    /// The latest start at or before which `pid`'s calls have waited too long for
    /// their placement at `now_ns` ([`MAX_WAIT_NS`], or past [`MAX_UNPLACED_CALLS`]
    /// the oldest quarter), when some have.
    pub fn overdue(&self, pid: u32, now_ns: u64) -> Option<u64> {
        let process = self.processes.get(&pid)?;
        let mut threshold = now_ns.saturating_sub(MAX_WAIT_NS);
        if process.unplaced.len() > MAX_UNPLACED_CALLS {
            let mut starts: Vec<u64> = process
                .unplaced
                .iter()
                .filter_map(|&key| Some(self.waiting.get(key)?.waits.placement?.start_ns))
                .collect();
            starts.sort_unstable();
            threshold = threshold.max(starts[starts.len() / 4]);
        }
        (process.oldest_unplaced_ns <= threshold).then_some(threshold)
    }

    /// Spans waiting, across processes (for their end, their placement or both).
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

/// Finished spans on their way out through the pending spans' training gate.
pub struct GatedOutput<'a> {
    pub pending: &'a mut PendingSpans,
    pub out: &'a mut dyn SpanExporter,
}

impl SpanExporter for GatedOutput<'_> {
    fn export(&mut self, span: SpanRecord) {
        self.pending.route(span, self.out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        settings::groups::SpanGroup,
        spans::{SpanId, SpanLog, SpanStatus},
    };

    fn span(pid: u32, id: u64, start_ns: u64) -> SpanRecord {
        SpanRecord {
            id: SpanId(id),
            parent: Some(SpanId(1)),
            name: "gloo.send",
            group: SpanGroup::Step,
            pid,
            tid: pid,
            start_ns,
            end_ns: start_ns + 5,
            attributes: Vec::new(),
            events: Vec::new(),
            status: SpanStatus::Unset,
        }
    }

    fn unplaced(start_ns: u64) -> Waits {
        Waits {
            end: false,
            placement: Some(UnplacedCall { owner: 7, start_ns }),
        }
    }

    #[test]
    fn a_span_goes_out_once_its_end_its_placement_and_its_training_are_known() {
        let mut pending = PendingSpans::default();
        let mut out = SpanLog::default();
        pending.start_process(7);
        let key = pending.hold(
            span(7, 10, 100),
            Waits {
                end: true,
                ..unplaced(100)
            },
        );
        // The placement first: the end still keeps it.
        let placement = Placement {
            parent: Some(SpanId(42)),
            group: SpanGroup::ForwardBackward,
        };
        assert!(
            pending
                .place(7, |_, _| true, |_| Some(placement))
                .is_empty()
        );
        assert!(!pending.has_unplaced(7));
        pending.record_mut(key).unwrap().end_ns = 900;
        let ready = pending.end_known(key).expect("nothing else waits");
        assert_eq!(ready.parent, Some(SpanId(42)));
        assert_eq!(ready.end_ns, 900);
        assert_eq!(pending.waiting(), 0);
        // Not training yet: it waits for that, then goes out in order.
        pending.route(ready, &mut out);
        pending.route(span(7, 11, 200), &mut out);
        assert!(out.spans.is_empty());
        let waited = pending.start_exporting(7);
        assert_eq!(waited.iter().map(|s| s.id.0).collect::<Vec<_>>(), [10, 11]);
        pending.route(span(7, 12, 300), &mut out);
        assert_eq!(out.spans.len(), 1);
    }

    #[test]
    fn calls_that_wait_too_long_or_too_many_are_placed_oldest_first() {
        let mut pending = PendingSpans::default();
        pending.start_process(7);
        pending.hold(span(7, 1, 1_000), unplaced(1_000));
        assert_eq!(pending.overdue(7, MAX_WAIT_NS), None);
        assert_eq!(pending.overdue(7, MAX_WAIT_NS + 1_001), Some(1_001));
        let ready = pending.place(7, |_, start| start <= 1_001, |_| None);
        assert_eq!(ready.len(), 1);
        assert_eq!(ready[0].parent, Some(SpanId(1)), "stays where it was shown");

        for i in 0..=MAX_UNPLACED_CALLS as u64 {
            pending.hold(span(7, 100 + i, 10 + i), unplaced(10 + i));
        }
        let threshold = pending.overdue(7, 0).expect("past the bound in number");
        let placed = pending.place(7, |_, start| start <= threshold, |_| None);
        assert_eq!(placed.len(), MAX_UNPLACED_CALLS / 4 + 1);
        assert!(placed.windows(2).all(|w| w[0].start_ns < w[1].start_ns));
        assert_eq!(pending.overdue(7, 0), None);
    }

    #[test]
    fn a_new_program_drops_what_only_waited_for_the_old_ones_phases() {
        let mut pending = PendingSpans::default();
        pending.start_process(7);
        pending.hold(span(7, 1, 10), unplaced(10));
        let collective = pending.hold(
            span(7, 2, 20),
            Waits {
                end: true,
                ..unplaced(20)
            },
        );
        pending.start_process(7);
        assert_eq!(
            pending.waiting(),
            1,
            "the collective still waits for its end"
        );
        assert!(!pending.has_unplaced(7));
        assert!(pending.end_known(collective).is_some());
        assert_eq!(pending.waiting(), 0);
    }
}
