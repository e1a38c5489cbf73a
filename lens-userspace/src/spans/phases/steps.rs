//! The step machine of a thread: torch scopes, DataLoader fetches, backward passes and
//! optimizer steps opening and closing `step`, `forward_backward` and `optimizer`
//! (`docs/spans.md`, "Rules").

use crate::spans::{SpanEvent, SpanId, names};
use crate::{events::TorchScope, semconv, settings::groups::SpanGroup};

use super::*;

impl ThreadPhases {
    pub(super) fn scope_enter(&mut self, ctx: &mut ProcessContext<'_>, at: u64, scope: TorchScope) {
        self.scopes.push(scope);
        match scope {
            TorchScope::DataLoaderNext => self.batch_fetched(ctx, at),
            TorchScope::ForwardPass => self.forward_began(ctx, at),
            TorchScope::OptimizerStep if ctx.ruled.contains(&SpanGroup::Step) => {}
            TorchScope::OptimizerStep => self.optimizer_scope_enter(ctx, at),
            TorchScope::OptimizerZeroGrad => {
                // Inside another `Optimizer.step` (this scope itself is a zero_grad).
                let nested = self.in_optimizer_step_scope();
                // A running step whose backward passes are done reaches `zero_grad` with
                // no `Optimizer.step` scope seen: the update ran without one
                // (`torch.compile(opt.step)`), between the last backward and here.
                if let Some(step) = self.training.step.as_ref()
                    && step.optimizer.is_none()
                    && step.optimizer_end.is_none()
                    && step.microbatches > 0
                    && self.training.backward_depth == 0
                    && self.training.optimizer_pending.is_none()
                    && !nested
                {
                    let since = step.last_backward_end;
                    self.optimizer_begins(ctx, since);
                }
                // zero_grad right after step: still the optimizer's work. Not after a
                // fetch (the next batch's), nor inside another `Optimizer.step` (the next
                // step's closure, as Lightning runs it).
                if let Some(step) = self
                    .training
                    .step
                    .as_mut()
                    .filter(|s| s.optimizer.is_some())
                    && self.training.pending_fetch.is_none()
                    && !nested
                {
                    step.optimizer_end = None;
                }
            }
            TorchScope::Other => {}
        }
    }

    /// A DataLoader fetch: an evaluation batch, the first batch of the next step, or
    /// the next microbatch of the running one.
    pub(super) fn batch_fetched(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        self.evaluation.fetch_since_training.get_or_insert(at);
        if let Some(evaluate) = self.evaluation.evaluate.as_mut() {
            evaluate.resumed = None;
            // With grad mode on again the loop may be over: this batch may be the next
            // step's (or the evaluation's next, if grad mode goes off again).
            if evaluate.ended_at.is_some() && self.training.pending_fetch.is_none() {
                self.training.pending_fetch = Some(at);
            }
        } else if let Some(candidate) = self.evaluation.eval_candidate {
            // Not inside a phase that closed after the candidate began: a framework
            // load's end comes from a sample, up to an interval (or a wait for a CPU)
            // after it returned, and validation may switch grad mode off in between.
            let after = self.training.boundary.unwrap_or(0).min(at);
            self.evaluate_begins(ctx, candidate.start.max(after));
        } else if !self.step_running() {
            // A complete step is over once the next batch is fetched: optimizer work
            // after this (a zero_grad) belongs to the next.
            self.finish_step(ctx);
            if self.training.pending_fetch.is_none() {
                self.training.pending_fetch = Some(at);
            }
        }
    }

    /// A wrapped model's forward pass began: between steps, the next step starts here
    /// unless a batch was fetched first.
    pub(super) fn forward_began(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        if self.evaluation.evaluate.is_some()
            || self.evaluation.eval_candidate.is_some()
            || self.step_running()
        {
            return;
        }
        self.finish_step(ctx);
        self.training.pending_fetch.get_or_insert(at);
    }

    /// A call made now, after the last `no_grad` block of an evaluation and before
    /// anything else (reducing its metrics across ranks): the evaluation's, which lasts
    /// until the call's end. `None` otherwise.
    pub fn claim_for_evaluation(&mut self, end_ns: u64) -> Option<SpanId> {
        if self.training.pending_fetch.is_some() {
            return None;
        }
        let evaluate = self.evaluation.evaluate.as_mut()?;
        let ended = evaluate.ended_at?;
        evaluate.ended_at = Some(ended.max(end_ns));
        Some(evaluate.span)
    }

    /// `Optimizer.step` entered. Its span opens when it is known where the update
    /// begins: at the end of a closure's backward pass if one runs first, else here.
    pub(super) fn optimizer_scope_enter(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        self.evaluation.fetch_since_training = None;
        if self.syncing {
            return;
        }
        // Training again (without backward probes, the first sign of it).
        self.end_finished_evaluation(ctx, at);
        match self.training.step.as_mut() {
            // More optimizer work of the same step (a second optimizer).
            Some(step) if step.optimizer.is_some() && self.training.pending_fetch.is_none() => {
                step.optimizer_end = None;
            }
            Some(step) if step.optimizer.is_some() => {
                self.finish_step(ctx);
                self.training.optimizer_pending.get_or_insert(at);
            }
            _ => {
                self.training.optimizer_pending.get_or_insert(at);
            }
        }
    }

    pub(super) fn scope_exit(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        let Some(scope) = self.scopes.pop() else {
            // Entered before we attached.
            return;
        };
        if !matches!(
            scope,
            TorchScope::OptimizerStep | TorchScope::OptimizerZeroGrad
        ) {
            return;
        }
        if self.syncing {
            // The first step boundary after attaching: steps are whole from here on.
            self.syncing = false;
            self.training.boundary = Some(at);
            self.training.pending_fetch = None;
            self.training.optimizer_pending = None;
            return;
        }
        if scope == TorchScope::OptimizerStep
            && !self.in_optimizer_step_scope()
            && let Some(start) = self.training.optimizer_pending.take()
        {
            // No closure ran a backward pass: the update began at the scope's entry.
            self.optimizer_begins(ctx, start);
        }
        let nested = self.in_optimizer_step_scope();
        match self.training.step.as_mut() {
            Some(step) if step.optimizer.is_some() && !nested => step.optimizer_end = Some(at),
            None if self.training.pending_fetch.is_none() && !nested => {
                // zero_grad between steps (top of the loop): the next step starts after it.
                self.training.boundary = Some(self.training.boundary.map_or(at, |b| b.max(at)));
            }
            _ => {}
        }
    }

    /// A step begins with its first backward pass; it started at the first batch fetch
    /// before it (or at the previous phase's end, when batches come from elsewhere).
    pub(super) fn backward_start(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        self.training.backward_depth += 1;
        self.evaluation.fetch_since_training = None;
        if self.training.backward_depth > 1 || self.syncing {
            return;
        }
        // The step takes over from an evaluation that was over, or a candidate.
        self.evaluation.eval_candidate = None;
        self.end_evaluation(ctx, at);
        self.training.backward_start = at;
        // A closure's backward inside `Optimizer.step`, before its update: the last
        // microbatch of the step.
        self.training.closure_backward = self.training.optimizer_pending.is_some()
            && self
                .training
                .step
                .as_ref()
                .is_none_or(|s| s.optimizer.is_none());
        if self.step_running() {
            // Another microbatch of the same step, or a closure optimizer (LBFGS) running
            // backward inside its step.
            return;
        }
        self.finish_step(ctx);
        let start = match (self.training.pending_fetch.take(), self.training.boundary) {
            (Some(fetch), Some(boundary)) => fetch.max(boundary),
            (Some(fetch), None) => fetch,
            (None, Some(boundary)) => boundary,
            (None, None) => at,
        };
        ctx.end_model_init(start);
        let span = self.open_phase(ctx, names::STEP, SpanGroup::Step, ctx.job, start);
        ctx.arena
            .set_attr(span, semconv::DL_ITERATION, self.training.iteration);
        self.training.iteration += 1;
        let forward_backward = self.open_phase(
            ctx,
            names::FORWARD_BACKWARD,
            SpanGroup::ForwardBackward,
            span,
            start,
        );
        self.training.step = Some(Step {
            span,
            forward_backward: Some(forward_backward),
            last_backward_end: at,
            microbatches: 0,
            optimizer: None,
            optimizer_end: None,
        });
    }

    pub(super) fn backward_end(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        if self.training.backward_depth == 0 {
            // Started before we attached.
            return;
        }
        self.training.backward_depth -= 1;
        if self.training.backward_depth > 0 {
            return;
        }
        let Some(step) = self.training.step.as_mut() else {
            return;
        };
        let Some(forward_backward) = step.forward_backward else {
            return;
        };
        ctx.arena.add_event(
            forward_backward,
            SpanEvent {
                name: names::BACKWARD_EVENT,
                at_ns: self.training.backward_start,
                attributes: vec![
                    (semconv::DL_MICROBATCH_ID, step.microbatches.into()),
                    (
                        semconv::DL_BACKWARD_DURATION_NS,
                        at.saturating_sub(self.training.backward_start).into(),
                    ),
                ],
            },
        );
        step.microbatches += 1;
        step.last_backward_end = at;
        if std::mem::take(&mut self.training.closure_backward) {
            // The closure's backward is done: what follows in `Optimizer.step` is the update.
            self.training.optimizer_pending = None;
            self.optimizer_begins(ctx, at);
        }
    }

    /// `forward_backward` ends at its last backward; `optimizer` runs from the first
    /// optimizer step to the end of the optimizer work that follows it.
    pub(super) fn optimizer_begins(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        if self.syncing {
            return;
        }
        let Some(step) = self.training.step.as_mut() else {
            return;
        };
        step.optimizer_end = None;
        let (span, fb, microbatches, fb_end) = (
            step.span,
            step.forward_backward.take(),
            step.microbatches,
            step.last_backward_end,
        );
        let open = step.optimizer.is_none();
        if let Some(forward_backward) = fb {
            ctx.arena
                .set_attr(forward_backward, semconv::DL_MICROBATCH_COUNT, microbatches);
            self.close_phase(ctx, forward_backward, fb_end);
        }
        if open {
            let optimizer = self.open_phase(ctx, names::OPTIMIZER, SpanGroup::Optimizer, span, at);
            if let Some(step) = self.training.step.as_mut() {
                step.optimizer = Some(optimizer);
            }
        }
    }

    /// Ends a complete step (its optimizer work returned) where that work ended.
    pub(super) fn finish_step(&mut self, ctx: &mut ProcessContext<'_>) {
        let Some(step) = self.training.step.take_if(|s| s.optimizer_end.is_some()) else {
            return;
        };
        let end = step.optimizer_end.unwrap_or(step.last_backward_end);
        if let Some(optimizer) = step.optimizer {
            self.close_phase(ctx, optimizer, end);
        }
        self.close_phase(ctx, step.span, end);
        self.training.boundary = Some(end);
    }
}
