//! What a probed call is, as users name it: the collective an NCCL or gloo call
//! performs, the wait a CUDA sync call makes, what a GPU memory or graph call does. The catalog gives each probe its meaning
//! (`catalog::Role`); span and metric names come from here.
use serde::Serialize;

/// A collective or point-to-point operation, named as users know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveOp {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    Send,
    Recv,
    AllToAll,
    /// Process groups only (NCCL has no barrier call).
    Barrier,
}

impl CollectiveOp {
    /// The span name of the call, e.g. `nccl.all_reduce`.
    pub const fn span_name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "nccl.all_reduce",
            CollectiveOp::Broadcast => "nccl.broadcast",
            CollectiveOp::Reduce => "nccl.reduce",
            CollectiveOp::AllGather => "nccl.all_gather",
            CollectiveOp::ReduceScatter => "nccl.reduce_scatter",
            CollectiveOp::Send => "nccl.send",
            CollectiveOp::Recv => "nccl.recv",
            CollectiveOp::AllToAll => "nccl.all_to_all",
            CollectiveOp::Barrier => "nccl.barrier",
        }
    }

    /// The span name of a `c10d::ProcessGroupGloo` call, e.g. `gloo.all_reduce`.
    pub const fn gloo_span_name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "gloo.all_reduce",
            CollectiveOp::Broadcast => "gloo.broadcast",
            CollectiveOp::Reduce => "gloo.reduce",
            CollectiveOp::AllGather => "gloo.all_gather",
            CollectiveOp::ReduceScatter => "gloo.reduce_scatter",
            CollectiveOp::Send => "gloo.send",
            CollectiveOp::Recv => "gloo.recv",
            CollectiveOp::AllToAll => "gloo.all_to_all",
            CollectiveOp::Barrier => "gloo.barrier",
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::Reduce => "reduce",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::Send => "send",
            CollectiveOp::Recv => "recv",
            CollectiveOp::AllToAll => "all_to_all",
            CollectiveOp::Barrier => "barrier",
        }
    }
}

/// What a CUDA synchronisation call waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncKind {
    Stream,
    Event,
    Device,
}

impl SyncKind {
    pub const fn span_name(self) -> &'static str {
        match self {
            SyncKind::Stream => "cuda.stream_synchronize",
            SyncKind::Event => "cuda.event_synchronize",
            SyncKind::Device => "cuda.device_synchronize",
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            SyncKind::Stream => "stream",
            SyncKind::Event => "event",
            SyncKind::Device => "device",
        }
    }
}

/// What a GPU memory call does to the device memory its process holds. Every such call
/// keeps its first four arguments (`lens_common::record::ApiCall`); these say which is
/// which.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryOp {
    /// Device memory allocated (`cudaMalloc*`, `cuMemAlloc*`): `args[1]` bytes, at the
    /// address written to `*args[0]`.
    Alloc,
    /// The allocation at `args[0]` freed (`cudaFree*`, `cuMemFree*`).
    Free,
    /// Physical memory created (`cuMemCreate`, the virtual-memory API behind PyTorch's
    /// expandable segments): `args[1]` bytes, its handle written to `*args[0]`.
    Create,
    /// That physical memory released (`cuMemRelease`): the handle `args[0]`.
    Release,
    /// Physical memory mapped at an address (`cuMemMap`): `args[1]` bytes at `args[0]`.
    Map,
    /// Unmapped (`cuMemUnmap`): `args[1]` bytes at `args[0]`.
    Unmap,
}

impl MemoryOp {
    /// The argument the call writes its result through (read at return).
    pub const fn out_arg(self) -> Option<u32> {
        match self {
            MemoryOp::Alloc | MemoryOp::Create => Some(0),
            _ => None,
        }
    }

    /// As metrics name it (`dl.gpu.memory.op`).
    pub const fn name(self) -> &'static str {
        match self {
            MemoryOp::Alloc => "alloc",
            MemoryOp::Free => "free",
            MemoryOp::Create => "create",
            MemoryOp::Release => "release",
            MemoryOp::Map => "map",
            MemoryOp::Unmap => "unmap",
        }
    }

    /// Whether the call takes memory (an allocation or a creation): its failure is an
    /// out-of-memory.
    pub const fn takes_memory(self) -> bool {
        matches!(self, MemoryOp::Alloc | MemoryOp::Create)
    }
}

/// What a CUDA graph call does (the launches of a graph are counted with the launches).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GraphOp {
    /// A stream begins capturing (`args[0]`): its launches are recorded, not run.
    BeginCapture,
    /// The capture on stream `args[0]` ends; the graph is written to `*args[1]`.
    EndCapture,
    /// A graph (`args[1]`) made launchable; the executable graph written to `*args[0]`.
    Instantiate,
    /// An executable graph (`args[0]`) launched on stream `args[1]` (counted with the
    /// launches; its return sends it, a span).
    Launch,
}

impl GraphOp {
    /// The argument the call writes its result through (read at return).
    pub const fn out_arg(self) -> Option<u32> {
        match self {
            GraphOp::BeginCapture | GraphOp::Launch => None,
            GraphOp::EndCapture => Some(1),
            GraphOp::Instantiate => Some(0),
        }
    }
}

/// The span name of a CUDA graph call, named after the call; `None` for other probes.
pub fn graph_span_name(probe: lens_common::ProbeId) -> Option<&'static str> {
    use lens_common::ProbeId;
    Some(match probe {
        ProbeId::CudaStreamBeginCapture => "cuda.stream_begin_capture",
        ProbeId::CudaStreamEndCapture => "cuda.stream_end_capture",
        ProbeId::CudaGraphInstantiate | ProbeId::CudaGraphInstantiateWithFlags => {
            "cuda.graph_instantiate"
        }
        ProbeId::CuStreamBeginCapture => "cuda.driver.stream_begin_capture",
        ProbeId::CuStreamEndCapture => "cuda.driver.stream_end_capture",
        ProbeId::CuGraphInstantiate => "cuda.driver.graph_instantiate",
        ProbeId::CudaGraphLaunch => "cuda.graph_launch",
        ProbeId::CuGraphLaunch => "cuda.driver.graph_launch",
        _ => return None,
    })
}

/// The span name of a memory call, named after the call (`cuda.malloc`,
/// `cuda.driver.mem_alloc`).
pub fn memory_span_name(probe: lens_common::ProbeId) -> &'static str {
    use lens_common::ProbeId;
    match probe {
        ProbeId::CudaMalloc => "cuda.malloc",
        ProbeId::CudaMallocAsync => "cuda.malloc_async",
        ProbeId::CudaMallocManaged => "cuda.malloc_managed",
        ProbeId::CudaFree => "cuda.free",
        ProbeId::CudaFreeAsync => "cuda.free_async",
        ProbeId::CuMemAlloc => "cuda.driver.mem_alloc",
        ProbeId::CuMemFree => "cuda.driver.mem_free",
        ProbeId::CuMemAllocAsync => "cuda.driver.mem_alloc_async",
        ProbeId::CuMemFreeAsync => "cuda.driver.mem_free_async",
        ProbeId::CuMemCreate => "cuda.driver.mem_create",
        ProbeId::CuMemMap => "cuda.driver.mem_map",
        ProbeId::CuMemUnmap => "cuda.driver.mem_unmap",
        ProbeId::CuMemRelease => "cuda.driver.mem_release",
        _ => "cuda.memory_call",
    }
}
