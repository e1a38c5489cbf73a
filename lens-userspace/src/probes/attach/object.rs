//! The BPF object built from `lens-ebpf`: loaded once, and its programs and ring
//! buffer found by name.

use aya::{
    Ebpf, EbpfLoader,
    programs::{ProgramError, UProbe},
};

use log::debug;

use crate::error::{LensError, Result};
use crate::probes::catalog::Program;

/// The BPF object built from `lens-ebpf` by the build script.
static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lens-ebpf.o"));

/// Loads the BPF object and its programs. `kernel_logs` keeps the kernel-side diagnostics
/// (aya-log) on; otherwise they are compiled in but switched off at load.
pub fn load_object(kernel_logs: bool) -> Result<Ebpf> {
    let level: u8 = if kernel_logs { 0xff } else { 0 };
    let layout = crate::probes::processes::kernel_layout_or_warn();
    let mut loader = EbpfLoader::new();
    loader.override_global("AYA_LOG_LEVEL", &level, false);
    if let Some(layout) = &layout {
        crate::probes::processes::configure(&mut loader, layout);
    }
    let mut ebpf = loader.load(BPF_OBJECT)?;
    for &program in Program::ALL {
        uprobe_mut(&mut ebpf, program)?
            .load()
            .map_err(|source| match source {
                ProgramError::LoadError {
                    io_error,
                    verifier_log,
                } => {
                    // The verifier's log is long: for -vv, not for the one-line error.
                    debug!("verifier log of {}:\n{verifier_log}", program.name());
                    LensError::VerifierRejected {
                        program: program.name(),
                        reason: io_error.to_string(),
                    }
                }
                source => LensError::Program {
                    program: program.name(),
                    source,
                },
            })?;
    }
    if layout.is_some() {
        crate::probes::processes::attach(&mut ebpf)?;
    }
    Ok(ebpf)
}

/// Takes the events ring buffer out of the loaded object, for the one reader that drains
/// it (a session, or the throughput bench).
pub fn take_event_ring(ebpf: &mut Ebpf) -> Result<aya::maps::RingBuf<aya::maps::MapData>> {
    let map = ebpf
        .take_map(lens_common::maps::EVENTS)
        .ok_or(LensError::MissingInObject {
            kind: "map",
            name: lens_common::maps::EVENTS,
        })?;
    aya::maps::RingBuf::try_from(map).map_err(|source| LensError::Map {
        map: lens_common::maps::EVENTS,
        source,
    })
}

pub(super) fn uprobe_mut(ebpf: &mut Ebpf, program: Program) -> Result<&mut UProbe> {
    program_mut(ebpf, program.name())
}

/// The object's program `name` as the program type `P` (`UProbe`, `RawTracePoint`…).
pub fn program_mut<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(LensError::MissingInObject {
            kind: "program",
            name,
        })?
        .try_into()
        .map_err(|source| LensError::Program {
            program: name,
            source,
        })
}
