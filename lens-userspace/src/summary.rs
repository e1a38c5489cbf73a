//! The exit summary: per process, where the calls went. Printed for people on stderr and,
//! with `--summary-json`, written as JSON for scripts.
use std::{collections::BTreeMap, fmt::Write as _};

use hdrhistogram::Histogram;
use lens_common::ProbeId;
use serde::Serialize;

use crate::{
    events::{
        CallTiming, CollectiveOp, Communicator, MemoryChange, PhaseSignal, ProbeEvent, SyncKind,
    },
    settings::format_size,
    sink::{EventSink, ProbeCost, ProcessEnd, SinkInput},
    sys::target::{ExitStatus, ProcessInfo},
};

#[derive(Clone, Debug, Default, Serialize)]
pub struct CollectiveStats {
    pub calls: u64,
    pub bytes: u64,
    /// Sum of the calls' own durations (enqueue time: NCCL calls are asynchronous).
    pub call_time_ns: u64,
    /// Calls that returned a non-zero ncclResult_t.
    pub errors: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct SyncStats {
    pub calls: u64,
    pub total_ns: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

/// A communicator a process initialised, and how its `ncclCommInitRank` returned.
#[derive(Clone, Debug, Serialize)]
pub struct CommunicatorInit {
    #[serde(flatten)]
    pub communicator: Communicator,
    pub result: i32,
}

/// One kind's sync waits: their distribution, and their exact total.
#[derive(Debug)]
struct SyncWaits {
    hist: Histogram<u64>,
    total_ns: u64,
}

impl Default for SyncWaits {
    fn default() -> Self {
        // 1 ns .. 1 h at 3 significant digits: bounded memory however long the run.
        SyncWaits {
            hist: Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds"),
            total_ns: 0,
        }
    }
}

#[derive(Debug, Default)]
pub struct ProcessSummary {
    pub process: Option<ProcessInfo>,
    pub collectives: BTreeMap<CollectiveOp, CollectiveStats>,
    /// `c10d::ProcessGroupGloo` calls: counted only (bytes unknown: tensors are not
    /// decoded; no call time: they are seen at their entry alone).
    pub gloo_collectives: BTreeMap<CollectiveOp, CollectiveStats>,
    sync_waits: BTreeMap<SyncKind, SyncWaits>,
    pub communicators: Vec<CommunicatorInit>,
    pub calls: BTreeMap<ProbeId, u64>,
    /// Launches captured into CUDA graphs (recorded, not run), by launch probe.
    pub captured: BTreeMap<ProbeId, u64>,
    pub exit: Option<ExitStatus>,
    pub ended: bool,
    /// What its probes cost it, estimated (the last word the session gave).
    pub probe_cost: Option<ProbeCost>,
    /// A training signal or call was seen (not only library loads and the grad-mode
    /// toggles of `import torch`).
    active: bool,
    /// Its GPU memory, where it made memory calls.
    pub memory: Option<MemorySummary>,
}

impl ProcessSummary {
    /// Whether the process did anything a training job does: a compiler, a linker,
    /// `ldconfig` or an inductor worker (which imports torch) did not, and gets no block.
    pub fn trained(&self) -> bool {
        self.active
            || self.calls.iter().any(|(probe, count)| {
                *count > 0
                    && !matches!(
                        probe,
                        ProbeId::DlDebugState
                            | ProbeId::CudaRegisterFunction
                            | ProbeId::TorchGradMode
                            | ProbeId::TorchSetGradEnabled
                            | ProbeId::FileOpen
                            | ProbeId::FileOpenAt
                    )
            })
    }
}

impl ProcessSummary {
    pub fn sync_stats(&self) -> BTreeMap<SyncKind, SyncStats> {
        self.sync_waits
            .iter()
            .map(|(kind, SyncWaits { hist, total_ns })| {
                (
                    *kind,
                    SyncStats {
                        calls: hist.len(),
                        total_ns: *total_ns,
                        p50_ns: hist.value_at_quantile(0.50),
                        p99_ns: hist.value_at_quantile(0.99),
                        max_ns: hist.max(),
                    },
                )
            })
            .collect()
    }

    /// Kernel and graph launches counted in the kernel.
    pub fn launches(&self) -> BTreeMap<ProbeId, u64> {
        [
            ProbeId::CudaLaunchKernel,
            ProbeId::CudaLaunchKernelExC,
            ProbeId::CudaGraphLaunch,
        ]
        .into_iter()
        .filter_map(|id| self.calls.get(&id).map(|n| (id, *n)))
        .collect()
    }

    /// Launches made directly through the driver (cuBLAS, cuDNN, NCCL, compiled graphs),
    /// not through libcudart (those are counted once, as runtime launches).
    pub fn driver_launches(&self) -> BTreeMap<ProbeId, u64> {
        [
            ProbeId::CuLaunchKernel,
            ProbeId::CuLaunchKernelEx,
            ProbeId::CuGraphLaunch,
        ]
        .into_iter()
        .filter_map(|id| self.calls.get(&id).map(|n| (id, *n)))
        .collect()
    }
}

/// Loss and decode accounting for the whole run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Losses {
    /// Kernel-side losses by cause (see `lens_common::LossCause`).
    pub kernel: BTreeMap<&'static str, u64>,
    /// Records the loader could not decode.
    pub undecodable: u64,
}

impl Losses {
    pub fn total(&self) -> u64 {
        self.kernel.values().sum::<u64>() + self.undecodable
    }
}

/// A process's GPU memory over its run, for the summary (text and JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemorySummary {
    /// The most it held, and what it held when it ended (or tracing stopped), bytes.
    pub peak_bytes: u64,
    pub held_bytes: u64,
    /// Memory calls seen, the time spent in them, and the allocations that failed for
    /// want of memory.
    pub calls: u64,
    pub call_time_ns: u64,
    pub out_of_memory: u64,
    /// The most PyTorch's caching allocator had allocated to tensors, and reserved
    /// from the device, as its `c10::reportMemoryUsageToProfiler` calls said (0: none
    /// seen: the probe is on with the step-level groups).
    pub torch_allocated_peak_bytes: u64,
    pub torch_reserved_peak_bytes: u64,
}

impl MemorySummary {
    pub fn add(&mut self, timing: &CallTiming, change: &MemoryChange) {
        self.peak_bytes = self.peak_bytes.max(change.peak);
        self.held_bytes = change.held;
        self.calls += 1;
        self.call_time_ns += timing.duration_ns();
        self.out_of_memory += u64::from(change.out_of_memory.is_some());
    }

    /// A report of PyTorch's caching allocator: its totals after an allocation or free.
    pub fn add_torch(&mut self, allocated: u64, reserved: u64) {
        self.torch_allocated_peak_bytes = self.torch_allocated_peak_bytes.max(allocated);
        self.torch_reserved_peak_bytes = self.torch_reserved_peak_bytes.max(reserved);
    }

    /// The summary's lines.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if self.calls > 0 {
            let failed = match self.out_of_memory {
                0 => String::new(),
                n => format!(", {n} out of memory"),
            };
            out = format!(
                "  GPU memory: peak {} held, {} at the end; {} memory calls ({}){failed}\n",
                format_size(self.peak_bytes),
                format_size(self.held_bytes),
                self.calls,
                format_duration(self.call_time_ns),
            );
        }
        if self.torch_reserved_peak_bytes > 0 {
            let _ = writeln!(
                out,
                "  PyTorch's allocator: peak {} allocated to tensors, {} reserved",
                format_size(self.torch_allocated_peak_bytes),
                format_size(self.torch_reserved_peak_bytes),
            );
        }
        out
    }
}

#[derive(Debug, Default)]
pub struct Summary {
    pub processes: BTreeMap<u32, ProcessSummary>,
    /// Drop a process's summary when it ends, keeping only a count (node mode, which
    /// runs for days over many processes).
    pub forget_ended: bool,
    pub ended_and_forgotten: u64,
    /// The per-call probes (collectives, launches, syncs) are not attached: the enabled
    /// span groups do not need them. Said instead of "none seen".
    pub per_call_unprobed: bool,
}

/// What the summary says when no process trained and the per-call probes were not
/// attached.
const NOTHING_SEEN: &str = "lens-probe: these span groups probe PyTorch's training loop, \
     checkpoints, GPU memory and NCCL communicators; a program that trains without PyTorch \
     (C++, JAX) needs --span-groups per_step for its collectives, kernel launches and \
     syncs\n";

/// What the summary says where the per-call probes were not attached.
const NOT_PROBED: &str = "not probed under these span groups (the step, forward_backward and optimizer groups \
     probe them: --span-groups per_step)";

impl Summary {
    /// Says "not probed" for what `groups` leave unattached, instead of "none seen".
    pub fn for_groups(mut self, groups: &crate::settings::groups::SpanGroups) -> Summary {
        self.per_call_unprobed = !crate::probes::catalog::STEP_DETAIL
            .iter()
            .any(|group| groups.contains(*group));
        self
    }

    fn nothing(&self, what: &str) -> String {
        if self.per_call_unprobed {
            format!("  {what}: {NOT_PROBED}\n")
        } else {
            format!("  {what}: none seen\n")
        }
    }

    /// A summary that keeps only the processes still running, and a count of the others.
    pub fn forgetting() -> Summary {
        Summary {
            forget_ended: true,
            ..Summary::default()
        }
    }
}

impl Summary {
    fn process_start(&mut self, process: &ProcessInfo) {
        self.processes.entry(process.pid).or_default().process = Some(process.clone());
    }

    fn process_exec(&mut self, process: &ProcessInfo) {
        self.on_process_start(process);
    }

    fn event(&mut self, event: &ProbeEvent) {
        let process = self.processes.entry(event.tgid()).or_default();
        process.active |= match event {
            // Grad mode switched and files opened are what any torch importer does (a
            // launcher creating its rendezvous files): no training activity of their own.
            ProbeEvent::Phase { signal, .. } => !matches!(
                signal,
                PhaseSignal::GradMode { .. }
                    | PhaseSignal::FileCreated { .. }
                    | PhaseSignal::FileRead { .. }
            ),
            ProbeEvent::Collective { .. }
            | ProbeEvent::SyncWait { .. }
            | ProbeEvent::CommInit { .. }
            | ProbeEvent::GlooCall { .. }
            | ProbeEvent::Group { .. }
            | ProbeEvent::EventRecorded { .. }
            | ProbeEvent::EventQueryComplete { .. }
            | ProbeEvent::RuleCall { .. } => true,
            _ => false,
        };
        match event {
            ProbeEvent::Collective {
                timing, op, result, ..
            } => {
                let stats = process.collectives.entry(*op).or_default();
                stats.calls += 1;
                stats.bytes += event.bytes().unwrap_or(0);
                stats.call_time_ns += timing.duration_ns();
                stats.errors += u64::from(*result != 0);
            }
            ProbeEvent::SyncWait { timing, kind, .. } => {
                let duration = timing.duration_ns().max(1);
                let waits = process.sync_waits.entry(*kind).or_default();
                waits.hist.saturating_record(duration);
                waits.total_ns += duration;
            }
            ProbeEvent::CommInit { result, .. } => {
                if let Some(communicator) = event.communicator() {
                    process.communicators.push(CommunicatorInit {
                        communicator,
                        result: *result,
                    });
                }
            }
            // Seen at their entry only (docs/probes.md): calls, no time.
            ProbeEvent::GlooCall { op, .. } => {
                process.gloo_collectives.entry(*op).or_default().calls += 1;
            }
            ProbeEvent::ApiCall {
                timing,
                memory: Some(change),
                ..
            } => process.memory.get_or_insert_default().add(timing, change),
            ProbeEvent::ApiCall {
                probe: ProbeId::TorchMemoryUsage,
                args,
                ..
            } => process
                .memory
                .get_or_insert_default()
                .add_torch(args[2], args[3]),
            ProbeEvent::Group { .. }
            | ProbeEvent::EventRecorded { .. }
            | ProbeEvent::EventQueryComplete { .. }
            | ProbeEvent::PyStack { .. }
            | ProbeEvent::Phase { .. }
            | ProbeEvent::RuleCall { .. }
            | ProbeEvent::ApiCall { .. } => {}
        }
    }

    fn process_end(&mut self, end: &ProcessEnd) {
        let process = self.processes.entry(end.pid).or_default();
        for (probe, count) in &end.calls {
            *process.calls.entry(*probe).or_default() += count;
        }
        for (probe, count) in &end.captured {
            *process.captured.entry(*probe).or_default() += count;
        }
        process.exit = end.exit;
        // `None`: tracing stopped while the process runs on: it has not ended.
        process.ended = end.exit.is_some();
        if self.forget_ended {
            self.processes.remove(&end.pid);
            self.ended_and_forgotten += 1;
        }
    }
}

impl EventSink for Summary {
    fn on(&mut self, input: &SinkInput<'_>) {
        match *input {
            SinkInput::ProcessStart(process) => self.process_start(process),
            SinkInput::ProcessExec(process) => self.process_exec(process),
            SinkInput::Event(event) => self.event(event),
            SinkInput::ProcessEnd(end) => self.process_end(end),
            SinkInput::ProbeCost { pid, cost } => {
                self.processes.entry(pid).or_default().probe_cost = Some(cost);
            }
            _ => {}
        }
    }
}

/// `1.23 s`, `4.56 ms`, `7.8 µs`: durations as people read them.
pub(crate) fn format_duration(ns: u64) -> String {
    let ns = ns as f64;
    if ns >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.1} µs", ns / 1e3)
    }
}

/// The line on lost events, by cause.
fn render_losses(out: &mut String, losses: &Losses) {
    if losses.total() == 0 {
        out.push_str("lens-probe: no events lost\n");
    } else {
        let causes: Vec<String> = losses
            .kernel
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(cause, n)| format!("{cause} {n}"))
            .chain((losses.undecodable > 0).then(|| format!("undecodable {}", losses.undecodable)))
            .collect();
        let _ = writeln!(
            out,
            "lens-probe: {} events lost ({})",
            losses.total(),
            causes.join(", ")
        );
    }
}

impl Summary {
    /// The summary as a person reads it.
    pub fn render(&self, losses: &Losses) -> String {
        let mut out = String::new();
        if self.ended_and_forgotten > 0 {
            let _ = writeln!(
                out,
                "lens-probe: {} traced processes ended",
                self.ended_and_forgotten
            );
        } else if self.processes.is_empty() {
            out.push_str("lens-probe: no traced process\n");
        }
        let quiet = self.processes.values().filter(|p| !p.trained()).count();
        if quiet > 0 {
            let _ = writeln!(
                out,
                "lens-probe: {quiet} traced process{} without training activity (launchers, \
                 compilers, helpers): no summary",
                if quiet == 1 { "" } else { "es" }
            );
        }
        if quiet > 0 && self.per_call_unprobed && !self.processes.values().any(|p| p.trained()) {
            // A program that trains without PyTorch (C++, JAX) shows nothing these
            // groups probe: say where its calls are.
            out.push_str(NOTHING_SEEN);
        }
        for (pid, process) in self.processes.iter().filter(|(_, p)| p.trained()) {
            self.render_process(&mut out, *pid, process);
        }
        render_losses(&mut out, losses);
        out
    }

    /// One trained process: its state, communicators, calls and probe cost.
    fn render_process(&self, out: &mut String, pid: u32, process: &ProcessSummary) {
        let name = process.process.as_ref().map_or("?", |p| p.name.as_str());
        let state = match (process.ended, process.exit) {
            // Tracing stopped (--duration, SIGINT) while it runs on.
            (false, _) | (true, None) => "still running".to_string(),
            (true, Some(ExitStatus::Exited(code))) => format!("exited {code}"),
            (true, Some(ExitStatus::Signaled(signal))) => format!("killed by signal {signal}"),
            (true, _) => "exited".to_string(),
        };
        let _ = writeln!(out, "lens-probe summary: pid {pid} ({name}), {state}");
        for CommunicatorInit {
            communicator: comm,
            result,
        } in &process.communicators
        {
            let _ = writeln!(
                out,
                "  communicator {:#x}: rank {}/{}  id {:016x}{}",
                comm.handle,
                comm.rank,
                comm.nranks,
                comm.id_hash,
                if *result != 0 {
                    format!("  (init failed: ncclResult {result})")
                } else {
                    String::new()
                }
            );
        }
        self.render_collectives(out, process);
        self.render_launches(out, process);
        self.render_sync_waits(out, process);
        if let Some(memory) = &process.memory {
            out.push_str(&memory.render());
        }
        if let Some(cost) = &process.probe_cost {
            let _ = writeln!(
                out,
                "  probe cost: an estimated {} of the {} traced ({:.2} %)",
                format_duration(cost.estimated_ns),
                format_duration(cost.traced_ns),
                cost.share() * 100.0
            );
        }
    }

    fn render_collectives(&self, out: &mut String, process: &ProcessSummary) {
        if process.collectives.is_empty() && process.gloo_collectives.is_empty() {
            out.push_str(&self.nothing("collectives"));
            return;
        }
        let _ = writeln!(
            out,
            "  {:<16} {:>8} {:>12} {:>12} {:>7}",
            "collective", "calls", "bytes", "call time", "errors"
        );
        for (op, stats) in &process.collectives {
            // The kernel counts every call; events lost on the way are said, not
            // hidden: bytes and call time are of the calls received.
            let counted = process
                .calls
                .iter()
                .filter(|(probe, _)| CollectiveOp::from_probe(**probe) == Some(*op))
                .map(|(_, count)| *count)
                .sum::<u64>();
            let lost = counted.saturating_sub(stats.calls);
            let _ = writeln!(
                out,
                "  {:<16} {:>8} {:>12} {:>12} {:>7}{}",
                op.name(),
                stats.calls.max(counted),
                format_size(stats.bytes),
                format_duration(stats.call_time_ns),
                stats.errors,
                if lost > 0 {
                    format!("  ({lost} calls' events lost: bytes and time of the rest)")
                } else {
                    String::new()
                }
            );
        }
        for (op, stats) in &process.gloo_collectives {
            let _ = writeln!(
                out,
                "  {:<16} {:>8} {:>12} {:>12}",
                op.gloo_span_name(),
                stats.calls,
                "-",
                "-",
            );
        }
    }

    fn render_launches(&self, out: &mut String, process: &ProcessSummary) {
        let launches = process.launches();
        if launches.is_empty() {
            out.push_str(&self.nothing("launches"));
        } else {
            let list: Vec<String> = launches
                .iter()
                .map(|(id, n)| format!("{} {n}", crate::probes::catalog::symbol(*id)))
                .collect();
            let _ = writeln!(out, "  launches: {}", list.join(", "));
        }
        let driver = process.driver_launches();
        if !driver.is_empty() {
            let list: Vec<String> = driver
                .iter()
                .map(|(id, n)| format!("{} {n}", crate::probes::catalog::symbol(*id)))
                .collect();
            let _ = writeln!(out, "  driver launches: {}", list.join(", "));
        }
        if !process.captured.is_empty() {
            let list: Vec<String> = process
                .captured
                .iter()
                .map(|(id, n)| format!("{} {n}", crate::probes::catalog::symbol(*id)))
                .collect();
            let _ = writeln!(
                out,
                "  captured into CUDA graphs (recorded, not run): {}",
                list.join(", ")
            );
        }
    }

    fn render_sync_waits(&self, out: &mut String, process: &ProcessSummary) {
        let syncs = process.sync_stats();
        if syncs.is_empty() {
            out.push_str(&self.nothing("sync waits"));
        } else {
            let _ = writeln!(
                out,
                "  {:<16} {:>8} {:>12} {:>12} {:>12}",
                "sync wait", "calls", "total", "p50", "p99"
            );
            for (kind, stats) in &syncs {
                let _ = writeln!(
                    out,
                    "  {:<16} {:>8} {:>12} {:>12} {:>12}",
                    kind.name(),
                    stats.calls,
                    format_duration(stats.total_ns),
                    format_duration(stats.p50_ns),
                    format_duration(stats.p99_ns)
                );
            }
        }
    }

    /// The summary for scripts.
    pub fn to_json(&self, losses: &Losses) -> serde_json::Value {
        let processes: Vec<serde_json::Value> = self
            .processes
            .iter()
            .filter(|(_, process)| process.trained())
            .map(|(pid, process)| {
                let calls: BTreeMap<&str, u64> = process
                    .calls
                    .iter()
                    .map(|(id, n)| (crate::probes::catalog::symbol(*id), *n))
                    .collect();
                let collectives: BTreeMap<&str, &CollectiveStats> = process
                    .collectives
                    .iter()
                    .map(|(op, stats)| (op.name(), stats))
                    .collect();
                let gloo_collectives: BTreeMap<&str, &CollectiveStats> = process
                    .gloo_collectives
                    .iter()
                    .map(|(op, stats)| (op.name(), stats))
                    .collect();
                let syncs: BTreeMap<&str, SyncStats> = process
                    .sync_stats()
                    .into_iter()
                    .map(|(kind, stats)| (kind.name(), stats))
                    .collect();
                serde_json::json!({
                    "pid": pid,
                    "name": process.process.as_ref().map(|p| p.name.clone()),
                    "command_line": process.process.as_ref().map(|p| p.command_line.clone()),
                    "ended": process.ended,
                    "exit": process.exit,
                    "communicators": process.communicators,
                    "collectives": collectives,
                    "gloo_collectives": gloo_collectives,
                    "sync_waits": syncs,
                    "calls": calls,
                    "captured_launches": process
                        .captured
                        .iter()
                        .map(|(id, n)| (crate::probes::catalog::symbol(*id), *n))
                        .collect::<BTreeMap<_, _>>(),
                    "probe_cost": process.probe_cost,
                    "gpu_memory": process.memory,
                })
            })
            .collect();
        serde_json::json!({
            "processes": processes,
            "processes_without_training": self.processes.values().filter(|p| !p.trained()).count(),
            "losses": losses,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{CallTiming, PythonCaller};

    fn timing(start_ns: u64, end_ns: u64) -> CallTiming {
        CallTiming {
            tgid: 7,
            tid: 7,
            start_ns,
            end_ns,
        }
    }

    #[test]
    fn collectives_and_syncs_aggregate_per_process() {
        let mut summary = Summary::default();
        for step in 1..=3u64 {
            summary.on_event(&ProbeEvent::Collective {
                timing: timing(0, 1_000),
                op: CollectiveOp::AllReduce,
                count: 1024 * step,
                datatype: crate::nccl::DataType::from_raw(7),
                raw_datatype: 7,
                redop: None,
                peer: None,
                comm: 1,
                stream: 2,
                result: 0,
                python_caller: PythonCaller::None,
            });
            summary.on_event(&ProbeEvent::SyncWait {
                timing: timing(0, step * 10_000_000),
                kind: SyncKind::Stream,
                handle: 2,
                result: 0,
                python_caller: PythonCaller::None,
            });
        }
        let process = &summary.processes[&7];
        let all_reduce = &process.collectives[&CollectiveOp::AllReduce];
        assert_eq!(all_reduce.calls, 3);
        assert_eq!(all_reduce.bytes, 4 * 1024 * 6);
        assert_eq!(all_reduce.call_time_ns, 3_000);
        let stream = &process.sync_stats()[&SyncKind::Stream];
        assert_eq!(stream.calls, 3);
        assert_eq!(stream.total_ns, 60_000_000);
        // 3 significant digits: within 0.1%.
        assert!(
            stream.p50_ns.abs_diff(20_000_000) < 20_000,
            "{}",
            stream.p50_ns
        );
        let text = summary.render(&Losses::default());
        assert!(text.contains("all_reduce"), "{text}");
        assert!(text.contains("no events lost"), "{text}");
    }

    #[test]
    fn a_launcher_that_only_creates_files_gets_no_summary_block() {
        let mut summary = Summary::default();
        summary.on_event(&ProbeEvent::Phase {
            tgid: 7,
            tid: 7,
            at_ns: 10,
            launches: 0,
            epoch: 0,
            signal: PhaseSignal::FileCreated { path: 0 },
        });
        let text = summary.render(&Losses::default());
        assert!(!text.contains("summary: pid 7"), "{text}");
        assert!(
            text.contains("1 traced process without training activity"),
            "{text}"
        );
        // All groups on: nothing more to say.
        assert!(!text.contains("--span-groups per_step"), "{text}");
    }

    #[test]
    fn nothing_trained_under_the_default_groups_says_what_per_step_adds() {
        let mut summary = Summary::default().for_groups(&Default::default());
        summary.on_event(&ProbeEvent::Phase {
            tgid: 7,
            tid: 7,
            at_ns: 10,
            launches: 0,
            epoch: 0,
            signal: PhaseSignal::FileCreated { path: 0 },
        });
        let text = summary.render(&Losses::default());
        assert!(
            text.contains(
                "a program that trains without PyTorch (C++, JAX) needs --span-groups per_step"
            ),
            "{text}"
        );
    }

    #[test]
    fn gloo_collectives_alone_have_their_header_and_no_none_seen() {
        let mut summary = Summary::default();
        summary.on_event(&ProbeEvent::GlooCall {
            timing: timing(0, 1_000),
            op: CollectiveOp::AllReduce,
            group: 0x10,
            comm: None,
        });
        let text = summary.render(&Losses::default());
        assert!(!text.contains("collectives: none seen"), "{text}");
        let header = text.find("collective ").expect("the table's header");
        let row = text.find("gloo.all_reduce").expect("the gloo row");
        assert!(header < row, "{text}");
    }

    #[test]
    fn a_communicator_is_reported_as_its_init_described_it() {
        let mut summary = Summary::default();
        summary.on_event(&ProbeEvent::CommInit {
            timing: timing(0, 1_000),
            comm: 0xc0,
            rank: 1,
            nranks: 4,
            comm_id_hash: 0xfeed,
            result: 0,
        });
        let json = summary.to_json(&Losses::default());
        assert_eq!(
            json["processes"][0]["communicators"],
            serde_json::json!([
                {"comm": 0xc0, "rank": 1, "nranks": 4, "id_hash": 0xfeed, "result": 0}
            ])
        );
        let text = summary.render(&Losses::default());
        assert!(
            text.contains("communicator 0xc0: rank 1/4  id 000000000000feed"),
            "{text}"
        );
    }

    #[test]
    fn processes_that_never_trained_get_no_block() {
        let mut summary = Summary::default();
        for (pid, name) in [(1, "python"), (2, "cc1plus"), (3, "ldconfig")] {
            summary.on_process_start(&ProcessInfo {
                pid,
                name: name.into(),
                command_line: vec![name.into()],
                traced_from_start: true,
                rank: None,
                view: Default::default(),
            });
        }
        // `import torch` in a compile worker toggles grad mode: not training.
        summary.on_event(&ProbeEvent::Phase {
            tgid: 2,
            tid: 2,
            at_ns: 1,
            launches: 0,
            epoch: 1,
            signal: PhaseSignal::GradMode { enabled: false },
        });
        summary.on_event(&ProbeEvent::Phase {
            tgid: 1,
            tid: 1,
            at_ns: 1,
            launches: 0,
            epoch: 1,
            signal: PhaseSignal::BackwardStart,
        });
        for pid in 1..=3 {
            summary.on_process_end(&ProcessEnd {
                pid,
                exit: Some(ExitStatus::Exited(0)),
                calls: [(ProbeId::DlDebugState, 3)].into_iter().collect(),
                ..ProcessEnd::default()
            });
        }
        let text = summary.render(&Losses::default());
        assert!(
            text.contains("lens-probe summary: pid 1 (python)"),
            "{text}"
        );
        assert!(
            !text.contains("cc1plus") && !text.contains("ldconfig"),
            "{text}"
        );
        assert!(
            text.contains("2 traced processes without training activity"),
            "{text}"
        );
        let json = summary.to_json(&Losses::default());
        assert_eq!(json["processes"].as_array().map(Vec::len), Some(1));
        assert_eq!(json["processes_without_training"], 2);
    }

    #[test]
    fn kernel_counts_are_shown_with_the_events_lost_beside_them() {
        let mut summary = Summary::default();
        for i in 0..3 {
            summary.on_event(&ProbeEvent::Collective {
                timing: timing(i, i + 10),
                op: CollectiveOp::AllReduce,
                count: 256,
                datatype: Some(crate::nccl::DataType::Float32),
                raw_datatype: 7,
                redop: None,
                peer: None,
                comm: 1,
                stream: 0,
                result: 0,
                python_caller: PythonCaller::None,
            });
        }
        summary.on_process_end(&ProcessEnd {
            pid: 7,
            exit: None,
            calls: [(ProbeId::NcclAllReduce, 20)].into_iter().collect(),
            ..ProcessEnd::default()
        });
        let text = summary.render(&Losses::default());
        assert!(text.contains("still running"), "{text}");
        let line = text.lines().find(|l| l.contains("all_reduce")).unwrap();
        assert!(line.contains(" 20 "), "{line}");
        assert!(line.contains("(17 calls' events lost"), "{line}");
        assert_eq!(
            summary.to_json(&Losses::default())["processes"][0]["ended"],
            false
        );
    }

    #[test]
    fn under_default_groups_the_per_call_probes_are_said_not_probed() {
        let mut summary = Summary::default().for_groups(&"default".parse().unwrap());
        summary.on_event(&ProbeEvent::Phase {
            tgid: 7,
            tid: 7,
            at_ns: 1,
            launches: 0,
            epoch: 1,
            signal: PhaseSignal::CheckpointWriteStart,
        });
        let text = summary.render(&Losses::default());
        for what in ["collectives", "launches", "sync waits"] {
            assert!(
                text.contains(&format!("  {what}: not probed under these span groups")),
                "{text}"
            );
        }
        assert!(text.contains("--span-groups per_step"), "{text}");
        let summary = Summary::default().for_groups(&"per_step".parse().unwrap());
        assert!(!summary.per_call_unprobed);
    }

    #[test]
    fn losses_are_always_reported() {
        let mut losses = Losses::default();
        losses.kernel.insert("ring_buffer_full", 5);
        losses.undecodable = 1;
        let text = Summary::default().render(&losses);
        assert!(
            text.contains("6 events lost (ring_buffer_full 5, undecodable 1)"),
            "{text}"
        );
    }

    #[test]
    fn sizes_and_durations_read_naturally() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(60 * 1024), "60.0 KiB");
        assert_eq!(format_duration(20_100_000), "20.10 ms");
        assert_eq!(format_duration(1_500), "1.5 µs");
    }
}
