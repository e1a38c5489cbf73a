//! `--overhead-budget`: feed the controller the launch counters, move the launch probes
//! as it says, and extrapolate launches over the pauses between sampled windows.
use std::collections::{BTreeMap, HashMap};

use lens_common::ProbeId;
use log::info;

use crate::{budget::Action, sink::EventSink};

use super::Session;

impl Session {
    /// One tick of the overhead budget: feed it the launch counters, move the launch
    /// probes as it says, and hand the sinks launch totals with the pauses estimated.
    pub(super) fn budget_tick(&mut self, sink: &mut dyn EventSink) {
        if self.costs.budget.is_none() {
            return;
        }
        let counts = self.call_counts();
        // What the probes cost is per hit: with the driver probed, a runtime launch hits
        // twice (its own probe, then the driver's, which leaves the count to the runtime).
        let hits: HashMap<u32, u64> = counts
            .iter()
            .map(|(pid, calls)| {
                let through_driver = if self.probes.attacher.probes_driver(*pid) {
                    runtime_launches(calls)
                } else {
                    0
                };
                (*pid, launch_total(calls) + through_driver)
            })
            .collect();
        let Some((controller, started)) = self.costs.budget.as_mut() else {
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
            let estimate = self.costs.launch_estimates.entry(*pid).or_default();
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
                let moved = self
                    .probes
                    .attacher
                    .set_launch_probes(&mut self.bpf.programs, false);
                info!("overhead budget: {moved} launch probes out");
            }
            Action::Attach => {
                let moved = self
                    .probes
                    .attacher
                    .set_launch_probes(&mut self.bpf.programs, true);
                info!("overhead budget: {moved} launch probes in for a sampled window");
                self.sync_launch_counting(sink);
            }
        }
        for (pid, counted) in counts {
            let mut reported = counted.clone();
            if let Some(estimate) = self.costs.launch_estimates.get(&pid) {
                scale_launches(&mut reported, estimate.estimated);
            }
            self.report_call_counts(pid, &counted, &reported, sink);
        }
    }
}

/// A process's launches under an overhead budget: counted in windows, extrapolated at the
/// last window's rate in between.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct LaunchEstimate {
    pub(super) counted: u64,
    pub(super) estimated: f64,
    /// Launches per second in the last window.
    pub(super) rate: f64,
}

pub(super) fn launch_total(calls: &BTreeMap<ProbeId, u64>) -> u64 {
    calls
        .iter()
        .filter(|(probe, _)| probe.is_launch())
        .map(|(_, count)| count)
        .sum()
}

/// Launches made through libcudart (each of which also enters the driver's launch).
pub(super) fn runtime_launches(calls: &BTreeMap<ProbeId, u64>) -> u64 {
    calls
        .iter()
        .filter(|(probe, _)| probe.is_launch() && !probe.is_driver_launch())
        .map(|(_, count)| count)
        .sum()
}

/// Scales the launch counters so that they add up to `estimated` (kinds keep their shares).
pub(super) fn scale_launches(calls: &mut BTreeMap<ProbeId, u64>, estimated: f64) {
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
