//! The probe catalog: every probed function, the library that defines it, the BPF program
//! that handles it and the span groups that need it. A probe that no enabled group needs
//! is not attached (the gate costs nothing).
use lens_common::ProbeId;

use super::library::LibraryKind;
use crate::groups::{SpanGroup, SpanGroups};

/// The BPF programs of `lens-ebpf`, by the name of their function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Program {
    CountOnly,
    NcclGroup,
    NcclCollectiveEntry,
    CudaSyncEntry,
    NcclCommInitEntry,
    CallReturn,
    DlDebugState,
    PhaseMark,
    PhaseMarkReturn,
    TorchBackwardEntry,
    TorchScopeEnter,
    TimedCallEntry,
    DriverLaunch,
    /// Configured probe rules (`crate::config`): entry and return of any function.
    UserRuleEntry,
    UserRuleReturn,
    CudaEventRecord,
    CudaEventQueryEntry,
    CudaEventQueryReturn,
    CudaRegisterFunction,
    FileOpenEntry,
    PythonStackEntry,
}

impl Program {
    pub const ALL: [Program; 21] = [
        Program::CountOnly,
        Program::NcclGroup,
        Program::NcclCollectiveEntry,
        Program::CudaSyncEntry,
        Program::NcclCommInitEntry,
        Program::CallReturn,
        Program::DlDebugState,
        Program::PhaseMark,
        Program::PhaseMarkReturn,
        Program::TorchBackwardEntry,
        Program::TorchScopeEnter,
        Program::TimedCallEntry,
        Program::DriverLaunch,
        Program::UserRuleEntry,
        Program::UserRuleReturn,
        Program::CudaEventRecord,
        Program::CudaEventQueryEntry,
        Program::CudaEventQueryReturn,
        Program::CudaRegisterFunction,
        Program::FileOpenEntry,
        Program::PythonStackEntry,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Program::CountOnly => "count_only",
            Program::NcclGroup => "nccl_group",
            Program::NcclCollectiveEntry => "nccl_collective_entry",
            Program::CudaSyncEntry => "cuda_sync_entry",
            Program::NcclCommInitEntry => "nccl_comm_init_entry",
            Program::CallReturn => "call_return",
            Program::DlDebugState => "dl_debug_state",
            Program::PhaseMark => "phase_mark",
            Program::PhaseMarkReturn => "phase_mark_return",
            Program::TorchBackwardEntry => "torch_backward_entry",
            Program::TorchScopeEnter => "torch_scope_enter",
            Program::TimedCallEntry => "timed_call_entry",
            Program::DriverLaunch => "driver_launch",
            Program::UserRuleEntry => "user_rule_entry",
            Program::UserRuleReturn => "user_rule_return",
            Program::CudaEventRecord => "cuda_event_record",
            Program::CudaEventQueryEntry => "cuda_event_query_entry",
            Program::CudaEventQueryReturn => "cuda_event_query_return",
            Program::CudaRegisterFunction => "cuda_register_function",
            Program::FileOpenEntry => "file_open_entry",
            Program::PythonStackEntry => "python_stack_entry",
        }
    }
}

/// One probed function.
#[derive(Debug)]
pub struct ProbeSpec {
    pub id: ProbeId,
    pub library: LibraryKind,
    /// Extra entry points of the same API, attached when the library has them and never
    /// reported when it does not (`_ptsz`: the per-thread default stream variants).
    pub optional_aliases: &'static [&'static str],
    /// The program attached at the function's entry, if any.
    pub entry: Option<Program>,
    /// The program attached at its return, if any.
    pub exit: Option<Program>,
    /// Attached when any of these groups is enabled; empty = always (infrastructure).
    pub groups: &'static [SpanGroup],
}

/// Per-call detail: collectives, launches and sync waits become children of the step's
/// phases, so only the step-level groups need them.
pub const STEP_DETAIL: &[SpanGroup] = &[
    SpanGroup::Step,
    SpanGroup::ForwardBackward,
    SpanGroup::Optimizer,
];
const ALWAYS: &[SpanGroup] = &[];
/// The step machine (what opens and closes steps, see docs/spans.md): torch scopes and
/// backward passes. `model_init` needs it too: it ends where the first step begins.
const STEP_PHASES: &[SpanGroup] = &[
    SpanGroup::ModelInit,
    SpanGroup::Step,
    SpanGroup::ForwardBackward,
    SpanGroup::Optimizer,
];
/// Torch scopes also tell evaluation loops (DataLoader fetches under `no_grad`).
const SCOPES: &[SpanGroup] = &[
    SpanGroup::ModelInit,
    SpanGroup::Step,
    SpanGroup::ForwardBackward,
    SpanGroup::Optimizer,
    SpanGroup::Evaluate,
];

const fn spec(
    id: ProbeId,
    library: LibraryKind,
    entry: Program,
    needs_return: bool,
    groups: &'static [SpanGroup],
) -> ProbeSpec {
    ProbeSpec {
        id,
        library,
        optional_aliases: &[],
        entry: Some(entry),
        exit: if needs_return {
            Some(Program::CallReturn)
        } else {
            None
        },
        groups,
    }
}

/// A phase boundary: marks sent at entry and/or at return.
const fn mark(
    id: ProbeId,
    library: LibraryKind,
    entry: Option<Program>,
    exit: Option<Program>,
    groups: &'static [SpanGroup],
) -> ProbeSpec {
    ProbeSpec {
        id,
        library,
        optional_aliases: &[],
        entry,
        exit,
        groups,
    }
}

const fn with_aliases(mut spec: ProbeSpec, aliases: &'static [&'static str]) -> ProbeSpec {
    spec.optional_aliases = aliases;
    spec
}

use LibraryKind::{
    C10, CudaDriver, CudaRuntime, DynamicLoader, Libc, Nccl, Safetensors, TorchCpu, TorchPython,
};
use Program::*;

pub static CATALOG: [ProbeSpec; ProbeId::COUNT] = [
    with_aliases(
        spec(
            ProbeId::CudaLaunchKernel,
            CudaRuntime,
            CountOnly,
            false,
            STEP_DETAIL,
        ),
        &["cudaLaunchKernel_ptsz"],
    ),
    with_aliases(
        spec(
            ProbeId::CudaLaunchKernelExC,
            CudaRuntime,
            CountOnly,
            false,
            STEP_DETAIL,
        ),
        &["cudaLaunchKernelExC_ptsz"],
    ),
    with_aliases(
        spec(
            ProbeId::CudaGraphLaunch,
            CudaRuntime,
            CountOnly,
            false,
            STEP_DETAIL,
        ),
        &["cudaGraphLaunch_ptsz"],
    ),
    with_aliases(
        spec(
            ProbeId::CudaStreamSynchronize,
            CudaRuntime,
            CudaSyncEntry,
            true,
            STEP_DETAIL,
        ),
        &["cudaStreamSynchronize_ptsz"],
    ),
    spec(
        ProbeId::CudaDeviceSynchronize,
        CudaRuntime,
        CudaSyncEntry,
        true,
        STEP_DETAIL,
    ),
    spec(
        ProbeId::CudaEventSynchronize,
        CudaRuntime,
        CudaSyncEntry,
        true,
        STEP_DETAIL,
    ),
    spec(
        ProbeId::NcclAllReduce,
        Nccl,
        NcclCollectiveEntry,
        true,
        STEP_DETAIL,
    ),
    spec(
        ProbeId::NcclBroadcast,
        Nccl,
        NcclCollectiveEntry,
        true,
        STEP_DETAIL,
    ),
    spec(
        ProbeId::NcclReduce,
        Nccl,
        NcclCollectiveEntry,
        true,
        STEP_DETAIL,
    ),
    spec(
        ProbeId::NcclAllGather,
        Nccl,
        NcclCollectiveEntry,
        true,
        STEP_DETAIL,
    ),
    spec(
        ProbeId::NcclReduceScatter,
        Nccl,
        NcclCollectiveEntry,
        true,
        STEP_DETAIL,
    ),
    spec(
        ProbeId::NcclSend,
        Nccl,
        NcclCollectiveEntry,
        true,
        STEP_DETAIL,
    ),
    spec(
        ProbeId::NcclRecv,
        Nccl,
        NcclCollectiveEntry,
        true,
        STEP_DETAIL,
    ),
    spec(ProbeId::NcclGroupStart, Nccl, NcclGroup, false, STEP_DETAIL),
    spec(ProbeId::NcclGroupEnd, Nccl, NcclGroup, false, STEP_DETAIL),
    // Rare and cheap, and it names the rank of every communicator: always on.
    // `ncclCommInitRankConfig` (what PyTorch's ProcessGroupNCCL calls with NCCL ≥ 2.14:
    // seen on a GPU with torch 2.11 / NCCL 2.28) takes the same first four arguments,
    // the id by value on the stack, plus a config pointer: the same program reads it.
    with_aliases(
        spec(
            ProbeId::NcclCommInitRank,
            Nccl,
            NcclCommInitEntry,
            true,
            ALWAYS,
        ),
        &["ncclCommInitRankConfig"],
    ),
    // How libraries loaded after start are found.
    spec(
        ProbeId::DlDebugState,
        DynamicLoader,
        DlDebugState,
        false,
        ALWAYS,
    ),
    mark(
        ProbeId::TorchScopeEnter,
        TorchCpu,
        Some(TorchScopeEnter),
        None,
        SCOPES,
    ),
    mark(
        ProbeId::TorchScopeExit,
        TorchCpu,
        Some(PhaseMark),
        None,
        SCOPES,
    ),
    mark(
        ProbeId::TorchBackward,
        TorchCpu,
        Some(TorchBackwardEntry),
        Some(PhaseMarkReturn),
        STEP_PHASES,
    ),
    mark(
        ProbeId::TorchGradMode,
        C10,
        Some(PhaseMark),
        None,
        &[SpanGroup::Evaluate],
    ),
    with_aliases(
        mark(
            ProbeId::CheckpointWriterOpen,
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
        TorchCpu,
        None,
        Some(PhaseMarkReturn),
        &[SpanGroup::Checkpoint],
    ),
    with_aliases(
        mark(
            ProbeId::CheckpointReaderOpen,
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
        TorchCpu,
        None,
        Some(PhaseMarkReturn),
        &[SpanGroup::LoadCheckpoint],
    ),
    gloo(ProbeId::GlooAllReduce),
    gloo(ProbeId::GlooBroadcast),
    gloo(ProbeId::GlooReduce),
    gloo(ProbeId::GlooAllGather),
    gloo(ProbeId::GlooReduceScatter),
    gloo(ProbeId::GlooSend),
    gloo(ProbeId::GlooRecv),
    gloo(ProbeId::GlooBarrier),
    // The driver's launches: counted when the caller is not libcudart (docs/probes.md).
    with_aliases(
        spec(
            ProbeId::CuLaunchKernel,
            CudaDriver,
            DriverLaunch,
            false,
            STEP_DETAIL,
        ),
        &["cuLaunchKernel_ptsz"],
    ),
    with_aliases(
        spec(
            ProbeId::CuLaunchKernelEx,
            CudaDriver,
            DriverLaunch,
            false,
            STEP_DETAIL,
        ),
        &["cuLaunchKernelEx_ptsz"],
    ),
    with_aliases(
        spec(
            ProbeId::CuGraphLaunch,
            CudaDriver,
            DriverLaunch,
            false,
            STEP_DETAIL,
        ),
        &["cuGraphLaunch_ptsz"],
    ),
    // Collective completion (docs/collectives.md): the event recorded after a collective
    // on its stream, and the queries that find it complete. Needed wherever collectives
    // are.
    with_aliases(
        spec(
            ProbeId::CudaEventRecord,
            CudaRuntime,
            CudaEventRecord,
            false,
            STEP_DETAIL,
        ),
        &["cudaEventRecord_ptsz"],
    ),
    with_aliases(
        spec(
            ProbeId::CudaEventRecordWithFlags,
            CudaRuntime,
            CudaEventRecord,
            false,
            STEP_DETAIL,
        ),
        &["cudaEventRecordWithFlags_ptsz"],
    ),
    ProbeSpec {
        id: ProbeId::CudaEventQuery,
        library: CudaRuntime,
        optional_aliases: &[],
        entry: Some(CudaEventQueryEntry),
        exit: Some(CudaEventQueryReturn),
        groups: STEP_DETAIL,
    },
    // Kernel names (the step's top kernels, `step` only): stubs paired with their names
    // as the modules register them, for libraries without symbols.
    spec(
        ProbeId::CudaRegisterFunction,
        CudaRuntime,
        CudaRegisterFunction,
        false,
        &[SpanGroup::Step],
    ),
    mark(
        ProbeId::TorchInferenceMode,
        TorchPython,
        Some(PhaseMark),
        None,
        &[SpanGroup::Evaluate],
    ),
    mark(
        ProbeId::SafetensorsSerializeFile,
        Safetensors,
        Some(PhaseMark),
        Some(PhaseMarkReturn),
        &[SpanGroup::Checkpoint],
    ),
    mark(
        ProbeId::SafetensorsOpen,
        Safetensors,
        Some(PhaseMark),
        None,
        &[SpanGroup::LoadCheckpoint],
    ),
    mark(
        ProbeId::SafetensorsClose,
        Safetensors,
        None,
        Some(PhaseMarkReturn),
        &[SpanGroup::LoadCheckpoint],
    ),
    // Files created: what a checkpoint's `nemo.checkpoint.files` counts. libc is mapped by
    // every process of the node, so these go on each target alone (`probes::files`).
    mark(
        ProbeId::FileOpen,
        Libc,
        Some(FileOpenEntry),
        None,
        &[SpanGroup::Checkpoint],
    ),
    mark(
        ProbeId::FileOpenAt,
        Libc,
        Some(FileOpenEntry),
        None,
        &[SpanGroup::Checkpoint],
    ),
    // Where torch's and DCP's save and load functions begin: a Python stack sample there
    // (the framework save rules are the sampler's, `config::FRAMEWORK_SAVE_RULES`).
    mark(
        ProbeId::TorchApiUsage,
        TorchPython,
        Some(PythonStackEntry),
        None,
        &[SpanGroup::Checkpoint, SpanGroup::LoadCheckpoint],
    ),
];

/// A `c10d::ProcessGroupGloo` collective: timed call, child of the phase it runs in.
const fn gloo(id: ProbeId) -> ProbeSpec {
    ProbeSpec {
        id,
        library: TorchCpu,
        optional_aliases: &[],
        entry: Some(TimedCallEntry),
        exit: Some(CallReturn),
        groups: STEP_DETAIL,
    }
}

impl ProbeSpec {
    pub fn enabled(&self, groups: &SpanGroups) -> bool {
        self.groups.is_empty() || self.groups.iter().any(|g| groups.contains(*g))
    }
}

/// The probes the enabled groups need, for one library kind.
pub fn enabled_for(
    library: LibraryKind,
    groups: &SpanGroups,
) -> impl Iterator<Item = &'static ProbeSpec> + '_ {
    CATALOG
        .iter()
        .filter(move |spec| spec.library == library && spec.enabled(groups))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_is_indexed_by_probe_id() {
        for (index, spec) in CATALOG.iter().enumerate() {
            assert_eq!(spec.id as usize, index, "{:?}", spec.id);
        }
    }

    #[test]
    fn default_groups_attach_only_infrastructure_probes() {
        let groups = SpanGroups::default();
        let nccl: Vec<ProbeId> = enabled_for(Nccl, &groups).map(|s| s.id).collect();
        assert_eq!(nccl, [ProbeId::NcclCommInitRank]);
        assert_eq!(enabled_for(CudaRuntime, &groups).count(), 0);
        assert_eq!(enabled_for(CudaDriver, &groups).count(), 0);
        assert_eq!(enabled_for(DynamicLoader, &groups).count(), 1);
        let torch: Vec<ProbeId> = enabled_for(TorchCpu, &groups).map(|s| s.id).collect();
        assert_eq!(
            torch,
            [
                ProbeId::TorchScopeEnter,
                ProbeId::TorchScopeExit,
                ProbeId::CheckpointWriterOpen,
                ProbeId::CheckpointWriterClose,
            ]
        );
        let c10: Vec<ProbeId> = enabled_for(C10, &groups).map(|s| s.id).collect();
        assert_eq!(c10, [ProbeId::TorchGradMode]);
    }

    #[test]
    fn per_step_attaches_everything() {
        let groups: SpanGroups = "per_step".parse().unwrap();
        // libc's probes go on each target alone (`probes::files`), not through `ALL`.
        let total: usize = LibraryKind::ALL
            .into_iter()
            .chain([LibraryKind::Libc])
            .map(|kind| enabled_for(kind, &groups).count())
            .sum();
        assert_eq!(total, ProbeId::COUNT);
    }
}
