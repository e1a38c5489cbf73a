//! The per-thread state machine that turns phase signals (torch scopes, backward passes,
//! grad mode, checkpoint files) into the training-loop spans. Each rule is written up in
//! `docs/spans.md`; the names of the rules there are the names of the methods here.
use std::collections::BTreeSet;

use super::{
    Attributes, SpanEvent, SpanExporter, SpanId,
    arena::{IdSource, Placement, SpanArena},
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

/// A span of this thread's phases with its time range, kept for a while after it ended:
/// calls held until their phase was known are placed by time (see `phase_at`).
#[derive(Clone, Copy, Debug)]
struct Interval {
    span: SpanId,
    start: u64,
    end: Option<u64>,
    /// Where a call inside it is shown.
    placement: Placement,
}

/// How many recent phase spans `phase_at` can place a held call in.
const RECENT_INTERVALS: usize = 32;

/// An evaluation loop that may be starting: grad mode off between steps.
#[derive(Clone, Copy, Debug)]
struct EvalCandidate {
    /// Where the evaluation starts if confirmed.
    start: u64,
    /// A batch was fetched before grad mode went off (transformers' `evaluation_loop`
    /// fetches outside its per-batch `no_grad`): the candidate outlives the switch back
    /// on and is confirmed by the next fetch unless a backward pass comes first.
    fetched_first: bool,
}

#[derive(Debug)]
struct Evaluate {
    span: SpanId,
    /// Grad mode was switched back on at this time: the loop may be over, or may go on
    /// (a batch per `no_grad` block, a recompile toggling grad mode). It ends here when
    /// the next other phase begins, else it goes on when grad mode goes off again.
    ended_at: Option<u64>,
    /// It went on when grad mode went off again after a fetch: (where it had ended,
    /// that fetch). If a backward pass comes before any other fetch, that was no
    /// evaluation batch but the next step's forward (a recompile toggles grad mode): the
    /// evaluation ended there, and the step began at the fetch.
    resumed: Option<(u64, u64)>,
}

/// A `checkpoint` or `load_checkpoint` span: files written/read back to back share it,
/// and so do the calls of a framework's save (load) function around them.
#[derive(Debug)]
pub(super) struct FileSpan {
    pub span: SpanId,
    open_files: u32,
    pub files: u32,
    last_end: Option<u64>,
    /// Framework save (load) calls open in it (`save_call_enter`).
    calls: u32,
    /// Files created while it was open (libc `open` with `O_CREAT`; for a load, files
    /// opened for reading inside a framework load): what it counts where that probe is
    /// in (a `torch.save` to a stream, DCP's per-item writes and reads, is no file; a
    /// JSON file written by Python is one).
    created: u32,
    /// Of those, the ones since the last writer (reader) returned, with no writer open:
    /// not the checkpoint's if its framework call turns out to have returned before
    /// them (the process exits right after a save, before a sample shows it returned).
    created_since_writer: u32,
    /// DCP's `async_save` handed it to a background writer that has not returned yet:
    /// the caller's next phase does not end it (the caller may be seen to return only
    /// after the writer did, having waited for it).
    written_elsewhere: bool,
}

impl FileSpan {
    /// Opened by a file writer (reader) that is still open.
    fn opened_by_writer(span: SpanId) -> FileSpan {
        FileSpan {
            open_files: 1,
            files: 1,
            calls: 0,
            ..FileSpan::opened_by_call(span)
        }
    }

    /// Opened by a framework's save (load) call that is still running.
    fn opened_by_call(span: SpanId) -> FileSpan {
        FileSpan {
            span,
            open_files: 0,
            files: 0,
            last_end: None,
            calls: 1,
            created: 0,
            created_since_writer: 0,
            written_elsewhere: false,
        }
    }

    fn idle(&self) -> bool {
        self.open_files == 0 && self.calls == 0 && !self.written_elsewhere
    }

    /// `nemo.checkpoint.files`: the files created if any were seen, else the writers
    /// (readers) that opened.
    fn file_count(&self) -> u32 {
        if self.created > 0 {
            self.created
        } else {
            self.files
        }
    }

    /// What it counted: (writers or readers, files created).
    pub fn counts(&self) -> (u32, u32) {
        (self.files, self.created)
    }

    fn add_counts(&mut self, (files, created): (u32, u32)) {
        self.files += files;
        self.created += created;
    }
}

#[derive(Debug)]
pub(super) struct ThreadPhases {
    tid: u32,
    /// Attached mid-run: nothing about steps is reported until one ends.
    syncing: bool,
    scopes: Vec<TorchScope>,
    grad_enabled: bool,
    /// When grad mode was last switched on.
    grad_on_at: u64,
    /// End of the last top-level phase (step, evaluate, checkpoint); a step starts here
    /// unless a batch fetch came later.
    boundary: Option<u64>,
    /// Start of the first DataLoader fetch since `boundary`, outside evaluation.
    pending_fetch: Option<u64>,
    /// Start of the first DataLoader fetch since the last training work (a backward
    /// pass, an optimizer step): a `no_grad` block after it may be an evaluation batch.
    /// Unlike `pending_fetch` it does not depend on the step probes being in.
    fetch_since_training: Option<u64>,
    /// Grad mode was switched off between steps: evaluation if a batch is fetched next.
    eval_candidate: Option<EvalCandidate>,
    evaluate: Option<Evaluate>,
    /// An `Optimizer.step` scope entered at this time whose span is not open yet: a
    /// closure (`optimizer.step(closure)`, as Lightning calls it) may first run the last
    /// microbatch's forward and backward inside it.
    optimizer_pending: Option<u64>,
    /// The backward pass running now was started by such a closure: the optimizer
    /// begins where it ends.
    closure_backward: bool,
    /// Per `Engine::execute` call running on this thread, outermost first: whether it
    /// is a backward pass (`accumulate_grad`) or `torch.autograd.grad`.
    engine_calls: Vec<bool>,
    /// Recent phase spans with their times, oldest first.
    recent: std::collections::VecDeque<Interval>,
    step: Option<Step>,
    checkpoint: Option<FileSpan>,
    load_checkpoint: Option<FileSpan>,
    iteration: u64,
    backward_depth: u32,
    backward_start: u64,
    /// Spans of configured probe rules open on this thread, outermost first: (rule, span).
    rule_spans: Vec<(u32, SpanId)>,
    /// A save's or load's preparation (DCP's `get_state_dict`) seen on this thread: the
    /// checkpoint (load) that follows before any other phase starts with it.
    prelude: Option<Prelude>,
}

/// A save's or load's preparation (DCP's `get_state_dict`), until the checkpoint (load)
/// it prepares opens its span.
#[derive(Clone, Copy, Debug)]
struct Prelude {
    /// Its first sample, less one sample interval (not before the last phase's end).
    start: u64,
    /// Files created (opened for reading in a load) since it began: the first a load
    /// reads (DCP's `.metadata`) can come before the load's own first sample.
    created: u32,
    read: u32,
}

impl ThreadPhases {
    pub fn new(tid: u32, traced_from_start: bool) -> ThreadPhases {
        ThreadPhases {
            tid,
            syncing: !traced_from_start,
            scopes: Vec::new(),
            grad_enabled: true,
            grad_on_at: 0,
            boundary: None,
            pending_fetch: None,
            fetch_since_training: None,
            eval_candidate: None,
            evaluate: None,
            optimizer_pending: None,
            closure_backward: false,
            engine_calls: Vec::new(),
            recent: std::collections::VecDeque::new(),
            step: None,
            checkpoint: None,
            load_checkpoint: None,
            iteration: 0,
            backward_depth: 0,
            backward_start: 0,
            rule_spans: Vec::new(),
            prelude: None,
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
            && self.fetch_since_training.is_none()
            && self.eval_candidate.is_none()
            && self.checkpoint.is_none()
            && self.load_checkpoint.is_none()
            && self.backward_depth == 0
            && self.engine_calls.is_empty()
            && self.optimizer_pending.is_none()
            && self.rule_spans.is_empty()
    }

    fn in_optimizer_scope(&self) -> bool {
        self.scopes
            .iter()
            .any(|s| matches!(s, TorchScope::OptimizerStep | TorchScope::OptimizerZeroGrad))
    }

    fn in_optimizer_step_scope(&self) -> bool {
        self.scopes.contains(&TorchScope::OptimizerStep)
    }

    fn step_running(&self) -> bool {
        self.step
            .as_ref()
            .is_some_and(|s| s.optimizer_end.is_none())
    }

    /// Opens a phase span and remembers its time range for `phase_at`.
    fn open_phase(
        &mut self,
        ctx: &mut ProcessContext<'_>,
        name: &'static str,
        group: SpanGroup,
        parent: SpanId,
        at: u64,
    ) -> SpanId {
        let span = ctx.open(name, group, parent, self.tid, at);
        if self.recent.len() == RECENT_INTERVALS {
            self.recent.pop_front();
        }
        let placement = ctx.arena.placement_in(span);
        self.recent.push_back(Interval {
            span,
            start: at,
            end: None,
            placement,
        });
        span
    }

    fn note_closed(&mut self, span: SpanId, at: u64) {
        if let Some(interval) = self.recent.iter_mut().rev().find(|i| i.span == span) {
            interval.end = Some(at);
        }
    }

    fn close_phase(&mut self, ctx: &mut ProcessContext<'_>, span: SpanId, at: u64) {
        ctx.close(span, at);
        self.note_closed(span, at);
    }

    fn truncate_phase(&mut self, ctx: &mut ProcessContext<'_>, span: SpanId, at: u64) {
        ctx.truncate(span, at);
        self.note_closed(span, at);
    }

    /// The open checkpoint (load) of this thread that holds a call starting at `at`
    /// (`None`: now): not one whose files and framework calls all ended before (it waits
    /// only to see whether more files follow).
    fn file_holding(&self, at: Option<u64>) -> Option<&FileSpan> {
        self.checkpoint
            .as_ref()
            .or(self.load_checkpoint.as_ref())
            .filter(|file| !(file.idle() && at.is_some_and(|at| file.last_end < Some(at))))
    }

    /// The innermost open span of this thread: where a call made now belongs.
    pub fn innermost(&self, ctx: &ProcessContext<'_>) -> SpanId {
        self.innermost_at(ctx, None)
    }

    /// As `innermost`, for a call that starts at `at` (`None`: now).
    fn innermost_at(&self, ctx: &ProcessContext<'_>, at: Option<u64>) -> SpanId {
        if let Some(file) = self.file_holding(at) {
            return file.span;
        }
        if let Some((_, span)) = self.rule_spans.last() {
            return *span;
        }
        if let Some(evaluate) = self.evaluate.as_ref().filter(|e| e.ended_at.is_none()) {
            return evaluate.span;
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

    /// Where a call made now belongs, or `None` while that is not known yet: between
    /// phases (a forward pass runs before the backward that opens its step), while an
    /// `Optimizer.step` may still run a closure, or after an evaluation batch (more may
    /// come). Such calls are held and placed by time once it is (`phase_at`). `at`: the
    /// call's start (`None`: now).
    pub fn current_phase(&self, ctx: &ProcessContext<'_>, at: Option<u64>) -> Option<SpanId> {
        if self.file_holding(at).is_some() || !self.rule_spans.is_empty() {
            return Some(self.innermost_at(ctx, at));
        }
        if let Some(evaluate) = &self.evaluate {
            return evaluate.ended_at.is_none().then_some(evaluate.span);
        }
        if let Some(step) = self.step.as_ref().filter(|s| s.optimizer_end.is_none()) {
            if self.optimizer_pending.is_some() && step.optimizer.is_none() {
                return None;
            }
            return Some(self.innermost_at(ctx, at));
        }
        (!self.in_loop()).then(|| self.innermost_at(ctx, at))
    }

    /// Whether this thread runs a training loop, or has begun to (a batch fetched, a
    /// forward pass begun): calls it makes may wait for their phase.
    pub fn in_loop(&self) -> bool {
        self.is_active()
            // A background thread writing a checkpoint (DCP's `async_save`): its calls
            // are the checkpoint's, not the loop thread's phase's.
            || self.checkpoint.is_some()
            || self.load_checkpoint.is_some()
            || self.pending_fetch.is_some()
            || self.eval_candidate.is_some()
            || self.optimizer_pending.is_some()
    }

    /// The innermost phase span of this thread whose time range holds `at` (open ones
    /// reach to now), among the recent ones.
    pub fn phase_at(&self, at: u64) -> Option<Placement> {
        // Open spans that are over in all but name: a complete step (its optimizer work
        // returned) and an evaluation whose grad mode came back on.
        let ended = |span: SpanId| {
            let step = self
                .step
                .as_ref()
                .filter(|s| s.span == span || s.optimizer == Some(span))
                .and_then(|s| s.optimizer_end);
            let evaluate = self
                .evaluate
                .as_ref()
                .filter(|e| e.span == span)
                .and_then(|e| e.ended_at);
            let file = [&self.checkpoint, &self.load_checkpoint]
                .into_iter()
                .flatten()
                .find(|f| f.span == span && f.idle())
                .and_then(|f| f.last_end);
            step.or(evaluate).or(file)
        };
        self.recent
            .iter()
            .enumerate()
            .filter(|(_, i)| {
                i.start <= at && i.end.or_else(|| ended(i.span)).is_none_or(|end| at <= end)
            })
            .max_by_key(|(index, i)| (i.start, *index))
            .map(|(_, i)| i.placement)
    }

    pub fn on_signal(&mut self, ctx: &mut ProcessContext<'_>, at: u64, signal: &PhaseSignal) {
        // A group configured rules took over: torch's signals for it are not used.
        let ruled = |group| ctx.ruled.contains(&group);
        let taken = match signal {
            PhaseSignal::BackwardStart | PhaseSignal::GradientStart | PhaseSignal::BackwardEnd => {
                ruled(SpanGroup::Step)
            }
            PhaseSignal::GradMode { .. } => ruled(SpanGroup::Evaluate),
            PhaseSignal::CheckpointWriteStart | PhaseSignal::CheckpointWriteEnd => {
                ruled(SpanGroup::Checkpoint)
            }
            PhaseSignal::CheckpointReadStart | PhaseSignal::CheckpointReadEnd => {
                ruled(SpanGroup::LoadCheckpoint)
            }
            PhaseSignal::FileCreated | PhaseSignal::FileRead => false,
            PhaseSignal::ScopeEnter { .. } | PhaseSignal::ScopeExit => false,
        };
        if taken {
            return;
        }
        // Files written (read) back to back are one checkpoint until another signal
        // comes; grad mode is not one (`load_state_dict` copies under `no_grad` between
        // the files of one load).
        let grad_mode = matches!(
            signal,
            PhaseSignal::GradMode { .. } | PhaseSignal::FileCreated | PhaseSignal::FileRead
        );
        let prelude_own = self.prelude_own(signal);
        if !grad_mode && !Self::is_file_signal(signal) && !prelude_own {
            // Another phase began: what was prepared was not for a checkpoint.
            self.prelude = None;
        }
        if !grad_mode
            && !matches!(
                signal,
                PhaseSignal::CheckpointWriteStart | PhaseSignal::CheckpointWriteEnd
            )
        {
            self.settle_files(ctx, SpanGroup::Checkpoint, at);
        }
        if !grad_mode
            && !matches!(
                signal,
                PhaseSignal::CheckpointReadStart | PhaseSignal::CheckpointReadEnd
            )
        {
            self.settle_files(ctx, SpanGroup::LoadCheckpoint, at);
        }
        match signal {
            // Kept on the scope stack only: no phase of the loop.
            PhaseSignal::ScopeEnter { scope, .. } if prelude_own => self.scopes.push(*scope),
            PhaseSignal::ScopeExit if prelude_own => {
                self.scopes.pop();
            }
            PhaseSignal::ScopeEnter { scope, .. } => self.scope_enter(ctx, at, *scope),
            PhaseSignal::ScopeExit => {
                if !ctx.ruled.contains(&SpanGroup::Step) {
                    self.scope_exit(ctx, at);
                } else {
                    self.scopes.pop();
                }
            }
            PhaseSignal::BackwardStart => {
                self.engine_calls.push(true);
                self.backward_start(ctx, at);
            }
            // `torch.autograd.grad` (AOTAutograd's graph capture, a gradient penalty):
            // not a backward pass of the step.
            PhaseSignal::GradientStart => self.engine_calls.push(false),
            PhaseSignal::BackwardEnd => {
                // An end without its start began before we attached.
                if self.engine_calls.pop() == Some(true) {
                    self.backward_end(ctx, at);
                }
            }
            PhaseSignal::GradMode { enabled } => self.grad_mode(at, *enabled),
            PhaseSignal::CheckpointWriteStart => self.file_open(ctx, at, SpanGroup::Checkpoint),
            PhaseSignal::CheckpointWriteEnd => Self::file_close(&mut self.checkpoint, at),
            PhaseSignal::CheckpointReadStart => self.file_open(ctx, at, SpanGroup::LoadCheckpoint),
            PhaseSignal::CheckpointReadEnd => Self::file_close(&mut self.load_checkpoint, at),
            // Counted while the checkpoint writes: a file created after its writers and
            // framework calls all returned (a log, the job's own output at exit) is not
            // the checkpoint's.
            PhaseSignal::FileCreated => {
                if !Self::file_created(&mut self.checkpoint)
                    && let Some(prelude) = self.prelude.as_mut()
                {
                    prelude.created += 1;
                }
            }
            PhaseSignal::FileRead => {
                if !Self::file_created(&mut self.load_checkpoint)
                    && let Some(prelude) = self.prelude.as_mut()
                {
                    prelude.read += 1;
                }
            }
        }
    }

    fn scope_enter(&mut self, ctx: &mut ProcessContext<'_>, at: u64, scope: TorchScope) {
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
                if let Some(step) = self.step.as_ref()
                    && step.optimizer.is_none()
                    && step.optimizer_end.is_none()
                    && step.microbatches > 0
                    && self.backward_depth == 0
                    && self.optimizer_pending.is_none()
                    && !nested
                {
                    let since = step.last_backward_end;
                    self.optimizer_begins(ctx, since);
                }
                // zero_grad right after step: still the optimizer's work. Not after a
                // fetch (the next batch's), nor inside another `Optimizer.step` (the next
                // step's closure, as Lightning runs it).
                if let Some(step) = self.step.as_mut().filter(|s| s.optimizer.is_some())
                    && self.pending_fetch.is_none()
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
    fn batch_fetched(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        self.fetch_since_training.get_or_insert(at);
        if let Some(evaluate) = self.evaluate.as_mut() {
            evaluate.resumed = None;
            // With grad mode on again the loop may be over: this batch may be the next
            // step's (or the evaluation's next, if grad mode goes off again).
            if evaluate.ended_at.is_some() && self.pending_fetch.is_none() {
                self.pending_fetch = Some(at);
            }
        } else if let Some(candidate) = self.eval_candidate {
            self.evaluate_begins(ctx, candidate.start);
        } else if !self.step_running() {
            // A complete step is over once the next batch is fetched: optimizer work
            // after this (a zero_grad) belongs to the next.
            self.finish_step(ctx);
            if self.pending_fetch.is_none() {
                self.pending_fetch = Some(at);
            }
        }
    }

    /// A wrapped model's forward pass began: between steps, the next step starts here
    /// unless a batch was fetched first.
    fn forward_began(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        if self.evaluate.is_some() || self.eval_candidate.is_some() || self.step_running() {
            return;
        }
        self.finish_step(ctx);
        self.pending_fetch.get_or_insert(at);
    }

    /// A call made now, after the last `no_grad` block of an evaluation and before
    /// anything else (reducing its metrics across ranks): the evaluation's, which lasts
    /// until the call's end. `None` otherwise.
    pub fn claim_for_evaluation(&mut self, end_ns: u64) -> Option<SpanId> {
        if self.pending_fetch.is_some() {
            return None;
        }
        let evaluate = self.evaluate.as_mut()?;
        let ended = evaluate.ended_at?;
        evaluate.ended_at = Some(ended.max(end_ns));
        Some(evaluate.span)
    }

    /// `Optimizer.step` entered. Its span opens when it is known where the update
    /// begins: at the end of a closure's backward pass if one runs first, else here.
    fn optimizer_scope_enter(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        self.fetch_since_training = None;
        if self.syncing {
            return;
        }
        // Training again (without backward probes, the first sign of it).
        self.end_finished_evaluation(ctx, at);
        match self.step.as_mut() {
            // More optimizer work of the same step (a second optimizer).
            Some(step) if step.optimizer.is_some() && self.pending_fetch.is_none() => {
                step.optimizer_end = None;
            }
            Some(step) if step.optimizer.is_some() => {
                self.finish_step(ctx);
                self.optimizer_pending.get_or_insert(at);
            }
            _ => {
                self.optimizer_pending.get_or_insert(at);
            }
        }
    }

    fn scope_exit(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
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
            self.optimizer_pending = None;
            return;
        }
        if scope == TorchScope::OptimizerStep
            && !self.in_optimizer_step_scope()
            && let Some(start) = self.optimizer_pending.take()
        {
            // No closure ran a backward pass: the update began at the scope's entry.
            self.optimizer_begins(ctx, start);
        }
        let nested = self.in_optimizer_step_scope();
        match self.step.as_mut() {
            Some(step) if step.optimizer.is_some() && !nested => step.optimizer_end = Some(at),
            None if self.pending_fetch.is_none() && !nested => {
                // zero_grad between steps (top of the loop): the next step starts after it.
                self.boundary = Some(self.boundary.map_or(at, |b| b.max(at)));
            }
            _ => {}
        }
    }

    /// A step begins with its first backward pass; it started at the first batch fetch
    /// before it (or at the previous phase's end, when batches come from elsewhere).
    fn backward_start(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        self.backward_depth += 1;
        self.fetch_since_training = None;
        if self.backward_depth > 1 || self.syncing {
            return;
        }
        // The step takes over from an evaluation that was over, or a candidate.
        self.eval_candidate = None;
        self.end_evaluation(ctx, at);
        self.backward_start = at;
        // A closure's backward inside `Optimizer.step`, before its update: the last
        // microbatch of the step.
        self.closure_backward = self.optimizer_pending.is_some()
            && self.step.as_ref().is_none_or(|s| s.optimizer.is_none());
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
        let span = self.open_phase(ctx, names::STEP, SpanGroup::Step, ctx.job, start);
        ctx.arena
            .set_attr(span, semconv::DL_ITERATION, self.iteration);
        self.iteration += 1;
        let forward_backward = self.open_phase(
            ctx,
            names::FORWARD_BACKWARD,
            SpanGroup::ForwardBackward,
            span,
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
        if std::mem::take(&mut self.closure_backward) {
            // The closure's backward is done: what follows in `Optimizer.step` is the update.
            self.optimizer_pending = None;
            self.optimizer_begins(ctx, at);
        }
    }

    /// `forward_backward` ends at its last backward; `optimizer` runs from the first
    /// optimizer step to the end of the optimizer work that follows it.
    fn optimizer_begins(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        if self.syncing {
            return;
        }
        let Some(step) = self.step.as_mut() else {
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
            if let Some(step) = self.step.as_mut() {
                step.optimizer = Some(optimizer);
            }
        }
    }

    /// Ends a complete step (its optimizer work returned) where that work ended.
    fn finish_step(&mut self, ctx: &mut ProcessContext<'_>) {
        let Some(step) = self.step.take_if(|s| s.optimizer_end.is_some()) else {
            return;
        };
        let end = step.optimizer_end.unwrap_or(step.last_backward_end);
        if let Some(optimizer) = step.optimizer {
            self.close_phase(ctx, optimizer, end);
        }
        self.close_phase(ctx, step.span, end);
        self.boundary = Some(end);
    }

    fn grad_mode(&mut self, at: u64, enabled: bool) {
        if enabled == self.grad_enabled {
            return;
        }
        self.grad_enabled = enabled;
        if enabled {
            self.grad_on_at = at;
        }
        if self.in_optimizer_scope() {
            // The optimizer's own `no_grad`: neither evaluation nor its end.
            return;
        }
        if let Some(evaluate) = self.evaluate.as_mut() {
            // Inside an evaluation loop grad mode may go on and off (per batch, around a
            // recompile): the loop goes on until another phase begins.
            if enabled {
                evaluate.ended_at = Some(at);
            } else {
                // The batch fetched meanwhile was the evaluation's, unless a backward
                // pass comes next.
                if let (Some(end), Some(fetch)) = (evaluate.ended_at, self.pending_fetch.take()) {
                    evaluate.resumed = Some((end, fetch));
                }
                evaluate.ended_at = None;
            }
            return;
        }
        if !enabled {
            // Between backward passes it is the step's own work.
            if !self.step_running() {
                self.eval_candidate = Some(match self.fetch_since_training {
                    Some(fetch) => EvalCandidate {
                        start: fetch,
                        fetched_first: true,
                    },
                    None => EvalCandidate {
                        start: at,
                        fetched_first: false,
                    },
                });
            }
            return;
        }
        // A `no_grad` block without a batch in it (an EMA update, logging) is not
        // evaluation, unless a batch came just before it (a per-batch `no_grad`).
        if self.eval_candidate.is_some_and(|c| !c.fetched_first) {
            self.eval_candidate = None;
        }
    }

    /// Evaluation: a DataLoader fetch after grad mode went off between steps. It began
    /// when grad mode was switched off, or at the batch fetched just before that.
    fn evaluate_begins(&mut self, ctx: &mut ProcessContext<'_>, start: u64) {
        self.finish_step(ctx);
        ctx.end_model_init(start);
        let span = self.open_phase(ctx, names::EVALUATE, SpanGroup::Evaluate, ctx.job, start);
        // Confirmed by a fetch after a per-batch `no_grad` block: the loop is over at
        // that block's end unless grad mode goes off again.
        let ended_at = self.grad_enabled.then_some(self.grad_on_at.max(start));
        self.evaluate = Some(Evaluate {
            span,
            ended_at,
            resumed: None,
        });
        self.eval_candidate = None;
        self.pending_fetch = None;
    }

    /// Another phase begins at `at`: an evaluation whose grad mode is back on ends (one
    /// still under `no_grad` goes on: the new phase is inside it).
    fn end_finished_evaluation(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        if self.evaluate.as_ref().is_some_and(|e| e.ended_at.is_some()) {
            self.end_evaluation(ctx, at);
        }
    }

    /// Another phase begins at `at`: an evaluation loop still open ends, where grad mode
    /// was last switched back on (or here, if it is still off).
    fn end_evaluation(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        let Some(evaluate) = self.evaluate.take() else {
            return;
        };
        let mut end = evaluate.ended_at.unwrap_or(at);
        if let Some((ended, fetch)) = evaluate.resumed {
            // What looked like another batch was the next step's forward.
            end = ended;
            self.pending_fetch = Some(fetch);
        }
        self.close_phase(ctx, evaluate.span, end);
        self.boundary = Some(end);
    }

    /// A file created (opened for reading, in a load) while `span` reads or writes:
    /// whether it was counted there.
    fn file_created(span: &mut Option<FileSpan>) -> bool {
        let Some(file) = span.as_mut().filter(|f| !f.idle()) else {
            return false;
        };
        file.created += 1;
        if file.open_files == 0 {
            file.created_since_writer += 1;
        }
        true
    }

    /// Whether `signal` is the running preparation's own work, not another phase: DCP's
    /// `get_state_dict` gives a fresh optimizer its state with a zero-lr
    /// `optimizer.step()` and `zero_grad()` (`_init_optim_state`), as a job that resumes
    /// does right before its load; no microbatch ran since the last step, so these are
    /// no update.
    fn prelude_own(&self, signal: &PhaseSignal) -> bool {
        let optimizer_scope = match signal {
            PhaseSignal::ScopeEnter { scope, .. } => matches!(
                scope,
                TorchScope::OptimizerStep | TorchScope::OptimizerZeroGrad
            ),
            PhaseSignal::ScopeExit => matches!(
                self.scopes.last(),
                Some(TorchScope::OptimizerStep | TorchScope::OptimizerZeroGrad)
            ),
            _ => false,
        };
        optimizer_scope && self.prelude.is_some() && !self.step_running()
    }

    fn is_file_signal(signal: &PhaseSignal) -> bool {
        matches!(
            signal,
            PhaseSignal::CheckpointWriteStart
                | PhaseSignal::CheckpointWriteEnd
                | PhaseSignal::CheckpointReadStart
                | PhaseSignal::CheckpointReadEnd
        )
    }

    /// A save's or load's preparation was entered (`at`: its first sample): the next
    /// checkpoint (load) starts there unless another phase begins first.
    pub fn save_prelude(&mut self, at: u64) {
        let earliest = at.saturating_sub(crate::python::sampler::SAMPLE_INTERVAL.as_nanos() as u64);
        // Not before the last phase ended (a complete step ends where its optimizer did).
        let step_end = self.step.as_ref().and_then(|s| s.optimizer_end);
        let floor = self.boundary.max(step_end).unwrap_or(0);
        self.prelude.get_or_insert(Prelude {
            start: earliest.max(floor),
            created: 0,
            read: 0,
        });
    }

    fn file_open(&mut self, ctx: &mut ProcessContext<'_>, at: u64, group: SpanGroup) {
        self.end_finished_evaluation(ctx, at);
        if let Some(file) = self.file_slot(group).as_mut() {
            file.open_files += 1;
            file.files += 1;
            return;
        }
        let span = self.open_file_span(ctx, at, group);
        let created = self.take_prelude_files(group);
        *self.file_slot(group) = Some(FileSpan {
            created,
            ..FileSpan::opened_by_writer(span)
        });
    }

    /// Opens the span of a checkpoint (load) beginning at `at`: inside a running step (or
    /// a configured rule's span, or an evaluation) it belongs there; otherwise it is a
    /// phase of its own.
    fn open_file_span(
        &mut self,
        ctx: &mut ProcessContext<'_>,
        at: u64,
        group: SpanGroup,
    ) -> SpanId {
        let running_step = self.step_running();
        let parent = if running_step || !self.rule_spans.is_empty() || self.evaluate.is_some() {
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
        let start = self.prelude.map_or(at, |prelude| prelude.start.min(at));
        self.open_phase(ctx, name, group, parent, start)
    }

    /// The files the preparation of a checkpoint (load) opening now saw before it: they
    /// are its. The preparation is over.
    fn take_prelude_files(&mut self, group: SpanGroup) -> u32 {
        match (self.prelude.take(), group) {
            (None, _) => 0,
            (Some(prelude), SpanGroup::Checkpoint) => prelude.created,
            (Some(prelude), _) => prelude.read,
        }
    }

    /// A framework's save (load) function (`config::FRAMEWORK_SAVE_RULES`) was entered:
    /// `at` is the first Python sample showing it, so it began within the sample interval
    /// before. Its span starts there (not before the last phase's end), or an open one
    /// (its file already began: samples arrive a sample later than native signals) is
    /// moved there; files and calls until it returns are its.
    pub fn save_call_enter(
        &mut self,
        ctx: &mut ProcessContext<'_>,
        at: u64,
        group: SpanGroup,
        attributes: Attributes,
    ) {
        let earliest = at.saturating_sub(crate::python::sampler::SAMPLE_INTERVAL.as_nanos() as u64);
        if let Some(file) = self.file_slot(group).as_mut() {
            file.calls += 1;
            let span = file.span;
            let start = earliest.max(self.boundary.unwrap_or(0));
            if ctx.arena.move_start(span, start)
                && let Some(interval) = self.recent.iter_mut().rev().find(|i| i.span == span)
            {
                interval.start = interval.start.min(start);
            }
            return;
        }
        self.end_finished_evaluation(ctx, at);
        self.finish_step(ctx);
        let start = earliest.max(self.boundary.unwrap_or(0)).min(at);
        let span = self.open_file_span(ctx, start, group);
        for (key, value) in attributes {
            ctx.arena.set_attr(span, key, value);
        }
        let created = self.take_prelude_files(group);
        *self.file_slot(group) = Some(FileSpan {
            created,
            ..FileSpan::opened_by_call(span)
        });
    }

    /// The framework call returned (`at`: the first sample without it). A call already
    /// ended by another phase's signal (its sample came after that signal) is ignored.
    pub fn save_call_return(&mut self, at: u64, group: SpanGroup) {
        if let Some(file) = self.file_slot(group).as_mut().filter(|f| f.calls > 0) {
            file.calls -= 1;
            file.last_end = Some(file.last_end.map_or(at, |end| end.max(at)));
        }
    }

    /// The open checkpoint (load) span of this thread, taken out: DCP's `async_save`
    /// hands its span to the background thread that writes it.
    pub fn take_file_span(&mut self, group: SpanGroup) -> Option<FileSpan> {
        self.file_slot(group).take()
    }

    /// The span of this thread's open checkpoint (load), if any.
    pub fn file_span(&self, group: SpanGroup) -> Option<SpanId> {
        match group {
            SpanGroup::Checkpoint => self.checkpoint.as_ref(),
            _ => self.load_checkpoint.as_ref(),
        }
        .map(|file| file.span)
    }

    /// Files other threads wrote into this thread's open checkpoint (load).
    pub fn add_files(&mut self, group: SpanGroup, counts: (u32, u32)) {
        if let Some(file) = self.file_slot(group).as_mut() {
            file.add_counts(counts);
        }
    }

    /// Files another thread wrote into `span`, if it is this thread's open checkpoint
    /// (load), written by it: whether they were added.
    pub fn add_files_to(&mut self, span: SpanId, group: SpanGroup, counts: (u32, u32)) -> bool {
        match self.file_slot(group).as_mut().filter(|f| f.span == span) {
            Some(file) => {
                file.add_counts(counts);
                file.written_elsewhere = false;
                true
            }
            None => false,
        }
    }

    /// This thread's open checkpoint `span` is written by a background thread now
    /// (`adopt_file_span` there): it lasts until that one returns.
    pub fn hand_off(&mut self, span: SpanId, group: SpanGroup) {
        if let Some(file) = self.file_slot(group).as_mut().filter(|f| f.span == span) {
            file.written_elsewhere = true;
        }
    }

    /// This thread (DCP's background writer) carries on `span`, opened by another thread:
    /// its files and calls are the span's until its framework call returns.
    pub fn adopt_file_span(&mut self, span: SpanId, group: SpanGroup) {
        *self.file_slot(group) = Some(FileSpan::opened_by_call(span));
    }

    /// The open checkpoint (`Checkpoint`) or load (`LoadCheckpoint`) of this thread.
    fn file_slot(&mut self, group: SpanGroup) -> &mut Option<FileSpan> {
        match group {
            SpanGroup::Checkpoint => &mut self.checkpoint,
            _ => &mut self.load_checkpoint,
        }
    }

    fn file_close(slot: &mut Option<FileSpan>, at: u64) {
        if let Some(file) = slot.as_mut().filter(|f| f.open_files > 0) {
            file.open_files -= 1;
            file.last_end = Some(at);
            file.created_since_writer = 0;
        }
    }

    /// Files written (read) back to back are one checkpoint: the span ends at the last
    /// file's end once anything else happens (`at`). A framework call still open then has
    /// returned (its sample is yet to come): it ends at `at`.
    fn settle_files(&mut self, ctx: &mut ProcessContext<'_>, group: SpanGroup, at: u64) {
        if let Some(file) = self
            .file_slot(group)
            .as_mut()
            .filter(|f| f.calls > 0 && f.open_files == 0)
        {
            file.calls = 0;
            file.last_end = Some(file.last_end.map_or(at, |end| end.max(at)));
        }
        let Some(file) = self
            .file_slot(group)
            .take_if(|f| f.idle() && f.last_end.is_some())
        else {
            return;
        };
        let end = file.last_end.unwrap_or_default();
        self.close_file_span(ctx, &file, end);
    }

    /// Closes `file`'s span at `end` (or after the calls made in it): where it closed.
    fn close_file_span(&mut self, ctx: &mut ProcessContext<'_>, file: &FileSpan, end: u64) -> u64 {
        // Its end may come from a sample (a framework call's return, its thread's last
        // sample): the calls made inside it, DCP's last metadata broadcast, still count.
        let end = end.max(ctx.arena.calls_end(file.span));
        ctx.arena
            .set_attr(file.span, semconv::NEMO_CHECKPOINT_FILES, file.file_count());
        self.close_phase(ctx, file.span, end);
        // A checkpoint inside a step or an evaluation is not a boundary between phases.
        if self.step.is_none() && self.evaluate.is_none() {
            self.boundary = Some(end);
        }
        end
    }

    /// `span`, one of this thread's phases, was closed at `end` by another thread (DCP's
    /// `async_save` by its writer): calls of this thread after `end` are not in it.
    pub fn closed_elsewhere(&mut self, span: SpanId, end: u64) {
        self.note_closed(span, end);
    }

    /// Ends an adopted span (`adopt_file_span`) when this thread's framework call returns:
    /// a background thread has no other signal that would settle it. `files`: those the
    /// other threads wrote into it.
    pub fn end_adopted(
        &mut self,
        ctx: &mut ProcessContext<'_>,
        at: u64,
        group: SpanGroup,
        counts: (u32, u32),
    ) -> Option<u64> {
        let mut file = self.file_slot(group).take()?;
        file.add_counts(counts);
        let end = file.last_end.map_or(at, |end| end.max(at));
        Some(self.close_file_span(ctx, &file, end))
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
        if top_level && self.rule_spans.is_empty() {
            self.end_finished_evaluation(ctx, at);
        }
        let mut parent = self.innermost(ctx);
        if top_level && Some(parent) == *ctx.model_init {
            ctx.end_model_init(at);
            parent = ctx.job;
        }
        let span = self.open_phase(ctx, name, group, parent, at);
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
                self.truncate_phase(ctx, span, at);
            }
        }
        if let Some((_, span)) = self.rule_spans.pop() {
            self.close_phase(ctx, span, at);
        }
    }

    /// The process is gone or tracing stops at `at`: complete phases end where they
    /// ended, open ones end now, innermost first, marked truncated.
    pub fn finish(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        while let Some((_, span)) = self.rule_spans.pop() {
            ctx.truncate(span, at);
        }
        // A framework call whose return no sample showed (the process ended right after
        // it): it returned after its last file; what came after is not its.
        for file in [&mut self.checkpoint, &mut self.load_checkpoint]
            .into_iter()
            .flatten()
            .filter(|f| f.calls > 0 && f.open_files == 0 && f.last_end.is_some())
        {
            file.calls = 0;
            file.created -= file.created_since_writer;
            file.created_since_writer = 0;
        }
        self.settle_files(ctx, SpanGroup::Checkpoint, at);
        self.settle_files(ctx, SpanGroup::LoadCheckpoint, at);
        for file in [self.checkpoint.take(), self.load_checkpoint.take()]
            .into_iter()
            .flatten()
        {
            self.truncate_phase(ctx, file.span, at);
        }
        if let Some(evaluate) = self.evaluate.take() {
            match evaluate.ended_at {
                // Grad mode came back on: the loop was over.
                Some(end) => self.close_phase(ctx, evaluate.span, end),
                None => self.truncate_phase(ctx, evaluate.span, at),
            }
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
