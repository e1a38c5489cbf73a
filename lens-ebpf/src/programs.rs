//! Every BPF program and map: the uprobes (launch counters, NCCL and sync calls, phase
//! marks, configured rules), the scheduler tracepoints and the Python sampler. (One file
//! for now: its split by concern is issue 18's next step.)
use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_NOEXIST, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user,
        bpf_probe_read_user_str_bytes, generated,
    },
    macros::{map, perf_event, raw_tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{PerfEventContext, ProbeContext, RawTracePointContext, RetProbeContext},
};
use aya_log_ebpf::{debug, warn};
use core::intrinsics::{AtomicOrdering, atomic_xadd};
use lens_common::{
    CODE_RANGES, CallKey, CodeRanges, DCP_LOAD_API_EVENT, Event, EventKind, HandleKey, InflightKey,
    KernelKey, LaunchTotals, LossCause, NCCL_UNIQUE_ID_WORDS, NcclArgs, PY_MAX_DEPTH, PY_MAX_WALK,
    PY_NO_FIELD, ProbeId, PyOffsets, PyStack, TARGET_STOP_ON_LINK_MAP_CHANGE, TargetConfig,
    comm_id_hash, cookie_shape, limits, saving, settings,
};

#[map(name = "EVENTS")]
pub(crate) static EVENTS: RingBuf = RingBuf::with_byte_size(limits::RING_BUFFER_BYTES, 0);

/// Processes being traced (tgid → settings). Probes are attached per library file, so
/// they fire in every process that maps it; this map is the filter.
#[map(name = "TARGETS")]
static TARGETS: HashMap<u32, TargetConfig> = HashMap::with_max_entries(limits::MAX_TARGETS, 0);

/// Targets this program stopped at a library load (tgid → when), until lens-probe (or,
/// past a bound, its guardian) continues them.
#[map(name = "STOPPED")]
static STOPPED: HashMap<u32, u64> = HashMap::with_max_entries(limits::MAX_TARGETS, 0);

#[map(name = "CALL_COUNTS")]
static CALL_COUNTS: PerCpuHashMap<CallKey, u64> =
    PerCpuHashMap::with_max_entries(limits::MAX_CALL_COUNTERS, 0);

/// Kernel launches and phase epoch per process (tgid → totals), read by the
/// phase-marking programs so that launches per phase need no event per launch.
#[map(name = "LAUNCH_TOTALS")]
static LAUNCH_TOTALS: HashMap<u32, LaunchTotals> =
    HashMap::with_max_entries(limits::MAX_TARGETS, 0);

/// Launches per (process, phase epoch, kernel), read and cleared by the loader: the top
/// kernels of each step.
#[map(name = "KERNEL_COUNTS")]
static KERNEL_COUNTS: HashMap<KernelKey, u64> =
    HashMap::with_max_entries(limits::MAX_KERNEL_COUNTS, 0);

/// Where each target maps libcudart (tgid → ranges): a driver launch called from there
/// is the runtime's own, already counted.
#[map(name = "RUNTIME_RANGES")]
static RUNTIME_RANGES: HashMap<u32, CodeRanges> = HashMap::with_max_entries(limits::MAX_TARGETS, 0);

/// Streams (per process) holding a collective that no event was recorded after yet:
/// the next `cudaEventRecord` on one is sent, its event watched.
#[map(name = "COLLECTIVE_STREAMS")]
static COLLECTIVE_STREAMS: LruHashMap<HandleKey, u8> =
    LruHashMap::with_max_entries(limits::MAX_COLLECTIVE_HANDLES, 0);

/// Events (per process) recorded after a collective and not seen complete yet → entry
/// time of the last query that found one not ready (0: none yet).
#[map(name = "COLLECTIVE_EVENTS")]
static COLLECTIVE_EVENTS: LruHashMap<HandleKey, u64> =
    LruHashMap::with_max_entries(limits::MAX_COLLECTIVE_HANDLES, 0);

/// Kernels as nvcc's module constructors registered them: (process, host stub) → the
/// address of the kernel's mangled name in the process (read by the loader when the
/// stub is launched and its library has no symbol for it).
#[map(name = "KERNEL_REGISTRY")]
static KERNEL_REGISTRY: LruHashMap<HandleKey, u64> =
    LruHashMap::with_max_entries(limits::MAX_REGISTERED_KERNELS, 0);

/// Traced CPython processes (tgid → where their interpreter state is).
#[map(name = "PY_TARGETS")]
static PY_TARGETS: HashMap<u32, PyOffsets> = HashMap::with_max_entries(limits::MAX_TARGETS, 0);

/// Python processes inside a framework save (`maps::PY_SAVING`).
#[map(name = "PY_SAVING")]
static PY_SAVING: HashMap<u32, u8> = HashMap::with_max_entries(limits::MAX_TARGETS, 0);

/// Sends the thread's Python stack before a collective or sync entry while the loader
/// has its process inside a framework save: whether the call is the save's is then read.
#[inline(always)]
fn sample_if_saving() {
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: only presence is read.
    if unsafe { PY_SAVING.get(&((pid_tgid >> 32) as u32)) }.is_some() {
        send_python_stack(pid_tgid, true);
    }
}

/// Entry of `torch._C._log_api_usage_once` (`ProbeId::TorchApiUsage`): the first line of
/// torch's and DCP's save and load functions. The Python stack is sent at once: the
/// framework call shows there, where it begins.
#[uprobe]
pub fn python_stack_entry(ctx: ProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    send_python_stack(pid_tgid, true);
    mark_if_dcp_load(&ctx, pid_tgid);
    0
}

/// DCP's load begins reading (`DCP_LOAD_API_EVENT`, the first argument after the module):
/// the process is loading from here on (`PY_SAVING`), before the loader has handled the
/// sample that shows it, as the `.metadata` file is read next. The loader clears it when
/// that load returns.
#[inline(always)]
fn mark_if_dcp_load(ctx: &ProbeContext, pid_tgid: u64) {
    const N: usize = DCP_LOAD_API_EVENT.len();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: copied out before the map can change under us.
    let Some(offsets) = (unsafe { PY_TARGETS.get(&tgid) }).copied() else {
        return;
    };
    let Some(event) = ctx.arg::<u64>(1) else {
        return;
    };
    // The text and its terminating NUL: an equal prefix of a longer name is not it.
    // SAFETY: reading the traced thread's memory through the checked helper.
    let Ok(text) =
        (unsafe { bpf_probe_read_user((event + offsets.str_data as u64) as *const [u8; N + 1]) })
    else {
        return;
    };
    if text[N] != 0 {
        return;
    }
    for i in 0..N {
        if text[i] != DCP_LOAD_API_EVENT[i] {
            return;
        }
    }
    // SAFETY: copied out.
    let bits = unsafe { PY_SAVING.get(&tgid) }.copied().unwrap_or(0);
    let _ = PY_SAVING.insert(&tgid, &(bits | saving::LOAD), 0);
}

/// Per Python thread, a hash of the stack last sent (low bit: sent once, to be sent again
/// at the next sample): an unchanged stack is not sent a third time.
#[map(name = "PY_LAST_STACK")]
static PY_LAST_STACK: LruHashMap<u32, u64> =
    LruHashMap::with_max_entries(limits::MAX_PY_THREADS, 0);

#[map(name = "INFLIGHT")]
static INFLIGHT: HashMap<InflightKey, Event> = HashMap::with_max_entries(limits::MAX_INFLIGHT, 0);

/// Run-wide switches set by the loader (`lens_common::settings`).
#[map(name = "SETTINGS")]
static SETTINGS: Array<u32> = Array::with_max_entries(settings::COUNT, 0);

#[inline(always)]
fn node_mode() -> bool {
    SETTINGS
        .get(settings::NODE_MODE)
        .is_some_and(|value| *value != 0)
}

#[inline(always)]
fn kernel_names() -> bool {
    SETTINGS
        .get(settings::KERNEL_NAMES)
        .is_some_and(|value| *value != 0)
}

#[map(name = "LOSSES")]
static LOSSES: PerCpuArray<u64> = PerCpuArray::with_max_entries(LossCause::COUNT as u32, 0);

const SIGSTOP: u32 = 19;

// Offsets in `struct task_struct`, set by the loader from the kernel's BTF (read
// volatile: the compiler must not fold the placeholder values).
#[unsafe(no_mangle)]
static TASK_TGID_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TASK_EXIT_CODE_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static EXIT_HAS_GROUP_DEAD: u32 = 0;
#[unsafe(no_mangle)]
static TASK_SIGNAL_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SIGNAL_NR_THREADS_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TASK_FSBASE_OFFSET: u32 = 0;

/// The current thread's thread pointer (`pthread_self()`), 0 when unknown.
#[inline(always)]
fn thread_pointer() -> u64 {
    // SAFETY: as in `has_other_threads`.
    unsafe {
        let offset = core::ptr::read_volatile(&TASK_FSBASE_OFFSET) as u64;
        if offset == 0 {
            return 0;
        }
        let task = generated::bpf_get_current_task();
        aya_ebpf::helpers::bpf_probe_read_kernel((task + offset) as *const u64).unwrap_or(0)
    }
}

/// Whether the current process has threads besides the current one (`task->signal->
/// nr_threads`); false when the kernel's layout is unknown.
#[inline(always)]
fn has_other_threads() -> bool {
    // SAFETY: reads of placeholders the loader set (volatile: not folded) and of kernel
    // memory through the checked helper, at offsets from the running kernel's BTF.
    unsafe {
        let signal_offset = core::ptr::read_volatile(&TASK_SIGNAL_OFFSET) as u64;
        let threads_offset = core::ptr::read_volatile(&SIGNAL_NR_THREADS_OFFSET) as u64;
        if signal_offset == 0 || threads_offset == 0 {
            return false;
        }
        let task = generated::bpf_get_current_task();
        let Ok(signal) =
            aya_ebpf::helpers::bpf_probe_read_kernel((task + signal_offset) as *const u64)
        else {
            return false;
        };
        aya_ebpf::helpers::bpf_probe_read_kernel((signal + threads_offset) as *const i32)
            .is_ok_and(|threads| threads > 1)
    }
}

#[inline(always)]
fn count_loss(cause: LossCause) {
    if let Some(counter) = LOSSES.get_ptr_mut(cause as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while we run.
        unsafe { *counter += 1 };
    }
}

/// The target's settings if the current process is traced.
#[inline(always)]
fn traced() -> Option<(u64, TargetConfig)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: the value is copied out before the map can change under us.
    let config = unsafe { TARGETS.get(&tgid) }.copied()?;
    Some((pid_tgid, config))
}

/// The running program's attach cookie: the probe (low 32 bits) and, for some, a detail
/// of its shape (`lens_common::probe_cookie`, `rule_cookie`).
#[inline(always)]
fn attach_cookie<C: EbpfContext>(ctx: &C) -> u64 {
    // SAFETY: the helper only reads the attach cookie of the running program.
    unsafe { generated::bpf_get_attach_cookie(ctx.as_ptr()) }
}

#[inline(always)]
fn probe_id<C: EbpfContext>(ctx: &C) -> u32 {
    attach_cookie(ctx) as u32
}

#[inline(always)]
fn count_call(pid_tgid: u64, probe: u32) {
    let key = CallKey {
        tgid: (pid_tgid >> 32) as u32,
        probe,
    };
    match CALL_COUNTS.get_ptr_mut(&key) {
        // SAFETY: per-CPU value, only this CPU writes it.
        Some(count) => unsafe { *count += 1 },
        None => {
            if CALL_COUNTS.insert(&key, &1, 0).is_err() {
                count_loss(LossCause::CounterMapFull);
            }
        }
    }
}

/// Bytes one event takes in the ring buffer (its 8-byte record header included).
const EVENT_RECORD_BYTES: u64 = (core::mem::size_of::<Event>() as u64 + 8 + 7) & !7;

/// Batched wakeups: the reader is woken each time the data waiting crosses a multiple of
/// the threshold, so once per 256 KiB however far it lags; it also drains on a timer,
/// so nothing stays behind. (A wakeup is an interrupt raised on the probed thread's CPU,
/// a VM exit on a virtual machine: woken on every event past the threshold, a lagging
/// reader made each probed collective cost ~5 µs more.)
#[inline(always)]
pub(crate) fn submit_flags() -> u64 {
    let waiting = EVENTS.query(BPF_RB_AVAIL_DATA as u64);
    let threshold = limits::WAKEUP_THRESHOLD_BYTES;
    if (waiting + EVENT_RECORD_BYTES) / threshold != waiting / threshold {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    }
}

#[inline(always)]
fn emit(event: &Event, flags: u64) {
    if EVENTS.output::<Event>(event, flags).is_err() {
        count_loss(LossCause::RingBufferFull);
    }
}

#[inline(always)]
fn new_event(kind: EventKind, probe: u32, pid_tgid: u64) -> Event {
    let mut event = Event::zeroed();
    event.kind = kind as u32;
    event.probe = probe;
    event.tgid = (pid_tgid >> 32) as u32;
    event.tid = pid_tgid as u32;
    // SAFETY: plain helper call.
    event.start_ns = unsafe { bpf_ktime_get_ns() };
    event.end_ns = event.start_ns;
    event
}

#[inline(always)]
fn remember_entry<C: EbpfContext>(ctx: &C, pid_tgid: u64, event: &Event) {
    let key = InflightKey {
        pid_tgid,
        probe: event.probe,
        _pad: 0,
    };
    if INFLIGHT.insert(&key, event, 0).is_err() {
        count_loss(LossCause::InflightMapFull);
        warn!(
            ctx,
            "lens: inflight map full, call of probe {} lost", event.probe
        );
    }
}

/// The `n`th integer argument at function entry on x86-64: six in registers, the rest on
/// the stack above the return address.
#[inline(always)]
fn arg_u64(ctx: &ProbeContext, n: usize) -> u64 {
    if n < 6 {
        return ctx.arg::<u64>(n).unwrap_or(0);
    }
    // SAFETY: reading the traced thread's stack through the checked helper.
    unsafe {
        let rsp = (*ctx.regs).rsp;
        bpf_probe_read_user((rsp + 8 * (n as u64 - 5)) as *const u64).unwrap_or(0)
    }
}

#[inline(always)]
fn arg_i32(ctx: &ProbeContext, n: usize) -> i32 {
    arg_u64(ctx, n) as i32
}

/// Common start of the entry programs: skip untraced processes, count the call, stamp
/// a new event of `kind`.
#[inline(always)]
fn begin_call(ctx: &ProbeContext, kind: EventKind) -> Option<(u64, Event)> {
    begin_call_with_cookie(ctx, kind).map(|(pid_tgid, event, _)| (pid_tgid, event))
}

/// [`begin_call`], also giving the whole attach cookie (an NCCL call's argument layout),
/// read once.
#[inline(always)]
fn begin_call_with_cookie(ctx: &ProbeContext, kind: EventKind) -> Option<(u64, Event, u64)> {
    let (pid_tgid, _) = traced()?;
    let cookie = attach_cookie(ctx);
    let probe = cookie as u32;
    count_call(pid_tgid, probe);
    Some((pid_tgid, new_event(kind, probe, pid_tgid), cookie))
}

/// Adds `value` to `*counter`, shared with other CPUs. (The old value is not used: BPF's
/// plain atomic add, without fetch, is what the `generic` CPU has.)
#[inline(always)]
fn atomic_add(counter: *mut u64, value: u64) {
    // SAFETY: a live map value; threads of one process on other CPUs add to it too.
    unsafe {
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counter, value);
    }
}

/// Counts one launch of the current process: per probe, in the process's total and,
/// when kernel names are on, per (epoch, kernel) under the epoch it runs in.
#[inline(always)]
fn count_launch(ctx: &ProbeContext, pid_tgid: u64, probe: u32, driver: bool) {
    count_call(pid_tgid, probe);
    let tgid = (pid_tgid >> 32) as u32;
    let epoch = match LAUNCH_TOTALS.get_ptr_mut(&tgid) {
        Some(totals) => {
            // SAFETY: a live map value (see `atomic_add`); the epoch is read as it is now.
            unsafe {
                atomic_add(&raw mut (*totals).launches, 1);
                core::ptr::read_volatile(&raw const (*totals).epoch)
            }
        }
        None => {
            let first = LaunchTotals {
                launches: 1,
                epoch: 0,
            };
            if LAUNCH_TOTALS
                .insert(&tgid, &first, BPF_NOEXIST as u64)
                .is_err()
            {
                // Another thread's first launch or mark came first, or the map is full.
                match LAUNCH_TOTALS.get_ptr_mut(&tgid) {
                    // SAFETY: as above.
                    Some(totals) => unsafe {
                        atomic_add(&raw mut (*totals).launches, 1);
                        core::ptr::read_volatile(&raw const (*totals).epoch)
                    },
                    None => {
                        count_loss(LossCause::CounterMapFull);
                        0
                    }
                }
            } else {
                0
            }
        }
    };
    if !kernel_names() {
        return;
    }
    // The kernel argument (`ProbeId::kernel_argument`), compared as plain integers.
    const RUNTIME_KERNEL: u32 = ProbeId::CudaLaunchKernel as u32;
    const RUNTIME_KERNEL_EX: u32 = ProbeId::CudaLaunchKernelExC as u32;
    const DRIVER_KERNEL: u32 = ProbeId::CuLaunchKernel as u32;
    const DRIVER_KERNEL_EX: u32 = ProbeId::CuLaunchKernelEx as u32;
    // Both registers read first, volatile: a context read at a computed offset (the
    // compiler folding the two) is one the verifier refuses.
    // SAFETY: reads of the probe's saved registers.
    let (first, second) = unsafe {
        (
            core::ptr::read_volatile(&(*ctx.regs).rdi),
            core::ptr::read_volatile(&(*ctx.regs).rsi),
        )
    };
    let function = match probe {
        RUNTIME_KERNEL | DRIVER_KERNEL => first,
        RUNTIME_KERNEL_EX | DRIVER_KERNEL_EX => second,
        _ => return,
    };
    let key = KernelKey {
        tgid,
        epoch: epoch as u32,
        function,
        driver: driver as u32,
        _pad: 0,
    };
    if let Some(count) = KERNEL_COUNTS.get_ptr_mut(&key) {
        atomic_add(count, 1);
        return;
    }
    if KERNEL_COUNTS.insert(&key, &1, BPF_NOEXIST as u64).is_ok() {
        return;
    }
    match KERNEL_COUNTS.get_ptr_mut(&key) {
        Some(count) => atomic_add(count, 1),
        None => count_loss(LossCause::KernelMapFull),
    }
}

/// Entry-only functions whose calls are counted, not sent (runtime kernel and graph
/// launches).
#[uprobe]
pub fn count_only(ctx: ProbeContext) -> u32 {
    if let Some((pid_tgid, _)) = traced() {
        count_launch(&ctx, pid_tgid, probe_id(&ctx), false);
    }
    0
}

/// The driver's launch functions (`cuLaunchKernel`, `cuLaunchKernelEx`, `cuGraphLaunch`).
/// The runtime launches through them too: a call whose return address (`[rsp]` at entry)
/// lies in the process's libcudart was counted by `count_only` already and is left out,
/// so each launch counts once. Calls from anywhere else (cuBLAS, cuDNN, NCCL's static
/// runtime, compiled graphs) are counted here.
#[uprobe]
pub fn driver_launch(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: the value is copied out before the map can change under us.
    if let Some(runtime) = unsafe { RUNTIME_RANGES.get(&tgid) }.copied() {
        // SAFETY: reading the traced thread's stack through the checked helper.
        let caller = unsafe { bpf_probe_read_user((*ctx.regs).rsp as *const u64) }.unwrap_or(0);
        let mut i = 0;
        while i < CODE_RANGES {
            let [start, end] = runtime.ranges[i];
            if caller >= start && caller < end {
                return 0;
            }
            i += 1;
        }
    }
    count_launch(&ctx, pid_tgid, probe_id(&ctx), true);
    0
}

/// The process's launches so far, stamped on phase marks.
#[inline(always)]
fn launches_so_far(pid_tgid: u64) -> u64 {
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: a plain read of a counter; a torn read cannot happen for an aligned u64.
    unsafe { LAUNCH_TOTALS.get(&tgid) }.map_or(0, |totals| totals.launches)
}

/// Adds one to the process's epoch and reads it back. (Two marks of two threads at the
/// same instant may both read the later epoch: the earlier one's launches, none between
/// them, are not misplaced.)
#[inline(always)]
fn bump_epoch(totals: *mut LaunchTotals) -> u64 {
    // SAFETY: a live map value (see `atomic_add`).
    unsafe {
        atomic_add(&raw mut (*totals).epoch, 1);
        core::ptr::read_volatile(&raw const (*totals).epoch)
    }
}

/// A phase mark opens the process's next epoch: launches after it are counted per kernel
/// under that epoch. Returns it (1 for the first mark).
#[inline(always)]
fn next_epoch(pid_tgid: u64) -> u64 {
    let tgid = (pid_tgid >> 32) as u32;
    if let Some(totals) = LAUNCH_TOTALS.get_ptr_mut(&tgid) {
        return bump_epoch(totals);
    }
    let first = LaunchTotals {
        launches: 0,
        epoch: 1,
    };
    if LAUNCH_TOTALS
        .insert(&tgid, &first, BPF_NOEXIST as u64)
        .is_ok()
    {
        return 1;
    }
    match LAUNCH_TOTALS.get_ptr_mut(&tgid) {
        Some(totals) => bump_epoch(totals),
        None => 0,
    }
}

/// `ncclGroupStart` / `ncclGroupEnd`: counted and sent, they bracket fused collectives.
#[uprobe]
pub fn nccl_group(ctx: ProbeContext) -> u32 {
    let Some((_, mut event)) = begin_call(&ctx, EventKind::Group) else {
        return 0;
    };
    event.group_open = (event.probe == ProbeId::NcclGroupStart as u32) as u32;
    emit(&event, submit_flags());
    0
}

/// Entry of an NCCL collective or point-to-point call: decode its arguments by shape.
#[uprobe]
pub fn nccl_collective_entry(ctx: ProbeContext) -> u32 {
    sample_if_saving();
    let Some((pid_tgid, mut event, cookie)) = begin_call_with_cookie(&ctx, EventKind::Collective)
    else {
        return 0;
    };
    event.count = arg_u64(&ctx, 2);
    event.datatype = arg_i32(&ctx, 3);
    // The cookie's shape says where the rest is. Compared as plain integers: a table
    // lookup would give the verifier an index to distrust.
    const OP_COMM_STREAM: u32 = NcclArgs::OpCommStream as u32;
    const ROOT_COMM_STREAM: u32 = NcclArgs::RootCommStream as u32;
    const OP_ROOT_COMM_STREAM: u32 = NcclArgs::OpRootCommStream as u32;
    const COMM_STREAM: u32 = NcclArgs::CommStream as u32;
    const POINT_TO_POINT: u32 = NcclArgs::PointToPoint as u32;
    match cookie_shape(cookie) {
        OP_COMM_STREAM => {
            event.redop = arg_i32(&ctx, 4);
            event.comm = arg_u64(&ctx, 5);
            event.handle = arg_u64(&ctx, 6);
        }
        ROOT_COMM_STREAM => {
            event.peer = arg_i32(&ctx, 4);
            event.comm = arg_u64(&ctx, 5);
            event.handle = arg_u64(&ctx, 6);
        }
        OP_ROOT_COMM_STREAM => {
            event.redop = arg_i32(&ctx, 4);
            event.peer = arg_i32(&ctx, 5);
            event.comm = arg_u64(&ctx, 6);
            event.handle = arg_u64(&ctx, 7);
        }
        COMM_STREAM => {
            event.comm = arg_u64(&ctx, 4);
            event.handle = arg_u64(&ctx, 5);
        }
        POINT_TO_POINT => {
            event.count = arg_u64(&ctx, 1);
            event.datatype = arg_i32(&ctx, 2);
            event.peer = arg_i32(&ctx, 3);
            event.comm = arg_u64(&ctx, 4);
            event.handle = arg_u64(&ctx, 5);
        }
        _ => return 0,
    }
    // The next event recorded on this stream tells when the collective completed.
    let stream = HandleKey {
        tgid: event.tgid,
        _pad: 0,
        handle: event.handle,
    };
    // Marked once: an LRU update allocates a new element even for a key already there.
    // SAFETY: only presence is read.
    if unsafe { COLLECTIVE_STREAMS.get(&stream) }.is_none() {
        let _ = COLLECTIVE_STREAMS.insert(&stream, &1, 0);
    }
    event.python_caller = python_caller(pid_tgid);
    remember_entry(&ctx, pid_tgid, &event);
    0
}

/// `cudaEventRecord[WithFlags](event, stream)`: sent only when it binds an event to the
/// collectives on `stream` (or unbinds a re-recorded one); every call is counted.
#[uprobe]
pub fn cuda_event_record(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let probe = probe_id(&ctx);
    count_call(pid_tgid, probe);
    let tgid = (pid_tgid >> 32) as u32;
    let stream = HandleKey {
        tgid,
        _pad: 0,
        handle: arg_u64(&ctx, 1),
    };
    let cuda_event = HandleKey {
        tgid,
        _pad: 0,
        handle: arg_u64(&ctx, 0),
    };
    // SAFETY: only presence is read.
    let binds = unsafe { COLLECTIVE_STREAMS.get(&stream) }.is_some();
    if binds {
        let _ = COLLECTIVE_STREAMS.remove(&stream);
        let _ = COLLECTIVE_EVENTS.insert(&cuda_event, &0, 0);
    } else if COLLECTIVE_EVENTS.remove(&cuda_event).is_err() {
        // Neither after a collective nor a watched event re-recorded: nothing to say.
        return 0;
    }
    let mut event = new_event(EventKind::CudaEvent, probe, pid_tgid);
    event.handle = cuda_event.handle;
    event.stream = stream.handle;
    emit(&event, submit_flags());
    0
}

/// `__cudaRegisterFunction(handle, hostFun, deviceFun, deviceName, …)`: remember which
/// name the host stub `hostFun` launches, for kernel names.
#[uprobe]
pub fn cuda_register_function(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    count_call(pid_tgid, probe_id(&ctx));
    if !kernel_names() {
        return 0;
    }
    let stub = HandleKey {
        tgid: (pid_tgid >> 32) as u32,
        _pad: 0,
        handle: arg_u64(&ctx, 1),
    };
    let _ = KERNEL_REGISTRY.insert(&stub, &arg_u64(&ctx, 2), 0);
    0
}

/// Entry of `cudaEventQuery(event)`: remembered only for events watched after a
/// collective (PyTorch's allocator and others query many more).
#[uprobe]
pub fn cuda_event_query_entry(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let probe = probe_id(&ctx);
    count_call(pid_tgid, probe);
    let key = HandleKey {
        tgid: (pid_tgid >> 32) as u32,
        _pad: 0,
        handle: arg_u64(&ctx, 0),
    };
    // SAFETY: only presence is read.
    if unsafe { COLLECTIVE_EVENTS.get(&key) }.is_none() {
        return 0;
    }
    let mut event = new_event(EventKind::CudaEvent, probe, pid_tgid);
    event.handle = key.handle;
    remember_entry(&ctx, pid_tgid, &event);
    0
}

/// `cudaErrorNotReady`: the event's work has not completed yet.
const CUDA_ERROR_NOT_READY: i64 = 600;

/// Return of `cudaEventQuery` on a watched event: not ready → remember when it was asked
/// (a lower bound of the completion); success → send it once, with that lower bound.
#[uretprobe]
pub fn cuda_event_query_return(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let key = InflightKey {
        pid_tgid,
        probe: probe_id(&ctx),
        _pad: 0,
    };
    // SAFETY: copied out before the entry is removed.
    let Some(mut event) = (unsafe { INFLIGHT.get(&key) }).copied() else {
        // An event nobody watches: its entry was not remembered.
        return 0;
    };
    let _ = INFLIGHT.remove(&key);
    let watched = HandleKey {
        tgid: event.tgid,
        _pad: 0,
        handle: event.handle,
    };
    event.ret = ctx.ret::<i64>() as i32 as i64;
    if event.ret == CUDA_ERROR_NOT_READY {
        let _ = COLLECTIVE_EVENTS.insert(&watched, &event.start_ns, 0);
        return 0;
    }
    // SAFETY: copied out before the entry is removed.
    let Some(not_ready_ns) = (unsafe { COLLECTIVE_EVENTS.get(&watched) }).copied() else {
        return 0;
    };
    let _ = COLLECTIVE_EVENTS.remove(&watched);
    if event.ret != 0 {
        return 0;
    }
    // SAFETY: plain helper call.
    event.end_ns = unsafe { bpf_ktime_get_ns() };
    event.not_ready_ns = not_ready_ns;
    emit(&event, submit_flags());
    0
}

/// Entry of a CUDA synchronisation call; `handle` is the stream or event waited on.
#[uprobe]
pub fn cuda_sync_entry(ctx: ProbeContext) -> u32 {
    sample_if_saving();
    let Some((pid_tgid, mut event)) = begin_call(&ctx, EventKind::SyncWait) else {
        return 0;
    };
    if event.probe != ProbeId::CudaDeviceSynchronize as u32 {
        event.handle = arg_u64(&ctx, 0);
    }
    event.python_caller = python_caller(pid_tgid);
    remember_entry(&ctx, pid_tgid, &event);
    0
}

/// Entry of `ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)`.
/// The 128-byte id is passed by value in memory, so `rank` takes the third register.
#[uprobe]
pub fn nccl_comm_init_entry(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, mut event)) = begin_call(&ctx, EventKind::CommInit) else {
        return 0;
    };
    // Where the call will write the new handle; read back at return.
    event.comm = arg_u64(&ctx, 0);
    event.nranks = arg_i32(&ctx, 1);
    event.rank = arg_i32(&ctx, 2);
    let mut words = [0u64; NCCL_UNIQUE_ID_WORDS];
    // SAFETY: reading the traced thread's stack through the checked helper.
    unsafe {
        let id = ((*ctx.regs).rsp + 8) as *const [u64; NCCL_UNIQUE_ID_WORDS];
        if let Ok(read) = bpf_probe_read_user(id) {
            words = read;
        }
    }
    event.comm_id_hash = comm_id_hash(&words);
    remember_entry(&ctx, pid_tgid, &event);
    0
}

/// Return of any call with entry state: pair it, stamp the end and the result, send it.
#[uretprobe]
pub fn call_return(ctx: RetProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let key = InflightKey {
        pid_tgid,
        probe: probe_id(&ctx),
        _pad: 0,
    };
    // SAFETY: copied out before the entry is removed.
    let Some(mut event) = (unsafe { INFLIGHT.get(&key) }).copied() else {
        count_loss(LossCause::UnmatchedReturn);
        return 0;
    };
    let _ = INFLIGHT.remove(&key);
    // SAFETY: plain helper call.
    event.end_ns = unsafe { bpf_ktime_get_ns() };
    event.ret = ctx.ret::<i64>() as i32 as i64;
    let mut flags = submit_flags();
    if event.kind == EventKind::CommInit as u32 {
        // SAFETY: the out-pointer the caller passed; read through the checked helper.
        event.comm = unsafe { bpf_probe_read_user(event.comm as *const u64) }.unwrap_or(0);
        // Rare and needed to name every later collective's communicator: deliver now.
        flags = BPF_RB_FORCE_WAKEUP as u64;
    }
    emit(&event, flags);
    0
}

/// glibc's `_dl_debug_state`: the target's set of loaded objects changed. Tell the loader
/// at once; for processes it started, stop them until it has attached to new libraries.
#[uprobe]
pub fn dl_debug_state(ctx: ProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: the value is copied out before the map can change under us.
    let config = unsafe { TARGETS.get(&tgid) }.copied();
    if config.is_none() && !node_mode() {
        return 0;
    }
    let mut event = new_event(
        EventKind::LinkMapChanged,
        ProbeId::DlDebugState as u32,
        pid_tgid,
    );
    // Job-control stops make some blocking calls of *other* threads fail with EINTR
    // (epoll_wait, semtimedop...; see signal(7)), which libraries such as gloo treat as
    // fatal: only a single-threaded process is stopped. A multi-threaded one runs on
    // while its new libraries are attached (a few ms).
    let stop = config.is_some_and(|c| c.flags & TARGET_STOP_ON_LINK_MAP_CHANGE != 0)
        && !has_other_threads();
    // `count`: 1 when the process was stopped and waits for the loader's SIGCONT;
    // `peer`: 1 when it is a target (else a candidate of node-wide discovery).
    event.count = stop as u64;
    event.peer = config.is_some() as i32;
    // Reserve first: without room for the event nobody would resume a stopped target.
    let Some(mut entry) = EVENTS.reserve::<Event>(0) else {
        count_loss(LossCause::RingBufferFull);
        return 0;
    };
    entry.write(event);
    if stop {
        // The stop is queued before the loader can see the event, so its SIGCONT always
        // comes after it (a SIGCONT discards a pending stop).
        debug!(&ctx, "lens: stopping {} for attach", event.tgid);
        // SAFETY: the helper only reads the clock.
        let _ = STOPPED.insert(&event.tgid, &unsafe { bpf_ktime_get_ns() }, 0);
        // SAFETY: signals the current process, which is the traced target.
        unsafe { generated::bpf_send_signal(SIGSTOP) };
    }
    let flags = if config.is_some() {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        submit_flags()
    };
    entry.submit(flags);
    0
}

/// Entry of a function that marks a phase boundary (torch scope exit, backward, grad
/// mode, checkpoint writer/reader): sent at once with the first integer argument
/// (`set_enabled`'s flag).
#[uprobe]
pub fn phase_mark(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, mut event)) = begin_call(&ctx, EventKind::PhaseMark) else {
        return 0;
    };
    event.count = arg_u64(&ctx, 0);
    event.epoch = next_epoch(pid_tgid);
    event.launches = launches_so_far(pid_tgid);
    emit(&event, submit_flags());
    0
}

/// libc's `open(path, flags)` / `openat(dirfd, path, flags)` entered: a file created
/// (`O_CREAT`) is sent as a mark (a checkpoint's file), and so is a file opened for
/// reading while the process is in a framework load (`PY_SAVING`); any other open sends
/// nothing and counts nothing, nor does one under `/dev/` or `/proc/` (POSIX semaphores
/// in `/dev/shm`, which progress bars create, are no checkpoint files).
#[uprobe]
pub fn file_open_entry(ctx: ProbeContext) -> u32 {
    use lens_common::open_flags::{ACCMODE, CREAT, DIRECTORY};
    // Both registers are read, then one chosen: the verifier takes context loads at
    // constant offsets only, which a branch between two loads can be merged out of.
    let (open_path, open_flags) = (ctx.arg::<u64>(0), ctx.arg::<u64>(1));
    let (openat_path, openat_flags) = (ctx.arg::<u64>(1), ctx.arg::<u64>(2));
    let (path, flags) = if probe_id(&ctx) == ProbeId::FileOpenAt as u32 {
        (openat_path, openat_flags)
    } else {
        (open_path, open_flags)
    };
    let flags = flags.unwrap_or(0);
    if flags & CREAT == 0 {
        // A file opened for reading counts only inside a framework load (DCP's reader
        // opens each file once; the per-item `torch.load`s read from streams).
        let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
        // SAFETY: the value is copied out.
        let loading = unsafe { PY_SAVING.get(&tgid) }.is_some_and(|v| *v & saving::LOAD != 0);
        if !loading || flags & ACCMODE != 0 || flags & DIRECTORY != 0 {
            return 0;
        }
    }
    // SAFETY: reading the traced thread's memory through the checked helper.
    let prefix =
        unsafe { bpf_probe_read_user(path.unwrap_or(0) as *const [u8; 6]) }.unwrap_or([0; 6]);
    if prefix[..5] == *b"/dev/" || prefix == *b"/proc/" {
        return 0;
    }
    let Some((pid_tgid, mut event)) = begin_call(&ctx, EventKind::PhaseMark) else {
        return 0;
    };
    // The Python stack first (stamped before the mark): the loader knows whether the
    // framework save that may have created it is still running.
    send_python_stack(pid_tgid, true);
    // The flags tell the loader a file created from one opened for reading.
    event.args[0] = flags;
    // SAFETY: the helper only reads the clock.
    event.start_ns = unsafe { bpf_ktime_get_ns() };
    event.end_ns = event.start_ns;
    event.epoch = next_epoch(pid_tgid);
    event.launches = launches_so_far(pid_tgid);
    emit(&event, submit_flags());
    0
}

/// Return of a phase-marking function (end of a backward, of a checkpoint file).
#[uretprobe]
pub fn phase_mark_return(ctx: RetProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let mut event = new_event(EventKind::PhaseMark, probe_id(&ctx), pid_tgid);
    event.at_return = 1;
    event.ret = ctx.ret::<i64>();
    event.epoch = next_epoch(pid_tgid);
    event.launches = launches_so_far(pid_tgid);
    emit(&event, submit_flags());
    0
}

/// `torch::autograd::Engine::execute(roots, inputs, keep_graph, create_graph,
/// accumulate_grad, outputs)` entered: sent at once with `accumulate_grad`, which tells
/// a backward pass (`.backward()`) from `torch.autograd.grad` (graph capture). The
/// function returns a vector by value, so the hidden return pointer takes rdi and
/// `accumulate_grad` is the seventh integer argument, the first on the stack.
#[uprobe]
pub fn torch_backward_entry(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, mut event)) = begin_call(&ctx, EventKind::PhaseMark) else {
        return 0;
    };
    event.count = arg_u64(&ctx, 6) & 0xff;
    event.epoch = next_epoch(pid_tgid);
    event.launches = launches_so_far(pid_tgid);
    emit(&event, submit_flags());
    0
}

/// `record_function_enter_new(const std::string& name, ...)`: the name is read here, in
/// the kernel, while the string is alive. The function returns a class by value, so the
/// hidden return pointer takes rdi and `name` is the second argument. libstdc++'s
/// `std::string` starts with its data pointer and length.
#[uprobe]
pub fn torch_scope_enter(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, mut event)) = begin_call(&ctx, EventKind::PhaseMark) else {
        return 0;
    };
    event.epoch = next_epoch(pid_tgid);
    event.launches = launches_so_far(pid_tgid);
    let string = arg_u64(&ctx, 1);
    // SAFETY: reads of the traced thread's memory through the checked helpers.
    unsafe {
        let data = bpf_probe_read_user(string as *const u64).unwrap_or(0);
        event.count = bpf_probe_read_user((string + 8) as *const u64).unwrap_or(0);
        if let Ok(name) = bpf_probe_read_user_str_bytes(data as *const u8, &mut event.name) {
            event.name_len = name.len() as u32;
        }
    }
    emit(&event, submit_flags());
    0
}

/// Entry of a call whose duration is wanted but whose arguments are not decoded
/// (gloo collectives: the tensors live behind C++ vectors). The first argument, the
/// `ProcessGroupGloo` object of a member function, is kept in `comm`: it tells the
/// process's groups apart (hang detection numbers each group's collectives).
#[uprobe]
pub fn timed_call_entry(ctx: ProbeContext) -> u32 {
    sample_if_saving();
    let Some((pid_tgid, mut event)) = begin_call(&ctx, EventKind::Collective) else {
        return 0;
    };
    event.comm = ctx.arg::<u64>(0).unwrap_or(0);
    remember_entry(&ctx, pid_tgid, &event);
    0
}

/// `sched_process_fork(parent, child)`: a traced process created another. A new process
/// (not a thread) is traced from here, with its parent's settings, before it runs.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn process_fork(ctx: RawTracePointContext) -> i32 {
    let Some((pid_tgid, config)) = traced() else {
        return 0;
    };
    let child: u64 = ctx.arg(1);
    // SAFETY: reads of kernel memory through the checked helper; the offsets come from
    // the running kernel's BTF.
    let child_tgid = unsafe {
        let offset = core::ptr::read_volatile(&TASK_TGID_OFFSET) as u64;
        aya_ebpf::helpers::bpf_probe_read_kernel((child + offset) as *const i32).unwrap_or(0)
    } as u32;
    let parent_tgid = (pid_tgid >> 32) as u32;
    if child_tgid == 0 || child_tgid == parent_tgid {
        // A new thread of the same process: already traced.
        return 0;
    }
    if TARGETS.insert(&child_tgid, &config, 0).is_err() {
        count_loss(LossCause::TargetMapFull);
        return 0;
    }
    let mut event = new_event(EventKind::ProcessForked, 0, pid_tgid);
    event.tgid = child_tgid;
    event.tid = child_tgid;
    event.count = parent_tgid as u64;
    emit(&event, BPF_RB_FORCE_WAKEUP as u64);
    0
}

/// `sched_process_exec`: a traced process now runs another program.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn process_exec(_ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: only the presence is read.
    let traced = unsafe { TARGETS.get(&tgid) }.is_some();
    if !traced && !node_mode() {
        return 0;
    }
    let mut event = new_event(EventKind::ProcessExec, 0, pid_tgid);
    // 1: a target; 0: any process, for node-wide discovery (its loader may be new).
    event.peer = traced as i32;
    emit(
        &event,
        if traced {
            BPF_RB_FORCE_WAKEUP as u64
        } else {
            submit_flags()
        },
    );
    0
}

/// `sched_process_exit(task[, group_dead])`: a thread of a traced process exits. The last
/// one (or, on kernels without `group_dead`, the leader) reports the process's wait
/// status, which only its parent could otherwise collect.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn process_exit(ctx: RawTracePointContext) -> i32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let task: u64 = ctx.arg(0);
    // SAFETY: reads of placeholders the loader set (volatile: not folded) and of kernel
    // memory through the checked helper, at offsets from the running kernel's BTF.
    let (last, code) = unsafe {
        let last = if core::ptr::read_volatile(&EXIT_HAS_GROUP_DEAD) != 0 {
            ctx.arg::<u64>(1) & 0xff != 0
        } else {
            pid_tgid as u32 == (pid_tgid >> 32) as u32
        };
        let offset = core::ptr::read_volatile(&TASK_EXIT_CODE_OFFSET) as u64;
        let code =
            aya_ebpf::helpers::bpf_probe_read_kernel((task + offset) as *const i32).unwrap_or(0);
        (last, code)
    };
    if !last {
        return 0;
    }
    let mut event = new_event(EventKind::ProcessExit, 0, pid_tgid);
    event.count = code as u32 as u64;
    emit(&event, BPF_RB_FORCE_WAKEUP as u64);
    0
}

/// Entry of a function a configured probe rule names. The cookie carries the rule
/// (`lens_common::rule_cookie`): its index and which argument, if any, is read as a
/// string. Sent at once, like a phase mark, with the six argument registers.
#[uprobe]
pub fn user_rule_entry(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let cookie = attach_cookie(&ctx);
    let mut event = new_event(EventKind::RuleCall, cookie as u32, pid_tgid);
    // A launch mark like a phase mark's: the span's launches (and kernels) are counted
    // between its two marks.
    event.epoch = next_epoch(pid_tgid);
    event.launches = launches_so_far(pid_tgid);
    let args = [
        arg_u64(&ctx, 0),
        arg_u64(&ctx, 1),
        arg_u64(&ctx, 2),
        arg_u64(&ctx, 3),
        arg_u64(&ctx, 4),
        arg_u64(&ctx, 5),
    ];
    // Which argument is a string: compared as plain integers, no index the verifier
    // would have to trust.
    let pointer = match (cookie >> 32) & 0xff {
        1 => args[0],
        2 => args[1],
        3 => args[2],
        4 => args[3],
        5 => args[4],
        6 => args[5],
        _ => 0,
    };
    event.args = args;
    if pointer != 0 {
        // SAFETY: reads of the traced thread's memory through the checked helpers.
        unsafe {
            let data = if (cookie >> 40) & 1 != 0 {
                // libstdc++'s std::string starts with its data pointer.
                bpf_probe_read_user(pointer as *const u64).unwrap_or(0)
            } else {
                pointer
            };
            if data != 0
                && let Ok(text) = bpf_probe_read_user_str_bytes(data as *const u8, &mut event.name)
            {
                event.name_len = text.len() as u32;
            }
        }
    }
    emit(&event, submit_flags());
    0
}

/// Return of a function a configured probe rule names: the span it opened ends here.
#[uretprobe]
pub fn user_rule_return(ctx: RetProbeContext) -> u32 {
    let Some((pid_tgid, _)) = traced() else {
        return 0;
    };
    let mut event = new_event(EventKind::RuleCall, probe_id(&ctx), pid_tgid);
    event.at_return = 1;
    event.ret = ctx.ret::<i64>();
    event.epoch = next_epoch(pid_tgid);
    event.launches = launches_so_far(pid_tgid);
    emit(&event, submit_flags());
    0
}

#[inline(always)]
fn read_user_u64(address: u64) -> u64 {
    // SAFETY: reading the sampled thread's memory through the checked helper.
    unsafe { bpf_probe_read_user(address as *const u64) }.unwrap_or(0)
}

/// The sampled thread's `PyThreadState`, 0 if it has none (not a Python thread): the
/// main interpreter's thread whose id is the thread's (tid, or thread pointer on 3.10).
#[inline(always)]
fn python_thread_state(offsets: &PyOffsets, tid: u32) -> u64 {
    let wanted = if offsets.match_thread_pointer != 0 {
        thread_pointer()
    } else {
        tid as u64
    };
    if wanted == 0 {
        return 0;
    }
    let interpreter = read_user_u64(offsets.runtime + offsets.interpreters_head as u64);
    if interpreter == 0 {
        return 0;
    }
    let mut state = read_user_u64(interpreter + offsets.threads_head as u64);
    let mut walked = 0;
    while walked < limits::MAX_PY_THREAD_WALK && state != 0 {
        if read_user_u64(state + offsets.tstate_native_thread_id as u64) == wanted {
            return state;
        }
        state = read_user_u64(state + offsets.tstate_next as u64);
        walked += 1;
    }
    0
}

/// The innermost Python frame of thread `tid` (Some(0) when it runs none); `None` when it
/// is no Python thread of the process.
#[inline(always)]
fn innermost_frame(offsets: &PyOffsets, tid: u32) -> Option<u64> {
    let state = python_thread_state(offsets, tid);
    if state == 0 {
        return None;
    }
    let frame = read_user_u64(state + offsets.tstate_frame as u64);
    if offsets.cframe_current_frame != PY_NO_FIELD && frame != 0 {
        return Some(read_user_u64(frame + offsets.cframe_current_frame as u64));
    }
    Some(frame)
}

/// The code object of the innermost Python frame of the calling thread, in a sampled
/// CPython process (0 otherwise, or when the thread runs no Python).
#[inline(always)]
fn python_caller(pid_tgid: u64) -> u64 {
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: copied out before the map can change under us.
    let Some(offsets) = (unsafe { PY_TARGETS.get(&tgid) }).copied() else {
        return 0;
    };
    let frame = innermost_frame(&offsets, pid_tgid as u32).unwrap_or(0);
    if frame == 0 {
        return 0;
    }
    read_user_u64(frame + offsets.frame_code as u64)
}

/// Samples traced Python threads on the CPU clock (every CPU, ~1 ms): reads the thread's
/// frame stack (code object, frame, first local per frame) and sends it when it differs
/// from the thread's last one. docs/python.md.
#[perf_event]
pub fn python_sample(_ctx: PerfEventContext) -> u32 {
    send_python_stack(bpf_get_current_pid_tgid(), false);
    0
}

/// Sends the current thread's Python stack (a CPython target's): from the sampler only
/// when it changed (`forced` false), or at once (a file created: which Python call
/// created it is then exact, not sampled).
#[inline(always)]
fn send_python_stack(pid_tgid: u64, forced: bool) {
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    // SAFETY: copied out before the map can change under us.
    let Some(offsets) = (unsafe { PY_TARGETS.get(&tgid) }).copied() else {
        return;
    };
    // A Python thread with no frame (idle in C) is sampled too: an empty stack ends calls.
    let Some(mut frame) = innermost_frame(&offsets, tid) else {
        return;
    };
    let Some(mut entry) = EVENTS.reserve::<PyStack>(0) else {
        count_loss(LossCause::RingBufferFull);
        return;
    };
    let stack = entry.as_mut_ptr();
    // Walk up to PY_MAX_WALK frames from the innermost, keeping the outermost
    // PY_MAX_DEPTH in a ring (slot = frame number mod PY_MAX_DEPTH): the functions rules
    // name (a step, an evaluation) sit near the bottom of a deep stack. One path through
    // the loop (no per-frame branch but its end): the verifier walks each iteration.
    let mut depth = 0usize;
    for i in 0..PY_MAX_WALK {
        if frame == 0 {
            break;
        }
        let slot = i % PY_MAX_DEPTH;
        // SAFETY: `slot` < PY_MAX_DEPTH: inside the reserved record.
        unsafe {
            (*stack).code[slot] = read_user_u64(frame + offsets.frame_code as u64);
            (*stack).frame[slot] = frame;
            (*stack).first_local[slot] = read_user_u64(frame + offsets.frame_first_local as u64);
        }
        depth = i + 1;
        frame = read_user_u64(frame + offsets.frame_previous as u64);
    }
    // The hash of the frames kept: a change deeper inside (a model's layers) is not a
    // change to send.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for slot in 0..PY_MAX_DEPTH {
        if slot >= depth {
            break;
        }
        // SAFETY: as above; written by the walk.
        let (code, frame, local) = unsafe {
            (
                (*stack).code[slot],
                (*stack).frame[slot],
                (*stack).first_local[slot],
            )
        };
        hash = (hash ^ code).wrapping_mul(0x100_0000_01b3);
        hash = (hash ^ frame).wrapping_mul(0x100_0000_01b3);
        hash = (hash ^ local).wrapping_mul(0x100_0000_01b3);
    }
    // A new stack is sent twice, at its first sample and at the next (the user side
    // takes a change two samples agree on: one can catch the chain mid-update); then not
    // again until it changes. The low bit of the remembered hash: the second is due.
    let hash = hash & !1;
    // A forced sample leaves the sampler's record alone: its next change is still sent.
    if !forced {
        // SAFETY: copied out.
        let last = unsafe { PY_LAST_STACK.get(&tid) }.copied();
        let remember = match last {
            Some(last) if last & !1 == hash && last & 1 == 0 => {
                entry.discard(0);
                return;
            }
            Some(last) if last & !1 == hash => hash,
            _ => hash | 1,
        };
        let _ = PY_LAST_STACK.insert(&tid, &remember, 0);
    }
    // SAFETY: the reserved record, filled before it is submitted.
    unsafe {
        (*stack).kind = EventKind::PyStack as u32;
        (*stack).depth = depth as u32;
        (*stack).tgid = tgid;
        (*stack).tid = tid;
        (*stack).synchronous = forced as u32;
        (*stack)._pad = 0;
        (*stack).at_ns = bpf_ktime_get_ns();
        (*stack).launches = launches_so_far(pid_tgid);
        (*stack).epoch = next_epoch(pid_tgid);
    }
    // Delivered at once: the loader names the frames from the process's memory, which a
    // process that exits soon after takes with it.
    entry.submit(BPF_RB_FORCE_WAKEUP as u64);
}
