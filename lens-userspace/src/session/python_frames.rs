//! Python frames, as a component: the stack tracker (Python rules: sampled stacks become
//! rule calls, and the Python caller of a probed call is named) and which processes are
//! inside a framework save or load. It owns both; the kernel's side (`PY_TARGETS`,
//! `PY_SAVING`) comes in through [`PythonMaps`], which it keeps in step with them.
use log::{info, warn};

use crate::{
    bpf::maps::PythonMaps,
    events::{PhaseSignal, ProbeEvent, PythonCaller, TorchScope},
    python::{self, PythonTracker, sampler::Sampler},
    sink::EventSink,
    sys::library::MappedLibrary,
};

use super::framework_saves::{FrameworkRole, FrameworkSaves};

/// Python stacks and what the session makes of framework calls.
#[derive(Default)]
pub(super) struct PythonFrames {
    /// Python rules: their sampled stacks become rule calls (`python`), and the sampler
    /// that takes them; none while no rule is configured or the sampler could not start.
    tracker: Option<(PythonTracker, Sampler)>,
    /// Which processes are inside a framework save or load (what `PY_SAVING` says).
    saves: FrameworkSaves,
}

impl PythonFrames {
    /// Python stacks are sampled from now on, for `tracker`'s rules.
    pub(super) fn start(&mut self, tracker: PythonTracker, sampler: Sampler) {
        self.tracker = Some((tracker, sampler));
    }

    fn tracker(&self) -> Option<&PythonTracker> {
        self.tracker.as_ref().map(|(tracker, _)| tracker)
    }

    fn tracker_mut(&mut self) -> Option<&mut PythonTracker> {
        self.tracker.as_mut().map(|(tracker, _)| tracker)
    }

    /// Whether rules of the user's own (not only the built-in framework ones) are
    /// sampled for: a process running CPython is then worth tracing by itself.
    pub(super) fn has_configured_rules(&self) -> bool {
        self.tracker().is_some_and(PythonTracker::has_configured)
    }

    /// Python rules that no traced process called, one line each (after a run).
    pub(super) fn unmatched_rules(&self) -> Vec<String> {
        self.tracker()
            .map_or_else(Vec::new, PythonTracker::unmatched)
    }

    /// Samples `pid`'s Python threads if it runs a CPython and Python rules exist.
    /// Returns whether it does.
    pub(super) fn sample(&mut self, pid: u32, maps: &mut PythonMaps) -> bool {
        let Some((tracker, sampler)) = self.tracker.as_mut() else {
            return false;
        };
        if tracker.knows(pid) {
            return true;
        }
        match python::find_runtime(pid) {
            Ok(Some(runtime)) => {
                let rate = tracker.rate(pid);
                let sampled = maps.add_target(pid, &runtime.offsets).and_then(|()| {
                    sampler.add(pid, rate).map_err(|error| {
                        maps.remove_target(pid);
                        crate::error::LensError::Io(error)
                    })
                });
                match sampled {
                    Ok(()) => {
                        info!(
                            "pid {pid} runs CPython {}.{} ({}): sampling its Python stacks \
                             ({rate:?})",
                            runtime.version.0,
                            runtime.version.1,
                            runtime.path.display()
                        );
                        tracker.add_process(pid, runtime.code);
                        true
                    }
                    // It ended while its threads were listed.
                    Err(_) if !crate::sys::process::Process::new(pid).has_thread(pid) => false,
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

    /// `pid`, sampled, maps `libraries`: some say its stacks are to be sampled closely.
    pub(super) fn libraries_mapped(&mut self, pid: u32, libraries: &[MappedLibrary]) {
        let Some(tracker) = self.tracker_mut() else {
            return;
        };
        for library in libraries {
            tracker.library_mapped(pid, library.kind);
        }
        self.change_rates();
    }

    /// Stops sampling `pid`'s Python threads; the calls they were in end now.
    pub(super) fn forget(&mut self, pid: u32, maps: &mut PythonMaps, sink: &mut dyn EventSink) {
        let Some((tracker, sampler)) = self.tracker.as_mut() else {
            return;
        };
        if !tracker.knows(pid) {
            return;
        }
        sampler.remove(pid);
        maps.remove_target(pid);
        let calls = tracker.confirm(0, Some(pid));
        self.deliver(calls, maps, sink);
        if let Some(tracker) = self.tracker_mut() {
            tracker.forget(pid);
        }
    }

    /// `pid` saves and loads nothing any more (it ended, or its entries in the kernel go).
    pub(super) fn forget_saves(&mut self, pid: u32) {
        self.saves.forget(pid);
    }

    /// A stack sample: the rule calls it opens or closes go to `sink`.
    pub(super) fn on_sample(
        &mut self,
        sample: &ProbeEvent,
        maps: &mut PythonMaps,
        sink: &mut dyn EventSink,
    ) {
        if let Some(tracker) = self.tracker_mut() {
            let calls = tracker.on_sample(sample);
            if let ProbeEvent::PyStack { tgid, .. } = sample {
                for (code, ruled) in tracker.take_named(*tgid) {
                    maps.code_named(*tgid, code, ruled);
                }
                self.change_rates();
            }
            self.deliver(calls, maps, sink);
        }
    }

    /// Any other event: a call that begins on a thread settles the framework calls the
    /// thread's samples left open, and a collective or sync has its Python caller named,
    /// in the event itself, before any sink sees it.
    pub(super) fn on_event(
        &mut self,
        event: &mut ProbeEvent,
        maps: &mut PythonMaps,
        sink: &mut dyn EventSink,
    ) {
        if let (Some(tracker), Some((tgid, tid, at))) = (self.tracker_mut(), event.thread_start()) {
            let mut calls = tracker.settle_framework_calls(tgid, tid, at);
            if let ProbeEvent::Phase {
                launches,
                epoch,
                signal:
                    PhaseSignal::BackwardStart
                    | PhaseSignal::ScopeEnter {
                        scope: TorchScope::DataLoaderNext,
                        ..
                    },
                ..
            } = event
            {
                calls.extend(tracker.end_framework_calls(tgid, tid, at, *launches, *epoch));
            }
            self.deliver(calls, maps, sink);
        }
        self.name_caller(event);
    }

    /// After a batch: rule calls whose end is now certain go to `sink`.
    pub(super) fn confirm(&mut self, now_ns: u64, maps: &mut PythonMaps, sink: &mut dyn EventSink) {
        if let Some(tracker) = self.tracker_mut() {
            let calls = tracker.confirm(now_ns, None);
            tracker.expire_follows(now_ns);
            self.deliver(calls, maps, sink);
            self.change_rates();
        }
    }

    /// Processes whose threads are to be sampled at another rate (`python::follow`) are
    /// from now on.
    fn change_rates(&mut self) {
        let Some((tracker, sampler)) = self.tracker.as_mut() else {
            return;
        };
        for (pid, rate) in tracker.take_rate_changes() {
            match sampler.set_rate(pid, rate) {
                Ok(()) => log::debug!("pid {pid}: Python stacks sampled at {rate:?}"),
                Err(error) => {
                    warn!("pid {pid}: cannot sample its Python threads at {rate:?}: {error}")
                }
            }
        }
    }

    /// Load preparations no load followed: their processes load no more.
    pub(super) fn expire_armed_loads(&mut self, maps: &mut PythonMaps) {
        for (pid, bits) in self.saves.expire(std::time::Instant::now()) {
            maps.set_saving(pid, bits);
        }
    }

    fn name_caller(&mut self, event: &mut ProbeEvent) {
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
            return;
        };
        let PythonCaller::Code(code) = *python_caller else {
            return;
        };
        if let Some((function, file)) = self
            .tracker_mut()
            .and_then(|python| python.name_code(timing.tgid, code))
        {
            *python_caller = PythonCaller::Named { function, file };
        }
    }

    /// Hands Python rule calls to `sink`, keeping the kernel's `PY_SAVING` (processes
    /// inside a framework save or load, whose collective and sync entries take a stack
    /// sample, and whose files opened during a load are counted) in step.
    fn deliver(&mut self, calls: Vec<ProbeEvent>, maps: &mut PythonMaps, sink: &mut dyn EventSink) {
        for call in &calls {
            if let ProbeEvent::RuleCall {
                tgid,
                rule,
                at_return,
                ..
            } = call
                && let Some(role) = self.tracker().and_then(|t| t.framework_role(*rule))
            {
                let role = FrameworkRole {
                    save: role.0,
                    load: role.1,
                };
                if let Some(bits) =
                    self.saves
                        .call(*tgid, role, *at_return, std::time::Instant::now())
                {
                    maps.set_saving(*tgid, bits);
                }
            }
            sink.on_event(call);
        }
    }
}
