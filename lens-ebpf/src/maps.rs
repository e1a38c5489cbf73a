//! The maps every program shares: the ring buffer, the target filter, the counters, the
//! calls in flight, the Python sampler's state and the run-wide switches.
use aya_ebpf::macros::map;
use aya_ebpf::maps::{Array, HashMap, LruHashMap, PerCpuArray};
use lens_common::record::{ApiCall, CollectiveCall, CommInitCall, EventQuery, SyncCall};
use lens_common::{
    CodeRanges, HandleKey, InflightKey, KernelKey, LossCause, PyOffsets, Record, TargetState,
    limits, python_gates, settings,
};

/// Processes being traced (tgid → settings, launch counters, phase epoch). Probes are
/// attached per library file, so they fire in every process that maps it; this map is the
/// filter.
#[map(name = "TARGETS")]
pub(crate) static TARGETS: HashMap<u32, TargetState> =
    HashMap::with_max_entries(limits::MAX_TARGETS, 0);

/// Where the fork tracepoint builds a child's `TARGETS` entry (one per CPU, all zero but
/// the flags): an entry is larger than a BPF program's stack.
#[map(name = "NEW_TARGET")]
pub(crate) static NEW_TARGET: PerCpuArray<TargetState> = PerCpuArray::with_max_entries(1, 0);

/// Targets this program stopped at a library load (tgid → when), until lens-probe (or,
/// past a bound, its guardian) continues them.
#[map(name = "STOPPED")]
pub(crate) static STOPPED: HashMap<u32, u64> = HashMap::with_max_entries(limits::MAX_TARGETS, 0);

/// Launches per (process, phase epoch, kernel), read and cleared by the loader: the top
/// kernels of each step.
#[map(name = "KERNEL_COUNTS")]
pub(crate) static KERNEL_COUNTS: HashMap<KernelKey, u64> =
    HashMap::with_max_entries(limits::MAX_KERNEL_COUNTS, 0);

/// Where each target maps libcudart (tgid → ranges): a driver launch called from there
/// is the runtime's own, already counted.
#[map(name = "RUNTIME_RANGES")]
pub(crate) static RUNTIME_RANGES: HashMap<u32, CodeRanges> =
    HashMap::with_max_entries(limits::MAX_TARGETS, 0);

/// Per thread (`tid` modulo [`limits::LAUNCH_NOTES`]), the runtime launch it runs now, if
/// any (`LaunchNote`): the driver launch it makes next is its own, counted at the runtime
/// already. An array, not a hash: its lookup is a few instructions, not a hashed key.
#[map(name = "LAUNCH_NOTES")]
pub(crate) static LAUNCH_NOTES: Array<LaunchNote> =
    Array::with_max_entries(limits::LAUNCH_NOTES, 0);

/// What a thread's slot in `LAUNCH_NOTES` says. Two live threads whose tids share a slot
/// overwrite each other's note: the one that finds another thread's note falls back to the
/// exact (and costly) check of its caller.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct LaunchNote {
    /// The thread (`bpf_get_current_pid_tgid()`) that wrote it.
    pub(crate) pid_tgid: u64,
    /// Its stack pointer at the entry of the runtime launch it runs now; 0 when it runs
    /// none (its last one reached the driver, or the exact check found its driver launch
    /// made elsewhere).
    pub(crate) stack: u64,
}

/// Streams (per process) holding a collective that no event was recorded after yet:
/// the next `cudaEventRecord` on one is sent, its event watched.
#[map(name = "COLLECTIVE_STREAMS")]
pub(crate) static COLLECTIVE_STREAMS: LruHashMap<HandleKey, u8> =
    LruHashMap::with_max_entries(limits::MAX_COLLECTIVE_HANDLES, 0);

/// Events (per process) recorded after a collective and not seen complete yet → entry
/// time of the last query that found one not ready (0: none yet).
#[map(name = "COLLECTIVE_EVENTS")]
pub(crate) static COLLECTIVE_EVENTS: LruHashMap<HandleKey, u64> =
    LruHashMap::with_max_entries(limits::MAX_COLLECTIVE_HANDLES, 0);

/// Kernels as nvcc's module constructors registered them: (process, host stub) → the
/// address of the kernel's mangled name in the process (read by the loader when the
/// stub is launched and its library has no symbol for it).
/// Streams capturing a CUDA graph (written at `cudaStreamBeginCapture`'s return and
/// `cudaStreamEndCapture`'s entry, and the driver's): a launch on one is captured, not run.
#[map(name = "CAPTURING_STREAMS")]
pub(crate) static CAPTURING_STREAMS: LruHashMap<HandleKey, u8> =
    LruHashMap::with_max_entries(limits::MAX_CAPTURING_STREAMS, 0);

#[map(name = "KERNEL_REGISTRY")]
pub(crate) static KERNEL_REGISTRY: LruHashMap<HandleKey, u64> =
    LruHashMap::with_max_entries(limits::MAX_REGISTERED_KERNELS, 0);

/// Traced CPython processes (tgid → where their interpreter state is).
#[map(name = "PY_TARGETS")]
pub(crate) static PY_TARGETS: HashMap<u32, PyOffsets> =
    HashMap::with_max_entries(limits::MAX_TARGETS, 0);

/// Python processes inside a framework save (`maps::PY_SAVING`).
#[map(name = "PY_SAVING")]
pub(crate) static PY_SAVING: HashMap<u32, u8> = HashMap::with_max_entries(limits::MAX_TARGETS, 0);

/// Whether `PY_TARGETS` and `PY_SAVING` may hold anything (`lens_common::python_gates`).
#[map(name = "PY_GATES")]
pub(crate) static PY_GATES: Array<u32> = Array::with_max_entries(python_gates::COUNT, 0);

/// Whether gate `gate` of `PY_GATES` is open.
#[inline(always)]
pub(crate) fn python_gate(gate: u32) -> bool {
    PY_GATES.get(gate).is_some_and(|value| *value != 0)
}

/// Python code objects lens-probe has named (`maps::PY_NAMED`).
#[map(name = "PY_NAMED")]
pub(crate) static PY_NAMED: LruHashMap<HandleKey, u8> =
    LruHashMap::with_max_entries(limits::MAX_PY_NAMED, 0);

/// A Python thread's last clock sample.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct LastSample {
    /// A hash of the stack last sent (low bit: sent once, to be sent again at the next
    /// sample): an unchanged stack is not sent a third time.
    pub(crate) hash: u64,
    /// When it was taken, sent or not, and the thread's voluntary switches then (`u64::MAX`:
    /// unknown): a later sample whose count is the same comes from a thread that has not
    /// slept since.
    pub(crate) at_ns: u64,
    pub(crate) switches: u64,
}

/// Per Python thread, its last clock sample.
#[map(name = "PY_LAST_STACK")]
pub(crate) static PY_LAST_STACK: LruHashMap<u32, LastSample> =
    LruHashMap::with_max_entries(limits::MAX_PY_THREADS, 0);

// Calls in flight (entry → return), one map per record body: each return program pairs
// its own kind, and a map's values are the size of that kind's record. A slot per thread
// and function, reused from call to call (`ctx::remember_entry`); LRU, so the slots of
// threads that ended make room for new ones.

#[map(name = "INFLIGHT_COLLECTIVES")]
pub(crate) static INFLIGHT_COLLECTIVES: LruHashMap<InflightKey, Record<CollectiveCall>> =
    LruHashMap::with_max_entries(limits::MAX_INFLIGHT, 0);

#[map(name = "INFLIGHT_SYNCS")]
pub(crate) static INFLIGHT_SYNCS: LruHashMap<InflightKey, Record<SyncCall>> =
    LruHashMap::with_max_entries(limits::MAX_INFLIGHT, 0);

#[map(name = "INFLIGHT_COMM_INITS")]
pub(crate) static INFLIGHT_COMM_INITS: LruHashMap<InflightKey, Record<CommInitCall>> =
    LruHashMap::with_max_entries(limits::MAX_INFLIGHT, 0);

#[map(name = "INFLIGHT_QUERIES")]
pub(crate) static INFLIGHT_QUERIES: LruHashMap<InflightKey, Record<EventQuery>> =
    LruHashMap::with_max_entries(limits::MAX_INFLIGHT, 0);

#[map(name = "INFLIGHT_API_CALLS")]
pub(crate) static INFLIGHT_API_CALLS: LruHashMap<InflightKey, Record<ApiCall>> =
    LruHashMap::with_max_entries(limits::MAX_INFLIGHT, 0);

/// Run-wide switches set by the loader (`lens_common::settings`).
#[map(name = "SETTINGS")]
pub(crate) static SETTINGS: Array<u32> = Array::with_max_entries(settings::COUNT, 0);

#[inline(always)]
pub(crate) fn node_mode() -> bool {
    SETTINGS
        .get(settings::NODE_MODE)
        .is_some_and(|value| *value != 0)
}

#[inline(always)]
pub(crate) fn graph_launch_spans() -> bool {
    SETTINGS
        .get(settings::GRAPH_LAUNCH_SPANS)
        .is_some_and(|value| *value != 0)
}

#[inline(always)]
pub(crate) fn kernel_names() -> bool {
    SETTINGS
        .get(settings::KERNEL_NAMES)
        .is_some_and(|value| *value != 0)
}

#[map(name = "LOSSES")]
pub(crate) static LOSSES: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(LossCause::COUNT as u32, 0);
