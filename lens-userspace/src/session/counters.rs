//! The probes' call counters, read into the sink periodically and when a process ends,
//! and what they cost the targets.
use std::collections::BTreeMap;

use lens_common::{LAUNCH_PROBES, ProbeId, TargetState};

use crate::sink::EventSink;

use super::{Session, target_table::Target};

impl Session {
    /// What `calls` cost `target`, and each of its `runtime_driver_hits`.
    pub(super) fn probe_cost(
        &self,
        target: &Target,
        calls: &BTreeMap<ProbeId, u64>,
        runtime_driver_hits: u64,
    ) -> crate::sink::ProbeCost {
        self.costs.cost_of(
            calls,
            runtime_driver_hits,
            target.traced_since_ns,
            crate::spans::monotonic_now_ns(),
        )
    }

    /// Hands `pid`'s call counts so far to the sink (`reported`: as counted, or scaled up
    /// under an overhead budget) and what the probes that made `counted` cost it.
    pub(super) fn report_call_counts(
        &self,
        pid: u32,
        counted: &BTreeMap<ProbeId, u64>,
        reported: &BTreeMap<ProbeId, u64>,
        sink: &mut dyn EventSink,
    ) {
        sink.on_call_counts(pid, reported);
        if let Some(target) = self.targets.get(pid) {
            let runtime_driver_hits = self.runtime_driver_hits(pid);
            sink.on_probe_cost(pid, self.probe_cost(target, counted, runtime_driver_hits));
        }
    }

    /// Every target's call counters so far, kept in the kernel in its `TARGETS` entry.
    pub(super) fn call_counts(&mut self) -> BTreeMap<u32, BTreeMap<ProbeId, u64>> {
        let mut by_pid: BTreeMap<u32, BTreeMap<ProbeId, u64>> = BTreeMap::new();
        for (pid, entry) in self.bpf.maps.targets.entries() {
            add_call_counts(by_pid.entry(pid).or_default(), Some(&entry));
        }
        by_pid.retain(|pid, _| self.targets.contains(*pid));
        by_pid
    }

    /// Takes `pid` out of `TARGETS`: its probes stop counting it. Returns its entry as
    /// it was, launch counters included.
    pub(super) fn take_target_entry(&mut self, pid: u32) -> Option<TargetState> {
        self.bpf.maps.targets.take(&pid)
    }

    /// Tells the sink about targets whose launches began or stopped being counted (their
    /// libraries' launch probes went in or out).
    pub(super) fn sync_launch_counting(&mut self, sink: &mut dyn EventSink) {
        let attacher = &self.probes.attacher;
        let changes = self.targets.launch_counting(
            |pid| attacher.counts_launches(pid),
            crate::spans::monotonic_now_ns(),
        );
        for change in changes {
            sink.on_launch_counting(
                change.pid,
                change.counted,
                change.since_ns,
                self.costs.sampled(),
            );
        }
    }
}

/// Adds the calls a `TARGETS` entry counted, per probe, to `calls` (probes that counted
/// nothing are left out, as probes that never fired are).
pub(super) fn add_call_counts(calls: &mut BTreeMap<ProbeId, u64>, entry: Option<&TargetState>) {
    let Some(entry) = entry else {
        return;
    };
    for (probe, &launches) in LAUNCH_PROBES.iter().zip(&entry.launches) {
        if launches > 0 {
            *calls.entry(*probe).or_default() += launches;
        }
    }
    for (probe, &count) in ProbeId::ALL.iter().zip(&entry.calls) {
        if count > 0 {
            *calls.entry(*probe).or_default() += count;
        }
    }
}

/// The launches of a `TARGETS` entry captured into CUDA graphs (recorded, not run), by
/// launch probe.
pub(super) fn captured_launches(entry: Option<&TargetState>) -> BTreeMap<ProbeId, u64> {
    let Some(entry) = entry else {
        return BTreeMap::new();
    };
    LAUNCH_PROBES
        .iter()
        .zip(entry.captured)
        .filter(|&(_, count)| count > 0)
        .map(|(&probe, count)| (probe, count))
        .collect()
}
