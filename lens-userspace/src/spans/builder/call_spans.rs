//! Timed calls (collectives, sync waits, gloo calls, slow or failed GPU memory calls)
//! turned into child spans of the phase they ran in.

use crate::spans::{
    Attributes, SpanExporter, SpanRecord,
    pending::{GatedOutput, UnplacedCall},
    phases::ProcessContext,
};
use crate::{
    events::CallTiming,
    gpu_memory::{self, MemoryChange},
    names, semconv,
    spans::SpanEvent,
};
use lens_common::ProbeId;

use super::*;

impl<E: SpanExporter> SpanBuilder<E> {
    pub(super) fn on_call(
        &mut self,
        timing: &CallTiming,
        name: &'static str,
        attributes: Attributes,
        result: i32,
    ) {
        if let Some((record, unplaced)) = self.call_record(timing, name, attributes, result) {
            self.send_call(record, unplaced);
        }
        self.bound_held(timing.tgid, timing.end_ns);
    }

    /// A GPU memory call: what it left held goes to the exporters (metrics, peaks); a
    /// slow one (it synchronised or mapped) or a failed one gets a span, and an
    /// out-of-memory failure an event on that span and on the span it ran in.
    pub(super) fn on_memory_call(
        &mut self,
        timing: &CallTiming,
        probe: ProbeId,
        result: i64,
        change: &MemoryChange,
    ) {
        self.exporter
            .process_memory(timing.tgid, timing.end_ns, change);
        if timing.duration_ns() < gpu_memory::SLOW_CALL_NS && result == 0 {
            return;
        }
        let attributes = vec![
            (semconv::DL_GPU_MEMORY_BYTES, change.bytes.into()),
            (semconv::DL_GPU_MEMORY_HELD, change.held.into()),
        ];
        let name = crate::calls::memory_span_name(probe);
        let result = i32::try_from(result).unwrap_or(i32::MIN);
        let Some((mut record, unplaced)) = self.call_record(timing, name, attributes, result)
        else {
            return;
        };
        if let Some(oom) = &change.out_of_memory {
            let mut attributes = vec![
                (semconv::DL_GPU_MEMORY_BYTES, change.bytes.into()),
                (semconv::DL_GPU_MEMORY_HELD, change.held.into()),
                (semconv::DL_GPU_MEMORY_PEAK, change.peak.into()),
            ];
            if !oom.python.is_empty() {
                attributes.push((semconv::CODE_STACKTRACE, oom.python.join("\n").into()));
            }
            let event = SpanEvent {
                name: names::OUT_OF_MEMORY_EVENT,
                at_ns: timing.end_ns,
                attributes,
            };
            if let (Some(parent), Some(process)) =
                (record.parent, self.processes.get_mut(&timing.tgid))
            {
                process.arena.add_event(parent, event.clone());
            }
            record.events.push(event);
        }
        self.send_call(record, unplaced);
        self.bound_held(timing.tgid, timing.end_ns);
    }

    /// A CUDA graph call: a graph launch is always a span (a handful a step); a
    /// capture or instantiation when it was slow (an instantiation takes ms) or failed,
    /// as a memory call's.
    pub(super) fn on_graph_call(&mut self, timing: &CallTiming, probe: ProbeId, result: i64) {
        let launch =
            crate::calls::GraphOp::from_probe(probe) == Some(crate::calls::GraphOp::Launch);
        if !launch && timing.duration_ns() < gpu_memory::SLOW_CALL_NS && result == 0 {
            return;
        }
        let Some(name) = crate::calls::graph_span_name(probe) else {
            return;
        };
        let result = i32::try_from(result).unwrap_or(i32::MIN);
        self.on_call(timing, name, Vec::new(), result);
    }

    /// The span of a call, child of the phase its thread (or the loop thread) is in;
    /// with the call to place later when that phase is not known yet.
    pub(super) fn call_record(
        &mut self,
        timing: &CallTiming,
        name: &'static str,
        attributes: Attributes,
        result: i32,
    ) -> Option<(SpanRecord, Option<UnplacedCall>)> {
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
        let mut output = GatedOutput {
            pending: &mut self.pending,
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
        let unplaced = owner.filter(|_| phase.is_none()).map(|owner| UnplacedCall {
            owner,
            start_ns: timing.start_ns,
        });
        Some((record, unplaced))
    }
}
