//! The catalog's table: one entry per probe, in `ProbeId` order, written with the
//! constructors of `rows.rs` (which groups need a probe, which program handles it).
use lens_common::{NcclArgs, ProbeId};

use super::rows::*;
use super::{ProbeSpec, Program, Role};
use crate::calls::{CollectiveOp, GraphOp, MemoryOp, SyncKind};
use crate::settings::groups::SpanGroup;
use crate::sys::library::LibraryKind;

pub use super::rows::STEP_DETAIL;

use LibraryKind::{
    C10, CudaDriver, CudaRuntime, DynamicLoader, Libc, Nccl, Safetensors, TorchCpu, TorchPython,
};
use Program::*;

pub static CATALOG: [ProbeSpec; ProbeId::COUNT] = [
    with_aliases(
        spec(
            ProbeId::CudaLaunchKernel,
            "cudaLaunchKernel",
            CudaRuntime,
            CountOnly,
            STEP_DETAIL,
        ),
        &["cudaLaunchKernel_ptsz"],
    ),
    with_aliases(
        spec(
            ProbeId::CudaLaunchKernelExC,
            "cudaLaunchKernelExC",
            CudaRuntime,
            CountOnly,
            STEP_DETAIL,
        ),
        &["cudaLaunchKernelExC_ptsz"],
    ),
    with_aliases(
        graph_launch(
            ProbeId::CudaGraphLaunch,
            "cudaGraphLaunch",
            CudaRuntime,
            CountOnly,
        ),
        &["cudaGraphLaunch_ptsz"],
    ),
    with_aliases(
        sync(
            ProbeId::CudaStreamSynchronize,
            "cudaStreamSynchronize",
            SyncKind::Stream,
        ),
        &["cudaStreamSynchronize_ptsz"],
    ),
    sync(
        ProbeId::CudaDeviceSynchronize,
        "cudaDeviceSynchronize",
        SyncKind::Device,
    ),
    sync(
        ProbeId::CudaEventSynchronize,
        "cudaEventSynchronize",
        SyncKind::Event,
    ),
    nccl(
        ProbeId::NcclAllReduce,
        "ncclAllReduce",
        CollectiveOp::AllReduce,
        NcclArgs::OpCommStream,
    ),
    nccl(
        ProbeId::NcclBroadcast,
        "ncclBroadcast",
        CollectiveOp::Broadcast,
        NcclArgs::RootCommStream,
    ),
    nccl(
        ProbeId::NcclReduce,
        "ncclReduce",
        CollectiveOp::Reduce,
        NcclArgs::OpRootCommStream,
    ),
    nccl(
        ProbeId::NcclAllGather,
        "ncclAllGather",
        CollectiveOp::AllGather,
        NcclArgs::CommStream,
    ),
    nccl(
        ProbeId::NcclReduceScatter,
        "ncclReduceScatter",
        CollectiveOp::ReduceScatter,
        NcclArgs::OpCommStream,
    ),
    nccl(
        ProbeId::NcclSend,
        "ncclSend",
        CollectiveOp::Send,
        NcclArgs::PointToPoint,
    ),
    nccl(
        ProbeId::NcclRecv,
        "ncclRecv",
        CollectiveOp::Recv,
        NcclArgs::PointToPoint,
    ),
    spec(
        ProbeId::NcclGroupStart,
        "ncclGroupStart",
        Nccl,
        NcclGroup,
        STEP_DETAIL,
    ),
    spec(
        ProbeId::NcclGroupEnd,
        "ncclGroupEnd",
        Nccl,
        NcclGroup,
        STEP_DETAIL,
    ),
    // Rare and cheap, and it names the rank of every communicator: always on.
    // `ncclCommInitRankConfig` (what PyTorch's ProcessGroupNCCL calls with NCCL ≥ 2.14:
    // seen on a GPU with torch 2.11 / NCCL 2.28) takes the same first four arguments,
    // the id by value on the stack, plus a config pointer: the same program reads it.
    with_aliases(
        spec(
            ProbeId::NcclCommInitRank,
            "ncclCommInitRank",
            Nccl,
            NcclCommInitEntry,
            ALWAYS,
        ),
        &["ncclCommInitRankConfig"],
    ),
    // How libraries loaded after start are found.
    spec(
        ProbeId::DlDebugState,
        "_dl_debug_state",
        DynamicLoader,
        DlDebugState,
        ALWAYS,
    ),
    mark(
        ProbeId::TorchScopeEnter,
        // torch::autograd::profiler::record_function_enter_new(const std::string&,
        //     const std::optional<std::string>&)
        "_ZN5torch8autograd8profiler25record_function_enter_newERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERKSt8optionalIS7_E",
        TorchCpu,
        Some(TorchScopeEnter),
        None,
        SCOPES,
    ),
    mark(
        ProbeId::TorchScopeExit,
        // torch::autograd::profiler::record_function_exit_new(
        //     const c10::intrusive_ptr<PythonRecordFunction>&)
        "_ZN5torch8autograd8profilerL24record_function_exit_newERKN3c1013intrusive_ptrINS1_20PythonRecordFunctionENS2_6detail34intrusive_target_default_null_typeIS4_EEEE",
        TorchCpu,
        Some(PhaseMark),
        None,
        SCOPES,
    ),
    // A backward's start: the engine's entry (it says whether gradients accumulate, a
    // `.backward()`, or are returned, `torch.autograd.grad`). Entry only: a C++ exception
    // (a raising custom backward, an out-of-memory) leaves `Engine::execute`, and a
    // return probe there would make that exception abort the process.
    mark(
        ProbeId::TorchBackward,
        // torch::autograd::Engine::execute(const edge_list&, const variable_list&,
        //     bool, bool, bool, const edge_list&)
        "_ZN5torch8autograd6Engine7executeERKSt6vectorINS0_4EdgeESaIS3_EERKS2_IN2at6TensorESaIS9_EEbbbS7_",
        TorchCpu,
        Some(TorchBackwardEntry),
        None,
        STEP_PHASES,
    ),
    // Grad mode, the evaluation signal (`lens-ebpf/src/grad_mode.rs`): every switch,
    // autograd's C++ guards too, where no Python binding is probed.
    superseded_by(
        mark(
            ProbeId::TorchGradMode,
            "_ZN3c108GradMode11set_enabledEb",
            C10,
            Some(GradModeEntry),
            None,
            &[SpanGroup::Evaluate],
        ),
        ProbeId::TorchSetGradEnabled,
    ),
    with_aliases(
        mark(
            ProbeId::CheckpointWriterOpen,
            // PyTorchStreamWriter(const std::string& file_name, bool, uint64_t)
            "_ZN6caffe29serialize19PyTorchStreamWriterC1ERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEEbm",
            TorchCpu,
            Some(PhaseMark),
            None,
            &[SpanGroup::Checkpoint],
        ),
        // The constructor that writes through a callback (`torch.save` to a buffer).
        &["_ZN6caffe29serialize19PyTorchStreamWriterC1ESt8functionIFmPKvmEEbm"],
    ),
    mark(
        ProbeId::CheckpointWriterClose,
        "_ZN6caffe29serialize19PyTorchStreamWriterD1Ev",
        TorchCpu,
        None,
        Some(PhaseMarkReturn),
        &[SpanGroup::Checkpoint],
    ),
    with_aliases(
        mark(
            ProbeId::CheckpointReaderOpen,
            // PyTorchStreamReader(const std::string& file_name)
            "_ZN6caffe29serialize19PyTorchStreamReaderC1ERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
            TorchCpu,
            Some(PhaseMark),
            None,
            &[SpanGroup::LoadCheckpoint],
        ),
        // From an istream and from a read adapter (`torch.load` of a file object).
        &[
            "_ZN6caffe29serialize19PyTorchStreamReaderC1EPSi",
            "_ZN6caffe29serialize19PyTorchStreamReaderC1ESt10shared_ptrINS0_20ReadAdapterInterfaceEE",
        ],
    ),
    mark(
        ProbeId::CheckpointReaderClose,
        "_ZN6caffe29serialize19PyTorchStreamReaderD1Ev",
        TorchCpu,
        None,
        Some(PhaseMarkReturn),
        &[SpanGroup::LoadCheckpoint],
    ),
    gloo(
        ProbeId::GlooAllReduce,
        CollectiveOp::AllReduce,
        "_ZN4c10d16ProcessGroupGloo9allreduceERSt6vectorIN2at6TensorESaIS3_EERKNS_16AllreduceOptionsE",
    ),
    gloo(
        ProbeId::GlooBroadcast,
        CollectiveOp::Broadcast,
        "_ZN4c10d16ProcessGroupGloo9broadcastERSt6vectorIN2at6TensorESaIS3_EERKNS_16BroadcastOptionsE",
    ),
    gloo(
        ProbeId::GlooReduce,
        CollectiveOp::Reduce,
        "_ZN4c10d16ProcessGroupGloo6reduceERSt6vectorIN2at6TensorESaIS3_EERKNS_13ReduceOptionsE",
    ),
    gloo(
        ProbeId::GlooAllGather,
        CollectiveOp::AllGather,
        "_ZN4c10d16ProcessGroupGloo9allgatherERSt6vectorIS1_IN2at6TensorESaIS3_EESaIS5_EERS5_RKNS_16AllgatherOptionsE",
    ),
    gloo(
        ProbeId::GlooReduceScatter,
        CollectiveOp::ReduceScatter,
        "_ZN4c10d16ProcessGroupGloo14reduce_scatterERSt6vectorIN2at6TensorESaIS3_EERS1_IS5_SaIS5_EERKNS_20ReduceScatterOptionsE",
    ),
    gloo(
        ProbeId::GlooSend,
        CollectiveOp::Send,
        "_ZN4c10d16ProcessGroupGloo4sendERSt6vectorIN2at6TensorESaIS3_EEii",
    ),
    gloo(
        ProbeId::GlooRecv,
        CollectiveOp::Recv,
        "_ZN4c10d16ProcessGroupGloo4recvERSt6vectorIN2at6TensorESaIS3_EEii",
    ),
    gloo(
        ProbeId::GlooBarrier,
        CollectiveOp::Barrier,
        "_ZN4c10d16ProcessGroupGloo7barrierERKNS_14BarrierOptionsE",
    ),
    // The driver's launches: counted when the caller is not libcudart (docs/probes.md).
    with_aliases(
        spec(
            ProbeId::CuLaunchKernel,
            "cuLaunchKernel",
            CudaDriver,
            DriverLaunch,
            STEP_DETAIL,
        ),
        &["cuLaunchKernel_ptsz"],
    ),
    with_aliases(
        spec(
            ProbeId::CuLaunchKernelEx,
            "cuLaunchKernelEx",
            CudaDriver,
            DriverLaunch,
            STEP_DETAIL,
        ),
        &["cuLaunchKernelEx_ptsz"],
    ),
    with_aliases(
        graph_launch(
            ProbeId::CuGraphLaunch,
            "cuGraphLaunch",
            CudaDriver,
            DriverLaunch,
        ),
        &["cuGraphLaunch_ptsz"],
    ),
    // Collective completion (docs/collectives.md): the event recorded after a collective
    // on its stream, and the queries that find it complete. Needed wherever collectives
    // are.
    with_aliases(
        spec(
            ProbeId::CudaEventRecord,
            "cudaEventRecord",
            CudaRuntime,
            CudaEventRecord,
            STEP_DETAIL,
        ),
        &["cudaEventRecord_ptsz"],
    ),
    with_aliases(
        spec(
            ProbeId::CudaEventRecordWithFlags,
            "cudaEventRecordWithFlags",
            CudaRuntime,
            CudaEventRecord,
            STEP_DETAIL,
        ),
        &["cudaEventRecordWithFlags_ptsz"],
    ),
    ProbeSpec {
        id: ProbeId::CudaEventQuery,
        symbol: "cudaEventQuery",
        library: CudaRuntime,
        optional_aliases: &[],
        entry: Some(CudaEventQueryEntry),
        exit: CudaEventQueryEntry.paired_return(),
        groups: STEP_DETAIL,
        role: Role::Plain,
        optional: false,
        superseded_by: None,
        unreadable_if_imports: None,
    },
    // Kernel names (the step's top kernels, `step` only): stubs paired with their names
    // as the modules register them, for libraries without symbols.
    spec(
        ProbeId::CudaRegisterFunction,
        "__cudaRegisterFunction",
        CudaRuntime,
        CudaRegisterFunction,
        &[SpanGroup::Step],
    ),
    mark(
        ProbeId::TorchInferenceMode,
        "_ZN3c1013AutogradState13set_tls_stateES0_@plt",
        TorchPython,
        Some(PhaseMark),
        None,
        &[SpanGroup::Evaluate],
    ),
    mark(
        ProbeId::SafetensorsSerializeFile,
        "_ZN16safetensors_rust27__pyfunction_serialize_file17h*E",
        Safetensors,
        Some(PhaseMark),
        Some(PhaseMarkReturn),
        &[SpanGroup::Checkpoint],
    ),
    mark(
        ProbeId::SafetensorsOpen,
        "_ZN16safetensors_rust9safe_open20__pymethod___new____17h*E",
        Safetensors,
        Some(PhaseMark),
        None,
        &[SpanGroup::LoadCheckpoint],
    ),
    mark(
        ProbeId::SafetensorsClose,
        "_ZN16safetensors_rust9safe_open21__pymethod___exit____17h*E",
        Safetensors,
        None,
        Some(PhaseMarkReturn),
        &[SpanGroup::LoadCheckpoint],
    ),
    // Files created: what a checkpoint's `nemo.checkpoint.files` counts. libc is mapped by
    // every process of the node, so these go on each target alone (`probes::files`).
    mark(
        ProbeId::FileOpen,
        "open",
        Libc,
        Some(FileOpenEntry),
        None,
        &[SpanGroup::Checkpoint],
    ),
    mark(
        ProbeId::FileOpenAt,
        "openat",
        Libc,
        Some(FileOpenEntry),
        None,
        &[SpanGroup::Checkpoint],
    ),
    // Where torch's and DCP's save and load functions begin: a Python stack sample there
    // (the framework save rules are the sampler's, `profiles::FRAMEWORK_SAVE_RULES`).
    mark(
        ProbeId::TorchApiUsage,
        "_ZL25LogAPIUsageOnceFromPythonP7_objectS0_",
        TorchPython,
        Some(PythonStackEntry),
        None,
        &[SpanGroup::Checkpoint, SpanGroup::LoadCheckpoint],
    ),
    optional(nccl(
        ProbeId::NcclAlltoAll,
        "ncclAlltoAll",
        CollectiveOp::AllToAll,
        NcclArgs::CommStream,
    )),
    // A backward's end: the return of the Python binding every backward and
    // `torch.autograd.grad` from Python goes through. It catches every C++ exception and
    // returns NULL (torch's `HANDLE_TH_ERRORS`), so no exception crosses its return probe.
    mark(
        ProbeId::TorchBackwardReturn,
        // THPEngine_run_backward(PyObject*, PyObject*, PyObject*), a static function
        "_ZL22THPEngine_run_backwardP7_objectS0_S0_",
        TorchPython,
        None,
        Some(PhaseMarkReturn),
        STEP_PHASES,
    ),
    // GPU memory: the runtime's calls, and the driver's not made by libcudart (left out in
    // the kernel). Stream-ordered and virtual-memory calls (CUDA 11.2, 10.2): optional.
    memory(
        ProbeId::CudaMalloc,
        "cudaMalloc",
        CudaRuntime,
        MemoryOp::Alloc,
    ),
    optional(with_aliases(
        memory(
            ProbeId::CudaMallocAsync,
            "cudaMallocAsync",
            CudaRuntime,
            MemoryOp::Alloc,
        ),
        &["cudaMallocAsync_ptsz"],
    )),
    memory(
        ProbeId::CudaMallocManaged,
        "cudaMallocManaged",
        CudaRuntime,
        MemoryOp::Alloc,
    ),
    memory(ProbeId::CudaFree, "cudaFree", CudaRuntime, MemoryOp::Free),
    optional(with_aliases(
        memory(
            ProbeId::CudaFreeAsync,
            "cudaFreeAsync",
            CudaRuntime,
            MemoryOp::Free,
        ),
        &["cudaFreeAsync_ptsz"],
    )),
    memory(
        ProbeId::CuMemAlloc,
        "cuMemAlloc_v2",
        CudaDriver,
        MemoryOp::Alloc,
    ),
    memory(
        ProbeId::CuMemFree,
        "cuMemFree_v2",
        CudaDriver,
        MemoryOp::Free,
    ),
    optional(with_aliases(
        memory(
            ProbeId::CuMemAllocAsync,
            "cuMemAllocAsync",
            CudaDriver,
            MemoryOp::Alloc,
        ),
        &["cuMemAllocAsync_ptsz"],
    )),
    optional(with_aliases(
        memory(
            ProbeId::CuMemFreeAsync,
            "cuMemFreeAsync",
            CudaDriver,
            MemoryOp::Free,
        ),
        &["cuMemFreeAsync_ptsz"],
    )),
    optional(memory(
        ProbeId::CuMemCreate,
        "cuMemCreate",
        CudaDriver,
        MemoryOp::Create,
    )),
    optional(memory(
        ProbeId::CuMemMap,
        "cuMemMap",
        CudaDriver,
        MemoryOp::Map,
    )),
    optional(memory(
        ProbeId::CuMemUnmap,
        "cuMemUnmap",
        CudaDriver,
        MemoryOp::Unmap,
    )),
    optional(memory(
        ProbeId::CuMemRelease,
        "cuMemRelease",
        CudaDriver,
        MemoryOp::Release,
    )),
    // CUDA graphs: a capture's begin and end tell the launch probes which streams
    // capture (their launches are recorded, not run); instantiation is counted and timed.
    with_aliases(
        graph(
            ProbeId::CudaStreamBeginCapture,
            "cudaStreamBeginCapture",
            CudaRuntime,
            GraphOp::BeginCapture,
        ),
        &[
            "cudaStreamBeginCapture_ptsz",
            "cudaStreamBeginCaptureToGraph",
            "cudaStreamBeginCaptureToGraph_ptsz",
        ],
    ),
    with_aliases(
        graph(
            ProbeId::CudaStreamEndCapture,
            "cudaStreamEndCapture",
            CudaRuntime,
            GraphOp::EndCapture,
        ),
        &["cudaStreamEndCapture_ptsz"],
    ),
    optional(with_aliases(
        graph(
            ProbeId::CuStreamBeginCapture,
            "cuStreamBeginCapture_v2",
            CudaDriver,
            GraphOp::BeginCapture,
        ),
        &["cuStreamBeginCapture_v2_ptsz"],
    )),
    optional(with_aliases(
        graph(
            ProbeId::CuStreamEndCapture,
            "cuStreamEndCapture",
            CudaDriver,
            GraphOp::EndCapture,
        ),
        &["cuStreamEndCapture_ptsz"],
    )),
    graph(
        ProbeId::CudaGraphInstantiate,
        "cudaGraphInstantiate",
        CudaRuntime,
        GraphOp::Instantiate,
    ),
    optional(graph(
        ProbeId::CudaGraphInstantiateWithFlags,
        "cudaGraphInstantiateWithFlags",
        CudaRuntime,
        GraphOp::Instantiate,
    )),
    optional(graph(
        ProbeId::CuGraphInstantiate,
        "cuGraphInstantiateWithFlags",
        CudaDriver,
        GraphOp::Instantiate,
    )),
    // PyTorch's caching allocator: thousands of calls a step, so with the launches.
    torch_memory(),
    // The switches Python asks for (`torch.no_grad()` and friends), where libtorch_python
    // is loaded: its args tuple is read with a default CPython build's object layout.
    unreadable_if_imports(
        optional(mark(
            ProbeId::TorchSetGradEnabled,
            // torch::autograd::set_grad_enabled(PyObject*, PyObject*, PyObject*), static
            "_ZN5torch8autogradL16set_grad_enabledEP7_objectS2_S2_",
            TorchPython,
            Some(PyGradModeEntry),
            None,
            &[SpanGroup::Evaluate],
        )),
        // What a free-threaded build's `Py_DECREF` calls.
        "_Py_DecRefShared",
    ),
];
