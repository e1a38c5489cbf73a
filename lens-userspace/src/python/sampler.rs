//! The Python sampler's kernel side: the `python_sample` program on every CPU's clock
//! (the `PY_TARGETS` map says which processes it reads and how: `bpf::maps`).
use std::time::Duration;

use aya::{
    Ebpf,
    programs::perf_event::{
        PerfEvent, PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent,
    },
    util::online_cpus,
};

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
    let program: &mut PerfEvent = crate::bpf::program_mut(ebpf, PROGRAM)?;
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
