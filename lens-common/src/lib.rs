//! Types shared by the BPF programs (`lens-ebpf`) and the loader (`lens-userspace`).
//!
//! Everything here is `#[repr(C)]` plain data: the kernel side writes it into maps and the
//! ring buffer, the user side reads the same bytes back. One definition, two worlds.
#![no_std]

#[macro_use]
mod ids;
pub mod record;
pub use ids::{LossCause, NcclArgs, ProbeId};
pub use record::{Body, EventKind, NONE_I32, Record, RecordHeader};

/// Room for a torch scope name (or a rule's string argument) in a record: enough for torch's own scope names
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

/// The shape bits ([`cookie_shape`]) of a catalog probe on the generic call programs
/// (`api_call_entry` / `api_call_return`, [`record::ApiCall`]): what to read besides the
/// arguments, and whether the call may be the runtime's own.
pub mod api_shape {
    /// Bits 0..3: the argument that is an out-pointer, read at return (its index + 1;
    /// 0: none).
    pub const fn out_arg(index: u32) -> u32 {
        (index + 1) & OUT_ARG_MASK
    }
    pub const OUT_ARG_MASK: u32 = 0x7;
    /// A driver call that libcudart makes inside its own call of the same meaning
    /// (`cudaMalloc` calls `cuMemAlloc_v2`): left out when its return address is in the
    /// process's libcudart (`RUNTIME_RANGES`), so that one allocation is seen once.
    pub const DRIVER: u32 = 1 << 3;
    /// A stream capture begins on the stream in the first argument, once the call
    /// returned 0: the process's launches on it are captured, not run.
    pub const CAPTURE_BEGIN: u32 = 1 << 4;
    /// The capture on the stream in the first argument ends (at the call's entry).
    pub const CAPTURE_END: u32 = 1 << 5;
}

/// The rule index of a `probe` value, if it is a configured rule's.
pub const fn rule_index(probe: u32) -> Option<u32> {
    if probe >= RULE_COOKIE_BASE && probe - RULE_COOKIE_BASE < MAX_RULES {
        Some(probe - RULE_COOKIE_BASE)
    } else {
        None
    }
}

/// Key of the per-kernel launch counters (`KERNEL_COUNTS`): launches of one kernel by
/// process `tgid` in one phase epoch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelKey {
    pub tgid: u32,
    /// The epoch (low 32 bits of [`TargetState::epoch`]) the launches ran in.
    pub epoch: u32,
    /// The launch's function argument: a host stub address (runtime launches) or a
    /// `CUfunction` handle (driver launches), with [`KernelKey::DRIVER`] set for the
    /// latter. (16 bytes in all, not 24 with a flag of its own: the key is hashed on every
    /// launch under `per_step`.)
    pub function: u64,
}

impl KernelKey {
    /// The bit of `function` that marks a driver handle: user-space addresses, stubs and
    /// the driver's heap alike, stay below 2^47.
    pub const DRIVER: u64 = 1 << 63;

    /// The function argument, without the driver bit.
    pub const fn function(&self) -> u64 {
        self.function & !Self::DRIVER
    }

    /// Whether the function is a driver `CUfunction` handle.
    pub const fn driver(&self) -> bool {
        self.function & Self::DRIVER != 0
    }
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

/// Key of the entry-state maps (`maps::INFLIGHT_*`): a call in flight on one thread.
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

/// Something of one process by its address or handle: a CUDA stream or event (the maps
/// that follow collectives to the event recorded after them), a Python code object
/// (`PY_NAMED`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HandleKey {
    pub tgid: u32,
    pub _pad: u32,
    pub handle: u64,
}

/// A traced process's entry in the `TARGETS` map (keyed by tgid): its settings, and the
/// launch counters and phase epoch its probes keep. They live here, not in maps of their
/// own, because a launch is the commonest probed call: finding its process is the one
/// lookup it needs before the per-kernel count.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TargetState {
    /// Bit set of `TARGET_*` flags, set when the entry is made and never after.
    pub flags: u32,
    pub _pad: u32,
    /// Phase marks so far: launches are counted per kernel under this epoch.
    pub epoch: u64,
    /// Launches counted so far, per launch probe ([`launch_slot`]).
    pub launches: [u64; LAUNCH_PROBES.len()],
    /// Driver launches left out because the runtime made them (counted at the runtime's
    /// launch already): not calls of their own, but each is a probe hit the process pays
    /// for (the overhead estimate counts them).
    pub runtime_driver_hits: u64,
    /// Streams of the process capturing a CUDA graph now (`CAPTURING_STREAMS`): while it
    /// is 0, a launch reads nothing more; otherwise it reads its stream to tell a
    /// captured launch from one that runs.
    pub capturing: u64,
    /// Launches captured into a CUDA graph so far (recorded, not run), per launch probe
    /// ([`launch_slot`]): not in `launches`.
    pub captured: [u64; LAUNCH_PROBES.len()],
    /// The most PyTorch's caching allocator had allocated and reserved so far, as its
    /// `reportMemoryUsageToProfiler` calls said: a call passing either is sent.
    pub torch_peaks: [u64; 2],
    /// Calls counted so far of every other catalog probe, by [`ProbeId`] (a launch probe's
    /// slot stays 0). Here, an atomic add beside the launch counters, rather than in a map
    /// keyed by (process, probe): the target lookup every hit makes already found them.
    /// [`CALL_SLOTS`] long, a power of two: the index the programs mask is in bounds for
    /// the verifier.
    pub calls: [u64; CALL_SLOTS],
}

/// Slots of [`TargetState::calls`]: every [`ProbeId`] has one.
pub const CALL_SLOTS: usize = 128;
const _: () = assert!(ProbeId::COUNT <= CALL_SLOTS && CALL_SLOTS.is_power_of_two());

impl Default for TargetState {
    fn default() -> Self {
        Self::new(0)
    }
}

impl TargetState {
    /// A new entry: nothing counted yet.
    pub const fn new(flags: u32) -> Self {
        Self {
            flags,
            _pad: 0,
            epoch: 0,
            launches: [0; LAUNCH_PROBES.len()],
            runtime_driver_hits: 0,
            capturing: 0,
            captured: [0; LAUNCH_PROBES.len()],
            torch_peaks: [0; 2],
            calls: [0; CALL_SLOTS],
        }
    }

    /// Launches of every kind counted so far.
    #[inline(always)]
    pub fn launches_total(&self) -> u64 {
        let mut total = 0;
        let mut slot = 0;
        while slot < LAUNCH_PROBES.len() {
            total += self.launches[slot];
            slot += 1;
        }
        total
    }
}

/// The probes whose calls are counted in [`TargetState::launches`], in slot order (the
/// call counters of every other probe are `CALL_COUNTS`).
pub const LAUNCH_PROBES: [ProbeId; 6] = [
    ProbeId::CudaLaunchKernel,
    ProbeId::CudaLaunchKernelExC,
    ProbeId::CudaGraphLaunch,
    ProbeId::CuLaunchKernel,
    ProbeId::CuLaunchKernelEx,
    ProbeId::CuGraphLaunch,
];

/// The slot of `probe`'s count in [`TargetState::launches`], if it is a launch probe.
#[inline(always)]
pub const fn launch_slot(probe: u32) -> Option<usize> {
    let mut slot = 0;
    while slot < LAUNCH_PROBES.len() {
        if LAUNCH_PROBES[slot] as u32 == probe {
            return Some(slot);
        }
        slot += 1;
    }
    None
}

/// Stop the target (SIGSTOP from the probe) whenever its loaded objects change, so the
/// loader can attach to new libraries before they run any code; the loader sends SIGCONT.
/// Only for processes the loader started itself (`--exec`).
pub const TARGET_STOP_ON_LINK_MAP_CHANGE: u32 = 1;

/// lens-probe itself, for the ~0.1 s its start-up measures what a probe hit costs: its
/// forks (a library user's other threads starting a job) are not followed, and its exec
/// and exit are not reported.
pub const TARGET_CALIBRATION: u32 = 2;

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
    /// `task_struct.nvcsw`: the thread's voluntary context switches (times it slept).
    pub const TASK_NVCSW_OFFSET: &str = "TASK_NVCSW_OFFSET";
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
    /// Non-zero: each graph launch is kept at its entry for its return probe, which
    /// sends it (a span). Off under an overhead budget, whose launch windows leave the
    /// return probes out.
    pub const GRAPH_LAUNCH_SPANS: u32 = 2;
    pub const COUNT: u32 = 3;
}

/// Map names, shared so the loader asks for exactly what the programs define.
pub mod maps {
    pub const EVENTS: &str = "EVENTS";
    pub const TARGETS: &str = "TARGETS";
    /// Calls in flight, one map per record body: the entry's record, kept until the
    /// return pairs it (keyed by [`super::InflightKey`]).
    pub const INFLIGHT_COLLECTIVES: &str = "INFLIGHT_COLLECTIVES";
    pub const INFLIGHT_SYNCS: &str = "INFLIGHT_SYNCS";
    pub const INFLIGHT_COMM_INITS: &str = "INFLIGHT_COMM_INITS";
    pub const INFLIGHT_QUERIES: &str = "INFLIGHT_QUERIES";
    pub const INFLIGHT_API_CALLS: &str = "INFLIGHT_API_CALLS";
    pub const LOSSES: &str = "LOSSES";
    pub const SETTINGS: &str = "SETTINGS";
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
    /// Whether `PY_TARGETS` and `PY_SAVING` may hold anything ([`super::python_gates`]).
    pub const PY_GATES: &str = "PY_GATES";
    /// Python code objects lens-probe has named, by process and address
    /// ([`super::HandleKey`] → [`super::py_named`], LRU; written by lens-probe): a stack
    /// sample whose code objects are all named and none a rule's is delivered with the
    /// ring's batched wakeups; one with a new code object at once, while the process that
    /// holds its names still lives, and one with a rule's function at once too.
    pub const PY_NAMED: &str = "PY_NAMED";
}

/// Values of `PY_NAMED` ([`maps::PY_NAMED`]).
pub mod py_named {
    /// Named, and no rule's function: samples of it may wait for the ring's batched
    /// wakeup.
    pub const PLAIN: u8 = 1;
    /// Named, and maybe a rule's function: samples showing it are delivered at once
    /// (the calls of a framework save are followed as they run).
    pub const RULED: u8 = 2;
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

/// Indexes of `PY_GATES`: whether `PY_TARGETS` and `PY_SAVING` may hold anything. A
/// collective or sync entry reads a gate (an array slot: a few instructions) before it
/// looks its process up in either (a hashed key), so a run with no Python process, or no
/// save running, pays for neither lookup.
pub mod python_gates {
    /// Non-zero while `PY_TARGETS` holds a process.
    pub const TARGETS: u32 = 0;
    /// Non-zero while `PY_SAVING` may hold a process: set before an entry goes in (and
    /// by the probe again after its own insert), cleared only after a removal that left
    /// the map empty, then set again if an entry appeared meanwhile.
    pub const SAVING: u32 = 1;
    pub const COUNT: u32 = 2;
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
    pub const MAX_INFLIGHT: u32 = 16384;
    /// Streams holding a collective no event was recorded after yet, and the events
    /// recorded after collectives not known complete (LRU: old ones fall out).
    pub const MAX_COLLECTIVE_HANDLES: u32 = 8192;
    /// Streams capturing a CUDA graph at once, across the traced processes (LRU: a
    /// process that died mid-capture leaves its entry to fall out).
    pub const MAX_CAPTURING_STREAMS: u32 = 1024;
    /// Kernels registered (host stub → name) across the traced processes; LRU. A
    /// PyTorch build registers some tens of thousands per process.
    pub const MAX_REGISTERED_KERNELS: u32 = 131_072;
    /// Python threads whose last stack the sampler remembers (LRU).
    pub const MAX_PY_THREADS: u32 = 16_384;
    /// Python code objects whose names lens-probe has read, across processes (LRU): a
    /// training job runs a few thousand functions.
    pub const MAX_PY_NAMED: u32 = 65_536;
    /// Thread states walked to find the sampled thread's.
    pub const MAX_PY_THREAD_WALK: u32 = 64;
    /// (process, epoch, kernel) launch counters not yet read by the loader.
    pub const MAX_KERNEL_COUNTS: u32 = 16384;
    /// Threads whose grad mode the kernel follows (LRU).
    pub const MAX_GRAD_MODE_THREADS: u32 = 16_384;
    /// Slots of the per-thread launch notes, indexed by tid modulo this (a power of two).
    pub const LAUNCH_NOTES: u32 = 65_536;
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: all of these are #[repr(C)] plain integers, valid for any bit pattern.
    // SAFETY: a record is a header and a `Body`, both plain integers without padding.
    unsafe impl<B: super::Body> aya::Pod for super::Record<B> {}
    unsafe impl aya::Pod for super::InflightKey {}
    unsafe impl aya::Pod for super::HandleKey {}
    unsafe impl aya::Pod for super::PyOffsets {}
    unsafe impl aya::Pod for super::TargetState {}
    unsafe impl aya::Pod for super::KernelKey {}
    unsafe impl aya::Pod for super::CodeRanges {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_launch_probe_has_its_own_slot_and_no_other_probe_has_one() {
        for probe in ProbeId::ALL {
            let slot = launch_slot(probe as u32);
            match LAUNCH_PROBES.iter().position(|launch| *launch == probe) {
                Some(index) => assert_eq!(slot, Some(index), "{probe:?}"),
                None => assert_eq!(slot, None, "{probe:?}"),
            }
        }
        let mut entry = TargetState::new(0);
        entry.launches = [1, 2, 3, 4, 5, 6];
        assert_eq!(entry.launches_total(), 21);
    }
}
