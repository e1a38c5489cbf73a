//! The span builder: an [`EventSink`] that keeps, per traced process, the `train.job`
//! root, a phase machine per thread, and turns calls (collectives, sync waits) into
//! child spans of the phase they happen in.
use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
};

use super::{
    AttrValue, Attributes, SpanEvent, SpanExporter, SpanId, SpanRecord,
    arena::{IdSource, Placement, SpanArena},
    collectives::{CollectiveComm, Collectives},
    monotonic_now_ns, names,
    phases::{ProcessContext, ThreadPhases},
    straggler_cause::{PhaseCall, PhaseHistory},
};
use crate::{
    config::{ArgType, DCP_ASYNC_SAVE, DCP_GET_STATE_DICT, NativeRule, ProbeRules},
    events::{CallTiming, ProbeEvent},
    groups::{SpanGroup, SpanGroups},
    hangs::{HangReport, Resolved},
    semconv,
    sink::{EventSink, ProcessEnd},
    target::{ExitStatus, ProcessInfo},
};

/// A communicator as `ncclCommInitRank` described it.
#[derive(Clone, Copy, Debug)]
struct Communicator {
    rank: i32,
    nranks: i32,
    id_hash: u64,
}

struct ProcessSpans {
    info: ProcessInfo,
    start_ns: u64,
    /// The process has shown training activity: its spans go to the exporter. Until
    /// then they are held, and dropped if it exits without any (a launcher, a shell).
    exporting: bool,
    held: Vec<SpanRecord>,
    arena: SpanArena,
    job: SpanId,
    model_init: Option<SpanId>,
    traced_from_start: bool,
    threads: HashMap<u32, ThreadPhases>,
    /// The thread running the training loop (first with phase activity): calls from
    /// threads without phases of their own are shown under its phases.
    loop_thread: Option<u32>,
    communicators: HashMap<u64, Communicator>,
    /// Groups configured probe rules have taken over from torch's signals (from the
    /// first call of such a rule on).
    ruled: BTreeSet<SpanGroup>,
    /// `dl.iteration` of the next step a rule opens.
    rule_iteration: u64,
    /// Calls made while their thread's phase was not known yet (see
    /// `ThreadPhases::current_phase`), by span id; placed by time once it is.
    unplaced: HashMap<SpanId, HeldCall>,
    /// Released spans of such calls, waiting for their placement.
    waiting: Vec<SpanRecord>,
    /// Placements decided for calls the collective tracker still holds.
    placed: HashMap<SpanId, Placement>,
    /// The earliest start among `unplaced` (`u64::MAX` when none): the per-call bound
    /// check reads this instead of walking every held call.
    oldest_held_ns: u64,
    /// A DCP `async_save` whose writing goes on in a background thread.
    async_save: Option<AsyncSave>,
}

/// An `async_save` whose writer was never seen (its `save` too short to be sampled, or
/// it failed to start): the span is what the call itself did.
fn close_unwritten_async_save(ctx: &mut ProcessContext<'_>, save: AsyncSave) {
    if save.writer.is_some() {
        return;
    }
    let (files, created) = save.caller_files.unwrap_or_default();
    let count = if created > 0 { created } else { files };
    ctx.arena
        .set_attr(save.span, semconv::NEMO_CHECKPOINT_FILES, count);
    ctx.arena.close(save.span, save.caller_end, false, ctx.out);
}

/// What a framework's save (load) function is to the span it bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FrameworkCall {
    /// The save (load) itself: the span lasts while it runs.
    Save,
    /// DCP's `async_save`: the span lasts until the background `save` it starts returns.
    AsyncSave,
    /// DCP's `get_state_dict`: the save or load that follows at once starts with it.
    Prelude,
}

/// A checkpoint begun by DCP's `async_save` on one thread and written by the `save` it
/// starts on another: one span, ended when the later of the two calls returns.
#[derive(Clone, Copy, Debug)]
struct AsyncSave {
    span: SpanId,
    caller: u32,
    /// `async_save` has returned, with what it counted (`FileSpan::counts`) and where
    /// it ended.
    caller_files: Option<(u32, u32)>,
    caller_end: u64,
    /// The background thread carrying the span on, once its `save` began.
    writer: Option<u32>,
    /// The background `save` returned (at, its counts) before `async_save` did.
    written: Option<(u64, (u32, u32))>,
}

/// A call whose phase was not known when it arrived.
#[derive(Clone, Copy, Debug)]
struct HeldCall {
    /// The thread whose phases place it (its own, or the loop thread's).
    owner: u32,
    start_ns: u64,
}

/// Calls held for placement per process, at most: past it the oldest are placed where
/// they would be shown now (memory stays bounded whatever the job does).
const MAX_HELD_CALLS: usize = 4096;
/// A call held this long is placed with what is known (a phase that never resolves:
/// a step whose backward never comes).
const HELD_CALL_TIMEOUT_NS: u64 = 30_000_000_000;

/// Routes a process's finished spans: to the exporter once it is exporting, else held.
struct ProcessOutput<'a> {
    exporting: bool,
    held: &'a mut Vec<SpanRecord>,
    out: &'a mut dyn SpanExporter,
}

impl SpanExporter for ProcessOutput<'_> {
    fn export(&mut self, span: SpanRecord) {
        if self.exporting {
            self.out.export(span);
        } else {
            self.held.push(span);
        }
    }
}

impl ProcessSpans {
    /// Once training shows, announce the job and release what was held, in order.
    fn export_if_training(&mut self, out: &mut dyn SpanExporter, groups: &SpanGroups) {
        if self.exporting || !self.arena.training_seen() {
            return;
        }
        self.exporting = true;
        let job = groups.contains(SpanGroup::Job).then_some(self.job);
        out.process_started(&self.info, job, self.start_ns);
        for span in self.held.drain(..) {
            out.export(span);
        }
    }
}

pub struct SpanBuilder<E: SpanExporter> {
    groups: SpanGroups,
    /// Configured probe rules: what their calls become.
    rules: Arc<ProbeRules>,
    ids: IdSource,
    processes: HashMap<u32, ProcessSpans>,
    /// Collective spans held until their completion and the other ranks are known.
    collectives: Collectives,
    /// Per thread, the Python function that made its next native call: (the call's
    /// start, function, file).
    python_callers: HashMap<(u32, u32), (u64, String, String)>,
    /// Calls in flight when a hang was found, by (process, thread, entry): their spans
    /// get a `lens_probe.hang` event when they return.
    hung_calls: HashMap<(u32, u32, u64), SpanEvent>,
    /// Per thread, its open torch scopes (whether each is a batch fetch, and its start):
    /// the fetches' times go to the stragglers' phase history.
    scope_stacks: HashMap<(u32, u32), Vec<(bool, u64)>>,
    exporter: Tap<E>,
}

/// The builder's exporter, with where each process's steps spent their time read off
/// the spans on their way out (for the stragglers' causes).
struct Tap<E> {
    inner: E,
    history: PhaseHistory,
}

impl<E: SpanExporter> SpanExporter for Tap<E> {
    fn process_started(&mut self, info: &ProcessInfo, job: Option<SpanId>, start_ns: u64) {
        self.inner.process_started(info, job, start_ns);
    }
    fn export(&mut self, span: SpanRecord) {
        self.history.record(&span);
        self.inner.export(span);
    }
    fn process_calls(
        &mut self,
        pid: u32,
        calls: &std::collections::BTreeMap<lens_common::ProbeId, u64>,
    ) {
        self.inner.process_calls(pid, calls);
    }
    fn launches_sampled(&mut self, pid: u32) {
        self.inner.launches_sampled(pid);
    }
    fn process_ended(&mut self, pid: u32) {
        self.history.forget(pid);
        self.inner.process_ended(pid);
    }
}

impl<E: SpanExporter> SpanBuilder<E> {
    pub fn new(groups: SpanGroups, exporter: E) -> SpanBuilder<E> {
        SpanBuilder {
            groups,
            rules: Arc::default(),
            ids: IdSource::new(),
            processes: HashMap::new(),
            collectives: Collectives::default(),
            python_callers: HashMap::new(),
            hung_calls: HashMap::new(),
            scope_stacks: HashMap::new(),
            exporter: Tap {
                inner: exporter,
                history: PhaseHistory::default(),
            },
        }
    }

    /// Calls of the functions these rules name become spans (see `on_rule_call`).
    pub fn with_rules(mut self, rules: Arc<ProbeRules>) -> SpanBuilder<E> {
        self.rules = rules;
        self
    }

    pub fn exporter(&self) -> &E {
        &self.exporter.inner
    }

    pub fn into_exporter(self) -> E {
        self.exporter.inner
    }

    /// Per collective operation, which traced rank arrived last how often.
    pub fn stragglers(
        &self,
    ) -> &std::collections::BTreeMap<crate::events::CollectiveOp, super::stragglers::OpStragglers>
    {
        self.collectives.stragglers()
    }

    /// `code.function` and `code.filepath` of the Python function that made the call
    /// `timing` describes, when the session named it.
    fn python_caller_of(&mut self, timing: &CallTiming) -> Attributes {
        match self.python_callers.remove(&(timing.tgid, timing.tid)) {
            Some((at_ns, function, file)) if at_ns == timing.start_ns => vec![
                (semconv::CODE_FUNCTION, function.into()),
                (semconv::CODE_FILEPATH, file.into()),
            ],
            _ => Attributes::new(),
        }
    }

    /// Sends spans the collective tracker released, each through its process (held
    /// there while the process has not shown training).
    fn send_released(&mut self, spans: Vec<SpanRecord>) {
        for mut span in spans {
            let Some(process) = self.processes.get_mut(&span.pid) else {
                continue;
            };
            if process.unplaced.contains_key(&span.id) {
                process.waiting.push(span);
                continue;
            }
            if let Some(placement) = process.placed.remove(&span.id) {
                placement.apply(&mut span);
            }
            let mut output = ProcessOutput {
                exporting: process.exporting,
                held: &mut process.held,
                out: &mut self.exporter,
            };
            output.export(span);
            process.export_if_training(&mut self.exporter, &self.groups);
        }
    }

    /// Places the held calls of `pid` that `which` selects (owner thread, start), each in
    /// the phase of its owner thread that holds its start, else where it was shown when
    /// it arrived; those already released go out.
    fn place_held(&mut self, pid: u32, which: impl Fn(u32, u64) -> bool) {
        let Some(process) = self.processes.get_mut(&pid) else {
            return;
        };
        let chosen: Vec<(SpanId, HeldCall)> = process
            .unplaced
            .iter()
            .filter(|(_, call)| which(call.owner, call.start_ns))
            .map(|(id, call)| (*id, *call))
            .collect();
        if chosen.is_empty() {
            return;
        }
        for (id, call) in &chosen {
            process.unplaced.remove(id);
            let placement = process
                .threads
                .get(&call.owner)
                .and_then(|thread| thread.phase_at(call.start_ns));
            if let Some(placement) = placement {
                process.placed.insert(*id, placement);
            }
        }
        process.oldest_held_ns = process
            .unplaced
            .values()
            .map(|call| call.start_ns)
            .min()
            .unwrap_or(u64::MAX);
        let (ready, still): (Vec<SpanRecord>, Vec<SpanRecord>) = process
            .waiting
            .drain(..)
            .partition(|span| !process.unplaced.contains_key(&span.id));
        process.waiting = still;
        self.send_released(ready);
    }

    /// Past [`MAX_HELD_CALLS`] held in `pid`, the oldest quarter is placed now; past
    /// [`HELD_CALL_TIMEOUT_NS`], any.
    fn bound_held(&mut self, pid: u32, now_ns: u64) {
        let Some(process) = self.processes.get(&pid) else {
            return;
        };
        let mut threshold = now_ns.saturating_sub(HELD_CALL_TIMEOUT_NS);
        if process.unplaced.len() > MAX_HELD_CALLS {
            let mut starts: Vec<u64> = process.unplaced.values().map(|c| c.start_ns).collect();
            starts.sort_unstable();
            threshold = threshold.max(starts[starts.len() / 4]);
        }
        if process.oldest_held_ns <= threshold {
            self.place_held(pid, |_, start| start <= threshold);
        }
    }

    /// The held calls of `tid` (as owner) go to their phases once its phase is known.
    fn place_when_known(&mut self, pid: u32, tid: u32) {
        let known = self.processes.get_mut(&pid).is_some_and(|process| {
            if process.unplaced.is_empty() {
                // Nothing held: the phase signals' common case costs nothing more.
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
                ruled: &process.ruled,
            };
            thread.current_phase(&ctx, None).is_some()
        });
        if known {
            self.place_held(pid, |owner, _| owner == tid);
        }
    }

    /// Starts the job of `info` at `start_ns` (the library entry point; the sink uses now).
    pub fn start_process(&mut self, info: &ProcessInfo, start_ns: u64) {
        let mut arena = SpanArena::new(info.pid, self.groups.clone());
        let job = arena.open(
            &mut self.ids,
            names::JOB,
            SpanGroup::Job,
            None,
            info.pid,
            start_ns,
        );
        arena.set_attr(job, semconv::PROCESS_PID, info.pid);
        if let Some(rank) = info.rank {
            arena.set_attr(job, semconv::DL_RANK, rank.rank);
            if let Some(world_size) = rank.world_size {
                arena.set_attr(job, semconv::DL_WORLD_SIZE, world_size);
            }
            if let Some(local_rank) = rank.local_rank {
                arena.set_attr(job, semconv::DL_LOCAL_RANK, local_rank);
            }
        }
        let model_init = if info.traced_from_start {
            Some(arena.open(
                &mut self.ids,
                names::MODEL_INIT,
                SpanGroup::ModelInit,
                Some(job),
                info.pid,
                start_ns,
            ))
        } else {
            arena.set_attr(job, semconv::NEMO_ATTACHED_MID_RUN, true);
            None
        };
        self.processes.insert(
            info.pid,
            ProcessSpans {
                info: info.clone(),
                start_ns,
                exporting: false,
                held: Vec::new(),
                arena,
                job,
                model_init,
                traced_from_start: info.traced_from_start,
                threads: HashMap::new(),
                loop_thread: None,
                communicators: HashMap::new(),
                ruled: BTreeSet::new(),
                rule_iteration: 0,
                unplaced: HashMap::new(),
                waiting: Vec::new(),
                placed: HashMap::new(),
                oldest_held_ns: u64::MAX,
                async_save: None,
            },
        );
    }

    /// Ends the job of `pid` at `end_ns`: open spans end there, marked truncated.
    pub fn end_process(&mut self, pid: u32, exit: Option<ExitStatus>, end_ns: u64) {
        self.end_process_with_calls(pid, exit, end_ns, &Default::default());
    }

    /// [`Self::end_process`], with the kernel's call counters of the process.
    pub fn end_process_with_calls(
        &mut self,
        pid: u32,
        exit: Option<ExitStatus>,
        end_ns: u64,
        calls: &std::collections::BTreeMap<lens_common::ProbeId, u64>,
    ) {
        // Its collectives go out with what is known before its spans close.
        let released = self.collectives.process_ended(pid, &self.exporter.history);
        self.send_released(released);
        self.place_held(pid, |_, _| true);
        self.scope_stacks.retain(|(p, _), _| *p != pid);
        let Some(mut process) = self.processes.remove(&pid) else {
            return;
        };
        // The kernel's final launch total closes the last phases' counts.
        if calls.keys().any(|probe| probe.is_launch()) {
            let launches = calls
                .iter()
                .filter(|(probe, _)| probe.is_launch())
                .map(|(_, count)| count)
                .sum();
            process
                .arena
                .launches_mut()
                .record_mark(end_ns, launches, super::launches::LAST_EPOCH);
        }
        let ProcessSpans {
            arena,
            job,
            model_init,
            threads,
            exporting,
            held,
            ruled,
            async_save,
            ..
        } = &mut process;
        if !*exporting && !arena.training_seen() {
            log::info!(
                "pid {pid} ({}) ended without training activity: no spans",
                process.info.name
            );
            return;
        }
        let mut output = ProcessOutput {
            exporting: *exporting,
            held,
            out: &mut self.exporter,
        };
        let mut ctx = ProcessContext {
            arena,
            ids: &mut self.ids,
            out: &mut output,
            job: *job,
            model_init,
            ruled,
        };
        if let Some(save) = async_save.take()
            && save.writer.is_none()
        {
            close_unwritten_async_save(&mut ctx, save);
        }
        let mut tids: Vec<u32> = threads.keys().copied().collect();
        tids.sort_unstable();
        for tid in tids {
            if let Some(thread) = threads.get_mut(&tid) {
                thread.finish(&mut ctx, end_ns);
            }
        }
        if let Some(id) = ctx.model_init.take() {
            ctx.arena.close(id, end_ns, true, ctx.out);
        }
        match exit {
            Some(ExitStatus::Exited(code)) => {
                ctx.arena.set_attr(*job, semconv::PROCESS_EXIT_CODE, code);
                if code != 0 {
                    ctx.arena
                        .set_error(*job, format!("exited with code {code}"));
                }
            }
            Some(ExitStatus::Signaled(signal)) => {
                ctx.arena
                    .set_error(*job, format!("killed by signal {signal}"));
            }
            Some(ExitStatus::Unknown) => {}
            // Tracing stopped while the job runs on: the job span is cut short.
            None => ctx.arena.set_attr(*job, semconv::NEMO_SPAN_TRUNCATED, true),
        }
        ctx.arena.close(*job, end_ns, false, ctx.out);
        process.export_if_training(&mut self.exporter, &self.groups);
        self.exporter.process_calls(pid, calls);
        self.exporter.process_ended(pid);
    }

    /// `pid` runs a new program: a job that has not trained yet starts over as that
    /// program (a launcher that execs the trainer, a worker forked by a launcher).
    /// `info.pid` replaced its program at `at_ns`. The old program's job ends there (what
    /// was open is truncated: it will never close) and the new program's begins.
    pub fn exec_process(&mut self, info: &ProcessInfo, at_ns: u64) {
        if self.processes.get(&info.pid).is_some_and(|p| p.exporting) {
            self.end_process(info.pid, None, at_ns);
        }
        self.start_process(info, at_ns);
    }

    /// Phase state kept for `pid`'s threads (bounded by the threads with open phases).
    pub fn thread_states(&self, pid: u32) -> usize {
        self.processes.get(&pid).map_or(0, |p| p.threads.len())
    }

    fn on_phase(
        &mut self,
        tgid: u32,
        tid: u32,
        at: u64,
        launches: u64,
        epoch: u64,
        signal: &crate::events::PhaseSignal,
    ) {
        let Some(process) = self.processes.get_mut(&tgid) else {
            return;
        };
        process
            .arena
            .launches_mut()
            .record_mark(at, launches, epoch);
        match signal {
            crate::events::PhaseSignal::ScopeEnter { scope, .. } => {
                let stack = self.scope_stacks.entry((tgid, tid)).or_default();
                // Bounded: a scope whose exit is never seen (an exception) must not grow it.
                if stack.len() < 256 {
                    stack.push((*scope == crate::events::TorchScope::DataLoaderNext, at));
                }
            }
            crate::events::PhaseSignal::ScopeExit => {
                if let Some((true, start)) =
                    self.scope_stacks.get_mut(&(tgid, tid)).and_then(Vec::pop)
                {
                    self.exporter
                        .history
                        .record_call(tgid, PhaseCall::Fetch, start, at);
                }
            }
            _ => {}
        }
        let traced_from_start = process.traced_from_start;
        let thread = process
            .threads
            .entry(tid)
            .or_insert_with(|| ThreadPhases::new(tid, traced_from_start));
        let mut output = ProcessOutput {
            exporting: process.exporting,
            held: &mut process.held,
            out: &mut self.exporter,
        };
        let mut ctx = ProcessContext {
            arena: &mut process.arena,
            ids: &mut self.ids,
            out: &mut output,
            job: process.job,
            model_init: &mut process.model_init,
            ruled: &process.ruled,
        };
        thread.on_signal(&mut ctx, at, signal);
        if process.loop_thread.is_none() && thread.is_active() {
            process.loop_thread = Some(tid);
        }
        // Threads come and go (workers, per-step helpers): keep state only for those
        // with something open.
        let idle = thread.is_idle() && process.loop_thread != Some(tid);
        process.export_if_training(&mut self.exporter, &self.groups);
        self.place_when_known(tgid, tid);
        if idle && let Some(process) = self.processes.get_mut(&tgid) {
            process.threads.remove(&tid);
        }
    }

    /// Entry or return of a function a configured rule names: a span of the rule's
    /// group opens or ends on that thread (`ThreadPhases::rule_enter`). A rule of group
    /// step, evaluate, checkpoint or load_checkpoint takes that group over in the process
    /// from its first call: torch's signals for it are ignored from then on, and a step
    /// rule's spans count `dl.iteration`.
    fn on_rule_call(&mut self, event: &ProbeEvent) {
        let ProbeEvent::RuleCall {
            tgid,
            tid,
            at_ns,
            launches,
            epoch,
            rule,
            at_return,
            args,
            text,
            ..
        } = event
        else {
            return;
        };
        // What the rule makes of the call: native rules read arguments; a Python
        // rule's call carries its function's file.
        let (index, group, name, attributes) = if let Some(rule) = self.rules.native_rule(*rule) {
            let attributes = (!at_return).then(|| rule_attributes(rule, args, text.as_deref()));
            (rule.index, rule.group, rule.name, attributes)
        } else if let Some(rule) = self.rules.python_rule(*rule)
            && rule.framework
        {
            let name = (rule.module.as_str(), rule.qualname.as_str());
            let function = format!("{}:{}", rule.module, rule.qualname);
            let kind = if name == DCP_ASYNC_SAVE {
                FrameworkCall::AsyncSave
            } else if name == DCP_GET_STATE_DICT {
                FrameworkCall::Prelude
            } else {
                FrameworkCall::Save
            };
            self.on_framework_call(event, rule.group, function, kind);
            return;
        } else if let Some(rule) = self.rules.python_rule(*rule) {
            let attributes = (!at_return).then(|| {
                let mut attributes: Attributes =
                    vec![(semconv::CODE_FUNCTION, rule.qualname.clone().into())];
                if let Some(file) = text {
                    attributes.push((semconv::CODE_FILEPATH, file.clone().into()));
                }
                attributes
            });
            (rule.index, rule.group, rule.name, attributes)
        } else {
            return;
        };
        let Some(process) = self.processes.get_mut(tgid) else {
            return;
        };
        let (at, tid) = (*at_ns, *tid);
        process
            .arena
            .launches_mut()
            .record_mark(at, *launches, *epoch);
        let taken_over = matches!(
            group,
            SpanGroup::Step
                | SpanGroup::Evaluate
                | SpanGroup::Checkpoint
                | SpanGroup::LoadCheckpoint
        );
        if !at_return && taken_over {
            process.ruled.insert(group);
        }
        let iteration = (!at_return && group == SpanGroup::Step).then(|| {
            process.rule_iteration += 1;
            process.rule_iteration - 1
        });
        let traced_from_start = process.traced_from_start;
        let thread = process
            .threads
            .entry(tid)
            .or_insert_with(|| ThreadPhases::new(tid, traced_from_start));
        let mut output = ProcessOutput {
            exporting: process.exporting,
            held: &mut process.held,
            out: &mut self.exporter,
        };
        let mut ctx = ProcessContext {
            arena: &mut process.arena,
            ids: &mut self.ids,
            out: &mut output,
            job: process.job,
            model_init: &mut process.model_init,
            ruled: &process.ruled,
        };
        match attributes {
            None => thread.rule_return(&mut ctx, at, index),
            Some(attributes) => {
                thread.rule_enter(&mut ctx, at, index, name, group, attributes, iteration)
            }
        }
        if process.loop_thread.is_none() && thread.is_active() {
            process.loop_thread = Some(tid);
        }
        let idle = thread.is_idle() && process.loop_thread != Some(tid);
        process.export_if_training(&mut self.exporter, &self.groups);
        self.place_when_known(*tgid, tid);
        if idle && let Some(process) = self.processes.get_mut(tgid) {
            process.threads.remove(&tid);
        }
    }

    /// Entry or return of a framework's save (load) function (sampled): it bounds the
    /// checkpoint (load) span of its thread (`ThreadPhases::save_call_enter`). DCP's
    /// `async_save` hands its span to the `save` it starts on a background thread.
    fn on_framework_call(
        &mut self,
        event: &ProbeEvent,
        group: SpanGroup,
        function: String,
        kind: FrameworkCall,
    ) {
        let is_async = kind == FrameworkCall::AsyncSave;
        let ProbeEvent::RuleCall {
            tgid,
            tid,
            at_ns,
            launches,
            epoch,
            at_return,
            ..
        } = event
        else {
            return;
        };
        let Some(process) = self.processes.get_mut(tgid) else {
            return;
        };
        let (at, tid, at_return) = (*at_ns, *tid, *at_return);
        process
            .arena
            .launches_mut()
            .record_mark(at, *launches, *epoch);
        let traced_from_start = process.traced_from_start;
        let job = process.job;
        let mut output = ProcessOutput {
            exporting: process.exporting,
            held: &mut process.held,
            out: &mut self.exporter,
        };
        let mut ctx = ProcessContext {
            arena: &mut process.arena,
            ids: &mut self.ids,
            out: &mut output,
            job,
            model_init: &mut process.model_init,
            ruled: &process.ruled,
        };
        let thread = process
            .threads
            .entry(tid)
            .or_insert_with(|| ThreadPhases::new(tid, traced_from_start));
        let pending = process.async_save;
        let (mut written_to_caller, mut handed_off, mut closed_for_caller) = (None, None, None);
        match (at_return, pending) {
            (false, _) if kind == FrameworkCall::Prelude => thread.save_prelude(at),
            (true, _) if kind == FrameworkCall::Prelude => {}
            // The background writer of an `async_save` begins: it carries the span on.
            (false, Some(save))
                if group == SpanGroup::Checkpoint
                    && save.writer.is_none()
                    && save.caller != tid =>
            {
                thread.adopt_file_span(save.span, group);
                process.async_save = Some(AsyncSave {
                    writer: Some(tid),
                    ..save
                });
                handed_off = Some((save.caller, save.span));
            }
            // The writer's `save` seen again after a sample showed it gone (the frame
            // caught mid-update as it returns): still the same writing, files and all.
            (false, Some(save)) if group == SpanGroup::Checkpoint && save.writer == Some(tid) => {
                thread.adopt_file_span(save.span, group);
                if let Some((_, files)) = save.written {
                    thread.add_files(group, files);
                }
                process.async_save = Some(AsyncSave {
                    written: None,
                    ..save
                });
                handed_off = Some((save.caller, save.span));
            }
            (false, _) => {
                let attributes = vec![(semconv::CODE_FUNCTION, function.into())];
                thread.save_call_enter(&mut ctx, at, group, attributes);
                if is_async && let Some(span) = thread.file_span(group) {
                    // One still waiting for a writer never got one: it was what it did.
                    if let Some(orphan) = process.async_save.take() {
                        close_unwritten_async_save(&mut ctx, orphan);
                    }
                    process.async_save = Some(AsyncSave {
                        span,
                        caller: tid,
                        caller_files: None,
                        caller_end: at,
                        writer: None,
                        written: None,
                    });
                }
            }
            (true, Some(save)) if save.writer == Some(tid) => {
                match save.caller_files {
                    // `async_save` returned first: the span ends with the writer (the
                    // caller's return is seen late when it waited for it, blocked).
                    Some(files) => {
                        if let Some(end) = thread.end_adopted(&mut ctx, at, group, files) {
                            closed_for_caller = Some((save.caller, save.span, end));
                        }
                        process.async_save = None;
                    }
                    None => {
                        let files = thread.take_file_span(group).map_or((0, 0), |f| f.counts());
                        process.async_save = Some(AsyncSave {
                            written: Some((at, files)),
                            ..save
                        });
                        // Credited to the caller's span at once: the caller's next phase
                        // may end it before a sample shows `async_save` returned (its
                        // thread sat blocked in `future.result()`).
                        written_to_caller = Some((save.caller, save.span, files));
                    }
                }
            }
            (true, Some(save)) if save.caller == tid && is_async => {
                thread.save_call_return(at, group);
                match (save.writer, save.written) {
                    // The writer finished first: the span is the caller's again.
                    (_, Some((end, files))) => {
                        thread.save_call_return(end, group);
                        thread.add_files(group, files);
                        process.async_save = None;
                    }
                    // The writer goes on (or has not been sampled yet): it ends the span.
                    (_, None) => {
                        let files = thread.take_file_span(group).map_or((0, 0), |f| f.counts());
                        process.async_save = Some(AsyncSave {
                            caller_files: Some(files),
                            caller_end: at,
                            ..save
                        });
                    }
                }
            }
            (true, _) => thread.save_call_return(at, group),
        }
        if process.loop_thread.is_none() && thread.is_active() {
            process.loop_thread = Some(tid);
        }
        if let Some((caller, span)) = handed_off
            && let Some(caller) = process.threads.get_mut(&caller)
        {
            caller.hand_off(span, group);
        }
        if let Some((caller, span, end)) = closed_for_caller
            && let Some(caller) = process.threads.get_mut(&caller)
        {
            caller.closed_elsewhere(span, end);
        }
        if let Some((caller, span, files)) = written_to_caller
            && process
                .threads
                .get_mut(&caller)
                .is_some_and(|caller| caller.add_files_to(span, group, files))
            && let Some(save) = process.async_save.as_mut()
        {
            save.written = save.written.map(|(end, _)| (end, (0, 0)));
        }
        process.export_if_training(&mut self.exporter, &self.groups);
        self.place_when_known(*tgid, tid);
    }

    fn on_call(
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
    fn call_record(
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
            exporting: process.exporting,
            held: &mut process.held,
            out: &mut self.exporter,
        };
        let ctx = ProcessContext {
            arena: &mut process.arena,
            ids: &mut self.ids,
            out: &mut output,
            job: process.job,
            model_init: &mut process.model_init,
            ruled: &process.ruled,
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
            process.unplaced.insert(
                record.id,
                HeldCall {
                    owner,
                    start_ns: timing.start_ns,
                },
            );
            process.oldest_held_ns = process.oldest_held_ns.min(timing.start_ns);
        }
        Some(record)
    }
}

impl<E: SpanExporter> EventSink for SpanBuilder<E> {
    fn on_process_start(&mut self, process: &ProcessInfo) {
        self.start_process(process, monotonic_now_ns());
    }

    fn on_process_exec(&mut self, process: &ProcessInfo) {
        self.exec_process(process, monotonic_now_ns());
    }

    fn on_event(&mut self, event: &ProbeEvent) {
        // Where each step's time goes, for the stragglers' causes: calls as they return.
        let call = match event {
            ProbeEvent::Collective { timing, .. } | ProbeEvent::GlooCall { timing, .. } => {
                Some((timing, PhaseCall::Collective))
            }
            ProbeEvent::SyncWait { timing, .. } => Some((timing, PhaseCall::Sync)),
            _ => None,
        };
        if let Some((timing, call)) = call {
            self.exporter
                .history
                .record_call(timing.tgid, call, timing.start_ns, timing.end_ns);
        }
        match event {
            ProbeEvent::Phase {
                tgid,
                tid,
                at_ns,
                launches,
                epoch,
                signal,
            } => self.on_phase(*tgid, *tid, *at_ns, *launches, *epoch, signal),
            ProbeEvent::Collective {
                timing,
                op,
                count,
                datatype,
                raw_datatype,
                redop,
                peer,
                comm,
                stream,
                result,
                ..
            } => {
                let mut attributes: Attributes = vec![
                    (semconv::DL_COLLECTIVE_BACKEND, "nccl".into()),
                    (semconv::DL_COLLECTIVE_OP, op.name().into()),
                    (semconv::DL_COLLECTIVE_COUNT, (*count).into()),
                    (
                        semconv::DL_COLLECTIVE_DTYPE,
                        datatype.map_or_else(
                            || AttrValue::from(format!("dtype({raw_datatype})")),
                            |d| d.name().into(),
                        ),
                    ),
                ];
                if let Some(bytes) = event.bytes() {
                    attributes.push((semconv::DL_COLLECTIVE_BYTES, bytes.into()));
                }
                if let Some(redop) = redop {
                    attributes.push((semconv::DL_COLLECTIVE_REDUCE_OP, redop.name().into()));
                }
                if let Some(peer) = peer {
                    attributes.push((semconv::DL_COLLECTIVE_PEER, (*peer).into()));
                }
                let communicator = self
                    .processes
                    .get(&timing.tgid)
                    .and_then(|p| p.communicators.get(comm).copied());
                if let Some(c) = communicator {
                    attributes.push((
                        semconv::DL_COLLECTIVE_COMM_ID,
                        format!("{:016x}", c.id_hash).into(),
                    ));
                    attributes.push((semconv::DL_RANK, c.rank.into()));
                    attributes.push((semconv::DL_WORLD_SIZE, c.nranks.into()));
                }
                attributes.extend(self.python_caller_of(timing));
                let Some(record) = self.call_record(timing, op.span_name(), attributes, *result)
                else {
                    return;
                };
                let comm = communicator.map(|c| CollectiveComm {
                    handle: *comm,
                    id_hash: c.id_hash,
                    rank: c.rank,
                });
                let released =
                    self.collectives
                        .add(record, *op, *stream, comm, &self.exporter.history);
                self.send_released(released);
                self.bound_held(timing.tgid, timing.end_ns);
            }
            ProbeEvent::GlooCall {
                timing, op, comm, ..
            } => {
                let mut attributes = vec![
                    (semconv::DL_COLLECTIVE_BACKEND, "gloo".into()),
                    (semconv::DL_COLLECTIVE_OP, op.name().into()),
                ];
                if let Some(comm) = comm {
                    attributes.extend([
                        (
                            semconv::DL_COLLECTIVE_COMM_ID,
                            format!("{:016x}", comm.id).into(),
                        ),
                        (semconv::DL_COLLECTIVE_SEQ, comm.seq.into()),
                        (semconv::DL_RANK, comm.rank.into()),
                    ]);
                }
                self.on_call(timing, op.gloo_span_name(), attributes, 0);
            }
            ProbeEvent::SyncWait {
                timing,
                kind,
                handle,
                result,
                ..
            } => {
                let mut attributes = vec![(semconv::CUDA_SYNC_KIND, kind.name().into())];
                attributes.extend(self.python_caller_of(timing));
                self.on_call(timing, kind.span_name(), attributes, *result);
                if *result == 0 {
                    let released =
                        self.collectives
                            .sync_returned(timing.tgid, *kind, *handle, timing.end_ns);
                    self.send_released(released);
                }
            }
            ProbeEvent::EventRecorded {
                timing,
                event,
                stream,
            } => self
                .collectives
                .event_recorded(timing.tgid, *event, *stream),
            ProbeEvent::EventQueryComplete {
                timing,
                event,
                not_ready_ns,
            } => {
                let released = self.collectives.event_complete(
                    timing.tgid,
                    *event,
                    timing.end_ns,
                    *not_ready_ns,
                );
                self.send_released(released);
            }
            ProbeEvent::CommInit {
                timing,
                comm,
                rank,
                nranks,
                comm_id_hash,
                result,
            } => {
                if *result == 0 {
                    self.collectives
                        .comm_init(timing.tgid, *comm, *comm_id_hash);
                }
                if let Some(process) = self.processes.get_mut(&timing.tgid) {
                    process.communicators.insert(
                        *comm,
                        Communicator {
                            rank: *rank,
                            nranks: *nranks,
                            id_hash: *comm_id_hash,
                        },
                    );
                }
                let attributes = vec![
                    (semconv::DL_COLLECTIVE_BACKEND, "nccl".into()),
                    (
                        semconv::DL_COLLECTIVE_COMM_ID,
                        format!("{comm_id_hash:016x}").into(),
                    ),
                    (semconv::DL_RANK, (*rank).into()),
                    (semconv::DL_WORLD_SIZE, (*nranks).into()),
                ];
                self.on_call(timing, names::NCCL_COMM_INIT, attributes, *result);
            }
            // The session turns samples into rule calls first.
            ProbeEvent::PythonCaller {
                tgid,
                tid,
                at_ns,
                function,
                file,
            } => {
                self.python_callers
                    .insert((*tgid, *tid), (*at_ns, function.clone(), file.clone()));
            }
            ProbeEvent::Group { .. }
            | ProbeEvent::PyStack { .. }
            | ProbeEvent::LinkMapChanged { .. }
            | ProbeEvent::ProcessForked { .. }
            | ProbeEvent::ProcessExec { .. }
            | ProbeEvent::ProcessExit { .. } => {}
            ProbeEvent::RuleCall { .. } => self.on_rule_call(event),
        }
    }

    fn on_call_counts(
        &mut self,
        pid: u32,
        calls: &std::collections::BTreeMap<lens_common::ProbeId, u64>,
    ) {
        if self.processes.get(&pid).is_some_and(|p| p.exporting) {
            self.exporter.process_calls(pid, calls);
        }
        // Read periodically while processes run: collectives held too long go out, and
        // calls whose phase never became known.
        let now = monotonic_now_ns();
        let released = self.collectives.expire(now);
        self.send_released(released);
        self.bound_held(pid, now);
    }

    fn on_launch_counting(&mut self, pid: u32, counting: bool, at_ns: u64, sampled: bool) {
        if sampled {
            self.exporter.launches_sampled(pid);
        }
        if let Some(process) = self.processes.get_mut(&pid) {
            process
                .arena
                .launches_mut()
                .set_counting(counting, at_ns, sampled);
        }
    }

    fn on_kernel_launches(&mut self, pid: u32, launches: &[crate::kernels::KernelLaunches]) {
        if let Some(process) = self.processes.get_mut(&pid) {
            let ledger = process.arena.launches_mut();
            for kernel in launches {
                ledger.add_kernel_launches(kernel.epoch, kernel.name.clone(), kernel.launches);
            }
        }
    }

    fn on_process_end(&mut self, end: &ProcessEnd) {
        self.end_process_with_calls(end.pid, end.exit, monotonic_now_ns(), &end.calls);
    }

    /// Each traced rank's process gets a `lens_probe.hang` span at once (error status,
    /// from the first arrival to the finding, under its `train.job`), and the calls its
    /// ranks wait in get the event when they return.
    fn on_hang(&mut self, report: &HangReport) {
        let hang = &report.hang;
        let summary = hang.summary();
        let lines = report.rank_lines().join("\n");
        let ranks = |list: &[crate::hangs::RankState]| {
            list.iter()
                .map(|r| r.rank.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let mut shared: Attributes = vec![
            (semconv::DL_COLLECTIVE_BACKEND, hang.backend.name().into()),
            (
                semconv::DL_COLLECTIVE_COMM_ID,
                format!("{:016x}", hang.comm).into(),
            ),
            (semconv::DL_COLLECTIVE_SEQ, hang.seq.into()),
            (semconv::LENS_PROBE_HANG_KIND, hang.kind.name().into()),
            (
                semconv::LENS_PROBE_HANG_RANKS_ARRIVED,
                ranks(&hang.arrived).into(),
            ),
            (
                semconv::LENS_PROBE_HANG_RANKS_MISSING,
                ranks(&hang.missing).into(),
            ),
            (semconv::LENS_PROBE_HANG_RANK_PLACES, lines.into()),
        ];
        if let Some(op) = hang.op {
            shared.push((semconv::DL_COLLECTIVE_OP, op.name().into()));
        }
        if let Some(bytes) = hang.bytes {
            shared.push((semconv::DL_COLLECTIVE_BYTES, bytes.into()));
        }
        for (rank, place) in hang.ranks().zip(&report.places) {
            if let Some(call) = &rank.waiting_in {
                self.hung_calls.insert(
                    (call.pid, call.tid, call.start_ns),
                    SpanEvent {
                        name: names::HANG,
                        at_ns: hang.detected_ns,
                        attributes: vec![
                            (semconv::LENS_PROBE_HANG_KIND, hang.kind.name().into()),
                            (semconv::DL_COLLECTIVE_SEQ, hang.seq.into()),
                        ],
                    },
                );
            }
            let Some(process) = self.processes.get_mut(&rank.pid) else {
                continue;
            };
            let mut attributes = shared.clone();
            attributes.push((semconv::DL_RANK, rank.rank.into()));
            if !place.python.is_empty() {
                let stack: Vec<String> = place.python.iter().map(ToString::to_string).collect();
                attributes.push((
                    semconv::LENS_PROBE_HANG_PYTHON_STACK,
                    stack.join("\n").into(),
                ));
            }
            let tid = rank.waiting_in.as_ref().map_or(rank.pid, |call| call.tid);
            let record = process.arena.call_record(
                &mut self.ids,
                names::HANG,
                Some(process.job),
                tid,
                hang.since_ns,
                hang.detected_ns,
                attributes,
                Some(summary.clone()),
            );
            if process.exporting {
                self.exporter.export(record);
            } else {
                process.held.push(record);
            }
        }
    }

    fn on_hang_resolved(&mut self, resolved: &Resolved) {
        // Calls that never returned (their process ended) need no event any more.
        for rank in resolved.hang.ranks() {
            if let Some(call) = &rank.waiting_in
                && !resolved.every_rank_went_on
            {
                self.hung_calls.remove(&(call.pid, call.tid, call.start_ns));
            }
        }
    }
}

/// The attributes a rule's arguments give, as its `args` say to read them. A string
/// argument that was NULL or unreadable is left out.
fn rule_attributes(rule: &NativeRule, args: &[u64], text: Option<&str>) -> Attributes {
    let mut attributes = Attributes::new();
    for arg in &rule.args {
        let raw = args.get(arg.index as usize).copied().unwrap_or(0);
        let value = match arg.kind {
            ArgType::Int => AttrValue::Int((raw as u32 as i32).into()),
            ArgType::Uint => AttrValue::Int((raw as u32).into()),
            ArgType::Long => AttrValue::Int(raw as i64),
            ArgType::Ulong => raw.into(),
            ArgType::Bool => AttrValue::Bool(raw & 0xff != 0),
            ArgType::Ptr => AttrValue::Str(format!("{raw:#x}")),
            ArgType::Str | ArgType::StdString => match text {
                Some(text) => text.into(),
                None => continue,
            },
        };
        attributes.push((arg.attribute, value));
    }
    attributes
}
