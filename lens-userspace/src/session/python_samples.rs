//! Python rules on the session's side: stack samples turned into rule calls, the
//! synthesized caller of a probed call, and the framework save/load bits the kernel
//! reads (`PY_SAVING`).
use log::{info, warn};

use crate::{
    events::{ProbeEvent, PythonCaller},
    python::{self, PythonTracker},
    sink::EventSink,
};

use super::{Session, framework_saves::FrameworkRole};

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
            Ok(Some(runtime)) => match self.bpf.maps.python.add_target(pid, &runtime.offsets) {
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
            },
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
        self.bpf.maps.python.remove_target(pid);
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
                let role = FrameworkRole {
                    save: role.0,
                    load: role.1,
                };
                if let Some(bits) =
                    self.python
                        .saves
                        .call(*tgid, role, *at_return, std::time::Instant::now())
                {
                    self.write_saving_bits(*tgid, bits);
                }
            }
            sink.on_event(call);
        }
    }

    /// Tells the kernel what `pid`'s framework calls make of it now.
    fn write_saving_bits(&mut self, pid: u32, bits: u8) {
        self.bpf.maps.python.set_saving(pid, bits);
    }

    /// Load preparations no load followed: their processes load no more.
    pub(super) fn expire_armed_loads(&mut self) {
        for (pid, bits) in self.python.saves.expire(std::time::Instant::now()) {
            self.write_saving_bits(pid, bits);
        }
    }
}
