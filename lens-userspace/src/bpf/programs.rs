//! The BPF object built from `lens-ebpf`: loaded once, and its programs and ring
//! buffer found by name ([`super::BpfObject`] takes the maps).

use aya::{
    Ebpf, EbpfLoader,
    programs::{ProgramError, UProbe},
};

use log::{debug, warn};

use crate::error::{LensError, Result};
use crate::settings::links::UprobeLinks;

/// The BPF object built from `lens-ebpf` by the build script.
static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lens-ebpf.o"));

/// Makes [`Program`] from one list: each variant and the name of its function in
/// `lens-ebpf` (the name the loaded object knows it by).
macro_rules! programs {
    ($( $(#[$doc:meta])* $variant:ident => $name:literal, )+) => {
        /// The BPF programs of `lens-ebpf`, by the name of their function.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Program {
            $( $(#[$doc])* $variant, )+
        }

        impl Program {
            pub const ALL: &[Program] = &[$(Program::$variant),+];

            pub const fn name(self) -> &'static str {
                match self {
                    $( Program::$variant => $name, )+
                }
            }

            /// The name of its twin in a `uprobe.multi` / `uretprobe.multi` section
            /// (`lens-ebpf` has one of each program, `<name>_m`).
            pub const fn multi_name(self) -> &'static str {
                match self {
                    $( Program::$variant => concat!($name, "_m"), )+
                }
            }
        }
    };
}

programs! {
    CountOnly => "count_only",
    NcclGroup => "nccl_group",
    NcclCollectiveEntry => "nccl_collective_entry",
    CudaSyncEntry => "cuda_sync_entry",
    NcclCommInitEntry => "nccl_comm_init_entry",
    NcclCollectiveReturn => "nccl_collective_return",
    CudaSyncReturn => "cuda_sync_return",
    NcclCommInitReturn => "nccl_comm_init_return",
    DlDebugState => "dl_debug_state",
    PhaseMark => "phase_mark",
    PhaseMarkReturn => "phase_mark_return",
    TorchBackwardEntry => "torch_backward_entry",
    TorchScopeEnter => "torch_scope_enter",
    GradModeEntry => "grad_mode_entry",
    PyGradModeEntry => "py_grad_mode_entry",
    TimedCallEntry => "timed_call_entry",
    DriverLaunch => "driver_launch",
    /// Configured probe rules (`crate::settings::probe_rules`): entry and return of any function.
    UserRuleEntry => "user_rule_entry",
    UserRuleReturn => "user_rule_return",
    CudaEventRecord => "cuda_event_record",
    CudaEventQueryEntry => "cuda_event_query_entry",
    CudaEventQueryReturn => "cuda_event_query_return",
    CudaRegisterFunction => "cuda_register_function",
    FileOpenEntry => "file_open_entry",
    PythonStackEntry => "python_stack_entry",
    /// Library calls whose arguments and result say what they did (GPU memory).
    ApiCallEntry => "api_call_entry",
    ApiCallReturn => "api_call_return",
    /// PyTorch's caching allocator's totals: counted, sent at a new peak.
    TorchMemoryEntry => "torch_memory_entry",
}

/// The name `program` is found under in `ebpf`: its `_m` twin where that is the one
/// [`load_object`] loaded. The object itself says which: only one twin is ever loaded.
fn loaded_name(ebpf: &Ebpf, program: Program) -> &'static str {
    let twin_loaded = ebpf
        .program(program.multi_name())
        .is_some_and(|loaded| loaded.fd().is_ok());
    name_for(program, twin_loaded)
}

/// The name `program` goes in under: its `_m` twin with uprobe_multi links (`multi`),
/// where it can go in so.
fn name_for(program: Program, multi: bool) -> &'static str {
    if multi {
        program.multi_name()
    } else {
        program.name()
    }
}

/// Whether `program` goes in as its uprobe_multi twin in `ebpf`: one kernel link for all
/// the points of one attach call.
pub(crate) fn is_multi(ebpf: &Ebpf, program: Program) -> bool {
    loaded_name(ebpf, program) != program.name()
}

/// Whether the programs go in as their uprobe_multi twins, for `links` on this kernel.
fn use_uprobe_multi(links: UprobeLinks) -> Result<bool> {
    if links == UprobeLinks::Perf {
        return Ok(false);
    }
    let supported =
        match aya::sys::is_uprobe_multi_supported(aya::sys::UProbeMultiFeature::LinkCreation) {
            Ok(supported) => supported,
            Err(error) => {
                debug!("cannot tell whether the kernel has uprobe_multi links: {error}");
                false
            }
        };
    let whole_process = crate::sys::kernel::release()
        .as_deref()
        .and_then(release_version)
        .is_some_and(|version| version >= MULTI_FILTERS_PROCESSES);
    match (supported, whole_process, links) {
        (true, true, _) => Ok(true),
        (false, _, UprobeLinks::Multi) => Err(LensError::NoUprobeMulti),
        (true, false, UprobeLinks::Multi) => {
            warn!(
                "--uprobe-links multi on a kernel older than Linux 6.10: unless it has the fix \
                 \"bpf: fix multi-uprobe PID filtering logic\", each process's probes fire in its \
                 first thread only, and calls from its other threads are not seen"
            );
            Ok(true)
        }
        (true, false, _) => {
            // Once per run: the object is loaded once.
            warn!(
                "this kernel's uprobe_multi links filter by thread, not process (before Linux \
                 6.10): one perf link per probe point instead, removed one at a time (about \
                 0.1 s each) after lens-probe exits"
            );
            Ok(false)
        }
        (false, _, _) => {
            warn!(
                "this kernel has no uprobe_multi links (Linux 6.6+): one perf link per probe \
                 point, removed one at a time (about 0.1 s each) after lens-probe exits"
            );
            Ok(false)
        }
    }
}

/// The first Linux release whose uprobe_multi links, opened for a process, fire in all its
/// threads: before it (commit 46ba0e49b642, "bpf: fix multi-uprobe PID filtering logic")
/// the kernel compared the calling thread with the one the link was opened for. Every
/// library probe is opened for one process (`docs/probes.md`, "Where probes go").
const MULTI_FILTERS_PROCESSES: (u32, u32) = (6, 10);

/// `6.18.44-fc-v1272` → (6, 18).
fn release_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Loads the BPF object and its programs. `kernel_logs` keeps the kernel-side diagnostics
/// (aya-log) on; otherwise they are compiled in but switched off at load.
pub fn load_object(kernel_logs: bool, links: UprobeLinks) -> Result<Ebpf> {
    let level: u8 = if kernel_logs { 0xff } else { 0 };
    let layout = super::sched::kernel_layout_or_warn();
    let mut loader = EbpfLoader::new();
    loader.override_global("AYA_LOG_LEVEL", &level, false);
    if let Some(layout) = &layout {
        super::sched::configure(&mut loader, layout);
    }
    let mut ebpf = loader.load(BPF_OBJECT)?;
    let multi = use_uprobe_multi(links)?;
    debug!(
        "uprobes go in as {}",
        if multi {
            "one uprobe_multi link per program and library"
        } else {
            "one perf link per point"
        }
    );
    for &program in Program::ALL {
        load_program(program_mut::<UProbe>(&mut ebpf, name_for(program, multi))?).map_err(
            |source| match source {
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
            },
        )?;
    }
    if layout.is_some() {
        super::sched::attach(&mut ebpf)?;
    }
    Ok(ebpf)
}

/// How many times a program load is tried while the kernel answers EAGAIN, as libbpf
/// does: the verifier gives up with it under memory pressure (a busy node), which a
/// moment later passes.
const LOAD_ATTEMPTS: u32 = 5;

fn load_program(program: &mut UProbe) -> std::result::Result<(), ProgramError> {
    let mut attempts = LOAD_ATTEMPTS;
    loop {
        // The verifier also gives up with EAGAIN whenever a signal is pending for the
        // loading thread; in a process whose other threads reap children (a test binary's
        // sessions, tokio's SIGCHLD handler) every try of a long verification was.
        match crate::sys::target::with_signals_blocked(|| program.load()) {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && attempts > 1 =>
            {
                attempts -= 1;
                debug!("program load: {io_error}, trying again");
            }
            result => return result,
        }
    }
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

pub(crate) fn uprobe_mut(ebpf: &mut Ebpf, program: Program) -> Result<&mut UProbe> {
    let name = loaded_name(ebpf, program);
    program_mut(ebpf, name)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases() {
        assert_eq!(release_version("6.18.44-fc-v1272\n"), Some((6, 18)));
        assert_eq!(release_version("6.8.0-49-generic"), Some((6, 8)));
        assert_eq!(release_version("5.15.0"), Some((5, 15)));
        assert_eq!(release_version("garbage"), None);
        assert!(release_version("6.9.12").unwrap() < MULTI_FILTERS_PROCESSES);
        assert!(release_version("6.10.1").unwrap() >= MULTI_FILTERS_PROCESSES);
    }
}
