//! The BPF object built from `lens-ebpf`: loaded once, and its programs and ring
//! buffer found by name.

use aya::{
    Ebpf, EbpfLoader,
    programs::{ProgramError, UProbe},
};

use std::sync::atomic::{AtomicBool, Ordering};

use log::debug;

use crate::error::{LensError, Result};
use crate::probes::catalog::Program;

/// The BPF object built from `lens-ebpf` by the build script.
static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lens-ebpf.o"));

/// Whether the programs were loaded as their `uprobe.multi` twins (one link per program
/// and library file). Set by [`load_object`].
static MULTI: AtomicBool = AtomicBool::new(false);

/// Set to `0` to load the per-point programs even where the kernel has uprobe_multi links.
pub const UPROBE_MULTI_ENV: &str = "LENS_PROBE_UPROBE_MULTI";

/// Whether `program` goes in through uprobe_multi links when the kernel has them: the ones
/// attached for all processes. `file_open_entry` is attached per process (libc's
/// `probes::files`), which early uprobe_multi kernels filter by thread, not process.
const fn multi_capable(program: Program) -> bool {
    !matches!(program, Program::FileOpenEntry)
}

/// The name `program` is loaded (and found) under: its `_m` twin with uprobe_multi.
pub(crate) fn loaded_name(program: Program) -> &'static str {
    if MULTI.load(Ordering::Relaxed) && multi_capable(program) {
        program.multi_name()
    } else {
        program.name()
    }
}

/// Whether this kernel can attach a library's points as one uprobe_multi link.
fn uprobe_multi_wanted() -> bool {
    if std::env::var_os(UPROBE_MULTI_ENV).is_some_and(|v| v == "0") {
        return false;
    }
    match aya::sys::is_uprobe_multi_supported(aya::sys::UProbeMultiFeature::LinkCreation) {
        Ok(supported) => supported,
        Err(error) => {
            debug!("cannot tell whether the kernel has uprobe_multi links: {error}");
            false
        }
    }
}

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
    MULTI.store(uprobe_multi_wanted(), Ordering::Relaxed);
    debug!(
        "uprobes go in as {}",
        if MULTI.load(Ordering::Relaxed) {
            "one uprobe_multi link per program and library"
        } else {
            "one perf link per point"
        }
    );
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
    program_mut(ebpf, loaded_name(program))
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
