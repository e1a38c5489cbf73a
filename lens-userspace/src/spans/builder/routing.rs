//! The builder as an [`EventSink`](crate::sink::EventSink): each event routed to what it changes.

use crate::spans::{
    AttrValue, Attributes, SpanEvent, SpanExporter, monotonic_now_ns, names, pending::Waits,
    straggler_cause::PhaseCall,
};
use crate::{
    events::{ProbeEvent, PythonCaller},
    hangs::{HangReport, Resolved},
    semconv,
    sink::{EventSink, ProcessEnd, SinkInput},
    sys::target::ProcessInfo,
};

use super::*;

impl<E: SpanExporter> SpanBuilder<E> {
    fn process_start(&mut self, process: &ProcessInfo) {
        self.start_process(process, monotonic_now_ns());
    }

    fn process_exec(&mut self, process: &ProcessInfo) {
        self.exec_process(process, monotonic_now_ns());
    }

    fn event(&mut self, event: &ProbeEvent) {
        self.record_call_time(event);
        match event {
            ProbeEvent::Phase {
                tgid,
                tid,
                at_ns,
                launches,
                epoch,
                signal,
            } => self.on_phase(*tgid, *tid, *at_ns, *launches, *epoch, signal),
            ProbeEvent::Collective { .. } => self.on_collective(event),
            ProbeEvent::GlooCall {
                timing, op, comm, ..
            } => self.on_gloo_call(timing, *op, comm.as_ref()),
            ProbeEvent::SyncWait {
                timing,
                kind,
                handle,
                result,
                python_caller,
            } => {
                let mut attributes = vec![(semconv::CUDA_SYNC_KIND, kind.name().into())];
                attributes.extend(python_caller_attributes(python_caller));
                self.on_call(timing, kind.span_name(), attributes, *result);
                if *result == 0 {
                    let released = self.collectives.sync_returned(
                        timing.tgid,
                        *kind,
                        *handle,
                        timing.end_ns,
                        &mut self.pending,
                    );
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
                    &mut self.pending,
                );
                self.send_released(released);
            }
            ProbeEvent::CommInit { .. } => self.on_comm_init(event),
            ProbeEvent::Group { .. } | ProbeEvent::PyStack { .. } => {}
            ProbeEvent::RuleCall { .. } => self.on_rule_call(event),
            ProbeEvent::ApiCall {
                timing,
                probe,
                result,
                memory: Some(change),
                ..
            } => self.on_memory_call(timing, *probe, *result, change),
            ProbeEvent::ApiCall {
                timing,
                probe,
                result,
                ..
            } => self.on_graph_call(timing, *probe, *result),
        }
    }

    /// Where each step's time goes, for the stragglers' causes: calls as they return.
    fn record_call_time(&mut self, event: &ProbeEvent) {
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
    }

    /// An NCCL collective returned: its span goes to the collective tracker, which holds
    /// it until its completion and the other ranks are known.
    fn on_collective(&mut self, event: &ProbeEvent) {
        let ProbeEvent::Collective {
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
        } = event
        else {
            return;
        };
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
        attributes.extend(python_caller_attributes(python_caller));
        let Some((record, placement)) =
            self.call_record(timing, op.span_name(), attributes, *result)
        else {
            return;
        };
        let key = self.pending.hold(
            record,
            Waits {
                end: true,
                placement,
            },
        );
        let released = self.collectives.add(
            key,
            *op,
            *stream,
            communicator,
            &self.exporter.history,
            &mut self.pending,
        );
        self.send_released(released);
        self.bound_held(timing.tgid, timing.end_ns);
    }

    fn on_gloo_call(
        &mut self,
        timing: &crate::events::CallTiming,
        op: crate::events::CollectiveOp,
        comm: Option<&crate::events::GlooComm>,
    ) {
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

    /// `ncclCommInitRank` returned: the communicator is known to the collective tracker
    /// and to the process's later collectives, and the call is a span of its own.
    fn on_comm_init(&mut self, event: &ProbeEvent) {
        let ProbeEvent::CommInit {
            timing,
            comm,
            rank,
            nranks,
            comm_id_hash,
            result,
        } = event
        else {
            return;
        };
        if *result == 0 {
            self.collectives
                .comm_init(timing.tgid, *comm, *comm_id_hash);
        }
        if let (Some(process), Some(communicator)) =
            (self.processes.get_mut(&timing.tgid), event.communicator())
        {
            process.communicators.insert(*comm, communicator);
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

    fn call_counts(
        &mut self,
        pid: u32,
        calls: &std::collections::BTreeMap<lens_common::ProbeId, u64>,
    ) {
        if self.pending.exporting(pid) {
            self.exporter.process_calls(pid, calls);
        }
        // Read periodically while processes run: collectives held too long go out, and
        // calls whose phase never became known.
        let now = monotonic_now_ns();
        let released = self.collectives.expire(now, &mut self.pending);
        self.send_released(released);
        self.bound_held(pid, now);
    }

    fn launch_counting(&mut self, pid: u32, counting: bool, at_ns: u64, sampled: bool) {
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

    fn kernel_launches(&mut self, pid: u32, launches: &[crate::gpu_kernels::KernelLaunches]) {
        if let Some(process) = self.processes.get_mut(&pid) {
            let ledger = process.arena.launches_mut();
            for kernel in launches {
                ledger.add_kernel_launches(kernel.epoch, kernel.name.clone(), kernel.launches);
            }
        }
    }

    fn process_end(&mut self, end: &ProcessEnd) {
        self.end_process_with_calls(end.pid, end.exit, monotonic_now_ns(), &end.calls);
    }

    /// Each traced rank's process gets a `lens_probe.hang` span at once (error status,
    /// from the first arrival to the finding, under its `train.job`), and the calls its
    /// ranks wait in get the event when they return.
    fn hang(&mut self, report: &HangReport) {
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
            self.pending.route(record, &mut self.exporter);
        }
    }

    fn hang_resolved(&mut self, resolved: &Resolved) {
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

impl<E: SpanExporter> EventSink for SpanBuilder<E> {
    fn on(&mut self, input: &SinkInput<'_>) {
        match *input {
            SinkInput::ProcessStart(process) => self.process_start(process),
            SinkInput::ProcessExec(process) => self.process_exec(process),
            SinkInput::Event(event) => self.event(event),
            SinkInput::CallCounts { pid, calls } => self.call_counts(pid, calls),
            SinkInput::ProbeCost { pid, cost } => {
                if self.pending.exporting(pid) {
                    self.exporter.process_probe_cost(pid, cost);
                }
            }
            SinkInput::LaunchCounting {
                pid,
                counting,
                at_ns,
                sampled,
            } => self.launch_counting(pid, counting, at_ns, sampled),
            SinkInput::KernelLaunches { pid, launches } => self.kernel_launches(pid, launches),
            SinkInput::ProcessEnd(end) => self.process_end(end),
            SinkInput::Hang(report) => self.hang(report),
            SinkInput::HangResolved(resolved) => self.hang_resolved(resolved),
        }
    }
}

/// `code.function` and `code.filepath` of the Python function that made a call, when
/// the session named it.
fn python_caller_attributes(caller: &PythonCaller) -> Attributes {
    match caller {
        PythonCaller::Named { function, file } => vec![
            (semconv::CODE_FUNCTION, function.as_str().into()),
            (semconv::CODE_FILEPATH, file.as_str().into()),
        ],
        PythonCaller::None | PythonCaller::Code(_) => Attributes::new(),
    }
}
