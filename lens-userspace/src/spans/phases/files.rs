//! Checkpoint and load spans: files written or read back to back, the framework save
//! and load calls around them, and a save's preparation (`docs/spans.md`,
//! "Rules").

use crate::spans::{Attributes, SpanId, names};
use crate::{
    events::{PhaseSignal, TorchScope},
    python::sampler::SAMPLE_INTERVAL,
    semconv,
    settings::groups::SpanGroup,
};

use super::*;

/// The paths a checkpoint (load) span remembers to count a file once.
const MAX_PATHS_KEPT: usize = 4096;

/// A framework load call shorter than this that read nothing loaded nothing
/// (`loaded_nothing`).
const NO_LOAD_WITHIN: u64 = 5_000_000;

impl ThreadPhases {
    /// A file created (opened for reading, in a load) at `path` (hashed; 0: not known)
    /// while `span` reads or writes: whether it was counted there. A path seen there
    /// before is the same file (fsspec creates its temporary file, closes it and opens
    /// it again to write).
    pub(super) fn file_created(span: &mut Option<FileSpan>, path: u32) -> bool {
        let Some(file) = span.as_mut().filter(|f| !f.idle()) else {
            return false;
        };
        if path != 0 {
            if file.paths.contains(&path) {
                return true;
            }
            // Bounded: a save of many files still counts each, its later repeats aside.
            if file.paths.len() < MAX_PATHS_KEPT {
                file.paths.insert(path);
            }
        }
        file.created += 1;
        if file.open_files == 0 {
            file.created_since_writer += 1;
        }
        true
    }

    /// Whether a reader (writer) of `span` has a file open now.
    pub(super) fn in_reader(span: &Option<FileSpan>) -> bool {
        span.as_ref().is_some_and(|f| f.open_files > 0)
    }

    /// Whether `signal` is the running preparation's own work, not another phase: DCP's
    /// `get_state_dict` gives a fresh optimizer its state with a zero-lr
    /// `optimizer.step()` and `zero_grad()` (`_init_optim_state`), as a job that resumes
    /// does right before its load; no microbatch ran since the last step, so these are
    /// no update.
    pub(super) fn prelude_own(&self, signal: &PhaseSignal) -> bool {
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
        optimizer_scope && self.files.prelude.is_some() && !self.step_running()
    }

    pub(super) fn is_file_signal(signal: &PhaseSignal) -> bool {
        matches!(
            signal,
            PhaseSignal::CheckpointWriteStart
                | PhaseSignal::CheckpointWriteEnd
                | PhaseSignal::CheckpointReadStart { .. }
                | PhaseSignal::CheckpointReadEnd
        )
    }

    /// A save's or load's preparation was entered (`at`: its first sample; `since`: the
    /// sample before, see `earliest_call_start`): the next checkpoint (load) starts there
    /// unless another phase begins first.
    pub fn save_prelude(&mut self, at: u64, since: Option<u64>) {
        let earliest = earliest_call_start(at, since);
        // Not before the last phase ended (a complete step ends where its optimizer did).
        let step_end = self.training.step.as_ref().and_then(|s| s.optimizer_end);
        let floor = self.training.boundary.max(step_end).unwrap_or(0);
        self.files.prelude.get_or_insert(Prelude {
            start: earliest.max(floor),
            created: 0,
            read: 0,
        });
    }

    /// A writer (reader) opened at `at`; `own_file`: a reader that opens its file itself.
    pub(super) fn file_open(
        &mut self,
        ctx: &mut ProcessContext<'_>,
        at: u64,
        group: SpanGroup,
        own_file: bool,
    ) {
        self.end_finished_evaluation(ctx, at);
        if let Some(file) = self.file_slot(group).as_mut() {
            file.open_files += 1;
            file.files += 1;
            file.own_files += u32::from(own_file);
            return;
        }
        let span = self.open_file_span(ctx, at, group);
        let created = self.take_prelude_files(group);
        *self.file_slot(group) = Some(FileSpan {
            created,
            own_files: u32::from(own_file),
            ..FileSpan::opened_by_writer(span)
        });
    }

    /// Opens the span of a checkpoint (load) beginning at `at`: inside a running step (or
    /// a configured rule's span, or an evaluation) it belongs there; otherwise it is a
    /// phase of its own.
    pub(super) fn open_file_span(
        &mut self,
        ctx: &mut ProcessContext<'_>,
        at: u64,
        group: SpanGroup,
    ) -> SpanId {
        let running_step = self.step_running();
        let parent =
            if running_step || !self.rule_spans.is_empty() || self.evaluation.evaluate.is_some() {
                self.innermost(ctx)
            } else {
                self.finish_step(ctx);
                ctx.end_model_init(at);
                // A save (load) of its own: batches fetched before it start no evaluation
                // after it.
                self.evaluation.fetch_since_training = None;
                ctx.job
            };
        let name = match group {
            SpanGroup::Checkpoint => names::CHECKPOINT,
            _ => names::LOAD_CHECKPOINT,
        };
        let start = self
            .files
            .prelude
            .map_or(at, |prelude| prelude.start.min(at));
        self.open_phase(ctx, name, group, parent, start)
    }

    /// The files the preparation of a checkpoint (load) opening now saw before it: they
    /// are its. The preparation is over.
    pub(super) fn take_prelude_files(&mut self, group: SpanGroup) -> u32 {
        match (self.files.prelude.take(), group) {
            (None, _) => 0,
            (Some(prelude), SpanGroup::Checkpoint) => prelude.created,
            (Some(prelude), _) => prelude.read,
        }
    }

    /// A framework's save (load) function (`profiles::FRAMEWORK_SAVE_RULES`) was entered:
    /// `at` is the first Python sample showing it, `since` the thread's sample before
    /// (`earliest_call_start`). Its span starts where the call can have begun at the
    /// earliest (not before the last phase's end), or an open one (its file already
    /// began: samples arrive a sample later than native signals) is moved there; files
    /// and calls until it returns are its.
    pub fn save_call_enter(
        &mut self,
        ctx: &mut ProcessContext<'_>,
        (at, since): (u64, Option<u64>),
        group: SpanGroup,
        attributes: Attributes,
    ) {
        let earliest = earliest_call_start(at, since);
        if let Some(file) = self.file_slot(group).as_mut() {
            file.calls += 1;
            let span = file.span;
            let start = earliest.max(self.training.boundary.unwrap_or(0));
            if ctx.arena.move_start(span, start)
                && let Some(interval) = self.recent.iter_mut().rev().find(|i| i.span == span)
            {
                interval.start = interval.start.min(start);
            }
            return;
        }
        self.end_finished_evaluation(ctx, at);
        self.finish_step(ctx);
        let start = earliest.max(self.training.boundary.unwrap_or(0)).min(at);
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
            SpanGroup::Checkpoint => self.files.checkpoint.as_ref(),
            _ => self.files.load_checkpoint.as_ref(),
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
    pub(super) fn file_slot(&mut self, group: SpanGroup) -> &mut Option<FileSpan> {
        match group {
            SpanGroup::Checkpoint => &mut self.files.checkpoint,
            _ => &mut self.files.load_checkpoint,
        }
    }

    pub(super) fn file_close(slot: &mut Option<FileSpan>, at: u64) {
        if let Some(file) = slot.as_mut().filter(|f| f.open_files > 0) {
            file.open_files -= 1;
            file.last_end = Some(at);
            file.created_since_writer = 0;
        }
    }

    /// Files written (read) back to back are one checkpoint: the span ends at the last
    /// file's end once anything else happens (`at`). A framework call still open then has
    /// returned (its sample is yet to come): it ends at `at`.
    pub(super) fn settle_files(&mut self, ctx: &mut ProcessContext<'_>, group: SpanGroup, at: u64) {
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
    pub(super) fn close_file_span(
        &mut self,
        ctx: &mut ProcessContext<'_>,
        file: &FileSpan,
        end: u64,
    ) -> u64 {
        // Its end may come from a sample (a framework call's return, its thread's last
        // sample): the calls made inside it, DCP's last metadata broadcast, still count.
        let calls_end = ctx.arena.calls_end(file.span);
        let end = end.max(calls_end);
        if Self::loaded_nothing(ctx, file, calls_end, end) {
            ctx.arena.discard(file.span);
            return end;
        }
        ctx.arena
            .set_attr(file.span, semconv::NEMO_CHECKPOINT_FILES, file.file_count());
        self.close_phase(ctx, file.span, end);
        // A checkpoint inside a step or an evaluation is not a boundary between phases.
        if self.training.step.is_none() && self.evaluation.evaluate.is_none() {
            self.training.boundary = Some(end);
        }
        end
    }

    /// Whether `file`, ending at `end`, is a framework load call that loaded nothing: no
    /// file read, no reader, no call, over in less than [`NO_LOAD_WITHIN`]. Lightning's
    /// `fit` calls its restore without a checkpoint, which returns at once; a sample can
    /// land in it. A load from remote storage takes longer, or calls a peer.
    fn loaded_nothing(ctx: &ProcessContext<'_>, file: &FileSpan, calls_end: u64, end: u64) -> bool {
        file.saw_nothing(calls_end)
            && ctx
                .arena
                .open_span(file.span)
                .is_some_and(|(group, start)| {
                    group == SpanGroup::LoadCheckpoint && end.saturating_sub(start) < NO_LOAD_WITHIN
                })
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
}

/// Where a call first seen by the Python sample at `at` can have begun at the earliest:
/// `since`, which the tracker gives for every sampled call (the thread's sample before,
/// or one interval of its process's sampling rate before `at`: `python::tracker`); a call
/// given none began within the followed rate's interval before `at`. The samples of a
/// thread that runs all along can be more than an interval apart: the two CPUs' clocks
/// tick out of step, and a virtual CPU can be held back by its host.
fn earliest_call_start(at: u64, since: Option<u64>) -> u64 {
    since
        .filter(|since| *since < at)
        .unwrap_or_else(|| at.saturating_sub(SAMPLE_INTERVAL.as_nanos() as u64))
}
