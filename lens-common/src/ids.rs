//! Every number the kernel and user space agree on, each from one list: [`ProbeId`]
//! (the probed functions), [`EventKind`] (what a record describes) and [`LossCause`]
//! (why the kernel lost something). A variant added to a list is in the enum, its `ALL`,
//! its `COUNT` and its `from_u32` at once.

/// Makes a `#[repr(u32)]` enum from one list of `Variant = value` (optionally
/// `=> "name"`), with `COUNT`, `ALL` (in list order) and `from_u32`.
macro_rules! numbered {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal $(=> $label:literal)?, )+
        }
    ) => {
        $(#[$meta])*
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant = $value, )+
        }

        impl $name {
            pub const COUNT: usize = [$($value),+].len();
            pub const ALL: [$name; Self::COUNT] = [$($name::$variant),+];
            /// Each variant's number, in list order.
            pub const VALUES: [u32; Self::COUNT] = [$($value),+];

            pub const fn from_u32(value: u32) -> Option<$name> {
                match value {
                    $( $value => Some($name::$variant), )+
                    _ => None,
                }
            }

            numbered!(@names $name $( $variant $(=> $label)? ; )+);
        }
    };
    (@names $name:ident $( $variant:ident => $label:literal ; )+) => {
        /// The name users see (summaries, metrics).
        pub const fn name(self) -> &'static str {
            match self {
                $( $name::$variant => $label, )+
            }
        }
    };
    (@names $name:ident $( $variant:ident ; )+) => {};
}

numbered! {
    /// Every probed function has one id. It is the attach cookie of the probe, the key of
    /// the per-call counters and the `probe` of a record's [`RecordHeader`](crate::record::RecordHeader). Its symbol,
    /// library and programs are user space's (`probes::catalog`); numbers are dense from 0.
    pub enum ProbeId {
        CudaLaunchKernel = 0,
        CudaLaunchKernelExC = 1,
        CudaGraphLaunch = 2,
        CudaStreamSynchronize = 3,
        CudaDeviceSynchronize = 4,
        CudaEventSynchronize = 5,
        NcclAllReduce = 6,
        NcclBroadcast = 7,
        NcclReduce = 8,
        NcclAllGather = 9,
        NcclReduceScatter = 10,
        NcclSend = 11,
        NcclRecv = 12,
        NcclGroupStart = 13,
        NcclGroupEnd = 14,
        NcclCommInitRank = 15,
        /// glibc's `_dl_debug_state`: the dynamic loader calls it whenever the set of loaded
        /// objects changes (start-up, dlopen, dlclose).
        DlDebugState = 16,
        /// PyTorch's `record_function` scope entry (`torch.autograd.profiler.record_function`,
        /// which torch wraps around `Optimizer.step`, `Optimizer.zero_grad`, DataLoader fetches).
        TorchScopeEnter = 17,
        /// The matching scope exit (a local symbol of libtorch_cpu.so).
        TorchScopeExit = 18,
        /// `torch::autograd::Engine::execute`, its entry: one backward pass begins (its end
        /// is [`ProbeId::TorchBackwardReturn`]).
        TorchBackward = 19,
        /// `c10::GradMode::set_enabled(bool)`: `torch.no_grad()` and friends.
        TorchGradMode = 20,
        /// `caffe2::serialize::PyTorchStreamWriter` constructed: a `torch.save` begins.
        CheckpointWriterOpen = 21,
        /// Its destructor: the checkpoint file is complete.
        CheckpointWriterClose = 22,
        /// `caffe2::serialize::PyTorchStreamReader` constructed: a `torch.load` begins.
        CheckpointReaderOpen = 23,
        /// Its destructor.
        CheckpointReaderClose = 24,
        GlooAllReduce = 25,
        GlooBroadcast = 26,
        GlooReduce = 27,
        GlooAllGather = 28,
        GlooReduceScatter = 29,
        GlooSend = 30,
        GlooRecv = 31,
        GlooBarrier = 32,
        /// The driver's `cuLaunchKernel` (libcuda.so.1): what cuBLAS, cuDNN, NCCL and the
        /// runtime itself call. Counted only when its caller is not libcudart (a runtime
        /// launch is counted once, at the runtime).
        CuLaunchKernel = 33,
        /// The driver's `cuLaunchKernelEx`.
        CuLaunchKernelEx = 34,
        /// The driver's `cuGraphLaunch`.
        CuGraphLaunch = 35,
        /// `cudaEventRecord(event, stream)`: an event recorded after a collective on the
        /// collective's stream completes when the collective does (collective completion).
        CudaEventRecord = 36,
        /// `cudaEventRecordWithFlags(event, stream, flags)`.
        CudaEventRecordWithFlags = 37,
        /// `cudaEventQuery(event)`: PyTorch's watchdog polls the event recorded after each
        /// collective; the first successful query bounds the collective's end.
        CudaEventQuery = 38,
        /// `__cudaRegisterFunction(handle, hostFun, deviceFun, …)`: what nvcc's module
        /// constructors call for every kernel; it pairs the host stub (what launches pass)
        /// with the kernel's mangled name, also in libraries shipped without symbols.
        CudaRegisterFunction = 39,
        /// libtorch_python's PLT stub of `c10::AutogradState::set_tls_state(AutogradState)`:
        /// called from there only by the `torch.inference_mode()` guard (entry and exit);
        /// grad mode is bit 0 of the state. The engine's own per-node calls (libtorch_cpu)
        /// do not go through it.
        TorchInferenceMode = 40,
        /// safetensors' `serialize_file` (Python `save_file`, `save_model`, transformers'
        /// `save_pretrained`), entry to return: one checkpoint file written. Rust names carry
        /// a hash, so the symbol is a glob.
        SafetensorsSerializeFile = 41,
        /// safetensors' `safe_open(...)` constructed: a file read (`load_file`) begins.
        SafetensorsOpen = 42,
        /// `safe_open.__exit__` returned: that read ended.
        SafetensorsClose = 43,
        /// libc's `open(path, flags, ...)` (`open64`: one function) with `O_CREAT`: a file
        /// created, whoever writes it (Python's `open`, `fopen`, Rust's `File::create`).
        /// Attached to the traced processes only, never node-wide.
        FileOpen = 44,
        /// libc's `openat(dirfd, path, flags, ...)` with `O_CREAT`.
        FileOpenAt = 45,
        /// libtorch_python's `torch._C._log_api_usage_once(event)` (a static function, in
        /// the `.symtab` PyPI's wheels ship): the first line of `torch.save`, `torch.load`
        /// and DCP's `save`, `async_save` and `load`. Its entry takes a Python stack sample,
        /// so such a call is seen where it begins, even if it then waits, unsampled, for
        /// the GIL or a peer.
        TorchApiUsage = 46,
        /// `ncclAlltoAll(send, recv, count, dtype, comm, stream)`: every rank sends `count`
        /// elements to every rank (mixture-of-experts token exchange). Newer NCCL only.
        NcclAlltoAll = 47,
        /// libtorch_python's `THPEngine_run_backward` (a static function, in the `.symtab`
        /// PyPI's wheels ship), its return: a backward (or `torch.autograd.grad`) begun from
        /// Python ended. The end of a backward is taken here and not at
        /// `Engine::execute`'s return because a return probe on a function an exception
        /// can leave aborts the process; this one catches every C++ exception
        /// (`HANDLE_TH_ERRORS`) and returns NULL instead.
        TorchBackwardReturn = 48,
        /// `cudaMalloc(void **devPtr, size_t size)`: device memory (the GPU memory calls
        /// below go through the generic call programs, `api_call_entry` / `_return`;
        /// docs/memory.md).
        CudaMalloc = 49,
        /// `cudaMallocAsync(void **devPtr, size_t size, cudaStream_t stream)`.
        CudaMallocAsync = 50,
        /// `cudaMallocManaged(void **devPtr, size_t size, unsigned flags)`.
        CudaMallocManaged = 51,
        /// `cudaFree(void *devPtr)`.
        CudaFree = 52,
        /// `cudaFreeAsync(void *devPtr, cudaStream_t stream)`.
        CudaFreeAsync = 53,
        /// The driver's `cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)`.
        CuMemAlloc = 54,
        /// `cuMemFree_v2(CUdeviceptr dptr)`.
        CuMemFree = 55,
        /// `cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)`.
        CuMemAllocAsync = 56,
        /// `cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)`.
        CuMemFreeAsync = 57,
        /// `cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, prop, flags)`:
        /// physical memory behind PyTorch's expandable segments (and NCCL's buffers).
        CuMemCreate = 58,
        /// `cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, handle, flags)`.
        CuMemMap = 59,
        /// `cuMemUnmap(CUdeviceptr ptr, size_t size)`.
        CuMemUnmap = 60,
        /// `cuMemRelease(CUmemGenericAllocationHandle handle)`.
        CuMemRelease = 61,
        /// `cudaStreamBeginCapture(stream, mode)`: launches on the stream are recorded
        /// into a graph from here on, not run (`api_shape::CAPTURE_BEGIN`).
        CudaStreamBeginCapture = 62,
        /// `cudaStreamEndCapture(stream, cudaGraph_t *graph)`: the capture ends.
        CudaStreamEndCapture = 63,
        /// The driver's `cuStreamBeginCapture_v2(hStream, mode)`.
        CuStreamBeginCapture = 64,
        /// `cuStreamEndCapture(hStream, CUgraph *phGraph)`.
        CuStreamEndCapture = 65,
        /// `cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, flags)`: a
        /// captured graph made launchable (slow: ms).
        CudaGraphInstantiate = 66,
        /// `cudaGraphInstantiateWithFlags(cudaGraphExec_t *exec, cudaGraph_t graph, flags)`.
        CudaGraphInstantiateWithFlags = 67,
        /// The driver's `cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, flags)`.
        CuGraphInstantiate = 68,
        /// `c10::reportMemoryUsageToProfiler(ptr, size, allocated, reserved, device)`
        /// (libc10.so): PyTorch's caching allocator calls it on every allocation and
        /// free with its totals after it (rdx, rcx). Counted; sent only when a total
        /// passes the process's peak (`TargetState::torch_peaks`).
        TorchMemoryUsage = 69,
        /// libtorch_python's `torch._C._set_grad_enabled(mode)` (a static function, in the
        /// `.symtab` PyPI's wheels ship): what `torch.no_grad()`, `enable_grad()` and
        /// `set_grad_enabled()` call. Where it is probed, [`ProbeId::TorchGradMode`] is
        /// not: autograd's own C++ guards, 60 % of a checkpointed model's switches, do
        /// not pass here. Its changes are sent as [`ProbeId::TorchGradMode`]'s.
        TorchSetGradEnabled = 70,
    }
}

impl ProbeId {
    /// A kernel or graph launch: counted in the kernel, never sent as an event, and the
    /// fine-grained probes an overhead budget samples.
    pub const fn is_launch(self) -> bool {
        matches!(
            self,
            ProbeId::CudaLaunchKernel
                | ProbeId::CudaLaunchKernelExC
                | ProbeId::CudaGraphLaunch
                | ProbeId::CuLaunchKernel
                | ProbeId::CuLaunchKernelEx
                | ProbeId::CuGraphLaunch
        )
    }

    /// A launch probe in the driver (libcuda), as opposed to the runtime (libcudart).
    pub const fn is_driver_launch(self) -> bool {
        matches!(
            self,
            ProbeId::CuLaunchKernel | ProbeId::CuLaunchKernelEx | ProbeId::CuGraphLaunch
        )
    }

    /// Which integer argument of a kernel launch names the kernel: the host stub
    /// (`cudaLaunchKernel`: 0, `cudaLaunchKernelExC`: 1) or the `CUfunction` handle
    /// (`cuLaunchKernel`: 0, `cuLaunchKernelEx`: 1). `None` for graph launches.
    pub const fn kernel_argument(self) -> Option<usize> {
        match self {
            ProbeId::CudaLaunchKernel | ProbeId::CuLaunchKernel => Some(0),
            ProbeId::CudaLaunchKernelExC | ProbeId::CuLaunchKernelEx => Some(1),
            _ => None,
        }
    }
}

numbered! {
    /// Why the kernel side could not do its job; indexes of the `LOSSES` per-CPU array.
    pub enum LossCause {
        /// The ring buffer had no room: an event was dropped.
        RingBufferFull = 0 => "ring_buffer_full",
        /// The entry-state map was full: that call's event was not produced.
        InflightMapFull = 1 => "inflight_map_full",
        /// A return without its entry (attached mid-call): nothing to pair it with.
        UnmatchedReturn = 2 => "unmatched_return",
        /// The target map was full: a forked child of a traced process is not traced.
        TargetMapFull = 3 => "target_map_full",
        /// The per-kernel launch counters were full: a launch was counted but its kernel not.
        KernelMapFull = 4 => "kernel_map_full",
    }
}

/// Whether `values` are 0, 1, 2, … in order: `from_u32` and the arrays indexed by id
/// (the catalog, the loss counters) rely on it.
const fn dense_from_zero(values: &[u32]) -> bool {
    let mut i = 0;
    while i < values.len() {
        if values[i] != i as u32 {
            return false;
        }
        i += 1;
    }
    true
}

const _: () = assert!(dense_from_zero(&ProbeId::VALUES));
const _: () = assert!(dense_from_zero(&LossCause::VALUES));
const _: () = assert!(dense_from_zero(&NcclArgs::VALUES));

numbered! {
    /// How an NCCL call lays out its arguments (x86-64 SysV; `docs/probes.md`), carried
    /// in bits 32..40 of its attach cookie ([`probe_cookie`](crate::probe_cookie)) so that
    /// one program decodes every collective and a new one of a known shape needs no
    /// kernel change. All but point-to-point start `(send, recv, count, datatype, …)`.
    pub enum NcclArgs {
        /// `…, op, comm, stream`: ncclAllReduce, ncclReduceScatter.
        OpCommStream = 0,
        /// `…, root, comm, stream`: ncclBroadcast.
        RootCommStream = 1,
        /// `…, op, root, comm, stream`: ncclReduce.
        OpRootCommStream = 2,
        /// `…, comm, stream`: ncclAllGather, ncclAlltoAll.
        CommStream = 3,
        /// `(buf, count, datatype, peer, comm, stream)`: ncclSend, ncclRecv.
        PointToPoint = 4,
    }
}
