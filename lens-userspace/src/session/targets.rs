//! Following targets: processes attached by pid or started with `--exec`, followed
//! through fork, exec and library loads (the attaching; `target_table` keeps what is
//! known of each), and finished when they exit.
use std::{ffi::OsString, os::fd::OwnedFd};

use log::{info, warn};

use crate::{
    attach_status::{AttachStatus, Traced},
    discovery::{self},
    error::{LensError, Result},
    probes::attach::{self},
    python,
    sink::{EventSink, ProcessEnd},
    sys::{
        library::{self, LibraryKind, MappedLibrary},
        target::{self, ExitStatus, ProcessInfo},
    },
};

use super::counters::{add_call_counts, captured_launches};
use super::event_loop::register;
use super::{
    Session,
    target_table::{Arrival, TargetTable},
};

impl Session {
    /// Counts the files `pid` creates (for checkpoints) if it maps what writes them
    /// (libtorch, safetensors) and is no fork running its parent's program: compilers,
    /// linkers and data workers create files too, and get no probes.
    pub(super) fn probe_file_creation(&mut self, pid: u32, libraries: &[MappedLibrary]) {
        let writes_checkpoints = libraries
            .iter()
            .any(|l| matches!(l.kind, LibraryKind::TorchCpu | LibraryKind::Safetensors));
        if writes_checkpoints && !self.probes.fork_images.contains(&pid) {
            self.probes
                .files
                .attach(&mut self.bpf.programs, pid, &self.groups);
        }
    }

    /// The libraries of interest `pid` maps: the built-in probes' and the files
    /// configured rules name.
    pub(super) fn libraries_of(&self, pid: u32) -> Result<Vec<MappedLibrary>> {
        library::find_libraries_with(pid, &|path| {
            self.probes.attacher.is_configured_library(path)
        })
    }

    pub(super) fn exports(&self, info: &ProcessInfo) -> bool {
        let exports = self.selection.export_strategy.exports(info.rank.as_ref());
        if !exports {
            warn!(
                "pid {} ({}, rank {}) does not export under {}: not traced",
                info.pid,
                info.name,
                info.rank.map_or(0, |r| r.rank),
                self.selection.export_strategy
            );
        }
        exports
    }

    /// Attaches to the libraries `pid` maps now; later loads are caught by the dynamic
    /// loader probe. Fails when the process maps neither libcudart nor libnccl.
    pub fn attach_pid(&mut self, pid: u32) -> Result<()> {
        if self.targets.contains(pid) {
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
    pub(super) fn traceable(&self, pid: u32, libraries: &[MappedLibrary]) -> bool {
        discovery::maps_training_library(libraries)
            || libraries.iter().any(|l| l.kind == LibraryKind::Configured)
            || (self.python.has_configured_rules()
                && matches!(python::find_runtime(pid), Ok(Some(_))))
    }

    /// Makes running process `info` (which maps `libraries`) a target: its libraries
    /// probed, then it enters the kernel's map, then its exit is watched. Armed last, so
    /// the first step boundary it reports is one all of whose signals are seen.
    pub(super) fn add_running_target(
        &mut self,
        info: ProcessInfo,
        libraries: &[MappedLibrary],
    ) -> Result<()> {
        let pid = info.pid;
        let pidfd = target::pidfd_open(pid)?;
        self.guard(pid);
        self.probes
            .attacher
            .attach_libraries(&mut self.bpf.programs, pid, libraries, &self.groups);
        self.set_runtime_ranges(pid, libraries);
        if self.python.sample(pid, &mut self.bpf.maps.python) {
            self.python.libraries_mapped(pid, libraries);
        }
        self.probe_file_creation(pid, libraries);
        self.set_target(pid, 0)?;
        // Before `run` the exit watch starts there; during it, here.
        let pidfd = match self.events.exit_tx {
            Some(_) => {
                self.watch_exit(pid, pidfd)?;
                None
            }
            None => Some(pidfd),
        };
        self.targets.add(
            info,
            Arrival::Attached(pidfd),
            crate::spans::monotonic_now_ns(),
        );
        Ok(())
    }

    /// Starts `argv` traced from its first instruction: the child waits at a gate until it
    /// is registered, and is stopped at each library load until the probes for the new
    /// libraries are attached. Returns its pid.
    pub fn exec(&mut self, argv: &[OsString]) -> Result<u32> {
        // The child will use (nearly always) the same dynamic loader file as we do.
        if let Some(loader) = attach::own_dynamic_loader()? {
            self.probes
                .attacher
                .attach_loader(&mut self.bpf.programs, &loader, &self.groups);
        }
        let gated = target::spawn_gated(argv)?;
        let pid = gated.pid;
        self.guard(pid);
        self.set_target(pid, TargetTable::STARTED_FLAGS)?;
        let pidfd = target::pidfd_open(pid)?;
        if let Err(error) = gated.release() {
            self.bpf.maps.targets.remove(&pid);
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
        self.targets.add(
            info,
            Arrival::Started(pidfd),
            crate::spans::monotonic_now_ns(),
        );
        Ok(pid)
    }

    /// Reports the exit of `pid` to `run` once its pidfd becomes readable.
    pub(super) fn watch_exit(&self, pid: u32, pidfd: OwnedFd) -> Result<()> {
        let Some(exit_tx) = self.events.exit_tx.clone() else {
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
    pub(super) fn on_fork(&mut self, parent: u32, child: u32, sink: &mut dyn EventSink) {
        self.guard(child);
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
                sink.on_process_start(&info);
                self.targets.add(
                    info,
                    Arrival::Forked { parent },
                    crate::spans::monotonic_now_ns(),
                );
                // It maps what its parent mapped.
                self.probes.fork_images.insert(child);
                self.attach_libraries_of(child);
            }
            // Gone already (a short-lived helper): nothing to trace.
            Err(_) => {
                self.bpf.maps.targets.remove(&child);
            }
        }
    }

    /// A traced process runs a new program: tell the sinks what it is now.
    pub(super) fn on_exec(&mut self, pid: u32, sink: &mut dyn EventSink) {
        self.probes.fork_images.remove(&pid);
        // A fork handled before its exec (torchrun's python starting a worker) was given
        // its parent's interpreter: the new program's is elsewhere (another load
        // address), found again at its library loads.
        self.python.forget(pid, &mut self.bpf.maps.python, sink);
        // Its libraries are new, its kernels too. (Its launch total and epochs run on from
        // the old program's: spans take differences between marks, and the kernel keeps
        // counting without a moment in which a launch could be missed.)
        self.forget_kernel_counts(pid);
        self.bpf.maps.launches.runtime_ranges.remove(&pid);
        if !self.targets.contains(pid) {
            return;
        }
        if let Ok(info) = ProcessInfo::read(pid) {
            // A new job in the sinks: told afresh whether launches are counted.
            let Some(info) = self.targets.executed(pid, info).cloned() else {
                return;
            };
            self.hangs.process_started(&info, true);
            sink.on_process_exec(&info);
            if !self.exports(&info) {
                self.finish_target(pid, None, sink);
            } else {
                // A program with the interpreter inside (a static python) maps it now;
                // a libpython is found at the library loads that follow.
                self.python.sample(pid, &mut self.bpf.maps.python);
            }
        }
    }

    /// New libraries in `pid`: attach to them, then let a stopped process go on. In node
    /// mode an untraced process that now maps a training library may become a target.
    pub(super) fn on_link_map_changed(
        &mut self,
        pid: u32,
        stopped: bool,
        traced: bool,
        sink: &mut dyn EventSink,
    ) {
        if self.targets.contains(pid) {
            self.attach_libraries_of(pid);
        } else if !traced && self.selection.node.is_some() {
            self.consider_candidate(pid, sink);
        }
        if stopped {
            self.resume_from_load(pid);
        }
    }

    /// Lets `pid`, stopped at a library load, go on. If its stop is no longer in the
    /// kernel's map, the guardian ended it first (lens-probe was held up past
    /// `guardian::MAX_HOLD`): what loaded then was attached late, and is counted.
    pub(super) fn resume_from_load(&mut self, pid: u32) {
        let removed = self.bpf.maps.stopped.remove(&pid);
        // One line per process (a process loading many libraries stops at each), all counted.
        if !removed {
            self.stops.late_attaches += 1;
        }
        if !removed && self.stops.late_warned.insert(pid) {
            warn!(
                "pid {pid} waited over {} ms at a library load: lens-probe's guardian let it \
                 go on, and its new library's first calls were not seen (attached late)",
                crate::sys::guardian::MAX_HOLD.as_millis()
            );
        }
        target::resume(pid);
    }

    /// Prints a line on stderr when what is traced changes (`attach_status`): the
    /// seconds of a job's start, spent attaching, are not silent.
    pub fn show_attach_status(&mut self) {
        self.events.attach_status = Some(AttachStatus::default());
    }

    pub(super) fn print_attach_status(&mut self) {
        let Some(status) = self.events.attach_status.as_mut() else {
            return;
        };
        // The dynamic loader's probe is how lens-probe follows library loads, not what
        // the job is traced in.
        let traced_in = || {
            self.probes
                .attacher
                .attachments()
                .iter()
                .filter(|a| a.library.kind != LibraryKind::DynamicLoader)
        };
        // Probes go in per process: a file several processes map is one library.
        let files: std::collections::HashSet<_> = traced_in().map(|a| a.library.file).collect();
        let traced = Traced {
            processes: self.targets.len(),
            libraries: files.len(),
            uprobes: traced_in().map(|a| a.attached().count()).sum(),
            links: traced_in().map(|a| a.kernel_links).sum(),
        };
        if let Some(line) = status.due(traced, std::time::Instant::now()) {
            crate::say!("{line}");
        }
    }

    /// Library loads whose target the guardian continued before lens-probe had attached.
    pub fn late_attaches(&self) -> u64 {
        self.stops.late_attaches
    }

    /// Attaches to every library `pid` maps that is not probed yet; records its use.
    pub(super) fn attach_libraries_of(&mut self, pid: u32) {
        match self.libraries_of(pid) {
            Ok(libraries) => {
                self.probes.attacher.attach_libraries(
                    &mut self.bpf.programs,
                    pid,
                    &libraries,
                    &self.groups,
                );
                self.set_runtime_ranges(pid, &libraries);
                if self.python.sample(pid, &mut self.bpf.maps.python) {
                    self.python.libraries_mapped(pid, &libraries);
                }
                self.probe_file_creation(pid, &libraries);
            }
            Err(error) => info!("pid {pid}: {error}"),
        }
    }

    /// Removes `pid` from tracing and hands its counters to the sink.
    pub(super) fn finish_target(
        &mut self,
        pid: u32,
        exit: Option<ExitStatus>,
        sink: &mut dyn EventSink,
    ) {
        let Some(target) = self.targets.remove(pid, exit) else {
            return;
        };
        // Its call counters go with its entry: read before it is removed.
        let entry = self.take_target_entry(pid);
        self.python.forget(pid, &mut self.bpf.maps.python, sink);
        if let Some(kernels) = self.gpu.kernels.as_mut() {
            kernels.read(&[pid], true, &mut self.bpf.maps.launches, sink);
        }
        self.forget_kernel_counts(pid);
        self.gpu.memory.forget(pid);
        let mut calls = std::collections::BTreeMap::new();
        add_call_counts(&mut calls, entry.as_ref());
        let captured = captured_launches(entry.as_ref());
        let runtime_driver_hits = entry.as_ref().map_or(0, |entry| entry.runtime_driver_hits);
        // A captured launch was a probe hit too.
        let mut hits = calls.clone();
        for (probe, count) in &captured {
            *hits.entry(*probe).or_default() += count;
        }
        let cost = self.probe_cost(&target, &hits, runtime_driver_hits);
        self.forget_kernel_state(pid);
        self.costs.process_ended(pid, &mut calls);
        // Node mode outlives its targets: probes nobody needs any more go. (Otherwise
        // lens-probe ends with its targets, and the probes with it.)
        if self.selection.node.is_some() {
            self.probes.attacher.release(&mut self.bpf.programs, pid);
        }
        self.probes.files.release(&mut self.bpf.programs, pid);
        self.probes.fork_images.remove(&pid);
        let ended = self
            .hangs
            .process_ended(pid, crate::spans::monotonic_now_ns());
        self.report_hangs(ended, sink);
        sink.on_probe_cost(pid, cost);
        sink.on_process_end(&ProcessEnd {
            pid,
            calls,
            captured,
            exit,
        });
    }
}

impl Session {
    /// Forgets `pid`'s per-kernel counters (it ended, or runs a new program whose
    /// kernels are new), in the kernel and in the component that reads them. (Without the
    /// `step` group the probes count none.)
    fn forget_kernel_counts(&mut self, pid: u32) {
        if let Some(kernels) = self.gpu.kernels.as_mut() {
            kernels.forget(pid, &mut self.bpf.maps.launches);
        }
    }
}
