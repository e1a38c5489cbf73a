//! Decoding: raw [`Event`] records from the ring buffer into typed [`ProbeEvent`]s, the
//! stream every consumer (summary, span builder, exporters) reads.
use lens_common::{
    Event, EventKind, NONE_I32, PY_MAX_DEPTH, PY_MAX_WALK, ProbeId, PyStack, RULE_ARGS, rule_index,
};
use serde::Serialize;

use crate::nccl::{DataType, RedOp};

pub use crate::probes::calls::{CollectiveOp, SyncKind};

/// The communicator identity of a gloo call, for its span and for hang detection:
/// numbered by the hang watcher (`hangs::HangWatcher::observe`), which sees every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlooComm {
    pub id: u64,
    pub rank: i32,
    pub seq: u64,
}

/// A torch `record_function` scope, by what its name says about the training loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TorchScope {
    /// `enumerate(DataLoader)#…__next__`: a batch fetch.
    DataLoaderNext,
    /// `Optimizer.step#…`.
    OptimizerStep,
    /// `Optimizer.zero_grad#…`.
    OptimizerZeroGrad,
    /// The start of a wrapped model's forward pass: `DistributedDataParallel.forward`,
    /// FSDP2's `FSDP::root_pre_forward`. Where a step starts when no batch is fetched
    /// from a DataLoader.
    ForwardPass,
    /// Any other scope (a user's own `record_function`, profiler regions).
    Other,
}

impl TorchScope {
    /// Name prefixes torch's own Python code gives these scopes.
    const DATALOADER_PREFIX: &str = "enumerate(DataLoader)#";
    const OPTIMIZER_STEP_PREFIX: &str = "Optimizer.step#";
    const OPTIMIZER_ZERO_GRAD_PREFIX: &str = "Optimizer.zero_grad#";
    const FORWARD_PASS_PREFIXES: [&str; 2] =
        ["DistributedDataParallel.forward", "FSDP::root_pre_forward"];

    pub fn from_name(name: &str) -> TorchScope {
        if name.starts_with(Self::DATALOADER_PREFIX) {
            TorchScope::DataLoaderNext
        } else if name.starts_with(Self::OPTIMIZER_STEP_PREFIX) {
            TorchScope::OptimizerStep
        } else if name.starts_with(Self::OPTIMIZER_ZERO_GRAD_PREFIX) {
            TorchScope::OptimizerZeroGrad
        } else if Self::FORWARD_PASS_PREFIXES
            .iter()
            .any(|prefix| name.starts_with(prefix))
        {
            TorchScope::ForwardPass
        } else {
            TorchScope::Other
        }
    }
}

/// A training-phase boundary seen in the target (one function entry or return).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "signal", rename_all = "snake_case")]
pub enum PhaseSignal {
    ScopeEnter {
        scope: TorchScope,
        name: String,
    },
    ScopeExit,
    /// `Engine::execute` with `accumulate_grad`: `.backward()`, a backward pass.
    BackwardStart,
    /// `Engine::execute` without it: `torch.autograd.grad` (AOTAutograd's graph
    /// capture, a gradient penalty), not a backward pass of the step.
    GradientStart,
    /// The return of either.
    BackwardEnd,
    GradMode {
        enabled: bool,
    },
    CheckpointWriteStart,
    CheckpointWriteEnd,
    CheckpointReadStart,
    CheckpointReadEnd,
    /// A file created (libc `open`/`openat` with `O_CREAT`): counted by the checkpoint
    /// open on the thread, if any; never a phase of its own.
    FileCreated,
    /// A file opened for reading inside a framework load: counted by the load open on
    /// the thread, if any; never a phase of its own.
    FileRead,
}

/// Where and when: common to every event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CallTiming {
    pub tgid: u32,
    pub tid: u32,
    /// CLOCK_MONOTONIC ns at entry and at return.
    pub start_ns: u64,
    pub end_ns: u64,
}

impl CallTiming {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

/// The Python function that made a native call: the code object the kernel read from
/// the calling thread's innermost frame, named by the session before any sink sees the
/// call.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PythonCaller {
    /// Not a sampled CPython thread, or no frame.
    #[default]
    None,
    /// The code object's address, not (yet) named.
    Code(u64),
    /// Named: `code.function` and `code.filepath`.
    Named { function: String, file: String },
}

impl PythonCaller {
    /// As the kernel sent it: 0 is no caller.
    pub fn from_code(code: u64) -> PythonCaller {
        match code {
            0 => PythonCaller::None,
            code => PythonCaller::Code(code),
        }
    }
}

/// A ring-buffer record, decoded: a process-lifecycle notice the session acts on, or
/// what traced code did, for the sinks.
#[derive(Clone, Debug, PartialEq)]
pub enum Decoded {
    Control(ControlEvent),
    Probe(ProbeEvent),
}

/// Process-lifecycle notices from the kernel. The session acts on them (targets,
/// attaching, exits); no sink sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ControlEvent {
    /// `tgid`'s dynamic loader mapped or unmapped libraries.
    LinkMapChanged {
        tgid: u32,
        /// The process is stopped until the loader resumes it.
        stopped: bool,
        /// A target (else a process seen by node-wide discovery).
        traced: bool,
    },
    /// Traced process `parent` forked `child`, which is traced from now on.
    ProcessForked { parent: u32, child: u32 },
    /// Traced process `tgid` called `execve`: it runs another program now.
    ProcessExec {
        tgid: u32,
        /// A target (else a process seen by node-wide discovery).
        traced: bool,
    },
    /// Traced process `tgid` exited with this wait status (as `waitpid` gives it).
    ProcessExit { tgid: u32, wait_status: i32 },
}

/// What traced code did, as the sinks see it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ProbeEvent {
    Collective {
        #[serde(flatten)]
        timing: CallTiming,
        op: CollectiveOp,
        count: u64,
        /// `None` for a datatype value NCCL does not define (then bytes are unknown).
        datatype: Option<DataType>,
        raw_datatype: i32,
        redop: Option<RedOp>,
        /// Root of Broadcast/Reduce, peer of Send/Recv.
        peer: Option<i32>,
        comm: u64,
        stream: u64,
        result: i32,
        /// The Python function that made the call (sampled CPython processes).
        python_caller: PythonCaller,
    },
    SyncWait {
        #[serde(flatten)]
        timing: CallTiming,
        kind: SyncKind,
        /// The stream or event waited on (0 for device-wide).
        handle: u64,
        result: i32,
        /// As for collectives.
        python_caller: PythonCaller,
    },
    CommInit {
        #[serde(flatten)]
        timing: CallTiming,
        comm: u64,
        rank: i32,
        nranks: i32,
        comm_id_hash: u64,
        result: i32,
    },
    Group {
        #[serde(flatten)]
        timing: CallTiming,
        open: bool,
    },
    /// A `c10d::ProcessGroupGloo` collective call, entry to return (the call enqueues
    /// the work; its arguments are not decoded).
    GlooCall {
        #[serde(flatten)]
        timing: CallTiming,
        op: CollectiveOp,
        /// The `c10d::ProcessGroupGloo` object the call was made on (its address in
        /// the process): one per process group.
        group: u64,
        /// Its communicator and number across the job's ranks, when known (the session
        /// fills it in: `hangs::HangWatcher::observe`).
        #[serde(skip)]
        comm: Option<GlooComm>,
    },
    Phase {
        tgid: u32,
        tid: u32,
        at_ns: u64,
        /// The process's kernel launches counted so far (0 while none is counted).
        launches: u64,
        /// The phase epoch this mark opens (`lens_common::Event::epoch`): launches per
        /// kernel are counted per epoch.
        epoch: u64,
        #[serde(flatten)]
        signal: PhaseSignal,
    },
    /// `cudaEventRecord` of `event` on `stream`, sent when the stream holds collectives
    /// no event was recorded after yet (they complete when the event does), or when the
    /// event was such an event before (it now stands for later work).
    EventRecorded {
        #[serde(flatten)]
        timing: CallTiming,
        event: u64,
        stream: u64,
    },
    /// The first `cudaEventQuery` that found an event recorded after collectives
    /// complete (entry to return).
    EventQueryComplete {
        #[serde(flatten)]
        timing: CallTiming,
        event: u64,
        /// Entry time of the last query that found it not ready (the collectives had not
        /// completed then), if one did.
        not_ready_ns: Option<u64>,
    },
    /// A Python thread's frames at a sample, innermost first, when they changed since
    /// its last sample (`python` module).
    PyStack {
        tgid: u32,
        tid: u32,
        /// Taken at a probed call's entry (its frame chain complete), not by the clock.
        synchronous: bool,
        at_ns: u64,
        /// The process's launches so far and the phase epoch the sample opens.
        launches: u64,
        epoch: u64,
        frames: Vec<PyFrame>,
    },
    /// Entry or return of a function a configured probe rule names (`crate::settings::config`).
    RuleCall {
        tgid: u32,
        tid: u32,
        at_ns: u64,
        /// The process's kernel launches counted so far.
        launches: u64,
        /// The phase epoch this call's entry or return opens, as a phase mark's.
        epoch: u64,
        /// The rule's index (`NativeRule::index`).
        rule: u32,
        at_return: bool,
        /// The six argument registers at entry (zero at return).
        args: [u64; RULE_ARGS],
        /// The argument the rule reads as a string, when it was readable (entry only).
        text: Option<String>,
        /// The return value register (return only).
        ret: i64,
    },
}

impl ProbeEvent {
    pub fn tgid(&self) -> u32 {
        match self {
            ProbeEvent::Collective { timing, .. }
            | ProbeEvent::SyncWait { timing, .. }
            | ProbeEvent::CommInit { timing, .. }
            | ProbeEvent::Group { timing, .. }
            | ProbeEvent::GlooCall { timing, .. }
            | ProbeEvent::EventRecorded { timing, .. }
            | ProbeEvent::EventQueryComplete { timing, .. } => timing.tgid,
            ProbeEvent::Phase { tgid, .. }
            | ProbeEvent::RuleCall { tgid, .. }
            | ProbeEvent::PyStack { tgid, .. } => *tgid,
        }
    }

    /// (tgid, tid, start) of a native call or phase mark a thread made.
    pub fn thread_start(&self) -> Option<(u32, u32, u64)> {
        match self {
            ProbeEvent::Collective { timing, .. }
            | ProbeEvent::SyncWait { timing, .. }
            | ProbeEvent::Group { timing, .. }
            | ProbeEvent::GlooCall { timing, .. } => {
                Some((timing.tgid, timing.tid, timing.start_ns))
            }
            ProbeEvent::Phase {
                tgid, tid, at_ns, ..
            } => Some((*tgid, *tid, *at_ns)),
            _ => None,
        }
    }

    /// Bytes a collective moves from this rank's point of view: `count × sizeof(dtype)`
    /// with the count the call was given (the send count for AllGather, the receive count
    /// for ReduceScatter, as NCCL's API takes them).
    pub fn bytes(&self) -> Option<u64> {
        match self {
            ProbeEvent::Collective {
                count,
                datatype: Some(datatype),
                ..
            } => Some(count.saturating_mul(datatype.size_bytes())),
            _ => None,
        }
    }
}

/// Why a ring buffer record could not be decoded (counted, never silently dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    TooShort(usize),
    UnknownKind(u32),
    UnknownProbe(u32),
}

fn opt_i32(value: i32) -> Option<i32> {
    (value != NONE_I32).then_some(value)
}

/// One Python frame of a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PyFrame {
    /// The code object (what the function is).
    pub code: u64,
    /// The frame (where this call lives) and its first local slot (which call it is).
    pub frame: u64,
    pub first_local: u64,
}

/// Decodes one ring buffer record.
pub fn decode(bytes: &[u8]) -> Result<Decoded, DecodeError> {
    let kind = bytes
        .get(..4)
        .map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")));
    if kind == Some(EventKind::PyStack as u32) {
        if bytes.len() < size_of::<PyStack>() {
            return Err(DecodeError::TooShort(bytes.len()));
        }
        // SAFETY: length checked; plain integers, valid for any bit pattern.
        let raw: PyStack = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        return Ok(Decoded::Probe(decode_py_stack(&raw)));
    }
    if bytes.len() < size_of::<Event>() {
        return Err(DecodeError::TooShort(bytes.len()));
    }
    // SAFETY: length checked; Event is plain integers, valid for any bit pattern;
    // read_unaligned because the ring buffer only guarantees 8-byte alignment.
    let raw: Event = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    decode_event(&raw)
}

pub fn decode_py_stack(raw: &PyStack) -> ProbeEvent {
    // The frames kept, innermost first: the last PY_MAX_DEPTH walked, by slot.
    let walked = (raw.depth as usize).min(PY_MAX_WALK);
    let kept = walked.min(PY_MAX_DEPTH);
    ProbeEvent::PyStack {
        tgid: raw.tgid,
        tid: raw.tid,
        synchronous: raw.synchronous != 0,
        at_ns: raw.at_ns,
        launches: raw.launches,
        epoch: raw.epoch,
        frames: (walked - kept..walked)
            .map(|i| {
                let slot = i % PY_MAX_DEPTH;
                PyFrame {
                    code: raw.code[slot],
                    frame: raw.frame[slot],
                    first_local: raw.first_local[slot],
                }
            })
            .collect(),
    }
}

pub fn decode_event(raw: &Event) -> Result<Decoded, DecodeError> {
    let kind = EventKind::from_u32(raw.kind).ok_or(DecodeError::UnknownKind(raw.kind))?;
    Ok(match control_event(kind, raw) {
        Some(control) => Decoded::Control(control),
        None => Decoded::Probe(probe_event(kind, raw)?),
    })
}

/// The process-lifecycle notices: from the scheduler's tracepoints and the dynamic
/// loader's probe.
fn control_event(kind: EventKind, raw: &Event) -> Option<ControlEvent> {
    Some(match kind {
        EventKind::ProcessForked => ControlEvent::ProcessForked {
            parent: raw.count as u32,
            child: raw.tgid,
        },
        EventKind::ProcessExec => ControlEvent::ProcessExec {
            tgid: raw.tgid,
            traced: raw.peer == 1,
        },
        EventKind::ProcessExit => ControlEvent::ProcessExit {
            tgid: raw.tgid,
            wait_status: raw.count as i32,
        },
        EventKind::LinkMapChanged => ControlEvent::LinkMapChanged {
            tgid: raw.tgid,
            stopped: raw.count == 1,
            traced: raw.peer == 1,
        },
        _ => return None,
    })
}

fn probe_event(kind: EventKind, raw: &Event) -> Result<ProbeEvent, DecodeError> {
    // A configured rule's call: its probe field is the rule, not a catalog probe.
    if kind == EventKind::RuleCall {
        let rule = rule_index(raw.probe).ok_or(DecodeError::UnknownProbe(raw.probe))?;
        let at_return = raw.at_return != 0;
        let len = (raw.name_len as usize).min(raw.name.len());
        return Ok(ProbeEvent::RuleCall {
            tgid: raw.tgid,
            tid: raw.tid,
            at_ns: raw.start_ns,
            launches: raw.launches,
            epoch: raw.epoch,
            rule,
            at_return,
            args: raw.args,
            text: (!at_return && len > 0)
                .then(|| String::from_utf8_lossy(&raw.name[..len]).into_owned()),
            ret: raw.ret,
        });
    }
    let probe = ProbeId::from_u32(raw.probe).ok_or(DecodeError::UnknownProbe(raw.probe))?;
    let timing = CallTiming {
        tgid: raw.tgid,
        tid: raw.tid,
        start_ns: raw.start_ns,
        end_ns: raw.end_ns,
    };
    let result = raw.ret as i32;
    Ok(match kind {
        EventKind::Collective if CollectiveOp::from_gloo_probe(probe).is_some() => {
            ProbeEvent::GlooCall {
                timing,
                op: CollectiveOp::from_gloo_probe(probe)
                    .ok_or(DecodeError::UnknownProbe(raw.probe))?,
                group: raw.comm,
                comm: None,
            }
        }
        EventKind::Collective => ProbeEvent::Collective {
            timing,
            op: CollectiveOp::from_probe(probe).ok_or(DecodeError::UnknownProbe(raw.probe))?,
            count: raw.count,
            datatype: DataType::from_raw(raw.datatype),
            raw_datatype: raw.datatype,
            redop: RedOp::from_raw(raw.redop),
            peer: opt_i32(raw.peer),
            comm: raw.comm,
            stream: raw.handle,
            result,
            python_caller: PythonCaller::from_code(raw.python_caller),
        },
        EventKind::SyncWait => ProbeEvent::SyncWait {
            timing,
            kind: SyncKind::from_probe(probe).ok_or(DecodeError::UnknownProbe(raw.probe))?,
            handle: raw.handle,
            result,
            python_caller: PythonCaller::from_code(raw.python_caller),
        },
        EventKind::CommInit => ProbeEvent::CommInit {
            timing,
            comm: raw.comm,
            rank: raw.rank,
            nranks: raw.nranks,
            comm_id_hash: raw.comm_id_hash,
            result,
        },
        EventKind::Group => ProbeEvent::Group {
            timing,
            open: raw.group_open != 0,
        },
        EventKind::CudaEvent => match probe {
            ProbeId::CudaEventRecord | ProbeId::CudaEventRecordWithFlags => {
                ProbeEvent::EventRecorded {
                    timing,
                    event: raw.handle,
                    stream: raw.stream,
                }
            }
            ProbeId::CudaEventQuery => ProbeEvent::EventQueryComplete {
                timing,
                event: raw.handle,
                not_ready_ns: (raw.not_ready_ns != 0).then_some(raw.not_ready_ns),
            },
            _ => return Err(DecodeError::UnknownProbe(raw.probe)),
        },
        EventKind::ProcessForked
        | EventKind::ProcessExec
        | EventKind::ProcessExit
        | EventKind::LinkMapChanged
        | EventKind::RuleCall => {
            unreachable!("decoded above")
        }
        // Another record type: only `decode` (from bytes) reads it.
        EventKind::PyStack => return Err(DecodeError::UnknownKind(raw.kind)),
        EventKind::PhaseMark => ProbeEvent::Phase {
            tgid: raw.tgid,
            tid: raw.tid,
            at_ns: raw.start_ns,
            launches: raw.launches,
            epoch: raw.epoch,
            signal: phase_signal(probe, raw).ok_or(DecodeError::UnknownProbe(raw.probe))?,
        },
    })
}

fn phase_signal(probe: ProbeId, raw: &Event) -> Option<PhaseSignal> {
    let at_return = raw.at_return != 0;
    Some(match (probe, at_return) {
        (ProbeId::TorchScopeEnter, false) => {
            let len = (raw.name_len as usize).min(raw.name.len());
            let name = String::from_utf8_lossy(&raw.name[..len]).into_owned();
            PhaseSignal::ScopeEnter {
                scope: TorchScope::from_name(&name),
                name,
            }
        }
        (ProbeId::TorchScopeExit, false) => PhaseSignal::ScopeExit,
        // `accumulate_grad`, read from the stack by the entry program.
        (ProbeId::TorchBackward, false) if raw.count & 0xff != 0 => PhaseSignal::BackwardStart,
        (ProbeId::TorchBackward, false) => PhaseSignal::GradientStart,
        (ProbeId::TorchBackward, true) => PhaseSignal::BackwardEnd,
        // `bool` in the low byte of the first argument register.
        (ProbeId::TorchGradMode, false) => PhaseSignal::GradMode {
            enabled: raw.count & 0xff != 0,
        },
        // The `AutogradState` passed by value: grad mode is its first bit.
        (ProbeId::TorchInferenceMode, false) => PhaseSignal::GradMode {
            enabled: raw.count & 1 != 0,
        },
        (ProbeId::CheckpointWriterOpen | ProbeId::SafetensorsSerializeFile, false) => {
            PhaseSignal::CheckpointWriteStart
        }
        (ProbeId::SafetensorsSerializeFile, true) => PhaseSignal::CheckpointWriteEnd,
        (ProbeId::SafetensorsOpen, false) => PhaseSignal::CheckpointReadStart,
        (ProbeId::SafetensorsClose, true) => PhaseSignal::CheckpointReadEnd,
        (ProbeId::CheckpointWriterClose, true) => PhaseSignal::CheckpointWriteEnd,
        (ProbeId::CheckpointReaderOpen, false) => PhaseSignal::CheckpointReadStart,
        (ProbeId::CheckpointReaderClose, true) => PhaseSignal::CheckpointReadEnd,
        // The open flags, kept by the entry program.
        (ProbeId::FileOpen | ProbeId::FileOpenAt, false)
            if raw.args[0] & lens_common::open_flags::CREAT != 0 =>
        {
            PhaseSignal::FileCreated
        }
        (ProbeId::FileOpen | ProbeId::FileOpenAt, false) => PhaseSignal::FileRead,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw_allreduce() -> Event {
        let mut raw = Event::zeroed();
        raw.kind = EventKind::Collective as u32;
        raw.probe = ProbeId::NcclAllReduce as u32;
        raw.tgid = 10;
        raw.tid = 11;
        raw.start_ns = 1_000;
        raw.end_ns = 3_500;
        raw.count = 1024;
        raw.datatype = 7;
        raw.redop = 0;
        raw.comm = 0xC0FFEE00;
        raw.handle = 0x5000;
        raw
    }

    fn as_bytes(raw: &Event) -> &[u8] {
        // SAFETY: Event is plain data without padding.
        unsafe { std::slice::from_raw_parts((raw as *const Event).cast(), size_of::<Event>()) }
    }

    #[test]
    fn allreduce_decodes_with_bytes_and_duration() {
        let Ok(Decoded::Probe(event)) = decode(as_bytes(&raw_allreduce())) else {
            panic!("not a probe event");
        };
        assert_eq!(event.bytes(), Some(4096));
        match event {
            ProbeEvent::Collective {
                timing,
                op,
                redop,
                peer,
                stream,
                ..
            } => {
                assert_eq!(op, CollectiveOp::AllReduce);
                assert_eq!(redop, Some(RedOp::Sum));
                assert_eq!(peer, None);
                assert_eq!(stream, 0x5000);
                assert_eq!(timing.duration_ns(), 2_500);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn process_lifecycle_records_are_control_events() {
        let mut raw = raw_allreduce();
        raw.kind = EventKind::ProcessExit as u32;
        raw.count = 9;
        assert_eq!(
            decode_event(&raw),
            Ok(Decoded::Control(ControlEvent::ProcessExit {
                tgid: 10,
                wait_status: 9
            }))
        );
    }

    #[test]
    fn malformed_records_are_reported_not_guessed() {
        assert_eq!(decode(&[0u8; 8]), Err(DecodeError::TooShort(8)));
        let mut raw = raw_allreduce();
        raw.kind = 99;
        assert_eq!(decode_event(&raw), Err(DecodeError::UnknownKind(99)));
        let mut raw = raw_allreduce();
        raw.probe = ProbeId::CudaLaunchKernel as u32;
        assert_eq!(decode_event(&raw), Err(DecodeError::UnknownProbe(0)));
    }

    #[test]
    fn unknown_datatype_keeps_the_raw_value_and_no_bytes() {
        let mut raw = raw_allreduce();
        raw.datatype = 42;
        let Ok(Decoded::Probe(event)) = decode_event(&raw) else {
            panic!("not a probe event");
        };
        assert_eq!(event.bytes(), None);
        assert!(matches!(
            event,
            ProbeEvent::Collective {
                raw_datatype: 42,
                ..
            }
        ));
    }
}
