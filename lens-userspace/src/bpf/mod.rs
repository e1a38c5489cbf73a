//! The one door to the kernel's side of tracing: the BPF object built from `lens-ebpf`,
//! loaded once. Its programs are found by name and loaded here (`programs`); its maps are
//! taken out of it typed (`maps`), each saying what it holds and who writes it. Nothing
//! outside this module names a map; the attach logic above it names programs through
//! [`Program`]. The scheduler's tracepoints, which every session attaches the same way,
//! go in here too (`sched`).
use aya::{
    Ebpf,
    maps::{MapData, RingBuf},
};

use crate::{error::Result, settings::links::UprobeLinks};

pub mod maps;
pub mod programs;
pub mod sched;

pub use maps::{KernelMaps, KernelState};
pub use programs::{Program, program_mut};
pub(crate) use programs::{is_multi, uprobe_mut};

/// The loaded object: its programs (and the links the attach code makes from them), and
/// the maps they share with lens-probe.
pub struct BpfObject {
    pub programs: Ebpf,
    pub maps: KernelMaps,
}

impl BpfObject {
    /// Loads the object and its programs. `kernel_logs` keeps the kernel-side diagnostics
    /// (aya-log) on; otherwise they are compiled in but switched off at load.
    pub fn load(kernel_logs: bool, links: UprobeLinks) -> Result<BpfObject> {
        let mut programs = programs::load_object(kernel_logs, links)?;
        let maps = KernelMaps::take(&mut programs)?;
        Ok(BpfObject { programs, maps })
    }

    /// Takes the events ring buffer out, for the one reader that drains it (a session, or
    /// the throughput bench).
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>> {
        programs::take_event_ring(&mut self.programs)
    }
}
