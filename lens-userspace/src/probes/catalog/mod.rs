//! The probe catalog: every probed function, the library that defines it, the BPF program
//! that handles it and the span groups that need it. A probe that no enabled group needs
//! is not attached (the gate costs nothing).
mod rows;
mod table;

use lens_common::{NcclArgs, ProbeId, api_shape, probe_cookie};

use crate::calls::{CollectiveOp, GraphOp, MemoryOp, SyncKind};
use crate::settings::groups::{SpanGroup, SpanGroups};
use crate::sys::library::LibraryKind;

pub use table::{CATALOG, STEP_DETAIL};

pub use crate::bpf::Program;

impl Program {
    /// The return program that pairs the record this entry program keeps in flight (each
    /// timed kind has its own, `lens-ebpf`'s `returns`); `None` for an entry that keeps
    /// none.
    pub const fn paired_return(self) -> Option<Program> {
        match self {
            Program::NcclCollectiveEntry => Some(Program::NcclCollectiveReturn),
            Program::CudaSyncEntry => Some(Program::CudaSyncReturn),
            Program::NcclCommInitEntry => Some(Program::NcclCommInitReturn),
            Program::CudaEventQueryEntry => Some(Program::CudaEventQueryReturn),
            Program::ApiCallEntry => Some(Program::ApiCallReturn),
            _ => None,
        }
    }
}

/// One probed function.
#[derive(Debug)]
pub struct ProbeSpec {
    pub id: ProbeId,
    /// Its ELF symbol: C++ names mangled, as the symbol tables hold them; a `*` is a glob
    /// (Rust's names end in a hash).
    pub symbol: &'static str,
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
    /// What its calls are, where the decoder needs to know.
    pub role: Role,
    /// A newer API that older versions of its library lack: attached where present, never
    /// reported missing.
    pub optional: bool,
    /// A probe of another library that sees the calls this one is for at fewer hits: where
    /// it is attached in a process, this one is not (the process's libraries are
    /// attached in [`attach_order`]).
    pub superseded_by: Option<ProbeId>,
    /// An import that says the library was built for what the probe's program cannot
    /// read (a free-threaded CPython's object layout): not attached where it is imported.
    pub unreadable_if_imports: Option<&'static str>,
}

/// Where a library kind comes among a process's libraries as they are attached: those
/// with a probe another library's may supersede last, so that the other's is known.
pub fn attach_order(library: LibraryKind) -> u8 {
    let superseded = CATALOG
        .iter()
        .any(|spec| spec.library == library && spec.superseded_by.is_some());
    u8::from(superseded)
}

/// What a probed function's calls are, beyond what its program's event kind says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Nothing more: launches, phase marks, infrastructure.
    Plain,
    /// An NCCL collective or point-to-point call, its arguments laid out as `NcclArgs`
    /// says (the kernel reads it from the attach cookie).
    Nccl(CollectiveOp, NcclArgs),
    /// A `c10d::ProcessGroupGloo` call.
    Gloo(CollectiveOp),
    /// A CUDA synchronisation call.
    Sync(SyncKind),
    /// A GPU memory call (the generic call programs: what to read is in the cookie).
    Memory(MemoryOp),
    /// A CUDA graph call (the generic call programs; a capture's begin and end also
    /// change what the launch probes count).
    Graph(GraphOp),
    /// PyTorch's caching allocator's totals (`ApiCall` records sent at a new peak).
    TorchMemory,
}

/// The catalog's entry of a probe.
pub fn spec_of(id: ProbeId) -> &'static ProbeSpec {
    &CATALOG[id as usize]
}

/// The symbol a probe attaches to (its primary name).
pub fn symbol(id: ProbeId) -> &'static str {
    spec_of(id).symbol
}

/// A probe's attach cookie: its id, and the argument layout of an NCCL call.
pub fn cookie(id: ProbeId) -> u64 {
    spec_of(id).cookie()
}

impl CollectiveOp {
    /// The collective an NCCL probe's calls perform.
    pub fn from_probe(probe: ProbeId) -> Option<CollectiveOp> {
        match spec_of(probe).role {
            Role::Nccl(op, _) => Some(op),
            _ => None,
        }
    }

    /// The collective a gloo probe's calls perform.
    pub fn from_gloo_probe(probe: ProbeId) -> Option<CollectiveOp> {
        match spec_of(probe).role {
            Role::Gloo(op) => Some(op),
            _ => None,
        }
    }
}

impl GraphOp {
    /// What a CUDA graph probe's calls do.
    pub fn from_probe(probe: ProbeId) -> Option<GraphOp> {
        match spec_of(probe).role {
            Role::Graph(op) => Some(op),
            _ => None,
        }
    }
}

impl MemoryOp {
    /// What a GPU memory probe's calls do.
    pub fn from_probe(probe: ProbeId) -> Option<MemoryOp> {
        match spec_of(probe).role {
            Role::Memory(op) => Some(op),
            _ => None,
        }
    }
}

impl SyncKind {
    /// What a sync probe's calls wait for.
    pub fn from_probe(probe: ProbeId) -> Option<SyncKind> {
        match spec_of(probe).role {
            Role::Sync(kind) => Some(kind),
            _ => None,
        }
    }
}

impl ProbeSpec {
    pub fn cookie(&self) -> u64 {
        let shape = match self.role {
            Role::Nccl(_, args) => args as u32,
            Role::Memory(op) => self.api_shape(op.out_arg()),
            Role::Graph(op) => {
                let capture = match op {
                    GraphOp::BeginCapture => api_shape::CAPTURE_BEGIN,
                    GraphOp::EndCapture => api_shape::CAPTURE_END,
                    GraphOp::Instantiate | GraphOp::Launch => 0,
                };
                self.api_shape(op.out_arg()) | capture
            }
            _ => 0,
        };
        probe_cookie(self.id, shape)
    }

    /// The shape bits of a call on the generic programs: its out-pointer, and whether
    /// libcudart may make it inside its own call (a driver call).
    fn api_shape(&self, out_arg: Option<u32>) -> u32 {
        let out = out_arg.map_or(0, api_shape::out_arg);
        let driver = match self.library {
            LibraryKind::CudaDriver => api_shape::DRIVER,
            _ => 0,
        };
        out | driver
    }

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
    use crate::sys::library::LibraryKind::{
        C10, CudaDriver, CudaRuntime, DynamicLoader, Nccl, TorchCpu,
    };

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
        // The CUDA libraries: only the memory calls (rare; the job span's peak).
        for library in [CudaRuntime, CudaDriver] {
            for spec in enabled_for(library, &groups) {
                assert!(matches!(spec.role, Role::Memory(_)), "{:?}", spec.id);
            }
        }
        let memory =
            enabled_for(CudaRuntime, &groups).count() + enabled_for(CudaDriver, &groups).count();
        assert_eq!(memory, 13);
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
