//! Types shared by the BPF programs (`lens-ebpf`) and the loader (`lens-userspace`).
//!
//! Everything here is `#[repr(C)]` plain data: the kernel side writes it into maps and the
//! ring buffer, the user side reads the same bytes back. One definition, two worlds.
#![no_std]

mod ids;
pub use ids::{EventKind, LossCause, NcclArgs, ProbeId};

/// Room for a torch scope name in an [`Event`]: enough for torch's own scope names
/// (`enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__` is 61 bytes).
pub const SCOPE_NAME_BYTES: usize = 64;

/// Integer arguments a configured probe rule can read: the six argument registers.
pub const RULE_ARGS: usize = 6;

/// Attach cookies and `probe` values of configured probe rules start here: rule `i` is
/// `RULE_COOKIE_BASE + i`, well above every [`ProbeId`].
pub const RULE_COOKIE_BASE: u32 = 0x1_0000;

/// The most configured probe rules one run can have.
pub const MAX_RULES: u32 = 1024;

/// A configured rule's attach cookie: the low 32 bits are `RULE_COOKIE_BASE + index`;
/// bits 32..40 name the argument read as a string (its index + 1; 0: none) and bit 40
/// says it is a libstdc++ `std::string` (its data pointer is read first) rather than a
/// C string.
pub const fn rule_cookie(index: u32, string_arg: Option<u32>, std_string: bool) -> u64 {
    let string = match string_arg {
        Some(arg) => (arg as u64 + 1) & 0xff,
        None => 0,
    };
    (RULE_COOKIE_BASE + index) as u64 | string << 32 | (std_string as u64) << 40
}

/// A catalog probe's attach cookie: the low 32 bits are its [`ProbeId`], bits 32..40
/// a detail of its shape (an NCCL call's [`NcclArgs`]; 0 for the others).
pub const fn probe_cookie(id: ProbeId, shape: u32) -> u64 {
    id as u64 | ((shape as u64) & 0xff) << 32
}

/// The shape detail of a catalog probe's cookie (see [`probe_cookie`]).
pub const fn cookie_shape(cookie: u64) -> u32 {
    ((cookie >> 32) & 0xff) as u32
}

/// The rule index of a `probe` value, if it is a configured rule's.
pub const fn rule_index(probe: u32) -> Option<u32> {
    if probe >= RULE_COOKIE_BASE && probe - RULE_COOKIE_BASE < MAX_RULES {
        Some(probe - RULE_COOKIE_BASE)
    } else {
        None
    }
}

/// "No peer / no root / no op" in the signed fields of [`Event`].
pub const NONE_I32: i32 = -1;

/// One record in the ring buffer. A flat layout: which fields are meaningful depends on
/// `kind` (see [`EventKind`]); unused ones are zero, or [`NONE_I32`] for the signed ones.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// [`EventKind`] as u32.
    pub kind: u32,
    /// [`ProbeId`] as u32.
    pub probe: u32,
    /// Process id (the kernel's tgid).
    pub tgid: u32,
    /// Thread id (the kernel's pid).
    pub tid: u32,
    /// `CLOCK_MONOTONIC` at function entry, ns.
    pub start_ns: u64,
    /// `CLOCK_MONOTONIC` at function return, ns (equal to `start_ns` for entry-only events).
    pub end_ns: u64,
    /// The function's return value (cudaError_t / ncclResult_t), 0 for entry-only events.
    pub ret: i64,
    /// Element count argument of a collective.
    pub count: u64,
    /// `ncclComm_t` handle (collectives; for CommInit the handle the call wrote).
    pub comm: u64,
    /// `cudaStream_t` of a collective, or the handle a sync call waited on
    /// (stream for cudaStreamSynchronize, event for cudaEventSynchronize).
    pub handle: u64,
    /// Hash of the 128-byte `ncclUniqueId` (CommInit).
    pub comm_id_hash: u64,
    /// The `cudaStream_t` an event was recorded on (`CudaEvent` records).
    pub stream: u64,
    /// Entry time of the last `cudaEventQuery` that found the event not ready yet
    /// (`CudaEvent` queries; 0 when none did): the collective had not completed then.
    pub not_ready_ns: u64,
    /// The code object of the Python function the calling thread was running
    /// (collectives and sync waits of a sampled CPython process; 0 otherwise): which
    /// Python function issued the call.
    pub python_caller: u64,
    /// The process's phase epoch this mark opens (PhaseMark events): every phase mark
    /// adds one, and each kernel launch is counted under the epoch it ran in
    /// ([`KernelKey`]), so launches per kernel per span need no event per launch.
    pub epoch: u64,
    /// The process's kernel launches counted so far (PhaseMark events): launches per
    /// phase are the difference between two marks, aggregated in the kernel.
    pub launches: u64,
    /// The first six integer arguments at entry (`RuleCall` events), as the registers
    /// held them; a file-open mark's open flags in the first.
    pub args: [u64; RULE_ARGS],
    /// `ncclDataType_t` (collectives).
    pub datatype: i32,
    /// `ncclRedOp_t` (AllReduce, Reduce, ReduceScatter), else [`NONE_I32`].
    pub redop: i32,
    /// Root (Broadcast, Reduce) or peer (Send, Recv), else [`NONE_I32`].
    pub peer: i32,
    /// `nranks` (CommInit).
    pub nranks: i32,
    /// `rank` (CommInit).
    pub rank: i32,
    /// 1 for ncclGroupStart, 0 for ncclGroupEnd (Group events).
    pub group_open: u32,
    /// 1 when a [`EventKind::PhaseMark`] was taken at the function's return.
    pub at_return: u32,
    /// Length of the scope name in `name` (TorchScopeEnter), without the NUL.
    pub name_len: u32,
    /// The scope name, NUL-terminated, truncated to [`SCOPE_NAME_BYTES`] - 1 bytes.
    pub name: [u8; SCOPE_NAME_BYTES],
}

impl Event {
    pub const fn zeroed() -> Event {
        Event {
            kind: 0,
            probe: 0,
            tgid: 0,
            tid: 0,
            start_ns: 0,
            end_ns: 0,
            ret: 0,
            count: 0,
            comm: 0,
            handle: 0,
            comm_id_hash: 0,
            stream: 0,
            not_ready_ns: 0,
            python_caller: 0,
            epoch: 0,
            launches: 0,
            args: [0; RULE_ARGS],
            datatype: NONE_I32,
            redop: NONE_I32,
            peer: NONE_I32,
            nranks: 0,
            rank: NONE_I32,
            group_open: 0,
            at_return: 0,
            name_len: 0,
            name: [0; SCOPE_NAME_BYTES],
        }
    }
}

/// Key of the in-kernel call counters: how often process `tgid` called probe `probe`.
/// Launches are counted here rather than sent one by one.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallKey {
    pub tgid: u32,
    pub probe: u32,
}

/// A process's launch total and phase epoch, the value of the `LAUNCH_TOTALS` map (keyed
/// by tgid).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LaunchTotals {
    /// Kernel and graph launches counted so far.
    pub launches: u64,
    /// Phase marks so far: launches are counted per kernel under this epoch.
    pub epoch: u64,
}

/// Key of the per-kernel launch counters (`KERNEL_COUNTS`): launches of one kernel by
/// process `tgid` in one phase epoch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelKey {
    pub tgid: u32,
    /// The epoch (low 32 bits of [`LaunchTotals::epoch`]) the launches ran in.
    pub epoch: u32,
    /// The launch's function argument: a host stub address (runtime launches) or a
    /// `CUfunction` handle (driver launches).
    pub function: u64,
    /// 1: `function` is a driver `CUfunction` handle.
    pub driver: u32,
    pub _pad: u32,
}

/// Where one process maps libcudart: a driver launch whose return address falls in one of
/// these ranges is the runtime's own call through the driver, counted at the runtime.
/// The value of the `RUNTIME_RANGES` map (keyed by tgid); unused ranges are `[0, 0]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CodeRanges {
    /// `[start, end)` of each mapping.
    pub ranges: [[u64; 2]; CODE_RANGES],
}

/// Mappings of libcudart remembered per process (a process may map a CUDA 12 and a
/// CUDA 13 runtime, each in a few segments).
pub const CODE_RANGES: usize = 8;

/// Key of the entry-state map: a call in flight on one thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InflightKey {
    /// `bpf_get_current_pid_tgid()`: tgid << 32 | tid.
    pub pid_tgid: u64,
    pub probe: u32,
    pub _pad: u32,
}

/// Python frames kept per sample: the outermost of those walked.
pub const PY_MAX_DEPTH: usize = 32;

/// Python frames walked per sample, from the innermost.
pub const PY_MAX_WALK: usize = 64;

/// "No such field in this CPython version" in [`PyOffsets`].
pub const PY_NO_FIELD: u32 = u32::MAX;

/// Where a traced CPython process keeps what the sampler reads (`lens-userspace`'s
/// `python` module fills it per interpreter version; docs/python.md). All offsets are
/// in bytes; [`PY_NO_FIELD`] where a version has no such field.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyOffsets {
    /// Address of `_PyRuntime` in the process.
    pub runtime: u64,
    /// `_PyRuntime.interpreters.head`: the main interpreter, whose threads are walked
    /// to find the sampled one.
    pub interpreters_head: u32,
    /// `PyInterpreterState.threads.head`.
    pub threads_head: u32,
    /// `PyThreadState.next`.
    pub tstate_next: u32,
    /// `PyThreadState.native_thread_id` (the kernel tid, 3.11+), or `.thread_id` (the
    /// thread pointer, `pthread_self()`: 3.10) with `match_thread_pointer`.
    pub tstate_native_thread_id: u32,
    /// 1: the field above holds the thread pointer (compared with the task's fsbase),
    /// not the tid.
    pub match_thread_pointer: u32,
    /// `PyThreadState.frame` (3.10), `.cframe` (3.11, 3.12) or `.current_frame` (3.13).
    pub tstate_frame: u32,
    /// `_PyCFrame.current_frame` (3.11, 3.12), or [`PY_NO_FIELD`] (the field above is
    /// the frame itself).
    pub cframe_current_frame: u32,
    /// The frame's code object (`f_code`, 3.13 `f_executable`).
    pub frame_code: u32,
    /// The caller's frame (`f_back`, 3.11+ `previous`).
    pub frame_previous: u32,
    /// The frame's first local slot (`localsplus[0]`, 3.10 `f_localsplus[0]`): a new
    /// call of the same function at the same frame address usually holds another
    /// object there, which tells two calls apart.
    pub frame_first_local: u32,
    /// Where a compact ASCII `str`'s text starts (`sizeof(PyASCIIObject)`).
    pub str_data: u32,
}

/// What `torch._C._log_api_usage_once` is passed as DCP's load begins reading
/// (`_load_state_dict`, called by `dcp.load`): the probe at its entry marks the process
/// as loading in the kernel at once, so the `.metadata` file read next is counted.
pub const DCP_LOAD_API_EVENT: &[u8] = b"torch.distributed.checkpoint.load_state_dict";

/// A Python thread's frames at a sample, innermost first: the record that follows an
/// [`EventKind::PyStack`] kind. Sent only when the stack differs from the thread's last.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyStack {
    /// [`EventKind::PyStack`] as u32 (the same place as [`Event::kind`]).
    pub kind: u32,
    /// Frames walked (at most [`PY_MAX_WALK`]); frame `i` from the innermost is in slot
    /// `i % PY_MAX_DEPTH`, so the last [`PY_MAX_DEPTH`] walked (the outermost) are kept.
    pub depth: u32,
    pub tgid: u32,
    pub tid: u32,
    /// 1: taken at a probed call's entry, the thread stopped inside a C call the
    /// interpreter made (its frame chain complete); 0: by the clock, at any instruction
    /// (it can catch the chain mid-update).
    pub synchronous: u32,
    pub _pad: u32,
    /// `CLOCK_MONOTONIC` ns of the sample.
    pub at_ns: u64,
    /// The process's launches so far and the phase epoch this sample opens, as a phase
    /// mark's (a changed stack may start or end a span).
    pub launches: u64,
    pub epoch: u64,
    /// Per frame slot: code object, frame address, first local slot.
    pub code: [u64; PY_MAX_DEPTH],
    pub frame: [u64; PY_MAX_DEPTH],
    pub first_local: [u64; PY_MAX_DEPTH],
}

/// A process's CUDA stream or event handle: the key of the maps that follow collectives
/// to the event recorded after them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HandleKey {
    pub tgid: u32,
    pub _pad: u32,
    pub handle: u64,
}

/// Per-target settings, the value of the `TARGETS` map (keyed by tgid).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TargetConfig {
    /// Bit set of `TARGET_*` flags.
    pub flags: u32,
}

/// Stop the target (SIGSTOP from the probe) whenever its loaded objects change, so the
/// loader can attach to new libraries before they run any code; the loader sends SIGCONT.
/// Only for processes the loader started itself (`--exec`).
pub const TARGET_STOP_ON_LINK_MAP_CHANGE: u32 = 1;

/// Size of `ncclUniqueId` in bytes, as 64-bit words.
pub const NCCL_UNIQUE_ID_WORDS: usize = 16;

/// Hash of an `ncclUniqueId` (128 bytes read as 16 little-endian u64 words): FNV-1a over
/// words. Every rank of one communicator passes the same id, so the hash names the
/// communicator across processes and nodes. Computed in the kernel, reproducible here.
pub const fn comm_id_hash(words: &[u64; NCCL_UNIQUE_ID_WORDS]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < NCCL_UNIQUE_ID_WORDS {
        hash ^= words[i];
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    hash
}

/// Globals of the BPF object the loader sets at load time: where `struct task_struct`
/// keeps the fields the scheduler tracepoints read (from the running kernel's BTF).
pub mod globals {
    pub const TASK_TGID_OFFSET: &str = "TASK_TGID_OFFSET";
    pub const TASK_EXIT_CODE_OFFSET: &str = "TASK_EXIT_CODE_OFFSET";
    pub const TASK_SIGNAL_OFFSET: &str = "TASK_SIGNAL_OFFSET";
    pub const SIGNAL_NR_THREADS_OFFSET: &str = "SIGNAL_NR_THREADS_OFFSET";
    /// `task_struct.thread.fsbase`: the thread pointer (`pthread_self()`).
    pub const TASK_FSBASE_OFFSET: &str = "TASK_FSBASE_OFFSET";
    /// Non-zero when `sched_process_exit` passes `group_dead` (Linux 6.16 and later).
    pub const EXIT_HAS_GROUP_DEAD: &str = "EXIT_HAS_GROUP_DEAD";
}

/// Indexes of the `SETTINGS` array: run-wide switches the loader sets.
pub mod settings {
    /// Non-zero: library loads and execs of every process are reported (node-wide
    /// discovery), not only those of targets.
    pub const NODE_MODE: u32 = 0;
    /// Non-zero: launches are also counted per kernel (`KERNEL_COUNTS`), for the top
    /// kernels of each step.
    pub const KERNEL_NAMES: u32 = 1;
    pub const COUNT: u32 = 2;
}

/// Map names, shared so the loader asks for exactly what the programs define.
pub mod maps {
    pub const EVENTS: &str = "EVENTS";
    pub const TARGETS: &str = "TARGETS";
    pub const CALL_COUNTS: &str = "CALL_COUNTS";
    pub const INFLIGHT: &str = "INFLIGHT";
    pub const LOSSES: &str = "LOSSES";
    pub const SETTINGS: &str = "SETTINGS";
    pub const LAUNCH_TOTALS: &str = "LAUNCH_TOTALS";
    pub const KERNEL_COUNTS: &str = "KERNEL_COUNTS";
    pub const RUNTIME_RANGES: &str = "RUNTIME_RANGES";
    pub const KERNEL_REGISTRY: &str = "KERNEL_REGISTRY";
    pub const PY_TARGETS: &str = "PY_TARGETS";
    /// Targets stopped at a library load (tgid → CLOCK_MONOTONIC ns of the stop): the
    /// guardian continues the ones lens-probe leaves there too long.
    pub const STOPPED: &str = "STOPPED";
    /// Python processes with a framework's save (load) function running on a thread
    /// (tgid → [`super::saving`] bits): the collective and sync entries of each of their
    /// threads take a Python stack sample first, so a call made after the save returned
    /// is not taken for one of its own, and a save DCP's `async_save` runs on a
    /// background thread is seen at that thread's first collective, not a sampling
    /// interval of CPU later. During a load, files opened for reading are marks too.
    pub const PY_SAVING: &str = "PY_SAVING";
}

/// libc `open` flags (x86-64/arm64 Linux) the file-open probe reads.
pub mod open_flags {
    /// The file may be created.
    pub const CREAT: u64 = 0o100;
    /// The access mode bits (0: read-only).
    pub const ACCMODE: u64 = 0o3;
    /// Only a directory is opened.
    pub const DIRECTORY: u64 = 0o200000;
}

/// What a `PY_SAVING` entry says is running in the process.
pub mod saving {
    /// A framework save function.
    pub const SAVE: u8 = 1;
    /// A framework load function, or DCP's `get_state_dict` (which begins a save or a
    /// load): the files opened for reading are what a load's `nemo.checkpoint.files`
    /// counts.
    pub const LOAD: u8 = 2;
}

/// Sizes of the kernel-side maps.
pub mod limits {
    /// Ring buffer size in bytes (power of two, multiple of the page size).
    pub const RING_BUFFER_BYTES: u32 = 4 * 1024 * 1024;
    /// Submit without waking the reader until this much data is waiting; the reader also
    /// drains on a short timer, so a quiet process's events still arrive.
    pub const WAKEUP_THRESHOLD_BYTES: u64 = 256 * 1024;
    pub const MAX_TARGETS: u32 = 4096;
    pub const MAX_CALL_COUNTERS: u32 = 16384;
    pub const MAX_INFLIGHT: u32 = 16384;
    /// Streams holding a collective no event was recorded after yet, and the events
    /// recorded after collectives not known complete (LRU: old ones fall out).
    pub const MAX_COLLECTIVE_HANDLES: u32 = 8192;
    /// Kernels registered (host stub → name) across the traced processes; LRU. A
    /// PyTorch build registers some tens of thousands per process.
    pub const MAX_REGISTERED_KERNELS: u32 = 131_072;
    /// Python threads whose last stack the sampler remembers (LRU).
    pub const MAX_PY_THREADS: u32 = 16_384;
    /// Thread states walked to find the sampled thread's.
    pub const MAX_PY_THREAD_WALK: u32 = 64;
    /// (process, epoch, kernel) launch counters not yet read by the loader.
    pub const MAX_KERNEL_COUNTS: u32 = 16384;
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: all of these are #[repr(C)] plain integers, valid for any bit pattern.
    unsafe impl aya::Pod for super::Event {}
    unsafe impl aya::Pod for super::CallKey {}
    unsafe impl aya::Pod for super::InflightKey {}
    unsafe impl aya::Pod for super::HandleKey {}
    unsafe impl aya::Pod for super::PyOffsets {}
    unsafe impl aya::Pod for super::TargetConfig {}
    unsafe impl aya::Pod for super::LaunchTotals {}
    unsafe impl aya::Pod for super::KernelKey {}
    unsafe impl aya::Pod for super::CodeRanges {}
}
