//! A tracing session: load the programs, register targets, then pump the ring buffer into
//! an [`EventSink`] until the targets exit, a signal arrives or the time is up.
//!
//! Data path: probe (kernel) → ring buffer → [`events::decode`] → sink.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    ffi::OsString,
    os::fd::OwnedFd,
    sync::Arc,
    time::Duration,
};

use aya::{
    Ebpf,
    maps::{
        Array as BpfArray, HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf,
    },
};
use aya_log::EbpfLogger;
use lens_common::{
    CODE_RANGES, CallKey, CodeRanges, Event, HandleKey, InflightKey, KernelKey, LaunchTotals,
    LossCause, ProbeId, TARGET_STOP_ON_LINK_MAP_CHANGE, TargetConfig, maps, saving, settings,
};
use log::{debug, info, warn};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
    sync::mpsc,
};

use crate::{
    attach_status::{AttachStatus, Traced},
    budget::{Action, BudgetController, BudgetReport, OverheadBudget},
    config::ProbeRules,
    discovery::{self, NodeFilter},
    error::{LensError, Result},
    events::{self, ProbeEvent},
    export::strategy::ExportStrategy,
    groups::{SpanGroup, SpanGroups},
    guardian::Guardian,
    hangs::{self, HangChange, HangWatcher},
    kernels::{KernelLaunches, KernelNames},
    privileges,
    probes::{
        attach::{self, Attacher},
        calibrate,
        files::FileProbes,
        library::{self, LibraryKind, MappedLibrary},
    },
    python::{self, PythonTracker},
    sink::{EventSink, ProcessEnd},
    summary::Losses,
    target::{self, ExitStatus, ProcessInfo},
};

/// How often the ring buffer is drained when no wakeup came (wakeups are batched: the
/// kernel wakes the reader once per 256 KiB of events, and at once for a control event).
/// Each wakeup of an idle loop costs tens of µs on a VM: at 20 ms they were a sixth of
/// lens-probe's CPU on a fast loop.
pub(crate) const DRAIN_INTERVAL: Duration = Duration::from_millis(50);
/// How often the kernel's call counters (launches) of running targets are read.
const CALL_COUNTS_INTERVAL: Duration = Duration::from_secs(5);
/// After a signal, how long the children we started get to exit before we give up.
const CHILD_EXIT_GRACE: Duration = Duration::from_secs(5);

#[derive(Clone, Debug, Default)]
pub struct TraceOptions {
    pub span_groups: SpanGroups,
    /// Kernel-side diagnostics (aya-log) forwarded to the log.
    pub kernel_logs: bool,
    /// `--overhead-budget`: launch probes sampled to stay within it.
    pub overhead_budget: Option<OverheadBudget>,
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

/// Entries in the kernel's per-process maps ([`Session::kernel_state`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelState {
    pub targets: usize,
    pub inflight: usize,
    pub call_counters: usize,
    pub launch_totals: usize,
    /// Per-kernel launch counters not yet read.
    pub kernel_counters: usize,
    /// Processes whose libcudart mappings the driver probes know.
    pub runtime_ranges: usize,
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

struct Target {
    info: ProcessInfo,
    /// Started by us (`--exec`): we can collect its exit status.
    own_child: bool,
    config: TargetConfig,
    pidfd: Option<OwnedFd>,
    /// The sink was told its launches are being counted.
    launches_counted: bool,
    /// ... at some time.
    launches_seen: bool,
    /// How it ended, as the kernel's exit tracepoint said (its parent reaps it, not us).
    exit: Option<ExitStatus>,
}

pub struct Session {
    ebpf: Ebpf,
    ring: Option<RingBuf<MapData>>,
    logger: Option<EbpfLogger<&'static dyn log::Log>>,
    attacher: Attacher,
    groups: SpanGroups,
    targets: HashMap<u32, Target>,
    /// The process started with `--exec`, whose exit status becomes ours.
    child: Option<u32>,
    child_exit: Option<ExitStatus>,
    undecodable: u64,
    /// Where the exit watchers of targets report (set while `run` runs).
    exit_tx: Option<mpsc::UnboundedSender<u32>>,
    /// Which ranks are traced (NeMo Lens' export strategies); others are let go.
    export_strategy: ExportStrategy,
    /// Node mode: the filter discovered processes must pass.
    node: Option<NodeFilter>,
    /// `--overhead-budget`: the controller, and when it started (monotonic ns).
    budget: Option<(BudgetController, u64)>,
    /// Launches per process as reported to the sinks: under a budget, counted launches
    /// plus an estimate for the pauses between windows.
    launch_estimates: HashMap<u32, LaunchEstimate>,
    /// Continues stopped targets should lens-probe die (the CLI starts one).
    guardian: Option<Guardian>,
    /// Python rules: their sampled stacks become rule calls (`python`).
    python: Option<PythonTracker>,
    /// Library loads attached after the guardian had continued their target, and the
    /// processes warned about.
    late_attaches: u64,
    late_warned: HashSet<u32>,
    /// The console line on what is traced (`show_attach_status`), off by default.
    attach_status: Option<AttachStatus>,
    /// Node mode: candidates paused until they are attached (`hold_candidates`).
    held_candidates: std::collections::HashSet<u32>,
    /// The event loop thread's raised priority, restored when the session ends.
    priority: Option<EventLoopPriority>,
    /// Framework save and load calls open per process (what `PY_SAVING` says to the
    /// kernel).
    saving_depth: HashMap<u32, [u32; 2]>,
    /// Processes whose load preparation returned and whose next framework call is not
    /// seen yet: the load part of `saving_depth` is kept for it (`deliver_rule_calls`).
    armed_loads: HashMap<u32, std::time::Instant>,
    /// File-creation probes, one set per traced process (`probes::files`).
    file_probes: FileProbes,
    /// Targets that are forks still running their parent's program (DataLoader and
    /// compile workers): they get no file-creation probes of their own.
    fork_images: HashSet<u32>,
    /// Launches are counted per kernel (the `step` group is on): the names, and what
    /// was read of each counter so far.
    kernels: Option<KernelCounters>,
    /// Collectives counted per communicator, for hang reports (`--hang-timeout`) and the
    /// gloo collectives' communicator and number.
    hangs: HangWatcher,
}

/// The per-kernel launch counters as read so far.
#[derive(Default)]
struct KernelCounters {
    names: KernelNames,
    /// Each counter's value at the last read.
    seen: HashMap<KernelKey, u64>,
    /// The newest epoch each process's phase marks opened: counters of older epochs are
    /// complete and are removed once read.
    epochs: HashMap<u32, u64>,
    /// Each process's launch total as the newest mark read carried it: a batch of marks
    /// that carry no more launches has nothing new to read, and the read is skipped
    /// (walking even an empty hash map visits every bucket: it was a tenth of
    /// lens-probe's CPU on a CPU-only loop).
    launches_read: HashMap<u32, u64>,
}

/// A process's launches under an overhead budget: counted in windows, extrapolated at the
/// last window's rate in between.
#[derive(Clone, Copy, Debug, Default)]
struct LaunchEstimate {
    counted: u64,
    estimated: f64,
    /// Launches per second in the last window.
    rate: f64,
}

impl Session {
    /// Checks privileges and kernel support, then loads the BPF programs.
    pub fn new(options: TraceOptions) -> Result<Session> {
        privileges::check()?;
        let mut ebpf = attach::load_object(options.kernel_logs)?;
        let ring = attach::take_event_ring(&mut ebpf)?;
        let logger = if options.kernel_logs {
            match EbpfLogger::init(&mut ebpf) {
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
            set_setting(&mut ebpf, settings::KERNEL_NAMES, 1)?;
        }
        let mut attacher = Attacher::default();
        let budget = match options.overhead_budget {
            Some(budget) => {
                attacher.sample_launches();
                let per_hit = calibrate::per_hit_cost(&mut ebpf);
                info!(
                    "overhead budget {budget}: a launch probe hit costs {} ns here",
                    per_hit.as_nanos()
                );
                Some((
                    BudgetController::new(budget, per_hit),
                    crate::spans::monotonic_now_ns(),
                ))
            }
            None => None,
        };
        Ok(Session {
            ebpf,
            ring: Some(ring),
            logger,
            attacher,
            groups: options.span_groups,
            targets: HashMap::new(),
            child: None,
            child_exit: None,
            undecodable: 0,
            exit_tx: None,
            export_strategy: ExportStrategy::AllRanks,
            node: None,
            budget,
            launch_estimates: HashMap::new(),
            guardian: None,
            python: None,
            late_attaches: 0,
            late_warned: HashSet::new(),
            attach_status: None,
            held_candidates: std::collections::HashSet::new(),
            priority: None,
            saving_depth: HashMap::new(),
            armed_loads: HashMap::new(),
            file_probes: FileProbes::default(),
            fork_images: HashSet::new(),
            // Launches per kernel, for the steps' top kernels: only when steps are on
            // (off, the launch probes skip that map update).
            kernels: kernel_names.then(KernelCounters::default),
            hangs: HangWatcher::new(None),
        })
    }

    /// Raises the calling thread's priority (`EventLoopPriority`) while the session
    /// lasts; called by [`Session::run`] on its thread, and earlier by the CLI on the
    /// thread that will run it, before it gives up the capability that allows it.
    pub fn raise_priority(&mut self) {
        if self.priority.is_none() {
            self.priority = EventLoopPriority::raise();
        }
    }

    /// `--hang-timeout`: report collectives hung this long (`None`: never).
    pub fn set_hang_timeout(&mut self, timeout: Option<Duration>) {
        self.hangs = HangWatcher::new(timeout);
    }

    /// Tells the driver probes where `pid` maps libcudart (all its mappings, merged): a
    /// driver launch returning there is the runtime's own, counted at the runtime.
    /// `libraries` are what `pid` maps of interest: without a libcudart, the maps (long
    /// in a torch process, and read at every library load) are not read again.
    fn set_runtime_ranges(&mut self, pid: u32, libraries: &[MappedLibrary]) {
        if !libraries.iter().any(|l| l.kind == LibraryKind::CudaRuntime) {
            return;
        }
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
            return;
        };
        let mut ranges: Vec<[u64; 2]> = Vec::new();
        for entry in library::parse_maps(&text) {
            let name = std::path::Path::new(&entry.path)
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if LibraryKind::from_file_name(name) != Some(LibraryKind::CudaRuntime) {
                continue;
            }
            match ranges.last_mut() {
                Some(last) if last[1] == entry.start => last[1] = entry.end,
                _ => ranges.push([entry.start, entry.end]),
            }
        }
        if ranges.is_empty() {
            return;
        }
        if ranges.len() > CODE_RANGES {
            warn!(
                "pid {pid} maps libcudart in {} places, the driver probes know {CODE_RANGES}: \
                 runtime launches from the others may count twice",
                ranges.len()
            );
        }
        let mut value = CodeRanges::default();
        for (slot, range) in value.ranges.iter_mut().zip(ranges) {
            *slot = range;
        }
        let Some(map) = self.ebpf.map_mut(maps::RUNTIME_RANGES) else {
            return;
        };
        if let Ok(mut map) = BpfHashMap::<_, u32, CodeRanges>::try_from(map)
            && let Err(error) = map.insert(pid, value, 0)
        {
            warn!("pid {pid}: cannot tell the driver probes where libcudart is: {error}");
        }
    }

    /// Reads the per-kernel launch counters of `pids` (all of them with `all`, for a
    /// process that ended) and hands what is new to the sink, named. Counters of epochs
    /// older than the newest mark seen are complete: they are removed once read.
    fn read_kernel_counts(&mut self, pids: &[u32], all: bool, sink: &mut dyn EventSink) {
        let Some(kernels) = self.kernels.as_mut() else {
            return;
        };
        let Some(map) = self.ebpf.map_mut(maps::KERNEL_COUNTS) else {
            return;
        };
        let Ok(mut counts) = BpfHashMap::<_, KernelKey, u64>::try_from(map) else {
            return;
        };
        let keys: Vec<KernelKey> = counts
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| pids.contains(&k.tgid))
            .collect();
        let mut new: HashMap<u32, Vec<(KernelKey, u64)>> = HashMap::new();
        for key in keys {
            let Ok(value) = counts.get(&key, 0) else {
                continue;
            };
            let seen = kernels.seen.entry(key).or_default();
            let delta = value.saturating_sub(*seen);
            *seen = value;
            let newest = kernels.epochs.get(&key.tgid).copied().unwrap_or(0);
            if all || u64::from(key.epoch) < newest {
                let _ = counts.remove(&key);
                kernels.seen.remove(&key);
            }
            if delta > 0 {
                new.entry(key.tgid).or_default().push((key, delta));
            }
        }
        // Stubs without a symbol are named as their module registered them.
        let registry = self
            .ebpf
            .map(maps::KERNEL_REGISTRY)
            .and_then(|map| BpfHashMap::<_, HandleKey, u64>::try_from(map).ok());
        for (pid, entries) in new {
            let functions: Vec<(u64, bool)> = entries
                .iter()
                .map(|(key, _)| (key.function, key.driver != 0))
                .collect();
            let registered = |function: u64| {
                let key = HandleKey {
                    tgid: pid,
                    _pad: 0,
                    handle: function,
                };
                registry.as_ref()?.get(&key, 0).ok()
            };
            let names = kernels.names.resolve(pid, &functions, &registered);
            let launches: Vec<KernelLaunches> = entries
                .iter()
                .zip(names)
                .map(|((key, launches), name)| KernelLaunches {
                    epoch: key.epoch.into(),
                    name,
                    launches: *launches,
                })
                .collect();
            sink.on_kernel_launches(pid, &launches);
        }
    }

    /// Forgets `pid`'s per-kernel counters (it ended, or runs a new program whose
    /// epochs start over), in the kernel and here.
    fn forget_kernel_counts(&mut self, pid: u32) {
        if let Some(kernels) = self.kernels.as_mut() {
            kernels.seen.retain(|key, _| key.tgid != pid);
            kernels.epochs.remove(&pid);
            kernels.launches_read.remove(&pid);
            kernels.names.forget(pid);
        }
        if let Some(map) = self.ebpf.map_mut(maps::KERNEL_COUNTS)
            && let Ok(mut counts) = BpfHashMap::<_, KernelKey, u64>::try_from(map)
        {
            let stale: Vec<KernelKey> = counts
                .keys()
                .filter_map(|k| k.ok())
                .filter(|k| k.tgid == pid)
                .collect();
            for key in stale {
                let _ = counts.remove(&key);
            }
        }
    }

    /// Tells `guardian` about every target from now on.
    pub fn set_guardian(&mut self, mut guardian: Guardian) {
        if let Some(aya::maps::Map::HashMap(map)) = self.ebpf.map(maps::STOPPED) {
            use std::os::fd::{AsFd, AsRawFd};
            guardian.share_stops(map.fd().as_fd().as_raw_fd());
        }
        self.guardian = Some(guardian);
    }

    fn guard(&mut self, pid: u32) {
        if let Some(guardian) = self.guardian.as_mut() {
            guardian.watch(pid);
        }
    }

    pub fn attacher(&self) -> &Attacher {
        &self.attacher
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
        self.attacher.set_rules(rules);
        if python.is_empty() {
            return;
        }
        let tracker_rules_configured = python.iter().any(|rule| !rule.framework);
        match python::sampler::start(&mut self.ebpf) {
            Ok(()) => self.python = Some(PythonTracker::new(python)),
            Err(error) if tracker_rules_configured => {
                warn!("Python rules: cannot start the sampler: {error}")
            }
            // Only the built-in framework rules: saves are then bounded by their files.
            Err(error) => info!("Python stacks are not sampled: {error}"),
        }
    }

    /// The Python function that made a collective or sync call, named, for the sinks to
    /// see just before the call.
    fn python_caller(&mut self, event: &ProbeEvent) -> Option<ProbeEvent> {
        let (ProbeEvent::Collective {
            timing,
            python_caller,
            ..
        }
        | ProbeEvent::SyncWait {
            timing,
            python_caller,
            ..
        }) = event
        else {
            return None;
        };
        if *python_caller == 0 {
            return None;
        }
        let (function, file) = self
            .python
            .as_mut()?
            .name_code(timing.tgid, *python_caller)?;
        Some(ProbeEvent::PythonCaller {
            tgid: timing.tgid,
            tid: timing.tid,
            at_ns: timing.start_ns,
            function,
            file,
        })
    }

    /// Python rules that no traced process called, one line each (after a run).
    pub fn unmatched_python_rules(&self) -> Vec<String> {
        self.python
            .as_ref()
            .map_or_else(Vec::new, PythonTracker::unmatched)
    }

    /// Counts the files `pid` creates (for checkpoints) if it maps what writes them
    /// (libtorch, safetensors) and is no fork running its parent's program: compilers,
    /// linkers and data workers create files too, and get no probes.
    fn probe_file_creation(&mut self, pid: u32, libraries: &[MappedLibrary]) {
        let writes_checkpoints = libraries
            .iter()
            .any(|l| matches!(l.kind, LibraryKind::TorchCpu | LibraryKind::Safetensors));
        if writes_checkpoints && !self.fork_images.contains(&pid) {
            self.file_probes.attach(&mut self.ebpf, pid, &self.groups);
        }
    }

    /// Samples `pid`'s Python threads if it runs a CPython and Python rules exist.
    /// Returns whether it does.
    fn sample_python(&mut self, pid: u32) -> bool {
        let Some(tracker) = self.python.as_mut() else {
            return false;
        };
        if tracker.knows(pid) {
            return true;
        }
        match python::find_runtime(pid) {
            Ok(Some(runtime)) => {
                match python::sampler::add_target(&mut self.ebpf, pid, &runtime.offsets) {
                    Ok(()) => {
                        info!(
                            "pid {pid} runs CPython {}.{} ({}): sampling its Python stacks",
                            runtime.version.0,
                            runtime.version.1,
                            runtime.path.display()
                        );
                        tracker.add_process(pid, runtime.code);
                        true
                    }
                    Err(error) => {
                        warn!("pid {pid}: cannot sample its Python threads: {error}");
                        false
                    }
                }
            }
            Ok(None) => false,
            Err(error) => {
                if tracker.refused(pid) {
                    warn!("pid {pid}: Python rules not traced there: {error}");
                }
                false
            }
        }
    }

    /// The libraries of interest `pid` maps: the built-in probes' and the files
    /// configured rules name.
    fn libraries_of(&self, pid: u32) -> Result<Vec<MappedLibrary>> {
        library::find_libraries_with(pid, &|path| self.attacher.is_configured_library(path))
    }

    fn launch_totals_map(&mut self) -> Result<BpfHashMap<&mut MapData, u32, LaunchTotals>> {
        hash_map_mut(&mut self.ebpf, maps::LAUNCH_TOTALS)
    }

    fn targets_map(&mut self) -> Result<BpfHashMap<&mut MapData, u32, TargetConfig>> {
        hash_map_mut(&mut self.ebpf, maps::TARGETS)
    }

    fn set_target(&mut self, pid: u32, config: TargetConfig) -> Result<()> {
        self.targets_map()?
            .insert(pid, config, 0)
            .map_err(|source| LensError::Map {
                map: maps::TARGETS,
                source,
            })
    }

    /// Which ranks to trace: a process whose rank does not export under `strategy` is not
    /// traced (decided when its rank is known: at attach, or when it execs). The library
    /// default is every rank; the CLI uses NeMo Lens' default, `single_rank`.
    pub fn set_export_strategy(&mut self, strategy: ExportStrategy) {
        self.export_strategy = strategy;
    }

    fn exports(&self, info: &ProcessInfo) -> bool {
        let exports = self.export_strategy.exports(info.rank.as_ref());
        if !exports {
            warn!(
                "pid {} ({}, rank {}) does not export under {}: not traced",
                info.pid,
                info.name,
                info.rank.map_or(0, |r| r.rank),
                self.export_strategy
            );
        }
        exports
    }

    /// Attaches to the libraries `pid` maps now; later loads are caught by the dynamic
    /// loader probe. Fails when the process maps neither libcudart nor libnccl.
    pub fn attach_pid(&mut self, pid: u32) -> Result<()> {
        if self.targets.contains_key(&pid) {
            // Named twice, or a launcher's worker named after its launcher.
            return Ok(());
        }
        let info = ProcessInfo::read(pid)?;
        if !self.exports(&info) {
            return Ok(());
        }
        let libraries = self.libraries_of(pid)?;
        // Its running descendants that train are attached too, each with its own rank:
        // the workers of a launcher (torchrun's agent, which maps torch itself, mpirun,
        // srun's step daemon, a shell), as `--exec` would have followed them. It is a
        // target itself so that the ones it starts later are followed.
        let trainers: Vec<u32> = target::descendants(pid)
            .into_iter()
            .filter(|child| {
                self.libraries_of(*child)
                    .is_ok_and(|libraries| self.traceable(*child, &libraries))
            })
            .collect();
        let traceable = self.traceable(pid, &libraries);
        if trainers.is_empty() && !traceable {
            return Err(LensError::NoTracedLibraries {
                pid,
                name: info.name,
                wanted: "libcudart.so, libnccl.so, libtorch_cpu.so".into(),
            });
        }
        // Workers run programs of their own (another command line); a trainer's forked
        // data workers run its own.
        let launched = trainers.iter().any(|child| {
            ProcessInfo::read(*child).is_ok_and(|c| c.command_line != info.command_line)
        });
        if launched {
            warn!(
                "pid {pid} ({}) is a launcher: tracing the {} of its processes that train, \
                 and the ones it starts",
                info.name,
                trainers.len()
            );
        }
        self.add_running_target(info, &libraries)?;
        for child in trainers {
            // One that exits meanwhile is not an error of the run.
            if let Err(error) = self.attach_pid(child) {
                warn!("pid {child}: {error}");
            }
        }
        Ok(())
    }

    /// Whether `pid`, mapping `libraries`, is something lens-probe traces.
    fn traceable(&self, pid: u32, libraries: &[MappedLibrary]) -> bool {
        discovery::maps_training_library(libraries)
            || libraries.iter().any(|l| l.kind == LibraryKind::Configured)
            || (self
                .python
                .as_ref()
                .is_some_and(PythonTracker::has_configured)
                && matches!(python::find_runtime(pid), Ok(Some(_))))
    }

    /// Makes running process `info` (which maps `libraries`) a target: its libraries
    /// probed, then it enters the kernel's map, then its exit is watched. Armed last, so
    /// the first step boundary it reports is one all of whose signals are seen.
    fn add_running_target(&mut self, info: ProcessInfo, libraries: &[MappedLibrary]) -> Result<()> {
        let pid = info.pid;
        let pidfd = target::pidfd_open(pid)?;
        self.guard(pid);
        self.attacher
            .use_libraries(pid, libraries.iter().map(|l| l.file));
        for library in libraries {
            self.attacher
                .attach_library(&mut self.ebpf, library, &self.groups);
        }
        self.set_runtime_ranges(pid, libraries);
        self.sample_python(pid);
        self.probe_file_creation(pid, libraries);
        self.set_target(pid, TargetConfig::default())?;
        // Before `run` the exit watch starts there; during it, here.
        let pidfd = match self.exit_tx {
            Some(_) => {
                self.watch_exit(pid, pidfd)?;
                None
            }
            None => Some(pidfd),
        };
        self.targets.insert(
            pid,
            Target {
                info,
                own_child: false,
                config: TargetConfig::default(),
                pidfd,
                launches_counted: false,
                launches_seen: false,
                exit: None,
            },
        );
        Ok(())
    }

    /// Starts `argv` traced from its first instruction: the child waits at a gate until it
    /// is registered, and is stopped at each library load until the probes for the new
    /// libraries are attached. Returns its pid.
    pub fn exec(&mut self, argv: &[OsString]) -> Result<u32> {
        // The child will use (nearly always) the same dynamic loader file as we do.
        if let Some(loader) = attach::own_dynamic_loader()? {
            self.attacher
                .attach_library(&mut self.ebpf, &loader, &self.groups);
        }
        let gated = target::spawn_gated(argv)?;
        let pid = gated.pid;
        self.guard(pid);
        let config = TargetConfig {
            flags: TARGET_STOP_ON_LINK_MAP_CHANGE,
        };
        self.set_target(pid, config)?;
        let pidfd = target::pidfd_open(pid)?;
        if let Err(error) = gated.release() {
            let _ = self.targets_map()?.remove(&pid);
            return Err(error);
        }
        let mut info = ProcessInfo::read(pid).unwrap_or_else(|_| ProcessInfo {
            pid,
            name: argv[0].to_string_lossy().into_owned(),
            command_line: argv
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect(),
            traced_from_start: true,
            rank: None,
            view: Default::default(),
        });
        info.traced_from_start = true;
        self.targets.insert(
            pid,
            Target {
                info,
                own_child: true,
                config,
                pidfd: Some(pidfd),
                launches_counted: false,
                launches_seen: false,
                exit: None,
            },
        );
        self.child = Some(pid);
        Ok(pid)
    }

    /// Reports the exit of `pid` to `run` once its pidfd becomes readable.
    fn watch_exit(&self, pid: u32, pidfd: OwnedFd) -> Result<()> {
        let Some(exit_tx) = self.exit_tx.clone() else {
            return Ok(());
        };
        let pidfd = register(pidfd)?;
        tokio::spawn(async move {
            let _ = pidfd.readable().await;
            let _ = exit_tx.send(pid);
        });
        Ok(())
    }

    /// A traced process forked: the kernel already traces the child; give it a target of
    /// its own (its exit watched, its settings inherited).
    fn on_fork(&mut self, parent: u32, child: u32, sink: &mut dyn EventSink) {
        self.guard(child);
        let config = self
            .targets
            .get(&parent)
            .map(|t| t.config)
            .unwrap_or_default();
        let registered = target::pidfd_open(child).and_then(|pidfd| {
            let mut info = ProcessInfo::read(child)?;
            info.traced_from_start = true;
            self.watch_exit(child, pidfd)?;
            Ok(info)
        });
        match registered {
            Ok(info) => {
                info!("pid {parent} started pid {child}: tracing it");
                self.hangs.process_started(&info, true);
                self.hangs.process_started(&info, true);
                sink.on_process_start(&info);
                self.targets.insert(
                    child,
                    Target {
                        info,
                        own_child: false,
                        config,
                        pidfd: None,
                        launches_counted: false,
                        launches_seen: false,
                        exit: None,
                    },
                );
                // It maps what its parent mapped.
                self.fork_images.insert(child);
                self.attach_libraries_of(child);
            }
            // Gone already (a short-lived helper): nothing to trace.
            Err(_) => {
                if let Ok(mut targets) = self.targets_map() {
                    let _ = targets.remove(&child);
                }
            }
        }
    }

    /// A traced process runs a new program: tell the sinks what it is now.
    fn on_exec(&mut self, pid: u32, sink: &mut dyn EventSink) {
        self.fork_images.remove(&pid);
        // A fork handled before its exec (torchrun's python starting a worker) was given
        // its parent's interpreter: the new program's is elsewhere (another load
        // address), found again at its library loads.
        self.forget_python(pid, sink);
        // The new program's launches count from 0, its epochs too; its libraries are new.
        if let Ok(mut totals) = self.launch_totals_map() {
            let _ = totals.remove(&pid);
        }
        self.forget_kernel_counts(pid);
        if let Some(map) = self.ebpf.map_mut(maps::RUNTIME_RANGES)
            && let Ok(mut ranges) = BpfHashMap::<_, u32, CodeRanges>::try_from(map)
        {
            let _ = ranges.remove(&pid);
        }
        let Some(target) = self.targets.get_mut(&pid) else {
            return;
        };
        if let Ok(mut info) = ProcessInfo::read(pid) {
            info.traced_from_start = true;
            target.info = info;
            // A new job in the sinks: tell it afresh whether launches are counted.
            target.launches_counted = false;
            target.launches_seen = false;
            self.hangs.process_started(&target.info, true);
            sink.on_process_exec(&target.info);
            let info = target.info.clone();
            if !self.exports(&info) {
                self.finish_target(pid, None, sink);
            } else {
                // A program with the interpreter inside (a static python) maps it now;
                // a libpython is found at the library loads that follow.
                self.sample_python(pid);
            }
        }
    }

    /// New libraries in `pid`: attach to them, then let a stopped process go on. In node
    /// mode an untraced process that now maps a training library may become a target.
    fn on_link_map_changed(
        &mut self,
        pid: u32,
        stopped: bool,
        traced: bool,
        sink: &mut dyn EventSink,
    ) {
        if self.targets.contains_key(&pid) {
            self.attach_libraries_of(pid);
        } else if !traced && self.node.is_some() {
            self.consider_candidate(pid, sink);
        }
        if stopped {
            self.resume_from_load(pid);
        }
    }

    /// Lets `pid`, stopped at a library load, go on. If its stop is no longer in the
    /// kernel's map, the guardian ended it first (lens-probe was held up past
    /// `guardian::MAX_HOLD`): what loaded then was attached late, and is counted.
    fn resume_from_load(&mut self, pid: u32) {
        let removed = match self.ebpf.map_mut(maps::STOPPED) {
            Some(map) => BpfHashMap::<_, u32, u64>::try_from(map)
                .map(|mut stops| stops.remove(&pid).is_ok())
                .unwrap_or(true),
            None => true,
        };
        // One line per process (a process loading many libraries stops at each), all counted.
        if !removed {
            self.late_attaches += 1;
        }
        if !removed && self.late_warned.insert(pid) {
            warn!(
                "pid {pid} waited over {} ms at a library load: lens-probe's guardian let it \
                 go on, and its new library's first calls were not seen (attached late)",
                crate::guardian::MAX_HOLD.as_millis()
            );
        }
        target::resume(pid);
    }

    /// Prints a line on stderr when what is traced changes (`attach_status`): the
    /// seconds of a job's start, spent attaching, are not silent.
    pub fn show_attach_status(&mut self) {
        self.attach_status = Some(AttachStatus::default());
    }

    fn print_attach_status(&mut self) {
        let Some(status) = self.attach_status.as_mut() else {
            return;
        };
        // The dynamic loader's probe is how lens-probe follows library loads, not what
        // the job is traced in.
        let traced_in = || {
            self.attacher
                .attachments()
                .iter()
                .filter(|a| a.library.kind != LibraryKind::DynamicLoader)
        };
        let traced = Traced {
            processes: self.targets.len(),
            libraries: traced_in().count(),
            uprobes: traced_in().map(|a| a.attached().count()).sum(),
        };
        if let Some(line) = status.due(traced, std::time::Instant::now()) {
            eprintln!("{line}");
        }
    }

    /// Library loads whose target the guardian continued before lens-probe had attached.
    pub fn late_attaches(&self) -> u64 {
        self.late_attaches
    }

    /// Attaches to every library `pid` maps that is not probed yet; records its use.
    fn attach_libraries_of(&mut self, pid: u32) {
        match self.libraries_of(pid) {
            Ok(libraries) => {
                self.attacher
                    .use_libraries(pid, libraries.iter().map(|l| l.file));
                for library in &libraries {
                    if !self.attacher.is_attached(library.file) {
                        info!(
                            "pid {pid} loaded {}: attaching",
                            library.shown_path.display()
                        );
                        self.attacher
                            .attach_library(&mut self.ebpf, library, &self.groups);
                    }
                }
                self.set_runtime_ranges(pid, &libraries);
                self.sample_python(pid);
                self.probe_file_creation(pid, &libraries);
            }
            Err(error) => info!("pid {pid}: {error}"),
        }
    }

    /// Node mode: traces every training process on the host that passes `filter`, those
    /// running now (from their next step on) and those that start later (from the moment
    /// they load a training library). Returns how many were running.
    pub fn watch_node(&mut self, filter: NodeFilter) -> Result<usize> {
        set_setting(&mut self.ebpf, settings::NODE_MODE, 1)?;
        self.node = Some(filter);
        if let Some(loader) = attach::own_dynamic_loader()? {
            self.attacher
                .attach_library(&mut self.ebpf, &loader, &self.groups);
        }
        let mut found = 0;
        for pid in discovery::all_pids() {
            if pid == std::process::id() {
                continue;
            }
            let Ok(libraries) = self.libraries_of(pid) else {
                continue;
            };
            // Loaders of running processes (containers bring their own): their future
            // children's library loads are seen too.
            self.attach_new_loaders(&libraries);
            if !discovery::maps_training_library(&libraries) {
                continue;
            }
            let Ok(info) = ProcessInfo::read(pid) else {
                continue;
            };
            if self.node.as_ref().is_some_and(|f| f.matches(&info)) && self.exports(&info) {
                self.add_running_target(info, &libraries)?;
                found += 1;
            }
        }
        Ok(found)
    }

    /// Node mode: any process ran a new program; probe its dynamic loader if it is one we
    /// have not seen (a container's own `ld.so`), so its library loads are reported.
    fn on_node_exec(&mut self, pid: u32) {
        if let Ok(libraries) = library::find_libraries(pid) {
            self.attach_new_loaders(&libraries);
        }
    }

    fn attach_new_loaders(&mut self, libraries: &[MappedLibrary]) {
        for library in libraries {
            if library.kind == LibraryKind::DynamicLoader
                && !self.attacher.is_attached(library.file)
            {
                info!(
                    "new dynamic loader {}: attaching",
                    library.shown_path.display()
                );
                self.attacher
                    .attach_library(&mut self.ebpf, library, &self.groups);
            }
        }
    }

    /// Node mode: `pid` changed its libraries; trace it if it is a training process that
    /// passes the filter.
    fn consider_candidate(&mut self, pid: u32, sink: &mut dyn EventSink) {
        let libraries = match self.libraries_of(pid) {
            Ok(libraries) => libraries,
            Err(error) => {
                debug!("node: pid {pid} not considered: {error}");
                return;
            }
        };
        if !discovery::maps_training_library(&libraries) {
            debug!("node: pid {pid} maps no training library yet");
            return;
        }
        let mut info = match ProcessInfo::read(pid) {
            Ok(info) => info,
            Err(error) => {
                debug!("node: pid {pid} not considered: {error}");
                return;
            }
        };
        if !self.node.as_ref().is_some_and(|f| f.matches(&info)) {
            debug!("node: pid {pid} ({}) does not match the filter", info.name);
            return;
        }
        if !self.exports(&info) {
            return;
        }
        // Seen as it loads its first training library: its job starts here, before any of
        // its events can arrive (they flow as soon as it is in the kernel's map).
        info.traced_from_start = true;
        sink.on_process_start(&info);
        // Paused while its probes go in (milliseconds), so that its first steps are seen
        // (already, when its load came in a batch with others: `hold_candidates`).
        let stopped = self.held_candidates.remove(&pid) || target::stop(pid);
        let registered = self.add_running_target(info.clone(), &libraries);
        if stopped {
            target::resume(pid);
        }
        if let Err(error) = registered {
            // Most often: it exited in the meantime.
            info!("pid {pid}: {error}");
            sink.on_process_end(&ProcessEnd {
                pid,
                calls: BTreeMap::new(),
                exit: None,
            });
            return;
        }
        info!("node: tracing pid {pid} ({})", info.name);
    }

    fn drain(&mut self, ring: &mut RingBuf<MapData>, sink: &mut dyn EventSink) {
        // Decode in batches: the ring's items borrow it, handling needs `self`.
        loop {
            let mut batch: Vec<std::result::Result<ProbeEvent, events::DecodeError>> = Vec::new();
            while let Some(item) = ring.next() {
                batch.push(events::decode(&item));
                if batch.len() == 4096 {
                    break;
                }
            }
            if batch.is_empty() {
                return;
            }
            // Phase marks may close steps: their kernels are read first (every launch
            // before the marks has been counted by now).
            if let Some(kernels) = self.kernels.as_mut() {
                let mut marked = Vec::new();
                for event in batch.iter().flatten() {
                    if let ProbeEvent::Phase {
                        tgid,
                        epoch,
                        launches,
                        ..
                    }
                    | ProbeEvent::RuleCall {
                        tgid,
                        epoch,
                        launches,
                        ..
                    }
                    | ProbeEvent::PyStack {
                        tgid,
                        epoch,
                        launches,
                        ..
                    } = event
                    {
                        let newest = kernels.epochs.entry(*tgid).or_default();
                        *newest = (*newest).max(*epoch);
                        // Marks carry the launch total: none since the last read, nothing
                        // new to read.
                        let read = kernels.launches_read.entry(*tgid).or_default();
                        if *launches > *read {
                            *read = *launches;
                            if !marked.contains(tgid) {
                                marked.push(*tgid);
                            }
                        }
                    }
                }
                if !marked.is_empty() {
                    self.read_kernel_counts(&marked, false, sink);
                }
            }
            self.hold_candidates(&batch);
            for decoded in batch {
                match decoded {
                    Ok(ProbeEvent::LinkMapChanged {
                        tgid,
                        stopped,
                        traced,
                    }) => self.on_link_map_changed(tgid, stopped, traced, sink),
                    Ok(ProbeEvent::ProcessForked { parent, child }) => {
                        self.on_fork(parent, child, sink);
                    }
                    Ok(ProbeEvent::ProcessExec { tgid, traced: true }) => self.on_exec(tgid, sink),
                    Ok(ProbeEvent::ProcessExec {
                        tgid,
                        traced: false,
                    }) => {
                        self.on_node_exec(tgid);
                    }
                    Ok(ProbeEvent::ProcessExit { tgid, wait_status }) => {
                        if let Some(target) = self.targets.get_mut(&tgid) {
                            target.exit = Some(ExitStatus::from_wait_status(wait_status));
                        }
                    }
                    Ok(sample @ ProbeEvent::PyStack { .. }) => {
                        if let Some(tracker) = self.python.as_mut() {
                            let calls = tracker.on_sample(&sample);
                            self.deliver_rule_calls(calls, sink);
                        }
                    }
                    Ok(mut event) => {
                        self.hangs.observe(&mut event);
                        if let (Some(tracker), Some((tgid, tid, at))) =
                            (self.python.as_mut(), event.thread_start())
                        {
                            let calls = tracker.settle_framework_calls(tgid, tid, at);
                            self.deliver_rule_calls(calls, sink);
                        }
                        if let Some(caller) = self.python_caller(&event) {
                            sink.on_event(&caller);
                        }
                        sink.on_event(&event);
                    }
                    Err(error) => {
                        self.undecodable += 1;
                        warn!("undecodable event: {error:?}");
                    }
                }
            }
            // Held candidates that did not become targets go on.
            for pid in self.held_candidates.drain() {
                target::resume(pid);
            }
            if let Some(tracker) = self.python.as_mut() {
                let calls = tracker.confirm(crate::spans::monotonic_now_ns(), None);
                self.deliver_rule_calls(calls, sink);
            }
        }
    }

    /// Node mode: every new training process (matching the filter) whose library load is
    /// in `batch` is paused before any of them is attached. Attaching one takes long
    /// enough (hundreds of ms for libtorch's probes the first time) for another started
    /// beside it, a job's second rank, to run its start unseen, or its whole life (a
    /// short job: seen, one SLURM task of two missing). `consider_candidate` resumes each.
    fn hold_candidates(&mut self, batch: &[std::result::Result<ProbeEvent, events::DecodeError>]) {
        let Some(filter) = self.node.as_ref() else {
            return;
        };
        let mut hold = Vec::new();
        for event in batch.iter().flatten() {
            let ProbeEvent::LinkMapChanged {
                tgid,
                traced: false,
                ..
            } = event
            else {
                continue;
            };
            if self.targets.contains_key(tgid) || hold.contains(tgid) {
                continue;
            }
            let trains = self
                .libraries_of(*tgid)
                .is_ok_and(|libraries| discovery::maps_training_library(&libraries));
            if trains && ProcessInfo::read(*tgid).is_ok_and(|info| filter.matches(&info)) {
                hold.push(*tgid);
            }
        }
        for pid in hold {
            if target::stop(pid) {
                self.held_candidates.insert(pid);
            }
        }
    }

    /// Stops sampling `pid`'s Python threads; the calls they were in end now.
    fn forget_python(&mut self, pid: u32, sink: &mut dyn EventSink) {
        let Some(tracker) = self.python.as_mut() else {
            return;
        };
        if !tracker.knows(pid) {
            return;
        }
        python::sampler::remove_target(&mut self.ebpf, pid);
        let calls = tracker.confirm(0, Some(pid));
        self.deliver_rule_calls(calls, sink);
        if let Some(tracker) = self.python.as_mut() {
            tracker.forget(pid);
        }
    }

    /// Hands Python rule calls to `sink`, keeping the kernel's `PY_SAVING` (processes
    /// inside a framework save or load, whose collective and sync entries take a stack
    /// sample, and whose files opened during a load are counted) in step.
    fn deliver_rule_calls(&mut self, calls: Vec<ProbeEvent>, sink: &mut dyn EventSink) {
        for call in &calls {
            if let ProbeEvent::RuleCall {
                tgid,
                rule,
                at_return,
                ..
            } = call
                && let Some(role) = self.python.as_ref().and_then(|t| t.framework_role(*rule))
            {
                let was = self.saving_bits(*tgid);
                let prelude_return = *at_return && role == (true, true);
                let depths = self.saving_depth.entry(*tgid).or_default();
                // A load's preparation (DCP's `get_state_dict`) keeps its load part past
                // its return, until the process's next framework call is seen: the load
                // after it reads its first file (`.metadata`) at once, often before a
                // sample shows the load itself (the sample between may show neither).
                if !prelude_return && self.armed_loads.remove(tgid).is_some() {
                    depths[1] = depths[1].saturating_sub(1);
                }
                for (index, (depth, part)) in depths.iter_mut().zip([role.0, role.1]).enumerate() {
                    if !part || (prelude_return && index == 1) {
                        continue;
                    }
                    *depth = if *at_return {
                        depth.saturating_sub(1)
                    } else {
                        *depth + 1
                    };
                }
                if prelude_return {
                    self.armed_loads.insert(*tgid, std::time::Instant::now());
                }
                self.write_saving_bits(*tgid, was);
            }
            sink.on_event(call);
        }
    }

    /// What `PY_SAVING` says of `pid` now.
    fn saving_bits(&self, pid: u32) -> u8 {
        self.saving_depth.get(&pid).map_or(0, |d| {
            (if d[0] > 0 { saving::SAVE } else { 0 }) | (if d[1] > 0 { saving::LOAD } else { 0 })
        })
    }

    /// Tells the kernel what `pid`'s framework calls make of it, if that changed from
    /// `was`.
    fn write_saving_bits(&mut self, pid: u32, was: u8) {
        let now = self.saving_bits(pid);
        if now == 0 {
            self.saving_depth.remove(&pid);
        }
        if was != now
            && let Some(map) = self.ebpf.map_mut(maps::PY_SAVING)
            && let Ok(mut saving) = BpfHashMap::<_, u32, u8>::try_from(map)
        {
            let _ = if now != 0 {
                saving.insert(pid, now, 0)
            } else {
                saving.remove(&pid)
            };
        }
    }

    /// A preparation no load followed within a second was for something else (a save,
    /// or the job's own use of the state dict): its files are no load's.
    fn expire_armed_loads(&mut self) {
        let expired: Vec<u32> = self
            .armed_loads
            .iter()
            .filter(|(_, since)| since.elapsed() >= Duration::from_secs(1))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in expired {
            self.armed_loads.remove(&pid);
            let was = self.saving_bits(pid);
            if let Some(depths) = self.saving_depth.get_mut(&pid) {
                depths[1] = depths[1].saturating_sub(1);
            }
            self.write_saving_bits(pid, was);
        }
    }

    /// Removes `pid` from tracing and hands its counters to the sink.
    fn finish_target(&mut self, pid: u32, exit: Option<ExitStatus>, sink: &mut dyn EventSink) {
        if self.targets.remove(&pid).is_none() {
            return;
        }
        if let Ok(mut targets) = self.targets_map() {
            let _ = targets.remove(&pid);
        }
        self.forget_python(pid, sink);
        self.read_kernel_counts(&[pid], true, sink);
        self.forget_kernel_counts(pid);
        let mut calls = self.take_call_counts(pid);
        self.forget_kernel_state(pid);
        if let Some(estimate) = self.launch_estimates.remove(&pid) {
            let new = launch_total(&calls).saturating_sub(estimate.counted);
            scale_launches(&mut calls, estimate.estimated + new as f64);
        }
        // Node mode outlives its targets: probes nobody needs any more go. (Otherwise
        // lens-probe ends with its targets, and the probes with it.)
        if self.node.is_some() {
            self.attacher.release(&mut self.ebpf, pid);
        }
        self.file_probes.release(&mut self.ebpf, pid);
        self.fork_images.remove(&pid);
        if Some(pid) == self.child {
            self.child_exit = exit;
        }
        let ended = self
            .hangs
            .process_ended(pid, crate::spans::monotonic_now_ns());
        self.report_hangs(ended, sink);
        sink.on_process_end(&ProcessEnd { pid, calls, exit });
    }

    /// Drops what the kernel keeps for `pid` besides its call counters (taken by the
    /// caller): its launch total and the entries of calls it never returned from (a thread
    /// killed in a sync wait).
    fn forget_kernel_state(&mut self, pid: u32) {
        if let Ok(mut totals) = self.launch_totals_map() {
            let _ = totals.remove(&pid);
        }
        if let Some(map) = self.ebpf.map_mut(maps::STOPPED)
            && let Ok(mut stops) = BpfHashMap::<_, u32, u64>::try_from(map)
        {
            let _ = stops.remove(&pid);
        }
        self.armed_loads.remove(&pid);
        if self.saving_depth.remove(&pid).is_some()
            && let Some(map) = self.ebpf.map_mut(maps::PY_SAVING)
            && let Ok(mut saving) = BpfHashMap::<_, u32, u8>::try_from(map)
        {
            let _ = saving.remove(&pid);
        }
        if let Some(map) = self.ebpf.map_mut(maps::RUNTIME_RANGES)
            && let Ok(mut ranges) = BpfHashMap::<_, u32, CodeRanges>::try_from(map)
        {
            let _ = ranges.remove(&pid);
        }
        if let Some(map) = self.ebpf.map_mut(maps::INFLIGHT)
            && let Ok(mut inflight) = BpfHashMap::<_, InflightKey, Event>::try_from(map)
        {
            let stale: Vec<InflightKey> = inflight
                .keys()
                .filter_map(|k| k.ok())
                .filter(|k| (k.pid_tgid >> 32) as u32 == pid)
                .collect();
            for key in stale {
                let _ = inflight.remove(&key);
            }
        }
    }

    /// The calls traced threads are in now (the kernel's entries waiting for returns).
    fn inflight_calls(&self) -> Vec<hangs::InflightCall> {
        let Some(map) = self.ebpf.map(maps::INFLIGHT) else {
            return Vec::new();
        };
        let Ok(inflight) = BpfHashMap::<_, InflightKey, Event>::try_from(map) else {
            return Vec::new();
        };
        inflight
            .iter()
            .filter_map(|entry| entry.ok())
            .filter_map(|(key, event)| {
                let probe = ProbeId::from_u32(key.probe)?;
                let nccl = events::CollectiveOp::from_probe(probe).is_some();
                let bytes = crate::nccl::DataType::from_raw(event.datatype)
                    .filter(|_| nccl)
                    .map(|dtype| event.count.saturating_mul(dtype.size_bytes()));
                let collective = nccl || events::CollectiveOp::from_gloo_probe(probe).is_some();
                Some(hangs::InflightCall {
                    pid: (key.pid_tgid >> 32) as u32,
                    tid: key.pid_tgid as u32,
                    probe,
                    start_ns: event.start_ns,
                    handle: if collective { event.comm } else { 0 },
                    bytes,
                })
            })
            .collect()
    }

    /// One look for hung collectives (`--hang-timeout`).
    fn check_hangs(&mut self, sink: &mut dyn EventSink) {
        let inflight = self.inflight_calls();
        let changes = self
            .hangs
            .check(crate::spans::monotonic_now_ns(), &inflight);
        self.report_hangs(changes, sink);
    }

    /// Hangs found (with where each rank is, read now) and resolved: on the console and
    /// to the sink.
    fn report_hangs(&mut self, changes: Vec<HangChange>, sink: &mut dyn EventSink) {
        for change in changes {
            match change {
                HangChange::Found(hang) => {
                    let report = hangs::HangReport::read(hang);
                    for line in report.console_lines() {
                        eprintln!("{line}");
                    }
                    sink.on_hang(&report);
                }
                HangChange::Resolved(resolved) => {
                    eprintln!("{}", resolved.console_line());
                    sink.on_hang_resolved(&resolved);
                }
            }
        }
    }

    /// Entries in the kernel's per-process maps now: targets, calls in flight, call
    /// counters and launch totals. Bounded by the maps' sizes; all 0 once every target
    /// has ended.
    pub fn kernel_state(&self) -> KernelState {
        fn entries<K: aya::Pod, V: aya::Pod>(ebpf: &Ebpf, name: &str) -> usize {
            ebpf.map(name)
                .and_then(|map| BpfHashMap::<_, K, V>::try_from(map).ok())
                .map_or(0, |map| map.keys().count())
        }
        let call_counters = self
            .ebpf
            .map(maps::CALL_COUNTS)
            .and_then(|map| PerCpuHashMap::<_, CallKey, u64>::try_from(map).ok())
            .map_or(0, |map| map.keys().count());
        KernelState {
            targets: entries::<u32, TargetConfig>(&self.ebpf, maps::TARGETS),
            inflight: entries::<InflightKey, Event>(&self.ebpf, maps::INFLIGHT),
            call_counters,
            launch_totals: entries::<u32, LaunchTotals>(&self.ebpf, maps::LAUNCH_TOTALS),
            kernel_counters: entries::<KernelKey, u64>(&self.ebpf, maps::KERNEL_COUNTS),
            runtime_ranges: entries::<u32, CodeRanges>(&self.ebpf, maps::RUNTIME_RANGES),
        }
    }

    /// Every target's call counters so far (kept in the kernel).
    fn call_counts(&mut self) -> BTreeMap<u32, BTreeMap<ProbeId, u64>> {
        let mut by_pid: BTreeMap<u32, BTreeMap<ProbeId, u64>> = BTreeMap::new();
        let Some(map) = self.ebpf.map(maps::CALL_COUNTS) else {
            return by_pid;
        };
        let Ok(counts) = PerCpuHashMap::<_, CallKey, u64>::try_from(map) else {
            return by_pid;
        };
        for key in counts.keys().filter_map(|k| k.ok()) {
            if !self.targets.contains_key(&key.tgid) {
                continue;
            }
            if let (Ok(values), Some(probe)) = (counts.get(&key, 0), ProbeId::from_u32(key.probe)) {
                by_pid
                    .entry(key.tgid)
                    .or_default()
                    .insert(probe, values.iter().sum());
            }
        }
        by_pid
    }

    fn take_call_counts(&mut self, pid: u32) -> BTreeMap<ProbeId, u64> {
        let mut calls = BTreeMap::new();
        let Some(map) = self.ebpf.map_mut(maps::CALL_COUNTS) else {
            return calls;
        };
        let Ok(mut counts) = PerCpuHashMap::<_, CallKey, u64>::try_from(map) else {
            return calls;
        };
        let keys: Vec<CallKey> = counts
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| k.tgid == pid)
            .collect();
        for key in keys {
            if let (Ok(values), Some(probe)) = (counts.get(&key, 0), ProbeId::from_u32(key.probe)) {
                calls.insert(probe, values.iter().sum());
            }
            let _ = counts.remove(&key);
        }
        calls
    }

    /// Tells the sink about targets whose launches began or stopped being counted (their
    /// libraries' launch probes went in or out).
    fn sync_launch_counting(&mut self, sink: &mut dyn EventSink) {
        let now = crate::spans::monotonic_now_ns();
        let sampled = self.budget.is_some();
        for (pid, target) in &mut self.targets {
            let counted = self.attacher.counts_launches(*pid);
            if counted != target.launches_counted {
                // A process traced from its start had its libraries probed as they loaded,
                // before any launch: its count starts with it.
                let since = if counted && !target.launches_seen && target.info.traced_from_start {
                    0
                } else {
                    now
                };
                target.launches_counted = counted;
                target.launches_seen |= counted;
                sink.on_launch_counting(*pid, counted, since, sampled);
            }
        }
    }

    /// One tick of the overhead budget: feed it the launch counters, move the launch
    /// probes as it says, and hand the sinks launch totals with the pauses estimated.
    fn budget_tick(&mut self, sink: &mut dyn EventSink) {
        if self.budget.is_none() {
            return;
        }
        let counts = self.call_counts();
        // What the probes cost is per hit: with the driver probed, a runtime launch hits
        // twice (its own probe, then the driver's, which leaves the count to the runtime).
        let hits: HashMap<u32, u64> = counts
            .iter()
            .map(|(pid, calls)| {
                let through_driver = if self.attacher.probes_driver(*pid) {
                    runtime_launches(calls)
                } else {
                    0
                };
                (*pid, launch_total(calls) + through_driver)
            })
            .collect();
        let Some((controller, started)) = self.budget.as_mut() else {
            return;
        };
        let started = *started;
        let now = crate::spans::monotonic_now_ns();
        let launches: HashMap<u32, u64> = counts
            .iter()
            .map(|(pid, calls)| (*pid, launch_total(calls)))
            .collect();
        let was_in = controller.probes_in();
        let elapsed = (now - started) as f64 / 1e9;
        let action = controller.tick(elapsed, &hits);
        log::debug!("overhead budget at {elapsed:.2}s: launches {launches:?} → {action:?}");
        let tick = crate::budget::TICK.as_secs_f64();
        for (pid, total) in &launches {
            let estimate = self.launch_estimates.entry(*pid).or_default();
            let new = total.saturating_sub(estimate.counted);
            estimate.counted = *total;
            if was_in {
                estimate.rate = new as f64 / tick;
                estimate.estimated += new as f64;
            } else {
                estimate.estimated += estimate.rate * tick;
            }
        }
        match action {
            Action::Keep => {}
            Action::Detach => {
                // Said before they go: a span ending after this is not fully counted.
                for (pid, target) in &mut self.targets {
                    if target.launches_counted {
                        target.launches_counted = false;
                        sink.on_launch_counting(*pid, false, now, true);
                    }
                }
                let moved = self.attacher.set_launch_probes(&mut self.ebpf, false);
                info!("overhead budget: {moved} launch probes out");
            }
            Action::Attach => {
                let moved = self.attacher.set_launch_probes(&mut self.ebpf, true);
                info!("overhead budget: {moved} launch probes in for a sampled window");
                self.sync_launch_counting(sink);
            }
        }
        for (pid, mut calls) in counts {
            if let Some(estimate) = self.launch_estimates.get(&pid) {
                scale_launches(&mut calls, estimate.estimated);
            }
            sink.on_call_counts(pid, &calls);
        }
    }

    fn losses(&self) -> Losses {
        let mut losses = Losses {
            undecodable: self.undecodable,
            ..Losses::default()
        };
        if let Some(map) = self.ebpf.map(maps::LOSSES)
            && let Ok(array) = PerCpuArray::<_, u64>::try_from(map)
        {
            for cause in LossCause::ALL {
                let total = array
                    .get(&(cause as u32), 0)
                    .map(|values| values.iter().sum())
                    .unwrap_or(0);
                losses.kernel.insert(cause.name(), total);
            }
        }
        losses
    }

    /// Pumps events into `sink` until every target exited, SIGINT/SIGTERM, or `limit`.
    pub async fn run(
        &mut self,
        sink: &mut dyn EventSink,
        limit: Option<Duration>,
    ) -> Result<RunReport> {
        let mut ring = register(self.ring.take().expect("run is called once"))?;
        self.raise_priority();
        let mut logger = match self.logger.take() {
            Some(logger) => Some(register(logger)?),
            None => None,
        };

        let (exit_tx, mut exit_rx) = mpsc::unbounded_channel::<u32>();
        self.exit_tx = Some(exit_tx);
        let mut pids: Vec<u32> = self.targets.keys().copied().collect();
        pids.sort_unstable();
        for pid in pids {
            let Some(target) = self.targets.get_mut(&pid) else {
                continue;
            };
            self.hangs
                .process_started(&target.info, target.info.traced_from_start);
            sink.on_process_start(&target.info);
            if let Some(pidfd) = target.pidfd.take() {
                self.watch_exit(pid, pidfd)?;
            }
        }

        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        // Handlers in place: a stop signal held since start-up is delivered now.
        target::release_stop_signals();
        let deadline = limit.map(|limit| tokio::time::Instant::now() + limit);
        let mut tick = tokio::time::interval(DRAIN_INTERVAL);
        let mut counts_tick = tokio::time::interval(CALL_COUNTS_INTERVAL);
        let mut budget_tick = tokio::time::interval(crate::budget::TICK);
        let mut hang_tick = tokio::time::interval(hangs::CHECK_INTERVAL);
        hang_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Ticks missed while the loop was busy are not made up in a burst: the controller
        // measures rates over the time that really passed.
        budget_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.sync_launch_counting(sink);
        let mut stop: Option<StopReason> = None;
        let mut grace_deadline: Option<tokio::time::Instant> = None;

        loop {
            // Node mode watches for new processes until told to stop.
            if self.targets.is_empty() && self.node.is_none() {
                stop.get_or_insert(StopReason::TargetsExited);
                break;
            }
            let grace = async {
                match grace_deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let until_deadline = async {
                match deadline {
                    Some(at) if stop.is_none() => tokio::time::sleep_until(at).await,
                    _ => std::future::pending().await,
                }
            };
            let log_ready = async {
                match logger.as_mut() {
                    Some(logger) => logger.readable_mut().await.map(|mut g| {
                        g.get_inner_mut().flush();
                        g.clear_ready();
                    }),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                guard = ring.readable_mut() => {
                    let mut guard = guard?;
                    self.drain(guard.get_inner_mut(), sink);
                    guard.clear_ready();
                }
                _ = tick.tick() => {
                    self.drain(ring.get_mut(), sink);
                    self.print_attach_status();
                    self.expire_armed_loads();
                }
                // Under a budget its tick reads the counters (and scales the launches).
                _ = counts_tick.tick(), if self.budget.is_none() => {
                    for (pid, calls) in self.call_counts() {
                        sink.on_call_counts(pid, &calls);
                    }
                }
                _ = budget_tick.tick(), if self.budget.is_some() => self.budget_tick(sink),
                _ = hang_tick.tick(), if self.hangs.watching() => {
                    self.drain(ring.get_mut(), sink);
                    self.check_hangs(sink);
                }
                _ = log_ready => {}
                Some(pid) = exit_rx.recv() => {
                    self.drain(ring.get_mut(), sink);
                    let exit = match self.targets.get(&pid) {
                        Some(t) if t.own_child => wait_child(pid).await,
                        Some(t) => Some(t.exit.unwrap_or(ExitStatus::Unknown)),
                        None => Some(ExitStatus::Unknown),
                    };
                    self.finish_target(pid, exit, sink);
                }
                _ = sigint.recv() => self.on_signal(libc::SIGINT, &mut stop, &mut grace_deadline),
                _ = sigterm.recv() => self.on_signal(libc::SIGTERM, &mut stop, &mut grace_deadline),
                _ = until_deadline => {
                    stop = Some(StopReason::Duration);
                    break;
                }
                _ = grace => break,
            }
            // Libraries attached while draining may have put launch probes in.
            self.sync_launch_counting(sink);
            if stop.is_some() && grace_deadline.is_none() {
                break;
            }
            if stop.is_some() && !self.targets.values().any(|t| t.own_child) {
                break;
            }
        }

        self.drain(ring.get_mut(), sink);
        let remaining: Vec<u32> = self.targets.keys().copied().collect();
        for pid in remaining {
            // Never leave a child of ours stopped at a library load.
            if self.targets.get(&pid).is_some_and(|t| t.own_child) {
                target::resume(pid);
            }
            self.finish_target(pid, None, sink);
        }
        self.ring = Some(ring.into_inner());
        self.exit_tx = None;
        let budget = self.budget.as_ref().map(|(controller, started)| {
            controller.report((crate::spans::monotonic_now_ns() - started) as f64 / 1e9)
        });
        Ok(RunReport {
            stop: stop.unwrap_or(StopReason::TargetsExited),
            losses: self.losses(),
            child_exit: self.child_exit,
            budget,
        })
    }

    /// [`Session::run`] on a single-threaded runtime of its own, for callers that are not
    /// async (the CLI, tests).
    pub fn run_blocking(
        &mut self,
        sink: &mut dyn EventSink,
        limit: Option<Duration>,
    ) -> Result<RunReport> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(self.run(sink, limit))
    }

    /// SIGINT/SIGTERM: pass it on to the children we started and give them a grace
    /// period to exit (their exit is then traced); processes we attached to are left alone.
    fn on_signal(
        &mut self,
        signal: i32,
        stop: &mut Option<StopReason>,
        grace_deadline: &mut Option<tokio::time::Instant>,
    ) {
        if stop.is_some() {
            return;
        }
        *stop = Some(StopReason::Signal(signal));
        let children: Vec<u32> = self
            .targets
            .iter()
            .filter(|(_, t)| t.own_child)
            .map(|(pid, _)| *pid)
            .collect();
        for pid in &children {
            // SAFETY: plain signal send to our own child.
            unsafe { libc::kill(*pid as libc::pid_t, signal) };
            target::resume(*pid);
        }
        if !children.is_empty() {
            *grace_deadline = Some(tokio::time::Instant::now() + CHILD_EXIT_GRACE);
        }
    }
}

fn launch_total(calls: &BTreeMap<ProbeId, u64>) -> u64 {
    calls
        .iter()
        .filter(|(probe, _)| probe.is_launch())
        .map(|(_, count)| count)
        .sum()
}

/// Launches made through libcudart (each of which also enters the driver's launch).
fn runtime_launches(calls: &BTreeMap<ProbeId, u64>) -> u64 {
    calls
        .iter()
        .filter(|(probe, _)| probe.is_launch() && !probe.is_driver_launch())
        .map(|(_, count)| count)
        .sum()
}

/// Scales the launch counters so that they add up to `estimated` (kinds keep their shares).
fn scale_launches(calls: &mut BTreeMap<ProbeId, u64>, estimated: f64) {
    let counted = launch_total(calls);
    if counted == 0 {
        return;
    }
    let factor = estimated / counted as f64;
    for (probe, count) in calls.iter_mut() {
        if probe.is_launch() {
            *count = (*count as f64 * factor).round() as u64;
        }
    }
}

/// The kernel's hash map `name`, typed.
fn hash_map_mut<'a, K: aya::Pod, V: aya::Pod>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<BpfHashMap<&'a mut MapData, K, V>> {
    let map = ebpf
        .map_mut(name)
        .ok_or(LensError::MissingInObject { kind: "map", name })?;
    BpfHashMap::try_from(map).map_err(|source| LensError::Map { map: name, source })
}

/// Sets one of the run-wide switches (`lens_common::settings`).
fn set_setting(ebpf: &mut Ebpf, index: u32, value: u32) -> Result<()> {
    let map = ebpf
        .map_mut(maps::SETTINGS)
        .ok_or(LensError::MissingInObject {
            kind: "map",
            name: maps::SETTINGS,
        })?;
    let mut settings_map: BpfArray<&mut MapData, u32> =
        BpfArray::try_from(map).map_err(|source| LensError::Map {
            map: maps::SETTINGS,
            source,
        })?;
    settings_map
        .set(index, value, 0)
        .map_err(|source| LensError::Map {
            map: maps::SETTINGS,
            source,
        })
}

/// Registers an fd-owning value with the runtime's reactor.
fn register<T: std::os::fd::AsRawFd>(inner: T) -> std::io::Result<AsyncFd<T>> {
    // SAFETY: every `T` here (ring buffer, logger, pidfd) owns its fd and keeps it open
    // and unchanged for as long as it lives inside the AsyncFd.
    unsafe { AsyncFd::register(inner) }.map_err(|error| error.into_parts().1)
}

/// The pidfd said our child is gone; reap it (it may take a moment to become waitable).
async fn wait_child(pid: u32) -> Option<ExitStatus> {
    for _ in 0..200 {
        if let Some(status) = target::try_wait_child(pid) {
            return Some(status);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// The event loop's thread runs at a higher priority than the jobs it traces while the
/// session lasts (nice `EVENT_LOOP_NICE`, restored after). On a node whose cores the job keeps
/// busy, a loop at the job's priority falls seconds behind: Python stacks are named from
/// the target's memory when they are read, and a process that ended meanwhile took its
/// names with it (a save just before a job's end went unseen). The loop's CPU time is
/// what its events cost, whatever its priority; only when it runs changes.
struct EventLoopPriority {
    tid: libc::id_t,
    was: libc::c_int,
}

const EVENT_LOOP_NICE: libc::c_int = -5;

impl EventLoopPriority {
    fn raise() -> Option<EventLoopPriority> {
        // SAFETY: plain system calls on this thread's own scheduling priority.
        unsafe {
            let tid = libc::gettid() as libc::id_t;
            *libc::__errno_location() = 0;
            let was = libc::getpriority(libc::PRIO_PROCESS, tid);
            if *libc::__errno_location() != 0 || was <= EVENT_LOOP_NICE {
                return None;
            }
            if libc::setpriority(libc::PRIO_PROCESS, tid, EVENT_LOOP_NICE) != 0 {
                debug!(
                    "the event loop keeps nice {was}: {}",
                    std::io::Error::last_os_error()
                );
                return None;
            }
            Some(EventLoopPriority { tid, was })
        }
    }
}

impl Drop for EventLoopPriority {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, self.tid, self.was) };
    }
}
