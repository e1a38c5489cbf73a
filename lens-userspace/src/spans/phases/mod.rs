//! The per-thread state machine that turns phase signals (torch scopes, backward passes,
//! grad mode, checkpoint files) into the training-loop spans. Each rule is written up in
//! `docs/spans.md`; the names of the rules there are the names of the methods here.
use std::collections::BTreeSet;

use super::{
    SpanExporter, SpanId,
    arena::{IdSource, Placement, SpanArena},
};
use crate::{
    events::{PhaseSignal, TorchScope},
    semconv,
    settings::groups::SpanGroup,
};

mod evaluation;
mod files;
mod rules;
mod steps;

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
    /// Readers of a load that open their file themselves (safetensors' `safe_open`: the
    /// opens inside a reader are not counted). `torch.load`'s file is opened by Python
    /// before its reader starts, and counted in `created`.
    own_files: u32,
    /// The paths (hashed) of the files in `created`: one created twice counts once.
    paths: std::collections::HashSet<u32>,
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
            own_files: 0,
            paths: std::collections::HashSet::new(),
            created_since_writer: 0,
            written_elsewhere: false,
        }
    }

    fn idle(&self) -> bool {
        self.open_files == 0 && self.calls == 0 && !self.written_elsewhere
    }

    /// `nemo.checkpoint.files`: the files created (read, with the readers that opened
    /// their own) if any were seen, else the writers (readers) that opened.
    fn file_count(&self) -> u32 {
        if self.created + self.own_files > 0 {
            self.created + self.own_files
        } else {
            self.files
        }
    }

    /// Whether it saw no file, no writer (reader) and no call of its own.
    fn saw_nothing(&self, calls_end: u64) -> bool {
        self.files == 0 && self.created + self.own_files == 0 && calls_end == 0
    }

    /// What it counted: (writers or readers, files created or read).
    pub fn counts(&self) -> (u32, u32) {
        (self.files, self.created + self.own_files)
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
    /// Recent phase spans with their times, oldest first.
    recent: std::collections::VecDeque<Interval>,
    /// Spans of configured probe rules open on this thread, outermost first: (rule, span).
    rule_spans: Vec<(u32, SpanId)>,
    training: TrainingState,
    evaluation: EvaluationState,
    files: FileState,
}

/// A thread's training steps: the step open now and what tells where the next begins.
#[derive(Debug, Default)]
struct TrainingState {
    /// End of the last top-level phase (step, evaluate, checkpoint); a step starts here
    /// unless a batch fetch came later.
    boundary: Option<u64>,
    /// Start of the first DataLoader fetch since `boundary`, outside evaluation.
    pending_fetch: Option<u64>,
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
    step: Option<Step>,
    iteration: u64,
    backward_depth: u32,
    backward_start: u64,
}

/// A thread's evaluation: grad mode, and the evaluation loop it may be running.
#[derive(Debug)]
struct EvaluationState {
    grad_enabled: bool,
    /// When grad mode was last switched on.
    grad_on_at: u64,
    /// Start of the first DataLoader fetch since the last training work (a backward
    /// pass, an optimizer step): a `no_grad` block after it may be an evaluation batch.
    /// Unlike `pending_fetch` it does not depend on the step probes being in.
    fetch_since_training: Option<u64>,
    /// Grad mode was switched off between steps: evaluation if a batch is fetched next.
    eval_candidate: Option<EvalCandidate>,
    evaluate: Option<Evaluate>,
}

/// A thread's checkpoint files: the save and the load open on it, and what prepares them.
#[derive(Debug, Default)]
struct FileState {
    checkpoint: Option<FileSpan>,
    load_checkpoint: Option<FileSpan>,
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
            recent: std::collections::VecDeque::new(),
            rule_spans: Vec::new(),
            training: TrainingState::default(),
            evaluation: EvaluationState {
                grad_enabled: true,
                grad_on_at: 0,
                fetch_since_training: None,
                eval_candidate: None,
                evaluate: None,
            },
            files: FileState::default(),
        }
    }

    /// Whether this thread has seen any training-loop activity (its spans exist).
    pub fn is_active(&self) -> bool {
        self.training.step.is_some()
            || !self.rule_spans.is_empty()
            || self.evaluation.evaluate.is_some()
            || self.training.iteration > 0
            || self.training.boundary.is_some()
    }

    /// Nothing open, nothing pending, nothing counted: the thread's state can go (a
    /// short-lived worker that toggled grad mode or entered a scope). Its next signal
    /// starts it afresh.
    pub fn is_idle(&self) -> bool {
        !self.is_active()
            && self.scopes.is_empty()
            && self.evaluation.grad_enabled
            && self.training.pending_fetch.is_none()
            && self.evaluation.fetch_since_training.is_none()
            && self.evaluation.eval_candidate.is_none()
            && self.files.checkpoint.is_none()
            && self.files.load_checkpoint.is_none()
            && self.training.backward_depth == 0
            && self.training.engine_calls.is_empty()
            && self.training.optimizer_pending.is_none()
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
        self.training
            .step
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
        self.files
            .checkpoint
            .as_ref()
            .or(self.files.load_checkpoint.as_ref())
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
        if let Some(evaluate) = self
            .evaluation
            .evaluate
            .as_ref()
            .filter(|e| e.ended_at.is_none())
        {
            return evaluate.span;
        }
        // A complete step (its optimizer work returned) ends there: a call after it (a
        // logging all-reduce, a barrier) is between steps, not inside the last one.
        if let Some(step) = self
            .training
            .step
            .as_ref()
            .filter(|s| s.optimizer_end.is_none())
        {
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
        if let Some(evaluate) = &self.evaluation.evaluate {
            return evaluate.ended_at.is_none().then_some(evaluate.span);
        }
        if let Some(step) = self
            .training
            .step
            .as_ref()
            .filter(|s| s.optimizer_end.is_none())
        {
            if self.training.optimizer_pending.is_some() && step.optimizer.is_none() {
                return None;
            }
            // Between backward passes: the next microbatch's forward (`forward_backward`)
            // or, after the last one, the step's own work before its update (a pipeline
            // stage's last send): known at the next backward or at the optimizer.
            if step.forward_backward.is_some()
                && step.optimizer.is_none()
                && step.microbatches > 0
                && self.training.backward_depth == 0
            {
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
            || self.files.checkpoint.is_some()
            || self.files.load_checkpoint.is_some()
            || self.training.pending_fetch.is_some()
            || self.evaluation.eval_candidate.is_some()
            || self.training.optimizer_pending.is_some()
    }

    /// The innermost phase span of this thread whose time range holds `at` (open ones
    /// reach to now), among the recent ones.
    pub fn phase_at(&self, at: u64) -> Option<Placement> {
        // Open spans that are over in all but name: a complete step (its optimizer work
        // returned) and an evaluation whose grad mode came back on.
        let ended = |span: SpanId| {
            let step = self
                .training
                .step
                .as_ref()
                .filter(|s| s.span == span || s.optimizer == Some(span))
                .and_then(|s| s.optimizer_end);
            let evaluate = self
                .evaluation
                .evaluate
                .as_ref()
                .filter(|e| e.span == span)
                .and_then(|e| e.ended_at);
            let file = [&self.files.checkpoint, &self.files.load_checkpoint]
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
            PhaseSignal::CheckpointReadStart { .. } | PhaseSignal::CheckpointReadEnd => {
                ruled(SpanGroup::LoadCheckpoint)
            }
            PhaseSignal::FileCreated { .. } | PhaseSignal::FileRead { .. } => false,
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
            PhaseSignal::GradMode { .. }
                | PhaseSignal::FileCreated { .. }
                | PhaseSignal::FileRead { .. }
        );
        let prelude_own = self.prelude_own(signal);
        if !grad_mode && !Self::is_file_signal(signal) && !prelude_own {
            // Another phase began: what was prepared was not for a checkpoint.
            self.files.prelude = None;
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
                PhaseSignal::CheckpointReadStart { .. } | PhaseSignal::CheckpointReadEnd
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
                self.training.engine_calls.push(true);
                self.backward_start(ctx, at);
            }
            // `torch.autograd.grad` (AOTAutograd's graph capture, a gradient penalty):
            // not a backward pass of the step.
            PhaseSignal::GradientStart => self.training.engine_calls.push(false),
            PhaseSignal::BackwardEnd => {
                // An end without its start began before we attached.
                if self.training.engine_calls.pop() == Some(true) {
                    self.backward_end(ctx, at);
                }
            }
            PhaseSignal::GradMode { enabled } => self.grad_mode(at, *enabled),
            PhaseSignal::CheckpointWriteStart => {
                self.file_open(ctx, at, SpanGroup::Checkpoint, false)
            }
            PhaseSignal::CheckpointWriteEnd => Self::file_close(&mut self.files.checkpoint, at),
            PhaseSignal::CheckpointReadStart { own_file } => {
                self.file_open(ctx, at, SpanGroup::LoadCheckpoint, *own_file)
            }
            PhaseSignal::CheckpointReadEnd => Self::file_close(&mut self.files.load_checkpoint, at),
            // Counted while the checkpoint writes: a file created after its writers and
            // framework calls all returned (a log, the job's own output at exit) is not
            // the checkpoint's.
            PhaseSignal::FileCreated { path } => {
                if !Self::file_created(&mut self.files.checkpoint, *path)
                    && let Some(prelude) = self.files.prelude.as_mut()
                {
                    prelude.created += 1;
                }
            }
            // A file opened while a reader of the load is open is that reader's own, which
            // counts once as it: safetensors' `safe_open` opens its file, then torch's
            // `UntypedStorage.from_file` opens it again. Whether these opens are seen at
            // all depends on when the loader learnt of the load (`PY_SAVING`), so they
            // must not decide the count.
            PhaseSignal::FileRead { .. } if Self::in_reader(&self.files.load_checkpoint) => {}
            PhaseSignal::FileRead { path } => {
                if !Self::file_created(&mut self.files.load_checkpoint, *path)
                    && let Some(prelude) = self.files.prelude.as_mut()
                {
                    prelude.read += 1;
                }
            }
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
        for file in [&mut self.files.checkpoint, &mut self.files.load_checkpoint]
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
        for file in [
            self.files.checkpoint.take(),
            self.files.load_checkpoint.take(),
        ]
        .into_iter()
        .flatten()
        {
            self.truncate_phase(ctx, file.span, at);
        }
        if let Some(evaluate) = self.evaluation.evaluate.take() {
            match evaluate.ended_at {
                // Grad mode came back on: the loop was over.
                Some(end) => self.close_phase(ctx, evaluate.span, end),
                None => self.truncate_phase(ctx, evaluate.span, at),
            }
        }
        self.finish_step(ctx);
        if let Some(step) = self.training.step.take() {
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
