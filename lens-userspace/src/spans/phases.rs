//! The per-thread state machine that turns phase signals (torch scopes, backward passes,
//! grad mode, checkpoint files) into the training-loop spans. Each rule is written up in
//! `docs/spans.md`; the names of the rules there are the names of the methods here.
use std::collections::BTreeSet;

use super::{
    Attributes, SpanEvent, SpanExporter, SpanId,
    arena::{IdSource, SpanArena},
    names,
};
use crate::{
    events::{PhaseSignal, TorchScope},
    groups::SpanGroup,
    semconv,
};

/// What a thread's machine needs from its process.
pub(super) struct ProcessContext<'a> {
    pub arena: &'a mut SpanArena,
    pub ids: &'a mut IdSource,
    pub out: &'a mut dyn SpanExporter,
    pub job: SpanId,
    /// Open from the job's start until the first top-level phase (when traced from start).
    pub model_init: &'a mut Option<SpanId>,
    /// Groups configured probe rules have taken over in this process: torch's signals
    /// for them are ignored (see `rule_enter`).
    pub ruled: &'a BTreeSet<SpanGroup>,
}

impl ProcessContext<'_> {
    fn open(
        &mut self,
        name: &'static str,
        group: SpanGroup,
        parent: SpanId,
        tid: u32,
        at: u64,
    ) -> SpanId {
        self.arena
            .open(self.ids, name, group, Some(parent), tid, at)
    }

    fn close(&mut self, id: SpanId, at: u64) {
        self.arena.close(id, at, false, self.out);
    }

    fn truncate(&mut self, id: SpanId, at: u64) {
        self.arena.close(id, at, true, self.out);
    }

    /// `model_init` lasts until the first top-level phase begins.
    fn end_model_init(&mut self, at: u64) {
        if let Some(id) = self.model_init.take() {
            self.arena.close(id, at, false, self.out);
        }
    }
}

#[derive(Debug)]
struct Step {
    span: SpanId,
    forward_backward: Option<SpanId>,
    /// End of the last backward pass so far.
    last_backward_end: u64,
    microbatches: u32,
    optimizer: Option<SpanId>,
    /// Set when the optimizer work (step, then zero_grad) has returned: the step is
    /// complete, and ends there unless more optimizer work follows at once.
    optimizer_end: Option<u64>,
}

/// A `checkpoint` or `load_checkpoint` span: files written/read back to back share it.
#[derive(Debug)]
struct FileSpan {
    span: SpanId,
    open_files: u32,
    files: u32,
    last_end: Option<u64>,
}

#[derive(Debug)]
pub(super) struct ThreadPhases {
    tid: u32,
    /// Attached mid-run: nothing about steps is reported until one ends.
    syncing: bool,
    scopes: Vec<TorchScope>,
    grad_enabled: bool,
    /// End of the last top-level phase (step, evaluate, checkpoint); a step starts here
    /// unless a batch fetch came later.
    boundary: Option<u64>,
    /// Start of the last DataLoader fetch since `boundary`, outside evaluation.
    pending_fetch: Option<u64>,
    /// Grad mode was switched off between steps at this time: evaluation if a batch is
    /// fetched before it is switched back on.
    eval_candidate: Option<u64>,
    evaluate: Option<SpanId>,
    step: Option<Step>,
    checkpoint: Option<FileSpan>,
    load_checkpoint: Option<FileSpan>,
    iteration: u64,
    backward_depth: u32,
    backward_start: u64,
    /// Spans of configured probe rules open on this thread, outermost first: (rule, span).
    rule_spans: Vec<(u32, SpanId)>,
}

impl ThreadPhases {
    pub fn new(tid: u32, traced_from_start: bool) -> ThreadPhases {
        ThreadPhases {
            tid,
            syncing: !traced_from_start,
            scopes: Vec::new(),
            grad_enabled: true,
            boundary: None,
            pending_fetch: None,
            eval_candidate: None,
            evaluate: None,
            step: None,
            checkpoint: None,
            load_checkpoint: None,
            iteration: 0,
            backward_depth: 0,
            backward_start: 0,
            rule_spans: Vec::new(),
        }
    }

    /// Whether this thread has seen any training-loop activity (its spans exist).
    pub fn is_active(&self) -> bool {
        self.step.is_some()
            || !self.rule_spans.is_empty()
            || self.evaluate.is_some()
            || self.iteration > 0
            || self.boundary.is_some()
    }

    /// Nothing open, nothing pending, nothing counted: the thread's state can go (a
    /// short-lived worker that toggled grad mode or entered a scope). Its next signal
    /// starts it afresh.
    pub fn is_idle(&self) -> bool {
        !self.is_active()
            && self.scopes.is_empty()
            && self.grad_enabled
            && self.pending_fetch.is_none()
            && self.eval_candidate.is_none()
            && self.checkpoint.is_none()
            && self.load_checkpoint.is_none()
            && self.backward_depth == 0
            && self.rule_spans.is_empty()
    }

    fn in_optimizer_scope(&self) -> bool {
        self.scopes
            .iter()
            .any(|s| matches!(s, TorchScope::OptimizerStep | TorchScope::OptimizerZeroGrad))
    }

    fn step_running(&self) -> bool {
        self.step
            .as_ref()
            .is_some_and(|s| s.optimizer_end.is_none())
    }

    /// The innermost open span of this thread: where a call made now belongs.
    pub fn innermost(&self, ctx: &ProcessContext<'_>) -> SpanId {
        if let Some(file) = self.checkpoint.as_ref().or(self.load_checkpoint.as_ref()) {
            return file.span;
        }
        if let Some((_, span)) = self.rule_spans.last() {
            return *span;
        }
        if let Some(evaluate) = self.evaluate {
            return evaluate;
        }
        // A complete step (its optimizer work returned) ends there: a call after it (a
        // logging all-reduce, a barrier) is between steps, not inside the last one.
        if let Some(step) = self.step.as_ref().filter(|s| s.optimizer_end.is_none()) {
            return step
                .optimizer
                .or(step.forward_backward)
                .unwrap_or(step.span);
        }
        ctx.model_init.unwrap_or(ctx.job)
    }

    pub fn on_signal(&mut self, ctx: &mut ProcessContext<'_>, at: u64, signal: &PhaseSignal) {
        // A group configured rules took over: torch's signals for it are not used.
        let ruled = |group| ctx.ruled.contains(&group);
        let taken = match signal {
            PhaseSignal::BackwardStart | PhaseSignal::BackwardEnd => ruled(SpanGroup::Step),
            PhaseSignal::GradMode { .. } => ruled(SpanGroup::Evaluate),
            PhaseSignal::CheckpointWriteStart | PhaseSignal::CheckpointWriteEnd => {
                ruled(SpanGroup::Checkpoint)
            }
            PhaseSignal::CheckpointReadStart | PhaseSignal::CheckpointReadEnd => {
                ruled(SpanGroup::LoadCheckpoint)
            }
            PhaseSignal::ScopeEnter { .. } | PhaseSignal::ScopeExit => false,
        };
        if taken {
            return;
        }
        if !matches!(
            signal,
            PhaseSignal::CheckpointWriteStart | PhaseSignal::CheckpointWriteEnd
        ) {
            Self::settle_files(&mut self.checkpoint, &mut self.boundary, ctx);
        }
        if !matches!(
            signal,
            PhaseSignal::CheckpointReadStart | PhaseSignal::CheckpointReadEnd
        ) {
            Self::settle_files(&mut self.load_checkpoint, &mut self.boundary, ctx);
        }
        match signal {
            PhaseSignal::ScopeEnter { scope, .. } => self.scope_enter(ctx, at, *scope),
            PhaseSignal::ScopeExit => {
                if !ctx.ruled.contains(&SpanGroup::Step) {
                    self.scope_exit(at);
                } else {
                    self.scopes.pop();
                }
            }
            PhaseSignal::BackwardStart => self.backward_start(ctx, at),
            PhaseSignal::BackwardEnd => self.backward_end(ctx, at),
            PhaseSignal::GradMode { enabled } => self.grad_mode(ctx, at, *enabled),
            PhaseSignal::CheckpointWriteStart => self.file_open(ctx, at, SpanGroup::Checkpoint),
            PhaseSignal::CheckpointWriteEnd => Self::file_close(&mut self.checkpoint, at),
            PhaseSignal::CheckpointReadStart => self.file_open(ctx, at, SpanGroup::LoadCheckpoint),
            PhaseSignal::CheckpointReadEnd => Self::file_close(&mut self.load_checkpoint, at),
        }
    }

    fn scope_enter(&mut self, ctx: &mut ProcessContext<'_>, at: u64, scope: TorchScope) {
        self.scopes.push(scope);
        match scope {
            TorchScope::DataLoaderNext => {
                if self.evaluate.is_some() {
                    // An evaluation batch.
                } else if let Some(start) = self.eval_candidate {
                    self.evaluate_begins(ctx, start);
                } else if !self.step_running() {
                    self.pending_fetch = Some(at);
                }
            }
            TorchScope::OptimizerStep if ctx.ruled.contains(&SpanGroup::Step) => {}
            TorchScope::OptimizerStep => self.optimizer_begins(ctx, at),
            TorchScope::OptimizerZeroGrad => {
                // zero_grad right after step: still the optimizer's work.
                if let Some(step) = self.step.as_mut().filter(|s| s.optimizer.is_some()) {
                    step.optimizer_end = None;
                }
            }
            TorchScope::Other => {}
        }
    }

    fn scope_exit(&mut self, at: u64) {
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
            self.boundary = Some(at);
            self.pending_fetch = None;
            return;
        }
        match self.step.as_mut() {
            Some(step) if step.optimizer.is_some() => step.optimizer_end = Some(at),
            None if self.pending_fetch.is_none() => {
                // zero_grad between steps (top of the loop): the next step starts after it.
                self.boundary = Some(self.boundary.map_or(at, |b| b.max(at)));
            }
            _ => {}
        }
    }

    /// A step begins with its first backward pass; it started at the last batch fetch
    /// before it (or at the previous phase's end, when batches come from elsewhere).
    fn backward_start(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        self.backward_depth += 1;
        if self.backward_depth > 1 || self.syncing || self.evaluate.is_some() {
            return;
        }
        self.backward_start = at;
        if self.step_running() {
            // Another microbatch of the same step, or a closure optimizer (LBFGS) running
            // backward inside its step.
            return;
        }
        self.finish_step(ctx);
        let start = match (self.pending_fetch.take(), self.boundary) {
            (Some(fetch), Some(boundary)) => fetch.max(boundary),
            (Some(fetch), None) => fetch,
            (None, Some(boundary)) => boundary,
            (None, None) => at,
        };
        ctx.end_model_init(start);
        let span = ctx.open(names::STEP, SpanGroup::Step, ctx.job, self.tid, start);
        ctx.arena
            .set_attr(span, semconv::DL_ITERATION, self.iteration);
        self.iteration += 1;
        let forward_backward = ctx.open(
            names::FORWARD_BACKWARD,
            SpanGroup::ForwardBackward,
            span,
            self.tid,
            start,
        );
        self.step = Some(Step {
            span,
            forward_backward: Some(forward_backward),
            last_backward_end: at,
            microbatches: 0,
            optimizer: None,
            optimizer_end: None,
        });
    }

    fn backward_end(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        if self.backward_depth == 0 {
            // Started before we attached.
            return;
        }
        self.backward_depth -= 1;
        if self.backward_depth > 0 {
            return;
        }
        let Some(step) = self.step.as_mut() else {
            return;
        };
        let Some(forward_backward) = step.forward_backward else {
            return;
        };
        ctx.arena.add_event(
            forward_backward,
            SpanEvent {
                name: names::BACKWARD_EVENT,
                at_ns: self.backward_start,
                attributes: vec![
                    (semconv::DL_MICROBATCH_ID, step.microbatches.into()),
                    (
                        semconv::DL_BACKWARD_DURATION_NS,
                        at.saturating_sub(self.backward_start).into(),
                    ),
                ],
            },
        );
        step.microbatches += 1;
        step.last_backward_end = at;
    }

    /// `forward_backward` ends at its last backward; `optimizer` runs from the first
    /// optimizer step to the end of the optimizer work that follows it.
    fn optimizer_begins(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        if self.syncing {
            return;
        }
        let tid = self.tid;
        let Some(step) = self.step.as_mut() else {
            return;
        };
        if let Some(forward_backward) = step.forward_backward.take() {
            ctx.arena.set_attr(
                forward_backward,
                semconv::DL_MICROBATCH_COUNT,
                step.microbatches,
            );
            ctx.close(forward_backward, step.last_backward_end);
        }
        step.optimizer_end = None;
        if step.optimizer.is_none() {
            step.optimizer =
                Some(ctx.open(names::OPTIMIZER, SpanGroup::Optimizer, step.span, tid, at));
        }
    }

    /// Ends a complete step (its optimizer work returned) where that work ended.
    fn finish_step(&mut self, ctx: &mut ProcessContext<'_>) {
        let Some(step) = self.step.take_if(|s| s.optimizer_end.is_some()) else {
            return;
        };
        let end = step.optimizer_end.unwrap_or(step.last_backward_end);
        if let Some(optimizer) = step.optimizer {
            ctx.close(optimizer, end);
        }
        ctx.close(step.span, end);
        self.boundary = Some(end);
    }

    fn grad_mode(&mut self, ctx: &mut ProcessContext<'_>, at: u64, enabled: bool) {
        if enabled == self.grad_enabled {
            return;
        }
        self.grad_enabled = enabled;
        if !enabled {
            // Inside the optimizer or between backward passes it is the step's own work.
            if !self.in_optimizer_scope() && !self.step_running() {
                self.eval_candidate = Some(at);
            }
            return;
        }
        self.eval_candidate = None;
        if let Some(evaluate) = self.evaluate.take() {
            ctx.close(evaluate, at);
            self.boundary = Some(at);
            self.pending_fetch = None;
        }
    }

    /// Evaluation: a DataLoader fetch with grad mode off between steps. It began when grad
    /// mode was switched off.
    fn evaluate_begins(&mut self, ctx: &mut ProcessContext<'_>, start: u64) {
        self.finish_step(ctx);
        ctx.end_model_init(start);
        self.evaluate = Some(ctx.open(
            names::EVALUATE,
            SpanGroup::Evaluate,
            ctx.job,
            self.tid,
            start,
        ));
        self.eval_candidate = None;
    }

    fn file_open(&mut self, ctx: &mut ProcessContext<'_>, at: u64, group: SpanGroup) {
        let running_step = self.step_running();
        let slot = match group {
            SpanGroup::Checkpoint => &mut self.checkpoint,
            _ => &mut self.load_checkpoint,
        };
        if let Some(file) = slot.as_mut() {
            file.open_files += 1;
            file.files += 1;
            return;
        }
        // Inside a running step (or a configured rule's span) it belongs there; otherwise it
        // is a phase of its own.
        let parent = if running_step || !self.rule_spans.is_empty() {
            self.innermost(ctx)
        } else {
            self.finish_step(ctx);
            ctx.end_model_init(at);
            ctx.job
        };
        let name = match group {
            SpanGroup::Checkpoint => names::CHECKPOINT,
            _ => names::LOAD_CHECKPOINT,
        };
        let span = ctx.open(name, group, parent, self.tid, at);
        let slot = match group {
            SpanGroup::Checkpoint => &mut self.checkpoint,
            _ => &mut self.load_checkpoint,
        };
        *slot = Some(FileSpan {
            span,
            open_files: 1,
            files: 1,
            last_end: None,
        });
    }

    fn file_close(slot: &mut Option<FileSpan>, at: u64) {
        if let Some(file) = slot.as_mut().filter(|f| f.open_files > 0) {
            file.open_files -= 1;
            file.last_end = Some(at);
        }
    }

    /// Files written (read) back to back are one checkpoint: the span ends at the last
    /// file's end once anything else happens.
    fn settle_files(
        slot: &mut Option<FileSpan>,
        boundary: &mut Option<u64>,
        ctx: &mut ProcessContext<'_>,
    ) {
        let Some(file) = slot.take_if(|f| f.open_files == 0 && f.last_end.is_some()) else {
            return;
        };
        let end = file.last_end.unwrap_or_default();
        ctx.arena
            .set_attr(file.span, semconv::NEMO_CHECKPOINT_FILES, file.files);
        ctx.close(file.span, end);
        *boundary = Some(end);
    }

    /// A function a configured rule names was entered: its span opens, under the
    /// innermost open span of the thread, like a call. Rules of the top-level groups
    /// (step, evaluate, checkpoint, load_checkpoint) *are* the phase when nothing else is
    /// open: a complete torch step ends first, `model_init` ends, and the span hangs on
    /// the job. `iteration`: the step's `dl.iteration`, for step rules.
    #[allow(clippy::too_many_arguments)]
    pub fn rule_enter(
        &mut self,
        ctx: &mut ProcessContext<'_>,
        at: u64,
        rule: u32,
        name: &'static str,
        group: SpanGroup,
        attributes: Attributes,
        iteration: Option<u64>,
    ) {
        let top_level = matches!(
            group,
            SpanGroup::Step
                | SpanGroup::Evaluate
                | SpanGroup::Checkpoint
                | SpanGroup::LoadCheckpoint
        );
        if group == SpanGroup::Step {
            // Steps come from the rule now: a torch step still open here never completes.
            self.finish_step(ctx);
            if let Some(step) = self.step.take() {
                for id in [step.forward_backward, step.optimizer]
                    .into_iter()
                    .flatten()
                {
                    ctx.truncate(id, at);
                }
                ctx.truncate(step.span, at);
            }
        } else if top_level && self.rule_spans.is_empty() {
            self.finish_step(ctx);
        }
        let mut parent = self.innermost(ctx);
        if top_level && Some(parent) == *ctx.model_init {
            ctx.end_model_init(at);
            parent = ctx.job;
        }
        let span = ctx.open(name, group, parent, self.tid, at);
        for (key, value) in attributes {
            ctx.arena.set_attr(span, key, value);
        }
        if let Some(iteration) = iteration {
            ctx.arena.set_attr(span, semconv::DL_ITERATION, iteration);
        }
        self.rule_spans.push((rule, span));
    }

    /// The function of `rule` returned: its innermost open span ends. Spans opened inside
    /// it and still open (their return was never seen: a longjmp, an exception through
    /// C) end with it, truncated. A return without its entry (attached mid-call) is
    /// ignored.
    pub fn rule_return(&mut self, ctx: &mut ProcessContext<'_>, at: u64, rule: u32) {
        let Some(position) = self.rule_spans.iter().rposition(|(r, _)| *r == rule) else {
            return;
        };
        while self.rule_spans.len() > position + 1 {
            if let Some((_, span)) = self.rule_spans.pop() {
                ctx.truncate(span, at);
            }
        }
        if let Some((_, span)) = self.rule_spans.pop() {
            ctx.close(span, at);
        }
    }

    /// The process is gone or tracing stops at `at`: complete phases end where they
    /// ended, open ones end now, innermost first, marked truncated.
    pub fn finish(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        while let Some((_, span)) = self.rule_spans.pop() {
            ctx.truncate(span, at);
        }
        Self::settle_files(&mut self.checkpoint, &mut self.boundary, ctx);
        Self::settle_files(&mut self.load_checkpoint, &mut self.boundary, ctx);
        for file in [self.checkpoint.take(), self.load_checkpoint.take()]
            .into_iter()
            .flatten()
        {
            ctx.truncate(file.span, at);
        }
        if let Some(evaluate) = self.evaluate.take() {
            ctx.truncate(evaluate, at);
        }
        self.finish_step(ctx);
        if let Some(step) = self.step.take() {
            if let Some(forward_backward) = step.forward_backward {
                ctx.arena.set_attr(
                    forward_backward,
                    semconv::DL_MICROBATCH_COUNT,
                    step.microbatches,
                );
            }
            for id in [step.forward_backward, step.optimizer]
                .into_iter()
                .flatten()
            {
                ctx.truncate(id, at);
            }
            ctx.truncate(step.span, at);
        }
    }
}
