//! What the kernel saw, as every consumer (summary, span builder, exporters) reads it:
//! process-lifecycle notices for the session ([`ControlEvent`]) and what traced code did
//! ([`ProbeEvent`]), decoded from the ring buffer's records by [`decode`].
use lens_common::{ProbeId, RULE_ARGS, record::API_ARGS};
use serde::Serialize;

mod decode;
pub use decode::{decode, decode_batch, record_as_bytes};

use crate::calls::MemoryOp;
use crate::nccl::{DataType, RedOp};

pub use crate::calls::{CollectiveOp, SyncKind};

/// An NCCL communicator as its `ncclCommInitRank` described it: the one description the
/// span builder's registry, the collective tracker and the summary share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Communicator {
    /// The `ncclComm_t` handle, as the process's later calls pass it.
    #[serde(rename = "comm")]
    pub handle: u64,
    pub rank: i32,
    pub nranks: i32,
    /// A hash of the `ncclUniqueId`: the same on every rank of the communicator.
    pub id_hash: u64,
}

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
    CheckpointReadStart {
        /// The reader opens its file itself (safetensors' `safe_open`); `torch.load`'s
        /// file is opened by Python first, and its reader reads from that.
        own_file: bool,
    },
    CheckpointReadEnd,
    /// A file created (libc `open`/`openat` with `O_CREAT`): counted by the checkpoint
    /// open on the thread, if any; never a phase of its own.
    FileCreated {
        /// A hash of the path it was opened with (0: not read): a file created twice
        /// (fsspec's temporary file, then opened again to write) is one file.
        path: u32,
    },
    /// A file opened for reading inside a framework load: counted by the load open on
    /// the thread, if any; never a phase of its own.
    FileRead {
        /// A hash of the path it was opened with (0: not read).
        path: u32,
    },
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
        /// The phase epoch this mark opens (`lens_common::record::LaunchMark::epoch`): launches per
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
        /// The thread's previous clock sample, if it has not slept since: what this
        /// sample shows and that one did not began after it.
        since_ns: Option<u64>,
        /// The process's launches so far and the phase epoch the sample opens.
        launches: u64,
        epoch: u64,
        frames: Vec<PyFrame>,
    },
    /// Entry or return of a function a configured probe rule names (`crate::settings::probe_rules`).
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
        /// A sampled Python call's entry: the earliest it can have begun (the thread's
        /// sample before the one that first showed it; one sampling interval of the
        /// process's rate before it when the thread slept between), when known.
        since_ns: Option<u64>,
    },
    /// A library call of the generic kind, entry to return (the GPU memory calls): its
    /// probe says what it is (`probes::catalog::Role`), its arguments and result what it
    /// did.
    ApiCall {
        #[serde(flatten)]
        timing: CallTiming,
        #[serde(serialize_with = "probe_symbol")]
        probe: ProbeId,
        args: [u64; API_ARGS],
        /// What the call wrote through its out-pointer argument (an address, a handle).
        out: u64,
        result: i64,
        /// What a memory call did to its process's memory, filled in by the session
        /// (`gpu_memory::GpuMemory`) before any sink sees the call.
        memory: Option<MemoryChange>,
    },
}

impl ProbeEvent {
    /// The communicator a `ncclCommInitRank` made (`CommInit` only).
    pub fn communicator(&self) -> Option<Communicator> {
        match self {
            ProbeEvent::CommInit {
                comm,
                rank,
                nranks,
                comm_id_hash,
                ..
            } => Some(Communicator {
                handle: *comm,
                rank: *rank,
                nranks: *nranks,
                id_hash: *comm_id_hash,
            }),
            _ => None,
        }
    }

    pub fn tgid(&self) -> u32 {
        match self {
            ProbeEvent::Collective { timing, .. }
            | ProbeEvent::SyncWait { timing, .. }
            | ProbeEvent::CommInit { timing, .. }
            | ProbeEvent::Group { timing, .. }
            | ProbeEvent::GlooCall { timing, .. }
            | ProbeEvent::EventRecorded { timing, .. }
            | ProbeEvent::EventQueryComplete { timing, .. }
            | ProbeEvent::ApiCall { timing, .. } => timing.tgid,
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

/// One Python frame of a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PyFrame {
    /// The code object (what the function is).
    pub code: u64,
    /// The frame (where this call lives) and its first local slot (which call it is).
    pub frame: u64,
    pub first_local: u64,
}

/// What one memory call did to its process's device memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryChange {
    pub op: MemoryOp,
    /// Bytes the call asked for (an allocation, a creation, a mapping) or gave back (a
    /// free or release of memory seen allocated; 0 for one that was not).
    pub bytes: u64,
    /// Bytes the process holds after the call (allocated and created, not freed or
    /// released), and the most it held so far.
    pub held: u64,
    pub peak: u64,
    /// The call failed for want of memory: what the thread was running.
    pub out_of_memory: Option<OutOfMemory>,
}

/// A failed allocation: the Python stack of the thread that asked, read when lens-probe
/// got the failure (the stack reader of the hang reports), innermost first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OutOfMemory {
    pub python: Vec<String>,
}

/// A probe, as JSON shows it: the symbol it is on.
fn probe_symbol<S: serde::Serializer>(probe: &ProbeId, out: S) -> Result<S::Ok, S::Error> {
    out.serialize_str(crate::probes::catalog::symbol(*probe))
}
