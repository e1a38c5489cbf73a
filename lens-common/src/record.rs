//! What the kernel sends through the ring buffer: one record type per [`EventKind`], a
//! [`RecordHeader`] and a body sized to what that kind carries. A kind's body is its own
//! struct, so no field means one thing for one kind and another for the next, and a
//! group call takes 32 bytes where a flat record took 264.
//!
//! The kind is fixed by the body's type ([`Body::KIND`]): [`Record::new`] writes it, and
//! the decoder reads the header first and then the body the kind names.

use crate::{PY_MAX_DEPTH, RULE_ARGS, SCOPE_NAME_BYTES};

numbered! {
    /// What a ring buffer record describes: each kind has a body of its own, defined
    /// below, beside it.
    pub enum EventKind {
        /// An NCCL collective or point-to-point call, entry to return
        /// ([`CollectiveCall`]).
        Collective = 1,
        /// A call seen at its entry, arguments not decoded: gloo's collectives
        /// ([`TimedCall`]).
        TimedCall = 2,
        /// A CUDA synchronisation call, entry to return
        /// ([`SyncCall`]).
        SyncWait = 3,
        /// `ncclCommInitRank`, entry to return: communicator handle, rank, size, id hash
        /// ([`CommInitCall`]).
        CommInit = 4,
        /// The first successful `cudaEventQuery` of an event recorded after a collective,
        /// entry to return ([`EventQuery`]). Every other event
        /// call is only counted.
        EventQueried = 5,
        /// `ncclGroupStart` / `ncclGroupEnd`, entry only
        /// ([`GroupCall`]).
        Group = 6,
        /// `cudaEventRecord` binding an event to the collectives on a stream, or
        /// unbinding a re-recorded one ([`EventRecord`]).
        EventRecorded = 7,
        /// Entry of a function that marks a training phase boundary: torch scope exit,
        /// backward, grad mode, checkpoint files ([`PhaseEntry`]).
        /// Sent at once, like every mark, so the phases a later event falls in are
        /// already known when it arrives.
        PhaseEntry = 8,
        /// Return of a phase-marking function ([`PhaseReturn`]).
        PhaseReturn = 9,
        /// A torch `record_function` scope entered, with its name
        /// ([`ScopeEnter`]).
        ScopeEnter = 10,
        /// Entry of a function a configured probe rule names, with the first six integer
        /// arguments and the string the rule reads ([`RuleEntry`]).
        RuleEntry = 11,
        /// Return of such a function ([`RuleReturn`]).
        RuleReturn = 12,
        /// A Python thread's frame stack changed between two samples
        /// ([`PyStack`]).
        PyStack = 13,
        /// The target's set of loaded objects changed: rescan its mappings
        /// ([`LinkMapChange`]).
        LinkMapChanged = 14,
        /// A traced process forked a new process, already traced
        /// ([`Fork`]).
        ProcessForked = 15,
        /// A process replaced its program (`execve`) ([`Exec`]).
        ProcessExec = 16,
        /// A traced process exited, with its wait status ([`Exit`]).
        ProcessExit = 17,
        /// A library call whose arguments and result say what it did (the GPU memory
        /// calls), entry to return ([`ApiCall`]). One body for every such call: a new
        /// one is a catalog row and a component's handling, no new program or decoder.
        ApiCall = 18,
    }
}

/// What every record starts with.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    /// [`EventKind`] as u32: which body follows.
    pub kind: u32,
    /// The [`ProbeId`](crate::ProbeId) that fired, a configured rule's
    /// [`RULE_COOKIE_BASE`](crate::RULE_COOKIE_BASE)` + index`, or [`NO_PROBE`] for the
    /// scheduler's tracepoints.
    pub probe: u32,
    /// Process id (the kernel's tgid).
    pub tgid: u32,
    /// Thread id (the kernel's pid).
    pub tid: u32,
}

/// The header's `probe` of a record no probe sent (the scheduler's tracepoints).
pub const NO_PROBE: u32 = u32::MAX;

/// The header's `kind` of an `INFLIGHT_*` slot whose call has returned. A thread's slot
/// for a function stays in its map and its next call is written over it: no map entry is
/// made and freed per call. Such a slot is not a call in flight.
pub const RETURNED_KIND: u32 = u32::MAX;

/// A record: its header, then its kind's body.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record<B> {
    pub header: RecordHeader,
    pub body: B,
}

/// A record's body.
///
/// # Safety
/// Implementors are `#[repr(C)]` structs of integers without padding: every bit pattern
/// is a value, so a record can be read from any bytes of its size.
pub unsafe trait Body: Copy + 'static {
    /// The kind whose records carry this body.
    const KIND: EventKind;
    /// Every field zero (or "none").
    const EMPTY: Self;
}

impl<B: Body> Record<B> {
    /// A record of `B`'s kind, its body empty.
    pub const fn new(probe: u32, tgid: u32, tid: u32) -> Self {
        Record {
            header: RecordHeader {
                kind: B::KIND as u32,
                probe,
                tgid,
                tid,
            },
            body: B::EMPTY,
        }
    }

    /// Bytes the record takes in the ring buffer (with the buffer's own 8-byte header,
    /// rounded up to 8).
    pub const RING_BYTES: u64 = (core::mem::size_of::<Self>() as u64 + 8 + 7) & !7;
}

/// "No peer / no root / no op" in the signed fields of [`CollectiveCall`].
pub const NONE_I32: i32 = -1;

/// `CLOCK_MONOTONIC` at a call's entry and return, ns.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallTimes {
    pub start_ns: u64,
    pub end_ns: u64,
}

impl CallTimes {
    pub const ZERO: CallTimes = CallTimes {
        start_ns: 0,
        end_ns: 0,
    };
}

/// Where in the process's launches a mark was taken: phase boundaries, rule calls and
/// Python stacks may each start or end a span, whose launches are the difference
/// between two marks.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchMark {
    /// `CLOCK_MONOTONIC` ns of the mark.
    pub at_ns: u64,
    /// The process's kernel launches counted so far.
    pub launches: u64,
    /// The phase epoch this mark opens: every mark adds one, and each launch is counted
    /// per kernel under the epoch it ran in ([`KernelKey`](crate::KernelKey)).
    pub epoch: u64,
}

impl LaunchMark {
    pub const ZERO: LaunchMark = LaunchMark {
        at_ns: 0,
        launches: 0,
        epoch: 0,
    };
}

/// Makes the [`Body`] impls: each body, its kind and its empty value.
macro_rules! bodies {
    ($( $body:ident => $kind:ident { $($field:ident: $empty:expr),* $(,)? } )+) => {
        $(
            // SAFETY: each body is #[repr(C)] integers without padding (the size asserts
            // below check the sums).
            unsafe impl Body for $body {
                const KIND: EventKind = EventKind::$kind;
                const EMPTY: Self = $body { $($field: $empty),* };
            }
        )+

        /// The size of the record each kind sends: what the decoder checks a record's
        /// length against before reading its body.
        pub const fn record_bytes(kind: EventKind) -> usize {
            match kind {
                $( EventKind::$kind => core::mem::size_of::<Record<$body>>(), )+
            }
        }
    };
}

/// An NCCL collective or point-to-point call, entry to return.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveCall {
    pub times: CallTimes,
    /// Element count.
    pub count: u64,
    /// `ncclComm_t`.
    pub comm: u64,
    /// `cudaStream_t`.
    pub stream: u64,
    /// The code object of the Python function the calling thread was running (a sampled
    /// CPython process; 0 otherwise).
    pub python_caller: u64,
    /// `ncclDataType_t`.
    pub datatype: i32,
    /// `ncclRedOp_t` (AllReduce, Reduce, ReduceScatter), else [`NONE_I32`].
    pub redop: i32,
    /// Root (Broadcast, Reduce) or peer (Send, Recv), else [`NONE_I32`].
    pub peer: i32,
    /// `ncclResult_t`.
    pub result: i32,
}

/// A call seen at its entry alone, its arguments not decoded (gloo's collectives: their
/// tensors live behind C++ vectors, and no return probe may go where they throw). Its
/// times are both the entry's.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimedCall {
    pub times: CallTimes,
    /// The first argument: the `ProcessGroupGloo` of a member function, which tells a
    /// process's groups apart.
    pub object: u64,
}

/// A CUDA synchronisation call (stream, event, device), entry to return.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncCall {
    pub times: CallTimes,
    /// The stream or event waited on (0 for the device).
    pub handle: u64,
    /// As [`CollectiveCall::python_caller`].
    pub python_caller: u64,
    /// `cudaError_t`.
    pub result: i32,
    pub _pad: u32,
}

/// `ncclCommInitRank`, entry to return.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommInitCall {
    pub times: CallTimes,
    /// Where the call writes the new handle (its first argument), read at return.
    pub comm_out: u64,
    /// The `ncclComm_t` the call wrote.
    pub comm: u64,
    /// Hash of the 128-byte `ncclUniqueId` ([`comm_id_hash`](crate::comm_id_hash)).
    pub comm_id_hash: u64,
    pub nranks: i32,
    pub rank: i32,
    /// `ncclResult_t`.
    pub result: i32,
    pub _pad: u32,
}

/// The first successful `cudaEventQuery` of an event recorded after a collective, entry
/// to return.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventQuery {
    pub times: CallTimes,
    /// The `cudaEvent_t`.
    pub event: u64,
    /// Entry time of the last query that found the event not ready (0: none did): the
    /// collective had not completed then.
    pub not_ready_ns: u64,
}

/// `ncclGroupStart` / `ncclGroupEnd` (entry only).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupCall {
    pub at_ns: u64,
    /// 1 for `ncclGroupStart`, 0 for `ncclGroupEnd`.
    pub open: u32,
    pub _pad: u32,
}

/// `cudaEventRecord` of an event on a stream that holds a collective no event was
/// recorded after yet (or of such an event again: the binding ends).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventRecord {
    pub at_ns: u64,
    /// The `cudaEvent_t`.
    pub event: u64,
    /// The `cudaStream_t` it was recorded on.
    pub stream: u64,
}

/// The entry of a function that marks a phase boundary: torch scope exit, backward, grad
/// mode, checkpoint files.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhaseEntry {
    pub mark: LaunchMark,
    /// The one argument that tells what the mark means: `set_enabled`'s flag, the
    /// inference-mode state, backward's `accumulate_grad`, a file open's flags (0 for
    /// the others).
    pub argument: u64,
}

/// The return of a phase-marking function (end of a backward, of a checkpoint file).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhaseReturn {
    pub mark: LaunchMark,
}

/// A torch `record_function` scope entered, with its name.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScopeEnter {
    pub mark: LaunchMark,
    /// Length of the name, without the NUL.
    pub name_len: u32,
    pub _pad: u32,
    /// The name, NUL-terminated, truncated to [`SCOPE_NAME_BYTES`] - 1 bytes.
    pub name: [u8; SCOPE_NAME_BYTES],
}

/// The entry of a function a configured probe rule names (the header's `probe` is
/// [`RULE_COOKIE_BASE`](crate::RULE_COOKIE_BASE) + the rule's index).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleEntry {
    pub mark: LaunchMark,
    /// The first six integer arguments, as the registers held them.
    pub args: [u64; RULE_ARGS],
    /// Length of the string argument the rule reads (0: none), without the NUL.
    pub text_len: u32,
    pub _pad: u32,
    /// That string, NUL-terminated, truncated to [`SCOPE_NAME_BYTES`] - 1 bytes.
    pub text: [u8; SCOPE_NAME_BYTES],
}

/// The return of a function a configured probe rule names.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleReturn {
    pub mark: LaunchMark,
    /// The return value register.
    pub ret: i64,
}

/// A Python thread's frames at a sample, innermost first. Sent only when the stack
/// differs from the thread's last.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyStack {
    /// The sample, as a mark (a changed stack may start or end a span).
    pub mark: LaunchMark,
    /// Frames walked (at most [`PY_MAX_WALK`](crate::PY_MAX_WALK)); frame `i` from the
    /// innermost is in slot `i % PY_MAX_DEPTH`, so the last [`PY_MAX_DEPTH`] walked (the
    /// outermost) are kept.
    pub depth: u32,
    /// 1: taken at a probed call's entry, the thread stopped inside a C call the
    /// interpreter made (its frame chain complete); 0: by the clock, at any instruction
    /// (it can catch the chain mid-update).
    pub synchronous: u32,
    /// The thread's previous clock sample, when it has not slept since (0: none, or
    /// unknown): a frame this sample shows and that one did not began after it.
    pub since_ns: u64,
    /// Per frame slot: code object, frame address, first local slot.
    pub code: [u64; PY_MAX_DEPTH],
    pub frame: [u64; PY_MAX_DEPTH],
    pub first_local: [u64; PY_MAX_DEPTH],
}

/// The target's set of loaded objects changed: rescan its mappings.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkMapChange {
    /// 1: the process was stopped and waits for the loader's SIGCONT.
    pub stopped: u32,
    /// 1: a target; 0: any process, for node-wide discovery.
    pub traced: u32,
}

/// A traced process forked a new process (the header's `tgid` is the child, already
/// traced).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fork {
    pub parent: u32,
    pub _pad: u32,
}

/// Integer arguments an [`ApiCall`] keeps: the first four registers.
pub const API_ARGS: usize = 4;

/// A library call whose arguments and result say what it did, entry to return. Which
/// argument is an out-pointer to read at return is in the probe's attach cookie
/// ([`api_shape`](crate::api_shape)).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApiCall {
    pub times: CallTimes,
    /// The first [`API_ARGS`] integer arguments, as the registers held them at entry.
    pub args: [u64; API_ARGS],
    /// The 8 bytes behind the out-pointer argument, read at return (0: none, or not
    /// readable): the address or handle an allocation made.
    pub out: u64,
    /// The return value register (`cudaError_t`, `CUresult`).
    pub result: i64,
}

/// A process replaced its program (`execve`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exec {
    /// 1: a target; 0: any process, for node-wide discovery (its loader may be new).
    pub traced: u32,
    pub _pad: u32,
}

/// A traced process exited.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exit {
    /// Its wait status: exit code << 8, or the signal that killed it.
    pub wait_status: i32,
    pub _pad: u32,
}

bodies! {
    CollectiveCall => Collective {
        times: CallTimes::ZERO, count: 0, comm: 0, stream: 0, python_caller: 0,
        datatype: NONE_I32, redop: NONE_I32, peer: NONE_I32, result: 0,
    }
    TimedCall => TimedCall { times: CallTimes::ZERO, object: 0 }
    SyncCall => SyncWait {
        times: CallTimes::ZERO, handle: 0, python_caller: 0, result: 0, _pad: 0,
    }
    CommInitCall => CommInit {
        times: CallTimes::ZERO, comm_out: 0, comm: 0, comm_id_hash: 0,
        nranks: 0, rank: NONE_I32, result: 0, _pad: 0,
    }
    EventQuery => EventQueried { times: CallTimes::ZERO, event: 0, not_ready_ns: 0 }
    GroupCall => Group { at_ns: 0, open: 0, _pad: 0 }
    EventRecord => EventRecorded { at_ns: 0, event: 0, stream: 0 }
    PhaseEntry => PhaseEntry { mark: LaunchMark::ZERO, argument: 0 }
    PhaseReturn => PhaseReturn { mark: LaunchMark::ZERO }
    ScopeEnter => ScopeEnter {
        mark: LaunchMark::ZERO, name_len: 0, _pad: 0, name: [0; SCOPE_NAME_BYTES],
    }
    RuleEntry => RuleEntry {
        mark: LaunchMark::ZERO, args: [0; RULE_ARGS], text_len: 0, _pad: 0,
        text: [0; SCOPE_NAME_BYTES],
    }
    RuleReturn => RuleReturn { mark: LaunchMark::ZERO, ret: 0 }
    PyStack => PyStack {
        mark: LaunchMark::ZERO, depth: 0, synchronous: 0, since_ns: 0,
        code: [0; PY_MAX_DEPTH], frame: [0; PY_MAX_DEPTH], first_local: [0; PY_MAX_DEPTH],
    }
    LinkMapChange => LinkMapChanged { stopped: 0, traced: 0 }
    Fork => ProcessForked { parent: 0, _pad: 0 }
    Exec => ProcessExec { traced: 0, _pad: 0 }
    Exit => ProcessExit { wait_status: 0, _pad: 0 }
    ApiCall => ApiCall { times: CallTimes::ZERO, args: [0; API_ARGS], out: 0, result: 0 }
}

/// The sizes, held: a field added to a body shows here, and a padding hole (which would
/// break [`Body`]'s promise) shows as a size that is not the sum of the fields.
const _: () = {
    use core::mem::size_of;
    assert!(size_of::<RecordHeader>() == 16);
    assert!(size_of::<Record<CollectiveCall>>() == 16 + 16 + 32 + 16);
    assert!(size_of::<Record<TimedCall>>() == 16 + 16 + 8);
    assert!(size_of::<Record<SyncCall>>() == 16 + 16 + 16 + 8);
    assert!(size_of::<Record<CommInitCall>>() == 16 + 16 + 24 + 16);
    assert!(size_of::<Record<EventQuery>>() == 16 + 16 + 16);
    assert!(size_of::<Record<GroupCall>>() == 16 + 16);
    assert!(size_of::<Record<EventRecord>>() == 16 + 24);
    assert!(size_of::<Record<PhaseEntry>>() == 16 + 24 + 8);
    assert!(size_of::<Record<PhaseReturn>>() == 16 + 24);
    assert!(size_of::<Record<ScopeEnter>>() == 16 + 24 + 8 + SCOPE_NAME_BYTES);
    assert!(size_of::<Record<RuleEntry>>() == 16 + 24 + 8 * RULE_ARGS + 8 + SCOPE_NAME_BYTES);
    assert!(size_of::<Record<RuleReturn>>() == 16 + 24 + 8);
    assert!(size_of::<Record<PyStack>>() == 16 + 24 + 16 + 3 * 8 * PY_MAX_DEPTH);
    assert!(size_of::<Record<LinkMapChange>>() == 16 + 8);
    assert!(size_of::<Record<Fork>>() == 16 + 8);
    assert!(size_of::<Record<Exec>>() == 16 + 8);
    assert!(size_of::<Record<Exit>>() == 16 + 8);
    assert!(size_of::<Record<ApiCall>>() == 16 + 16 + 8 * API_ARGS + 16);
};
