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
}

impl Program {
    pub const ALL: [Program; 7] = [
        Program::CountOnly,
        Program::NcclGroup,
        Program::NcclCollectiveEntry,
        Program::CudaSyncEntry,
        Program::NcclCommInitEntry,
        Program::CallReturn,
        Program::DlDebugState,
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
    pub entry: Program,
    /// Also attach [`Program::CallReturn`]: the call's duration and result are needed.
    pub needs_return: bool,
    /// Attached when any of these groups is enabled; empty = always (infrastructure).
    pub groups: &'static [SpanGroup],
}

/// Per-call detail: collectives, launches and sync waits become children of the step's
/// phases, so only the step-level groups need them.
const STEP_DETAIL: &[SpanGroup] = &[
    SpanGroup::Step,
    SpanGroup::ForwardBackward,
    SpanGroup::Optimizer,
];
const ALWAYS: &[SpanGroup] = &[];

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
        entry,
        needs_return,
        groups,
    }
}

const fn with_aliases(mut spec: ProbeSpec, aliases: &'static [&'static str]) -> ProbeSpec {
    spec.optional_aliases = aliases;
    spec
}

use LibraryKind::{CudaRuntime, DynamicLoader, Nccl};
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
    spec(
        ProbeId::NcclCommInitRank,
        Nccl,
        NcclCommInitEntry,
        true,
        ALWAYS,
    ),
    // How libraries loaded after start are found.
    spec(
        ProbeId::DlDebugState,
        DynamicLoader,
        DlDebugState,
        false,
        ALWAYS,
    ),
];

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
        assert_eq!(enabled_for(DynamicLoader, &groups).count(), 1);
    }

    #[test]
    fn per_step_attaches_everything() {
        let groups: SpanGroups = "per_step".parse().unwrap();
        let total: usize = [CudaRuntime, Nccl, DynamicLoader]
            .into_iter()
            .map(|kind| enabled_for(kind, &groups).count())
            .sum();
        assert_eq!(total, ProbeId::COUNT);
    }
}
