//! The Python sampler's kernel side: the `python_sample` program on every CPU's clock,
//! and the `PY_TARGETS` map that says which processes it reads and how.
use std::time::Duration;

use aya::{
    Ebpf,
    maps::HashMap as BpfHashMap,
    programs::perf_event::{
        PerfEvent, PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent,
    },
    util::online_cpus,
};
use lens_common::{PyOffsets, maps};

use crate::error::{LensError, Result};

const PROGRAM: &str = "python_sample";

/// How often each CPU looks at the Python thread it runs (docs/python.md: the precision
/// of a Python span's ends).
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(1);

/// Loads the sampler and attaches it to every online CPU's clock. It reads only the
/// processes in `PY_TARGETS` (none yet).
pub fn start(ebpf: &mut Ebpf) -> Result<()> {
    let program_error = |source| LensError::Program {
        program: PROGRAM,
        source,
    };
    let program: &mut PerfEvent = crate::probes::attach::program_mut(ebpf, PROGRAM)?;
    program.load().map_err(program_error)?;
    let cpus = online_cpus().map_err(|(_, error)| LensError::Io(error))?;
    for cpu in cpus {
        program
            .attach(
                PerfEventConfig::Software(SoftwareEvent::CpuClock),
                PerfEventScope::AllProcessesOneCpu { cpu },
                SamplePolicy::Period(SAMPLE_INTERVAL.as_nanos() as u64),
                false,
            )
            .map_err(program_error)?;
    }
    Ok(())
}

/// Samples `pid`'s threads, read with `offsets`.
pub fn add_target(ebpf: &mut Ebpf, pid: u32, offsets: &PyOffsets) -> Result<()> {
    let map_error = |source| LensError::Map {
        map: maps::PY_TARGETS,
        source,
    };
    let map = ebpf
        .map_mut(maps::PY_TARGETS)
        .ok_or(LensError::MissingInObject {
            kind: "map",
            name: maps::PY_TARGETS,
        })?;
    let mut targets = BpfHashMap::<_, u32, PyOffsets>::try_from(map).map_err(map_error)?;
    targets.insert(&pid, offsets, 0).map_err(map_error)
}

/// Stops sampling `pid`.
pub fn remove_target(ebpf: &mut Ebpf, pid: u32) {
    if let Some(map) = ebpf.map_mut(maps::PY_TARGETS)
        && let Ok(mut targets) = BpfHashMap::<_, u32, PyOffsets>::try_from(map)
    {
        let _ = targets.remove(&pid);
    }
}
