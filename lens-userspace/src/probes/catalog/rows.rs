//! How a row of the catalog's table is written: which groups need a probe, which program
//! handles it, what its calls are (`table.rs` lists the rows).
use lens_common::{NcclArgs, ProbeId};

use super::{ProbeSpec, Program, Role};
use crate::calls::{CollectiveOp, GraphOp, MemoryOp, SyncKind};
use crate::settings::groups::SpanGroup;
use crate::sys::library::LibraryKind;

use LibraryKind::{C10, CudaRuntime, Nccl, TorchCpu};
use Program::*;

/// Per-call detail: collectives, launches and sync waits become children of the step's
/// phases, so only the step-level groups need them.
pub const STEP_DETAIL: &[SpanGroup] = &[
    SpanGroup::Step,
    SpanGroup::ForwardBackward,
    SpanGroup::Optimizer,
];
pub(super) const ALWAYS: &[SpanGroup] = &[];
/// The step machine (what opens and closes steps, see docs/spans.md): torch scopes and
/// backward passes. `model_init` needs it too: it ends where the first step begins.
pub(super) const STEP_PHASES: &[SpanGroup] = &[
    SpanGroup::ModelInit,
    SpanGroup::Step,
    SpanGroup::ForwardBackward,
    SpanGroup::Optimizer,
];
/// Torch scopes also tell evaluation loops (DataLoader fetches under `no_grad`).
pub(super) const SCOPES: &[SpanGroup] = &[
    SpanGroup::ModelInit,
    SpanGroup::Step,
    SpanGroup::ForwardBackward,
    SpanGroup::Optimizer,
    SpanGroup::Evaluate,
];

pub(super) const fn spec(
    id: ProbeId,
    symbol: &'static str,
    library: LibraryKind,
    entry: Program,
    groups: &'static [SpanGroup],
) -> ProbeSpec {
    ProbeSpec {
        id,
        symbol,
        library,
        optional_aliases: &[],
        entry: Some(entry),
        exit: entry.paired_return(),
        groups,
        role: Role::Plain,
        optional: false,
        superseded_by: None,
        unreadable_if_imports: None,
    }
}

/// A phase boundary: marks sent at entry and/or at return.
pub(super) const fn mark(
    id: ProbeId,
    symbol: &'static str,
    library: LibraryKind,
    entry: Option<Program>,
    exit: Option<Program>,
    groups: &'static [SpanGroup],
) -> ProbeSpec {
    ProbeSpec {
        id,
        symbol,
        library,
        optional_aliases: &[],
        entry,
        exit,
        groups,
        role: Role::Plain,
        optional: false,
        superseded_by: None,
        unreadable_if_imports: None,
    }
}

/// An NCCL collective or point-to-point call: timed, child of the phase it runs in.
pub(super) const fn nccl(
    id: ProbeId,
    symbol: &'static str,
    op: CollectiveOp,
    args: NcclArgs,
) -> ProbeSpec {
    let mut spec = spec(id, symbol, Nccl, NcclCollectiveEntry, STEP_DETAIL);
    spec.role = Role::Nccl(op, args);
    spec
}

/// A CUDA runtime sync call: timed, child of the phase it runs in.
pub(super) const fn sync(id: ProbeId, symbol: &'static str, kind: SyncKind) -> ProbeSpec {
    let mut spec = spec(id, symbol, CudaRuntime, CudaSyncEntry, STEP_DETAIL);
    spec.role = Role::Sync(kind);
    spec
}

/// The GPU memory calls: rare and cheap next to what they cost (docs/memory.md), so on
/// with the job span (the run's peak) and with steps (theirs).
pub(super) const MEMORY: &[SpanGroup] = &[SpanGroup::Job, SpanGroup::Step];

/// A GPU memory call: timed, its arguments and result read by the generic call programs.
pub(super) const fn memory(
    id: ProbeId,
    symbol: &'static str,
    library: LibraryKind,
    op: MemoryOp,
) -> ProbeSpec {
    let mut spec = spec(id, symbol, library, ApiCallEntry, MEMORY);
    spec.role = Role::Memory(op);
    spec
}

/// A CUDA graph call: the generic call programs; with the launches whose counts it changes.
pub(super) const fn graph(
    id: ProbeId,
    symbol: &'static str,
    library: LibraryKind,
    op: GraphOp,
) -> ProbeSpec {
    let mut spec = spec(id, symbol, library, ApiCallEntry, STEP_DETAIL);
    spec.role = Role::Graph(op);
    spec
}

/// `c10::reportMemoryUsageToProfiler`: entry only (counted; sent at a new peak).
pub(super) const fn torch_memory() -> ProbeSpec {
    // c10::reportMemoryUsageToProfiler(void*, long, unsigned long, unsigned long, c10::Device)
    let symbol = "_ZN3c1027reportMemoryUsageToProfilerEPvlmmNS_6DeviceE";
    let mut spec = spec(
        ProbeId::TorchMemoryUsage,
        symbol,
        C10,
        TorchMemoryEntry,
        STEP_DETAIL,
    );
    spec.role = Role::TorchMemory;
    spec
}

/// A graph launch: counted by the launch program `entry` (sampled under a budget with the
/// other launches), and sent by the generic return program, a span.
pub(super) const fn graph_launch(
    id: ProbeId,
    symbol: &'static str,
    library: LibraryKind,
    entry: Program,
) -> ProbeSpec {
    let mut spec = spec(id, symbol, library, entry, STEP_DETAIL);
    spec.exit = Some(ApiCallReturn);
    spec.role = Role::Graph(GraphOp::Launch);
    spec
}

pub(super) const fn optional(mut spec: ProbeSpec) -> ProbeSpec {
    spec.optional = true;
    spec
}

/// Not attached in a process where `other` is (see [`ProbeSpec::superseded_by`]).
pub(super) const fn superseded_by(mut spec: ProbeSpec, other: ProbeId) -> ProbeSpec {
    spec.superseded_by = Some(other);
    spec
}

/// Not attached to a library that imports `symbol` (see
/// [`ProbeSpec::unreadable_if_imports`]).
pub(super) const fn unreadable_if_imports(mut spec: ProbeSpec, symbol: &'static str) -> ProbeSpec {
    spec.unreadable_if_imports = Some(symbol);
    spec
}

pub(super) const fn with_aliases(
    mut spec: ProbeSpec,
    aliases: &'static [&'static str],
) -> ProbeSpec {
    spec.optional_aliases = aliases;
    spec
}

/// A `c10d::ProcessGroupGloo` collective: child of the phase it runs in, seen at its
/// entry only. These methods throw (`c10::Error` on a wrong-size tensor, gloo's
/// `IoException` when a peer is gone) and the caller may catch it: an exception that
/// crosses a return probe aborts the process. Their return told only the enqueue anyway
/// (the collective runs on gloo's worker threads).
pub(super) const fn gloo(id: ProbeId, op: CollectiveOp, symbol: &'static str) -> ProbeSpec {
    // `TimedCallEntry` pairs no return program: entry only.
    let mut spec = spec(id, symbol, TorchCpu, TimedCallEntry, STEP_DETAIL);
    spec.role = Role::Gloo(op);
    spec
}
