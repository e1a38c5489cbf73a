//! The builder's side of the pending spans (`spans::pending`): finished spans go out
//! through the store's training gate, and calls waiting there are placed once their
//! thread's phases say where, or once they have waited too long.

use crate::spans::{
    SpanExporter, SpanRecord,
    pending::{UnplacedCall, Waits},
    phases::ProcessContext,
};

use super::*;

impl<E: SpanExporter> SpanBuilder<E> {
    /// Sends spans that wait for nothing more (the collective tracker's, or calls')
    /// each through the training gate of its process.
    pub(super) fn send_released(&mut self, spans: impl IntoIterator<Item = SpanRecord>) {
        for span in spans {
            let pid = span.pid;
            let Some(process) = self.processes.get(&pid) else {
                continue;
            };
            self.pending.route(span, &mut self.exporter);
            export_if_training(process, &mut self.pending, &mut self.exporter, &self.groups);
        }
    }

    /// A finished call's span: out, or into the pending spans while its placement is
    /// not known.
    pub(super) fn send_call(&mut self, record: SpanRecord, unplaced: Option<UnplacedCall>) {
        match unplaced {
            Some(call) => {
                let waits = Waits {
                    end: false,
                    placement: Some(call),
                };
                self.pending.hold(record, waits);
            }
            None => self.send_released([record]),
        }
    }

    /// Places the waiting calls of `pid` that `which` selects (owner thread, start), each
    /// in the phase of its owner thread that holds its start, else where it was shown
    /// when it arrived; those already finished go out.
    pub(super) fn place_held(&mut self, pid: u32, which: impl Fn(u32, u64) -> bool) {
        let Some(process) = self.processes.get(&pid) else {
            return;
        };
        let threads = &process.threads;
        let ready = self.pending.place(pid, which, |call: &UnplacedCall| {
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
        if let Some(threshold) = self.pending.overdue(pid, now_ns) {
            self.place_held(pid, |_, start| start <= threshold);
        }
    }

    /// The waiting calls of `tid` (as owner) go to their phases once its phase is known.
    pub(super) fn place_when_known(&mut self, pid: u32, tid: u32) {
        if !self.pending.has_unplaced(pid) {
            // Nothing waits: the phase signals' common case costs nothing more.
            return;
        }
        let known = self.processes.get_mut(&pid).is_some_and(|process| {
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
