//! A tracing session: load the programs, register targets, then pump the ring buffer into
//! an [`EventSink`](crate::sink::EventSink) until the targets exit, a signal arrives or the time is up.
//!
//! Data path: probe (kernel) → ring buffer → [`events::decode`] → sink.
use std::{collections::HashSet, sync::Arc, time::Duration};

use aya::maps::{MapData, RingBuf};
use aya_log::EbpfLogger;
use lens_common::settings;
use log::{info, warn};
use tokio::sync::mpsc;

use crate::{
    attach_status::AttachStatus,
    bpf::BpfObject,
    budget::{BudgetController, BudgetReport, OverheadBudget},
    discovery::NodeFilter,
    error::Result,
    export::strategy::ExportStrategy,
    gpu_memory::GpuMemory,
    hangs::HangWatcher,
    probes::{attach::Attacher, calibrate, file_probes::FileProbes},
    python::{self, PythonTracker},
    settings::{
        groups::{SpanGroup, SpanGroups},
        probe_rules::ProbeRules,
    },
    summary::Losses,
    sys::{guardian::Guardian, privileges, target::ExitStatus},
};

mod costs;
mod counters;
mod drain;
mod event_loop;
mod framework_saves;
mod hang_checks;
mod kernel_counters;
mod node;
mod python_frames;
mod target_maps;
mod target_table;
mod targets;

use costs::ProbeCosts;
use event_loop::EventLoopPriority;
use kernel_counters::KernelCounters;
use python_frames::PythonFrames;
use target_table::TargetTable;

pub use crate::bpf::KernelState;

/// How often the ring buffer is drained when no wakeup came (wakeups are batched: the
/// kernel wakes the reader once per 256 KiB of events, and at once for a control event).
/// Each wakeup of an idle loop costs tens of µs on a VM: at 20 ms they were a sixth of
/// lens-probe's CPU on a fast loop.
pub const DRAIN_INTERVAL: Duration = Duration::from_millis(50);

/// How often the kernel's call counters (launches) of running targets are read.
const CALL_COUNTS_INTERVAL: Duration = Duration::from_secs(5);

/// After a signal, how long the children we started are traced on (`--stop-grace`'s
/// default for a `Session`).
const CHILD_EXIT_GRACE: Duration = Duration::from_secs(5);

#[derive(Clone, Debug, Default)]
pub struct TraceOptions {
    pub span_groups: SpanGroups,
    /// Kernel-side diagnostics (aya-log) forwarded to the log.
    pub kernel_logs: bool,
    /// `--overhead-budget`: launch probes sampled to stay within it.
    pub overhead_budget: Option<OverheadBudget>,
    /// `--uprobe-links`: uprobe_multi or perf links.
    pub uprobe_links: crate::settings::links::UprobeLinks,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// Every traced process exited.
    TargetsExited,
    /// SIGINT or SIGTERM.
    Signal(i32),
    /// `--duration` elapsed.
    Duration,
}

/// What a finished run reports besides what went to the sink.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub stop: StopReason,
    pub losses: Losses,
    /// Exit status of the process started with [`Session::exec`], once it exited.
    pub child_exit: Option<ExitStatus>,
    /// What the overhead budget did, when one was set.
    pub budget: Option<BudgetReport>,
}

pub struct Session {
    bpf: BpfObject,
    /// Where events come from: the ring buffer, the exit watchers, the kernel's logs.
    events: EventInputs,
    /// The probes in the kernel, per traced process.
    probes: TargetProbes,
    groups: SpanGroups,
    /// The traced processes, and the one lens-probe started.
    targets: TargetTable,
    /// Which processes become targets.
    selection: Selection,
    /// `--stop-grace`: how long the process started with `--exec` is traced on after a
    /// stop signal was passed on to it.
    stop_grace: Duration,
    /// What the probes cost, and the overhead budget that bounds it.
    costs: ProbeCosts,
    /// Targets stopped at a library load, and who lets them go.
    stops: LoadStops,
    /// Python stacks and the framework calls read from them.
    python: PythonFrames,
    /// What the GPU did for each process: its kernels and its memory.
    gpu: GpuComponents,
    /// Collectives counted per communicator, for hang reports (`--hang-timeout`) and the
    /// gloo collectives' communicator and number.
    hangs: HangWatcher,
}

/// The components that follow each process's GPU work.
struct GpuComponents {
    /// Launches are counted per kernel (the `step` group is on): the names, and what
    /// was read of each counter so far.
    kernels: Option<KernelCounters>,
    /// The device memory each process holds, from its memory calls.
    memory: GpuMemory,
}

/// The event loop's inputs besides the clock, and its thread.
struct EventInputs {
    ring: Option<RingBuf<MapData>>,
    logger: Option<EbpfLogger<&'static dyn log::Log>>,
    /// Records the decoder refused.
    undecodable: u64,
    /// Where the exit watchers of targets report (set while `run` runs).
    exit_tx: Option<mpsc::UnboundedSender<u32>>,
    /// The event loop thread's raised priority, restored when the session ends.
    priority: Option<EventLoopPriority>,
    /// The console line on what is traced (`show_attach_status`), off by default.
    attach_status: Option<AttachStatus>,
}

/// The probes in the kernel, per traced process.
struct TargetProbes {
    attacher: Attacher,
    /// File-creation probes, one set per traced process (`probes::files`).
    files: FileProbes,
    /// Targets that are forks still running their parent's program (DataLoader and
    /// compile workers): they get no file-creation probes of their own.
    fork_images: HashSet<u32>,
}

/// Which processes become targets.
struct Selection {
    /// Which ranks are traced (NeMo Lens' export strategies); others are let go.
    export_strategy: ExportStrategy,
    /// Node mode: the filter discovered processes must pass.
    node: Option<NodeFilter>,
}

/// Targets stopped at a library load until their new library is attached.
struct LoadStops {
    /// Continues stopped targets should lens-probe die (the CLI starts one).
    guardian: Option<Guardian>,
    /// Library loads attached after the guardian had continued their target, and the
    /// processes warned about.
    late_attaches: u64,
    late_warned: HashSet<u32>,
    /// Node mode: candidates paused until they are attached (`hold_candidates`).
    held_candidates: HashSet<u32>,
}

impl Session {
    /// Checks privileges and kernel support, then loads the BPF programs.
    pub fn new(options: TraceOptions) -> Result<Session> {
        privileges::check()?;
        let mut bpf = BpfObject::load(options.kernel_logs, options.uprobe_links)?;
        let ring = bpf.take_events()?;
        let logger = if options.kernel_logs {
            match EbpfLogger::init(&mut bpf.programs) {
                Ok(logger) => Some(logger),
                Err(error) => {
                    warn!("kernel-side logs unavailable: {error}");
                    None
                }
            }
        } else {
            None
        };
        // Before the calibration below: a launch probe hit costs what it costs with it.
        let kernel_names = options.span_groups.contains(SpanGroup::Step);
        if kernel_names {
            bpf.maps.settings.set(settings::KERNEL_NAMES, 1)?;
        }
        // Under a budget the launch probes go in and out without their return probes.
        if options.overhead_budget.is_none() {
            bpf.maps.settings.set(settings::GRAPH_LAUNCH_SPANS, 1)?;
        }
        let mut attacher = Attacher::default();
        let hit_costs = calibrate::hit_costs(&mut bpf);
        info!(
            "a probe hit costs {} ns here, {} ns more with a return probe",
            hit_costs.entry.as_nanos(),
            hit_costs.ret.as_nanos()
        );
        let budget = match options.overhead_budget {
            Some(budget) => {
                attacher.sample_launches();
                let min_cycle = if Attacher::launch_probes_move_as_one(&bpf.programs) {
                    crate::budget::MIN_CYCLE_MULTI_LINKS
                } else {
                    crate::budget::MIN_CYCLE_PERF_LINKS
                };
                Some((
                    BudgetController::new(budget, hit_costs.entry, min_cycle),
                    crate::spans::monotonic_now_ns(),
                ))
            }
            None => None,
        };
        Ok(Session {
            bpf,
            events: EventInputs {
                ring: Some(ring),
                logger,
                undecodable: 0,
                exit_tx: None,
                priority: None,
                attach_status: None,
            },
            probes: TargetProbes {
                attacher,
                files: FileProbes::default(),
                fork_images: HashSet::new(),
            },
            groups: options.span_groups,
            targets: TargetTable::default(),
            selection: Selection {
                export_strategy: ExportStrategy::AllRanks,
                node: None,
            },
            stop_grace: CHILD_EXIT_GRACE,
            costs: ProbeCosts::new(hit_costs, budget),
            stops: LoadStops {
                guardian: None,
                late_attaches: 0,
                late_warned: HashSet::new(),
                held_candidates: HashSet::new(),
            },
            python: PythonFrames::default(),
            // Launches per kernel, for the steps' top kernels: only when steps are on
            // (off, the launch probes skip that map update).
            gpu: GpuComponents {
                kernels: kernel_names.then(KernelCounters::default),
                memory: GpuMemory::default(),
            },
            hangs: HangWatcher::new(None),
        })
    }

    /// Raises the calling thread's priority (`EventLoopPriority`) while the session
    /// lasts; called by [`Session::run`] on its thread, and earlier by the CLI on the
    /// thread that will run it, before it gives up the capability that allows it.
    pub fn raise_priority(&mut self) {
        if self.events.priority.is_none() {
            self.events.priority = EventLoopPriority::raise();
        }
    }

    /// `--hang-timeout`: report collectives hung this long (`None`: never).
    pub fn set_hang_timeout(&mut self, timeout: Option<Duration>) {
        self.hangs = HangWatcher::new(timeout);
    }

    /// `--stop-grace`: after a stop signal, how long the commands lens-probe started are
    /// traced on (their exit then seen) before tracing stops.
    pub fn set_stop_grace(&mut self, grace: Duration) {
        self.stop_grace = grace;
    }

    /// Tells `guardian` about every target from now on.
    pub fn set_guardian(&mut self, mut guardian: Guardian) {
        guardian.share_stops(self.bpf.maps.stopped.raw_fd());
        self.stops.guardian = Some(guardian);
    }

    fn guard(&mut self, pid: u32) {
        if let Some(guardian) = self.stops.guardian.as_mut() {
            guardian.watch(pid);
        }
    }

    /// Python rules that no traced process called, one line each (after a run).
    pub fn unmatched_python_rules(&self) -> Vec<String> {
        self.python.unmatched_rules()
    }

    pub fn attacher(&self) -> &Attacher {
        &self.probes.attacher
    }

    /// Configured probe rules (`--config`, `--profile`) to attach besides the built-in
    /// probes. Call before adding targets.
    pub fn set_rules(&mut self, rules: Arc<ProbeRules>) {
        let python: Vec<_> = rules
            .python
            .iter()
            .filter(|rule| self.groups.contains(rule.group))
            .cloned()
            .collect();
        self.probes.attacher.set_rules(rules);
        if python.is_empty() {
            return;
        }
        let tracker_rules_configured = python.iter().any(|rule| !rule.framework);
        match python::sampler::Sampler::load(&mut self.bpf.programs) {
            Ok(sampler) => self.python.start(PythonTracker::new(python), sampler),
            Err(error) if tracker_rules_configured => {
                warn!("Python rules: cannot start the sampler: {error}")
            }
            // Only the built-in framework rules: saves are then bounded by their files.
            Err(error) => info!("Python stacks are not sampled: {error}"),
        }
    }

    /// Which ranks to trace: a process whose rank does not export under `strategy` is not
    /// traced (decided when its rank is known: at attach, or when it execs). The library
    /// default is every rank; the CLI uses NeMo Lens' default, `single_rank`.
    pub fn set_export_strategy(&mut self, strategy: ExportStrategy) {
        self.selection.export_strategy = strategy;
    }
}
