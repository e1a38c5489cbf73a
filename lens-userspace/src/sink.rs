//! The event stream's consumers. Everything downstream of decoding (the exit summary, the
//! verbose printer, later the span builder and the exporters) is an [`EventSink`].
use std::{collections::BTreeMap, io::Write};

use lens_common::ProbeId;

use crate::{
    events::ProbeEvent,
    hangs::{HangReport, Resolved},
    kernels::KernelLaunches,
    target::{ExitStatus, ProcessInfo},
};

/// How a traced process's tracing ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessEnd {
    pub pid: u32,
    /// Calls counted in the kernel (launches and every other probed call), by probe.
    pub calls: BTreeMap<ProbeId, u64>,
    /// `None` when tracing stopped while the process was still running.
    pub exit: Option<ExitStatus>,
}

pub trait EventSink {
    fn on_process_start(&mut self, _process: &ProcessInfo) {}
    /// A traced process replaced its program (`execve`); `process` describes the new one.
    fn on_process_exec(&mut self, _process: &ProcessInfo) {}
    fn on_event(&mut self, event: &ProbeEvent);
    /// The kernel's call counters of a running process so far (totals, by probe):
    /// launches are counted there, not sent as events.
    fn on_call_counts(&mut self, _pid: u32, _calls: &BTreeMap<ProbeId, u64>) {}
    /// The launch probes of `pid`'s libraries went in (`counting`) or out at `at_ns`
    /// (monotonic clock). `sampled`: an overhead budget moves them in and out.
    fn on_launch_counting(&mut self, _pid: u32, _counting: bool, _at_ns: u64, _sampled: bool) {}
    /// Launches per kernel of `pid` since the last call, by phase epoch: counted in the
    /// kernel, read by the session before the phase marks that may need them.
    fn on_kernel_launches(&mut self, _pid: u32, _launches: &[KernelLaunches]) {}
    fn on_process_end(&mut self, _end: &ProcessEnd) {}
    /// A collective found hung (`--hang-timeout`), with where its ranks are.
    fn on_hang(&mut self, _report: &HangReport) {}
    /// A hang reported before ended.
    fn on_hang_resolved(&mut self, _resolved: &Resolved) {}
}

impl<A: EventSink, B: EventSink> EventSink for (A, B) {
    fn on_process_start(&mut self, process: &ProcessInfo) {
        self.0.on_process_start(process);
        self.1.on_process_start(process);
    }
    fn on_process_exec(&mut self, process: &ProcessInfo) {
        self.0.on_process_exec(process);
        self.1.on_process_exec(process);
    }
    fn on_event(&mut self, event: &ProbeEvent) {
        self.0.on_event(event);
        self.1.on_event(event);
    }
    fn on_call_counts(&mut self, pid: u32, calls: &BTreeMap<ProbeId, u64>) {
        self.0.on_call_counts(pid, calls);
        self.1.on_call_counts(pid, calls);
    }
    fn on_launch_counting(&mut self, pid: u32, counting: bool, at_ns: u64, sampled: bool) {
        self.0.on_launch_counting(pid, counting, at_ns, sampled);
        self.1.on_launch_counting(pid, counting, at_ns, sampled);
    }
    fn on_kernel_launches(&mut self, pid: u32, launches: &[KernelLaunches]) {
        self.0.on_kernel_launches(pid, launches);
        self.1.on_kernel_launches(pid, launches);
    }
    fn on_process_end(&mut self, end: &ProcessEnd) {
        self.0.on_process_end(end);
        self.1.on_process_end(end);
    }
    fn on_hang(&mut self, report: &HangReport) {
        self.0.on_hang(report);
        self.1.on_hang(report);
    }
    fn on_hang_resolved(&mut self, resolved: &Resolved) {
        self.0.on_hang_resolved(resolved);
        self.1.on_hang_resolved(resolved);
    }
}

impl<S: EventSink + ?Sized> EventSink for &mut S {
    fn on_process_start(&mut self, process: &ProcessInfo) {
        (**self).on_process_start(process);
    }
    fn on_process_exec(&mut self, process: &ProcessInfo) {
        (**self).on_process_exec(process);
    }
    fn on_event(&mut self, event: &ProbeEvent) {
        (**self).on_event(event);
    }
    fn on_call_counts(&mut self, pid: u32, calls: &BTreeMap<ProbeId, u64>) {
        (**self).on_call_counts(pid, calls);
    }
    fn on_launch_counting(&mut self, pid: u32, counting: bool, at_ns: u64, sampled: bool) {
        (**self).on_launch_counting(pid, counting, at_ns, sampled);
    }
    fn on_kernel_launches(&mut self, pid: u32, launches: &[KernelLaunches]) {
        (**self).on_kernel_launches(pid, launches);
    }
    fn on_process_end(&mut self, end: &ProcessEnd) {
        (**self).on_process_end(end);
    }
    fn on_hang(&mut self, report: &HangReport) {
        (**self).on_hang(report);
    }
    fn on_hang_resolved(&mut self, resolved: &Resolved) {
        (**self).on_hang_resolved(resolved);
    }
}

impl<S: EventSink> EventSink for Option<S> {
    fn on_process_start(&mut self, process: &ProcessInfo) {
        if let Some(sink) = self {
            sink.on_process_start(process);
        }
    }
    fn on_process_exec(&mut self, process: &ProcessInfo) {
        if let Some(sink) = self {
            sink.on_process_exec(process);
        }
    }
    fn on_event(&mut self, event: &ProbeEvent) {
        if let Some(sink) = self {
            sink.on_event(event);
        }
    }
    fn on_call_counts(&mut self, pid: u32, calls: &BTreeMap<ProbeId, u64>) {
        if let Some(sink) = self {
            sink.on_call_counts(pid, calls);
        }
    }
    fn on_launch_counting(&mut self, pid: u32, counting: bool, at_ns: u64, sampled: bool) {
        if let Some(sink) = self {
            sink.on_launch_counting(pid, counting, at_ns, sampled);
        }
    }
    fn on_kernel_launches(&mut self, pid: u32, launches: &[KernelLaunches]) {
        if let Some(sink) = self {
            sink.on_kernel_launches(pid, launches);
        }
    }
    fn on_process_end(&mut self, end: &ProcessEnd) {
        if let Some(sink) = self {
            sink.on_process_end(end);
        }
    }
    fn on_hang(&mut self, report: &HangReport) {
        if let Some(sink) = self {
            sink.on_hang(report);
        }
    }
    fn on_hang_resolved(&mut self, resolved: &Resolved) {
        if let Some(sink) = self {
            sink.on_hang_resolved(resolved);
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

impl EventSink for EventLog {
    fn on_process_start(&mut self, process: &ProcessInfo) {
        self.started.push(process.clone());
    }
    fn on_event(&mut self, event: &ProbeEvent) {
        self.events.push(event.clone());
    }
    fn on_process_end(&mut self, end: &ProcessEnd) {
        self.ended.push(end.clone());
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

fn describe(event: &ProbeEvent) -> String {
    fn us(ns: u64) -> f64 {
        ns as f64 / 1_000.0
    }
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
            ..
        } => {
            let dtype =
                datatype.map_or_else(|| format!("dtype({raw_datatype})"), |d| d.name().into());
            let mut line = format!(
                "[{}:{}] {} count={count} dtype={dtype}",
                timing.tgid,
                timing.tid,
                op.span_name()
            );
            if let Some(bytes) = event.bytes() {
                line += &format!(" bytes={bytes}");
            }
            if let Some(redop) = redop {
                line += &format!(" op={}", redop.name());
            }
            if let Some(peer) = peer {
                line += &format!(" peer={peer}");
            }
            line + &format!(
                " comm={comm:#x} stream={stream:#x} ret={result} call={:.1}us",
                us(timing.duration_ns())
            )
        }
        ProbeEvent::SyncWait {
            timing,
            kind,
            handle,
            result,
            ..
        } => format!(
            "[{}:{}] {} handle={handle:#x} ret={result} wait={:.1}us",
            timing.tgid,
            timing.tid,
            kind.span_name(),
            us(timing.duration_ns())
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
        ProbeEvent::PythonCaller {
            tgid,
            tid,
            function,
            file,
            ..
        } => format!("[{tgid}:{tid}] called from Python {function} ({file})"),
        ProbeEvent::PyStack {
            tgid, tid, frames, ..
        } => format!(
            "[{tgid}:{tid}] Python stack changed: {} frames",
            frames.len()
        ),
        ProbeEvent::LinkMapChanged { tgid, .. } => format!("[{tgid}] libraries changed"),
        ProbeEvent::ProcessForked { parent, child } => format!("[{parent}] forked {child}"),
        ProbeEvent::ProcessExec { tgid, .. } => format!("[{tgid}] exec"),
        ProbeEvent::ProcessExit { tgid, wait_status } => {
            format!(
                "[{tgid}] exit {:?}",
                ExitStatus::from_wait_status(*wait_status)
            )
        }
    }
}

impl<W: Write> EventSink for EventPrinter<W> {
    fn on_process_start(&mut self, process: &ProcessInfo) {
        let _ = writeln!(
            self.out,
            "lens-probe: tracing pid {} ({})",
            process.pid, process.name
        );
    }
    fn on_event(&mut self, event: &ProbeEvent) {
        let _ = writeln!(self.out, "lens-probe: {}", describe(event));
    }
}
