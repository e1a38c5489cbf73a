//! Python rules on the session's side: stack samples turned into rule calls, the
//! synthesized caller of a probed call, and the framework save/load bits the kernel
//! reads (`PY_SAVING`).
use std::time::Duration;

use lens_common::saving;
use log::{info, warn};

use crate::{
    events::{ProbeEvent, PythonCaller},
    python::{self, PythonTracker},
    sink::EventSink,
};

use super::Session;

impl Session {
    /// Names the Python function that made a collective or sync call, in the event
    /// itself, before any sink sees it.
    pub(super) fn name_python_caller(&mut self, event: &mut ProbeEvent) {
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
            .python
            .tracker
            .as_mut()
            .and_then(|python| python.name_code(timing.tgid, code))
        {
            *python_caller = PythonCaller::Named { function, file };
        }
    }

    /// Python rules that no traced process called, one line each (after a run).
    pub fn unmatched_python_rules(&self) -> Vec<String> {
        self.python
            .tracker
            .as_ref()
            .map_or_else(Vec::new, PythonTracker::unmatched)
    }

    /// Samples `pid`'s Python threads if it runs a CPython and Python rules exist.
    /// Returns whether it does.
    pub(super) fn sample_python(&mut self, pid: u32) -> bool {
        let Some(tracker) = self.python.tracker.as_mut() else {
            return false;
        };
        if tracker.knows(pid) {
            return true;
        }
        match python::find_runtime(pid) {
            Ok(Some(runtime)) => {
                match self.bpf.maps.python.targets.insert(&pid, &runtime.offsets) {
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

    /// Stops sampling `pid`'s Python threads; the calls they were in end now.
    pub(super) fn forget_python(&mut self, pid: u32, sink: &mut dyn EventSink) {
        let Some(tracker) = self.python.tracker.as_mut() else {
            return;
        };
        if !tracker.knows(pid) {
            return;
        }
        self.bpf.maps.python.targets.remove(&pid);
        let calls = tracker.confirm(0, Some(pid));
        self.deliver_rule_calls(calls, sink);
        if let Some(tracker) = self.python.tracker.as_mut() {
            tracker.forget(pid);
        }
    }

    /// Hands Python rule calls to `sink`, keeping the kernel's `PY_SAVING` (processes
    /// inside a framework save or load, whose collective and sync entries take a stack
    /// sample, and whose files opened during a load are counted) in step.
    pub(super) fn deliver_rule_calls(&mut self, calls: Vec<ProbeEvent>, sink: &mut dyn EventSink) {
        for call in &calls {
            if let ProbeEvent::RuleCall {
                tgid,
                rule,
                at_return,
                ..
            } = call
                && let Some(role) = self
                    .python
                    .tracker
                    .as_ref()
                    .and_then(|t| t.framework_role(*rule))
            {
                let was = self.saving_bits(*tgid);
                let prelude_return = *at_return && role == (true, true);
                let depths = self.python.saving_depth.entry(*tgid).or_default();
                // A load's preparation (DCP's `get_state_dict`) keeps its load part past
                // its return, until the process's next framework call is seen: the load
                // after it reads its first file (`.metadata`) at once, often before a
                // sample shows the load itself (the sample between may show neither).
                if !prelude_return && self.python.armed_loads.remove(tgid).is_some() {
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
                    self.python
                        .armed_loads
                        .insert(*tgid, std::time::Instant::now());
                }
                self.write_saving_bits(*tgid, was);
            }
            sink.on_event(call);
        }
    }

    /// What `PY_SAVING` says of `pid` now.
    pub(super) fn saving_bits(&self, pid: u32) -> u8 {
        self.python.saving_depth.get(&pid).map_or(0, |d| {
            (if d[0] > 0 { saving::SAVE } else { 0 }) | (if d[1] > 0 { saving::LOAD } else { 0 })
        })
    }

    /// Tells the kernel what `pid`'s framework calls make of it, if that changed from
    /// `was`.
    pub(super) fn write_saving_bits(&mut self, pid: u32, was: u8) {
        let now = self.saving_bits(pid);
        if now == 0 {
            self.python.saving_depth.remove(&pid);
        }
        if was != now {
            let saving = &mut self.bpf.maps.python.saving;
            if now != 0 {
                let _ = saving.insert(&pid, &now);
            } else {
                saving.remove(&pid);
            }
        }
    }

    /// A preparation no load followed within a second was for something else (a save,
    /// or the job's own use of the state dict): its files are no load's.
    pub(super) fn expire_armed_loads(&mut self) {
        let expired: Vec<u32> = self
            .python
            .armed_loads
            .iter()
            .filter(|(_, since)| since.elapsed() >= Duration::from_secs(1))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in expired {
            self.python.armed_loads.remove(&pid);
            let was = self.saving_bits(pid);
            if let Some(depths) = self.python.saving_depth.get_mut(&pid) {
                depths[1] = depths[1].saturating_sub(1);
            }
            self.write_saving_bits(pid, was);
        }
    }
}
