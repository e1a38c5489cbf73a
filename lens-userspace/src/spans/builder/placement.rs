//! The builder's side of the pending spans (`spans::pending`): finished spans go out
//! through their process's store, and its waiting calls are placed once their thread's
//! phases say where, or once they have waited too long.

use crate::spans::{
    SpanExporter, SpanRecord,
    pending::{ProcessOutput, UnplacedCall},
    phases::ProcessContext,
};

use super::*;

impl<E: SpanExporter> SpanBuilder<E> {
    /// Sends finished spans (the collective tracker's, or calls') each through its
    /// process's pending spans.
    pub(super) fn send_released(&mut self, spans: Vec<SpanRecord>) {
        for span in spans {
            let Some(process) = self.processes.get_mut(&span.pid) else {
                continue;
            };
            let Some(span) = process.pending.arrive(span) else {
                continue;
            };
            let mut output = ProcessOutput {
                pending: &mut process.pending,
                out: &mut self.exporter,
            };
            output.export(span);
            process.export_if_training(&mut self.exporter, &self.groups);
        }
    }

    /// Places the waiting calls of `pid` that `which` selects (owner thread, start), each
    /// in the phase of its owner thread that holds its start, else where it was shown
    /// when it arrived; those already finished go out.
    pub(super) fn place_held(&mut self, pid: u32, which: impl Fn(u32, u64) -> bool) {
        let Some(process) = self.processes.get_mut(&pid) else {
            return;
        };
        let threads = &process.threads;
        let ready = process.pending.place(which, |call: &UnplacedCall| {
            threads
                .get(&call.owner)
                .and_then(|thread| thread.phase_at(call.start_ns))
        });
        if !ready.is_empty() {
            self.send_released(ready);
        }
    }

    /// Places the calls of `pid` that have waited too long at `now_ns`
    /// (`PendingSpans::overdue`).
    pub(super) fn bound_held(&mut self, pid: u32, now_ns: u64) {
        let overdue = self
            .processes
            .get(&pid)
            .and_then(|process| process.pending.overdue(now_ns));
        if let Some(threshold) = overdue {
            self.place_held(pid, |_, start| start <= threshold);
        }
    }

    /// The waiting calls of `tid` (as owner) go to their phases once its phase is known.
    pub(super) fn place_when_known(&mut self, pid: u32, tid: u32) {
        let known = self.processes.get_mut(&pid).is_some_and(|process| {
            if !process.pending.has_unplaced() {
                // Nothing waits: the phase signals' common case costs nothing more.
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
                ruled: &process.ruled.groups,
            };
            thread.current_phase(&ctx, None).is_some()
        });
        if known {
            self.place_held(pid, |owner, _| owner == tid);
        }
    }
}
