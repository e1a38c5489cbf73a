//! The span builder: an [`EventSink`](crate::sink::EventSink) that keeps, per traced process, the `train.job`
//! root, a phase machine per thread, and turns calls (collectives, sync waits) into
//! child spans of the phase they happen in.
use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
};

use super::{
    SpanEvent, SpanExporter, SpanId, SpanRecord,
    arena::{IdSource, SpanArena},
    collectives::Collectives,
    memory_peaks::MemoryPeaks,
    names,
    pending::{GatedOutput, PendingSpans},
    phases::{ProcessContext, ThreadPhases},
    straggler_cause::{PhaseCall, PhaseHistory},
};
use crate::{
    semconv,
    settings::{
        groups::{SpanGroup, SpanGroups},
        probe_rules::ProbeRules,
    },
    sys::target::{ExitStatus, ProcessInfo},
};

mod call_spans;
mod framework_calls;
mod placement;
mod routing;

use framework_calls::{AsyncSave, close_unwritten_async_save};

struct ProcessSpans {
    info: ProcessInfo,
    start_ns: u64,
    arena: SpanArena,
    job: SpanId,
    model_init: Option<SpanId>,
    traced_from_start: bool,
    threads: HashMap<u32, ThreadPhases>,
    /// The thread running the training loop (first with phase activity): calls from
    /// threads without phases of their own are shown under its phases.
    loop_thread: Option<u32>,
    /// The communicators it initialised, by handle: what its collectives name.
    communicators: HashMap<u64, crate::events::Communicator>,
    ruled: RuledGroups,
    /// A DCP `async_save` whose writing goes on in a background thread.
    async_save: Option<AsyncSave>,
}

/// Groups configured probe rules have taken over from torch's signals (from the first
/// call of such a rule on).
#[derive(Default)]
struct RuledGroups {
    groups: BTreeSet<SpanGroup>,
    /// `dl.iteration` of the next step a rule opens.
    next_iteration: u64,
}

impl ProcessSpans {
    /// Runs `f` on thread `tid`'s phases (made on first use) with this process's span
    /// context, finished spans to `out` through the training gate of `pending`; the
    /// first thread with phase activity becomes the loop thread. Returns whether the
    /// thread is left idle (nothing open, not the loop thread): its state can go.
    fn on_thread(
        &mut self,
        tid: u32,
        ids: &mut IdSource,
        pending: &mut PendingSpans,
        out: &mut dyn SpanExporter,
        f: impl FnOnce(&mut ThreadPhases, &mut ProcessContext<'_>),
    ) -> bool {
        let traced_from_start = self.traced_from_start;
        let thread = self
            .threads
            .entry(tid)
            .or_insert_with(|| ThreadPhases::new(tid, traced_from_start));
        let mut ctx = ProcessContext {
            arena: &mut self.arena,
            ids,
            out: &mut GatedOutput { pending, out },
            job: self.job,
            model_init: &mut self.model_init,
            ruled: &self.ruled.groups,
        };
        f(thread, &mut ctx);
        if self.loop_thread.is_none() && thread.is_active() {
            self.loop_thread = Some(tid);
        }
        thread.is_idle() && self.loop_thread != Some(tid)
    }
}

pub struct SpanBuilder<E: SpanExporter> {
    groups: SpanGroups,
    /// Configured probe rules: what their calls become.
    rules: Arc<ProbeRules>,
    ids: IdSource,
    processes: HashMap<u32, ProcessSpans>,
    /// Every span that waits before it goes out (`spans::pending`).
    pending: PendingSpans,
    /// What ends collective spans: their completion and the other ranks' calls.
    collectives: Collectives,
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
    /// Held GPU memory over time: the peaks steps and jobs carry.
    memory: MemoryPeaks,
}

impl<E: SpanExporter> SpanExporter for Tap<E> {
    fn process_started(&mut self, info: &ProcessInfo, job: Option<SpanId>, start_ns: u64) {
        self.inner.process_started(info, job, start_ns);
    }
    fn export(&mut self, mut span: SpanRecord) {
        self.history.record(&span);
        self.memory.annotate(&mut span);
        self.inner.export(span);
    }
    fn process_calls(
        &mut self,
        pid: u32,
        calls: &std::collections::BTreeMap<lens_common::ProbeId, u64>,
    ) {
        self.inner.process_calls(pid, calls);
    }
    fn process_probe_cost(&mut self, pid: u32, cost: crate::sink::ProbeCost) {
        self.inner.process_probe_cost(pid, cost);
    }
    fn launches_sampled(&mut self, pid: u32) {
        self.inner.launches_sampled(pid);
    }
    fn process_memory(&mut self, pid: u32, at_ns: u64, change: &crate::gpu_memory::MemoryChange) {
        self.memory.record(pid, at_ns, change.held, change.peak);
        self.inner.process_memory(pid, at_ns, change);
    }
    fn process_ended(&mut self, pid: u32) {
        self.history.forget(pid);
        self.memory.forget(pid);
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
            pending: PendingSpans::default(),
            collectives: Collectives::default(),
            hung_calls: HashMap::new(),
            scope_stacks: HashMap::new(),
            exporter: Tap {
                inner: exporter,
                history: PhaseHistory::default(),
                memory: MemoryPeaks::default(),
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
        self.pending.start_process(info.pid);
        self.processes.insert(
            info.pid,
            ProcessSpans {
                info: info.clone(),
                start_ns,
                arena,
                job,
                model_init,
                traced_from_start: info.traced_from_start,
                threads: HashMap::new(),
                loop_thread: None,
                communicators: HashMap::new(),
                ruled: RuledGroups::default(),
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
        // Its spans stop waiting (the pending spans' rule at exit): its collectives go
        // out with what is known, its calls are placed, before its spans close.
        let released =
            self.collectives
                .process_ended(pid, &self.exporter.history, &mut self.pending);
        self.send_released(released);
        self.place_held(pid, |_, _| true);
        self.scope_stacks.retain(|(p, _), _| *p != pid);
        let Some(mut process) = self.processes.remove(&pid) else {
            self.pending.end_process(pid);
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
            ruled,
            async_save,
            ..
        } = &mut process;
        if !self.pending.exporting(pid) && !arena.training_seen() {
            log::info!(
                "pid {pid} ({}) ended without training activity: no spans",
                process.info.name
            );
            self.pending.end_process(pid);
            return;
        }
        let mut output = GatedOutput {
            pending: &mut self.pending,
            out: &mut self.exporter,
        };
        let mut ctx = ProcessContext {
            arena,
            ids: &mut self.ids,
            out: &mut output,
            job: *job,
            model_init,
            ruled: &ruled.groups,
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
        export_if_training(
            &process,
            &mut self.pending,
            &mut self.exporter,
            &self.groups,
        );
        self.pending.end_process(pid);
        self.exporter.process_calls(pid, calls);
        self.exporter.process_ended(pid);
    }

    /// `pid` runs a new program: a job that has not trained yet starts over as that
    /// program (a launcher that execs the trainer, a worker forked by a launcher).
    /// `info.pid` replaced its program at `at_ns`. The old program's job ends there (what
    /// was open is truncated: it will never close) and the new program's begins.
    pub fn exec_process(&mut self, info: &ProcessInfo, at_ns: u64) {
        if self.pending.exporting(info.pid) {
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
        // Threads come and go (workers, per-step helpers): keep state only for those
        // with something open.
        let idle = process.on_thread(
            tid,
            &mut self.ids,
            &mut self.pending,
            &mut self.exporter,
            |thread, ctx| thread.on_signal(ctx, at, signal),
        );
        export_if_training(process, &mut self.pending, &mut self.exporter, &self.groups);
        self.place_when_known(tgid, tid);
        if idle && let Some(process) = self.processes.get_mut(&tgid) {
            process.threads.remove(&tid);
        }
    }
}

/// Once `process` shows training, announce its job and release what waited for that,
/// in order.
fn export_if_training(
    process: &ProcessSpans,
    pending: &mut PendingSpans,
    out: &mut dyn SpanExporter,
    groups: &SpanGroups,
) {
    let pid = process.info.pid;
    if pending.exporting(pid) || !process.arena.training_seen() {
        return;
    }
    let waited = pending.start_exporting(pid);
    let job = groups.contains(SpanGroup::Job).then_some(process.job);
    out.process_started(&process.info, job, process.start_ns);
    for span in waited {
        out.export(span);
    }
}
