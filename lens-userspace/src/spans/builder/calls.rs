//! Timed calls (collectives, sync waits, gloo calls) turned into child spans of the
//! phase they ran in.

use crate::spans::{
    Attributes, SpanExporter, SpanRecord,
    pending::{ProcessOutput, UnplacedCall},
    phases::ProcessContext,
};
use crate::{events::CallTiming, semconv};

use super::*;

impl<E: SpanExporter> SpanBuilder<E> {
    pub(super) fn on_call(
        &mut self,
        timing: &CallTiming,
        name: &'static str,
        attributes: Attributes,
        result: i32,
    ) {
        if let Some(record) = self.call_record(timing, name, attributes, result) {
            self.send_released(vec![record]);
        }
        self.bound_held(timing.tgid, timing.end_ns);
    }

    /// The span of a call, child of the phase its thread (or the loop thread) is in.
    pub(super) fn call_record(
        &mut self,
        timing: &CallTiming,
        name: &'static str,
        attributes: Attributes,
        result: i32,
    ) -> Option<SpanRecord> {
        let process = self.processes.get_mut(&timing.tgid)?;
        let own = process
            .threads
            .get(&timing.tid)
            .filter(|t| t.in_loop())
            .map(|_| timing.tid);
        let owner = own.or(process.loop_thread);
        let claimed = owner
            .and_then(|tid| process.threads.get_mut(&tid))
            .and_then(|thread| thread.claim_for_evaluation(timing.end_ns));
        let thread = owner.and_then(|tid| process.threads.get(&tid));
        let mut output = ProcessOutput {
            pending: &mut process.pending,
            out: &mut self.exporter,
        };
        let ctx = ProcessContext {
            arena: &mut process.arena,
            ids: &mut self.ids,
            out: &mut output,
            job: process.job,
            model_init: &mut process.model_init,
            ruled: &process.ruled.groups,
        };
        let phase = match thread {
            _ if claimed.is_some() => claimed,
            Some(thread) => thread.current_phase(&ctx, Some(timing.start_ns)),
            None => Some(ctx.model_init.unwrap_or(ctx.job)),
        };
        // Not known yet: shown where it would be now unless a phase that begins later
        // turns out to hold it.
        let parent = phase.unwrap_or_else(|| ctx.model_init.unwrap_or(ctx.job));
        let mut attributes = attributes;
        let error = (result != 0).then(|| format!("{name} returned {result}"));
        if result != 0 {
            attributes.push((semconv::DL_CALL_RESULT, result.into()));
        }
        let mut record = ctx.arena.call_record(
            ctx.ids,
            name,
            Some(parent),
            timing.tid,
            timing.start_ns,
            timing.end_ns,
            attributes,
            error,
        );
        if let Some(event) = self
            .hung_calls
            .remove(&(timing.tgid, timing.tid, timing.start_ns))
        {
            record.events.push(event);
        }
        if phase.is_none()
            && let Some(owner) = owner
        {
            process.pending.hold_call(
                record.id,
                UnplacedCall {
                    owner,
                    start_ns: timing.start_ns,
                },
            );
        }
        Some(record)
    }
}
