//! The event stream's consumers. Everything downstream of decoding (the exit summary, the
//! verbose printer, later the span builder and the exporters) is an [`EventSink`].
use std::{collections::BTreeMap, io::Write};

use lens_common::ProbeId;

use crate::{
    events::{ProbeEvent, PythonCaller},
    gpu_kernels::KernelLaunches,
    hangs::{HangReport, Resolved},
    nccl::{DataType, RedOp},
    sys::target::{ExitStatus, ProcessInfo},
};

/// How a traced process's tracing ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessEnd {
    pub pid: u32,
    /// Calls counted in the kernel (launches and every other probed call), by probe.
    pub calls: BTreeMap<ProbeId, u64>,
    /// Launches captured into CUDA graphs (recorded, not run), by launch probe: not in
    /// `calls`.
    pub captured: BTreeMap<ProbeId, u64>,
    /// `None` when tracing stopped while the process was still running.
    pub exit: Option<ExitStatus>,
}

/// What a process's probes cost it so far, estimated: its calls (the kernel's counts) ×
/// what a probe hit costs on this machine (measured at start-up), against the time it has
/// been traced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProbeCost {
    pub estimated_ns: u64,
    pub traced_ns: u64,
    /// The measured costs it was estimated with: an entry hit, and a return hit on top.
    pub entry_hit_ns: u64,
    pub return_hit_ns: u64,
}

impl ProbeCost {
    /// The estimate as a share of the traced time (0.01 = 1 %).
    pub fn share(&self) -> f64 {
        if self.traced_ns == 0 {
            0.0
        } else {
            self.estimated_ns as f64 / self.traced_ns as f64
        }
    }
}

/// Everything a sink is told, one variant per kind of news.
#[derive(Clone, Copy, Debug)]
pub enum SinkInput<'a> {
    ProcessStart(&'a ProcessInfo),
    /// A traced process replaced its program (`execve`); the new one.
    ProcessExec(&'a ProcessInfo),
    Event(&'a ProbeEvent),
    /// The kernel's call counters of a running process so far (totals, by probe):
    /// launches are counted there, not sent as events.
    CallCounts {
        pid: u32,
        calls: &'a BTreeMap<ProbeId, u64>,
    },
    /// What `pid`'s probes have cost it so far; told after each [`SinkInput::CallCounts`]
    /// and before [`SinkInput::ProcessEnd`].
    ProbeCost {
        pid: u32,
        cost: ProbeCost,
    },
    /// The launch probes of `pid`'s libraries went in (`counting`) or out at `at_ns`
    /// (monotonic clock). `sampled`: an overhead budget moves them in and out.
    LaunchCounting {
        pid: u32,
        counting: bool,
        at_ns: u64,
        sampled: bool,
    },
    /// Launches per kernel of `pid` since the last time, by phase epoch: counted in the
    /// kernel, read by the session before the phase marks that may need them.
    KernelLaunches {
        pid: u32,
        launches: &'a [KernelLaunches],
    },
    ProcessEnd(&'a ProcessEnd),
    /// A collective found hung (`--hang-timeout`), with where its ranks are.
    Hang(&'a HangReport),
    /// A hang reported before ended.
    HangResolved(&'a Resolved),
}

/// A consumer of the stream: one method over one input type. The `on_*` methods are
/// shorthands that build the input; a sink implements `on` alone.
pub trait EventSink {
    fn on(&mut self, input: &SinkInput<'_>);

    fn on_process_start(&mut self, process: &ProcessInfo) {
        self.on(&SinkInput::ProcessStart(process));
    }
    fn on_process_exec(&mut self, process: &ProcessInfo) {
        self.on(&SinkInput::ProcessExec(process));
    }
    fn on_event(&mut self, event: &ProbeEvent) {
        self.on(&SinkInput::Event(event));
    }
    fn on_call_counts(&mut self, pid: u32, calls: &BTreeMap<ProbeId, u64>) {
        self.on(&SinkInput::CallCounts { pid, calls });
    }
    fn on_probe_cost(&mut self, pid: u32, cost: ProbeCost) {
        self.on(&SinkInput::ProbeCost { pid, cost });
    }
    fn on_launch_counting(&mut self, pid: u32, counting: bool, at_ns: u64, sampled: bool) {
        self.on(&SinkInput::LaunchCounting {
            pid,
            counting,
            at_ns,
            sampled,
        });
    }
    fn on_kernel_launches(&mut self, pid: u32, launches: &[KernelLaunches]) {
        self.on(&SinkInput::KernelLaunches { pid, launches });
    }
    fn on_process_end(&mut self, end: &ProcessEnd) {
        self.on(&SinkInput::ProcessEnd(end));
    }
    fn on_hang(&mut self, report: &HangReport) {
        self.on(&SinkInput::Hang(report));
    }
    fn on_hang_resolved(&mut self, resolved: &Resolved) {
        self.on(&SinkInput::HangResolved(resolved));
    }
}

/// Fan-out: both sinks are told everything, the first first.
impl<A: EventSink, B: EventSink> EventSink for (A, B) {
    fn on(&mut self, input: &SinkInput<'_>) {
        self.0.on(input);
        self.1.on(input);
    }
}

impl<S: EventSink + ?Sized> EventSink for &mut S {
    fn on(&mut self, input: &SinkInput<'_>) {
        (**self).on(input);
    }
}

impl<S: EventSink> EventSink for Option<S> {
    fn on(&mut self, input: &SinkInput<'_>) {
        if let Some(sink) = self {
            sink.on(input);
        }
    }
}

/// Keeps everything it is given, in order (tests, and tools built on the library).
#[derive(Debug, Default)]
pub struct EventLog {
    pub started: Vec<ProcessInfo>,
    pub events: Vec<ProbeEvent>,
    pub ended: Vec<ProcessEnd>,
}

impl EventLog {
    fn process_start(&mut self, process: &ProcessInfo) {
        self.started.push(process.clone());
    }
    fn event(&mut self, event: &ProbeEvent) {
        self.events.push(event.clone());
    }
    fn process_end(&mut self, end: &ProcessEnd) {
        self.ended.push(end.clone());
    }
}

impl EventSink for EventLog {
    fn on(&mut self, input: &SinkInput<'_>) {
        match *input {
            SinkInput::ProcessStart(process) => self.process_start(process),
            SinkInput::Event(event) => self.event(event),
            SinkInput::ProcessEnd(end) => self.process_end(end),
            _ => {}
        }
    }
}

/// `-v`: one line per event as it arrives, on stderr.
pub struct EventPrinter<W: Write> {
    out: W,
}

impl<W: Write> EventPrinter<W> {
    pub fn new(out: W) -> Self {
        EventPrinter { out }
    }
}

/// ` from Python FUNCTION (FILE)` when the caller was named.
fn called_from(caller: &PythonCaller) -> String {
    match caller {
        PythonCaller::Named { function, file } => format!(" from Python {function} ({file})"),
        PythonCaller::None | PythonCaller::Code(_) => String::new(),
    }
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1_000.0
}

/// `dtype=… [bytes=…] [op=…] [peer=…]`: what a collective call was given, where it has it.
fn collective_arguments(
    event: &ProbeEvent,
    datatype: Option<DataType>,
    raw_datatype: i32,
    redop: Option<RedOp>,
    peer: Option<i32>,
) -> String {
    let dtype = datatype.map_or_else(|| format!("dtype({raw_datatype})"), |d| d.name().into());
    let mut line = format!("dtype={dtype}");
    if let Some(bytes) = event.bytes() {
        line += &format!(" bytes={bytes}");
    }
    if let Some(redop) = redop {
        line += &format!(" op={}", redop.name());
    }
    if let Some(peer) = peer {
        line += &format!(" peer={peer}");
    }
    line
}

fn describe(event: &ProbeEvent) -> String {
    match event {
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
            python_caller,
        } => format!(
            "[{}:{}] {} count={count} {} comm={comm:#x} stream={stream:#x} ret={result} call={:.1}us{}",
            timing.tgid,
            timing.tid,
            op.span_name(),
            collective_arguments(event, *datatype, *raw_datatype, *redop, *peer),
            us(timing.duration_ns()),
            called_from(python_caller)
        ),
        ProbeEvent::SyncWait {
            timing,
            kind,
            handle,
            result,
            python_caller,
        } => format!(
            "[{}:{}] {} handle={handle:#x} ret={result} wait={:.1}us{}",
            timing.tgid,
            timing.tid,
            kind.span_name(),
            us(timing.duration_ns()),
            called_from(python_caller)
        ),
        ProbeEvent::CommInit {
            timing,
            comm,
            rank,
            nranks,
            comm_id_hash,
            result,
        } => format!(
            "[{}:{}] nccl.comm_init_rank comm={comm:#x} rank={rank}/{nranks} id={comm_id_hash:016x} ret={result}",
            timing.tgid, timing.tid
        ),
        ProbeEvent::Group { timing, open } => format!(
            "[{}:{}] {}",
            timing.tgid,
            timing.tid,
            if *open {
                "nccl.group_start"
            } else {
                "nccl.group_end"
            }
        ),
        ProbeEvent::GlooCall { timing, op, .. } => format!(
            "[{}:{}] {} call={:.1}us",
            timing.tgid,
            timing.tid,
            op.gloo_span_name(),
            us(timing.duration_ns())
        ),
        ProbeEvent::Phase {
            tgid,
            tid,
            at_ns,
            launches,
            signal,
            ..
        } => format!("[{tgid}:{tid}] {signal:?} at={at_ns} launches={launches}"),
        ProbeEvent::RuleCall {
            tgid,
            tid,
            at_ns,
            rule,
            at_return,
            ..
        } => format!(
            "[{tgid}:{tid}] configured rule {} {} at={at_ns}",
            rule + 1,
            if *at_return { "return" } else { "entry" }
        ),
        ProbeEvent::EventRecorded {
            timing,
            event,
            stream,
        } => format!(
            "[{}:{}] cudaEventRecord event={event:#x} stream={stream:#x} (after a collective)",
            timing.tgid, timing.tid
        ),
        ProbeEvent::EventQueryComplete {
            timing,
            event,
            not_ready_ns,
        } => format!(
            "[{}:{}] cudaEventQuery event={event:#x} complete{}",
            timing.tgid,
            timing.tid,
            not_ready_ns.map_or_else(String::new, |at| format!(
                " (not ready {:.1}us before)",
                us(timing.end_ns.saturating_sub(at))
            ))
        ),
        ProbeEvent::PyStack {
            tgid, tid, frames, ..
        } => format!(
            "[{tgid}:{tid}] Python stack changed: {} frames",
            frames.len()
        ),
        ProbeEvent::ApiCall { .. } => describe_api_call(event),
    }
}

fn describe_api_call(event: &ProbeEvent) -> String {
    let ProbeEvent::ApiCall {
        timing,
        probe,
        args,
        out,
        result,
        memory,
    } = event
    else {
        return String::new();
    };
    let effect = memory.as_ref().map_or_else(String::new, |change| {
        format!(" bytes={} held={}", change.bytes, change.held)
    });
    format!(
        "[{}:{}] {} args={args:x?} out={out:#x} ret={result}{effect} call={:.1}us",
        timing.tgid,
        timing.tid,
        crate::probes::catalog::symbol(*probe),
        us(timing.duration_ns()),
    )
}

impl<W: Write> EventPrinter<W> {
    fn process_start(&mut self, process: &ProcessInfo) {
        let _ = writeln!(
            self.out,
            "lens-probe: tracing pid {} ({})",
            process.pid, process.name
        );
    }
    fn event(&mut self, event: &ProbeEvent) {
        let _ = writeln!(self.out, "lens-probe: {}", describe(event));
    }
}

impl<W: Write> EventSink for EventPrinter<W> {
    fn on(&mut self, input: &SinkInput<'_>) {
        match *input {
            SinkInput::ProcessStart(process) => self.process_start(process),
            SinkInput::Event(event) => self.event(event),
            _ => {}
        }
    }
}
