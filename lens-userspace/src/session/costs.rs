//! What the probes cost the targets, as a component: the hit costs measured at start-up,
//! and under `--overhead-budget` the controller that moves the launch probes and the
//! launches extrapolated over the pauses between its sampled windows.
//!
//! It owns its state and decides; the session moves the probes it names and hands the
//! sinks what it reports.
use std::collections::{BTreeMap, HashMap};

use lens_common::ProbeId;
use log::info;

use crate::{
    budget::{Action, BudgetController, BudgetReport},
    probes::calibrate::HitCosts,
    sink::{EventSink, ProbeCost},
};

use super::Session;

/// What the probes cost the targets.
pub(super) struct ProbeCosts {
    /// What a probe hit costs here (measured at start-up): each process's estimate.
    hit_costs: HitCosts,
    /// `--overhead-budget`: the controller, and when it started (monotonic ns).
    budget: Option<(BudgetController, u64)>,
    /// Launches per process as reported to the sinks: under a budget, counted launches
    /// plus an estimate for the pauses between windows.
    launch_estimates: HashMap<u32, LaunchEstimate>,
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

impl ProbeCosts {
    pub(super) fn new(hit_costs: HitCosts, budget: Option<(BudgetController, u64)>) -> Self {
        ProbeCosts {
            hit_costs,
            budget,
            launch_estimates: HashMap::new(),
        }
    }

    /// An overhead budget samples the launch probes.
    pub(super) fn sampled(&self) -> bool {
        self.budget.is_some()
    }

    /// What `calls` cost a target traced since `traced_since_ns`, and each of its
    /// `runtime_driver_hits` (driver launches left out as the runtime's own: an entry hit,
    /// not a call), as estimated from the hit costs measured at start-up.
    pub(super) fn cost_of(
        &self,
        calls: &BTreeMap<ProbeId, u64>,
        runtime_driver_hits: u64,
        traced_since_ns: u64,
        now_ns: u64,
    ) -> ProbeCost {
        let entry_ns = self.hit_costs.entry.as_nanos() as u64;
        ProbeCost {
            estimated_ns: self.hit_costs.of_calls(calls).as_nanos() as u64
                + entry_ns * runtime_driver_hits,
            traced_ns: now_ns.saturating_sub(traced_since_ns),
            entry_hit_ns: entry_ns,
            return_hit_ns: self.hit_costs.ret.as_nanos() as u64,
        }
    }

    /// One tick of the overhead budget at `now_ns`: `counts` are the targets' counters,
    /// `hits` their launch probe hits. Updates each process's launch estimate and returns
    /// what the launch probes should do (`None` without a budget).
    pub(super) fn budget_tick(
        &mut self,
        now_ns: u64,
        counts: &BTreeMap<u32, BTreeMap<ProbeId, u64>>,
        hits: &HashMap<u32, u64>,
    ) -> Option<Action> {
        let (controller, started) = self.budget.as_mut()?;
        let was_in = controller.probes_in();
        let elapsed = now_ns.saturating_sub(*started) as f64 / 1e9;
        let action = controller.tick(elapsed, hits);
        let tick = crate::budget::TICK.as_secs_f64();
        for (pid, calls) in counts {
            let total = launch_total(calls);
            let estimate = self.launch_estimates.entry(*pid).or_default();
            let new = total.saturating_sub(estimate.counted);
            estimate.counted = total;
            if was_in {
                estimate.rate = new as f64 / tick;
                estimate.estimated += new as f64;
            } else {
                estimate.estimated += estimate.rate * tick;
            }
        }
        log::debug!("overhead budget at {elapsed:.2}s: {action:?}");
        Some(action)
    }

    /// `pid`'s counters as the sinks see them: as counted, or under a budget with the
    /// launches scaled to the estimate.
    pub(super) fn reported(
        &self,
        pid: u32,
        counted: &BTreeMap<ProbeId, u64>,
    ) -> BTreeMap<ProbeId, u64> {
        let mut reported = counted.clone();
        if let Some(estimate) = self.launch_estimates.get(&pid) {
            scale_launches(&mut reported, estimate.estimated);
        }
        reported
    }

    /// `pid` ended with `calls` counted in all: scales its launches to the estimate (the
    /// launches since the last tick counted as they are) and forgets it.
    pub(super) fn process_ended(&mut self, pid: u32, calls: &mut BTreeMap<ProbeId, u64>) {
        if let Some(estimate) = self.launch_estimates.remove(&pid) {
            let new = launch_total(calls).saturating_sub(estimate.counted);
            scale_launches(calls, estimate.estimated + new as f64);
        }
    }

    /// What the budget did, at `now_ns`, when one was set.
    pub(super) fn report(&self, now_ns: u64) -> Option<BudgetReport> {
        self.budget.as_ref().map(|(controller, started)| {
            controller.report(now_ns.saturating_sub(*started) as f64 / 1e9)
        })
    }
}

impl Session {
    /// One tick of the overhead budget: feed it the launch counters, move the launch
    /// probes as it says, and hand the sinks launch totals with the pauses estimated.
    pub(super) fn budget_tick(&mut self, sink: &mut dyn EventSink) {
        if !self.costs.sampled() {
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
        let now = crate::spans::monotonic_now_ns();
        match self.costs.budget_tick(now, &counts, &hits) {
            None | Some(Action::Keep) => {}
            Some(Action::Detach) => {
                // Said before they go: a span ending after this is not fully counted.
                for pid in self.targets.stop_counting_launches() {
                    sink.on_launch_counting(pid, false, now, true);
                }
                let moved = self
                    .probes
                    .attacher
                    .set_launch_probes(&mut self.bpf.programs, false);
                info!("overhead budget: {moved} launch probes out");
            }
            Some(Action::Attach) => {
                let moved = self
                    .probes
                    .attacher
                    .set_launch_probes(&mut self.bpf.programs, true);
                info!("overhead budget: {moved} launch probes in for a sampled window");
                self.sync_launch_counting(sink);
            }
        }
        for (pid, counted) in counts {
            let reported = self.costs.reported(pid, &counted);
            self.report_call_counts(pid, &counted, &reported, sink);
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::budget::{MIN_CYCLE_PERF_LINKS, TICK};

    const PID: u32 = 7;
    const TICK_NS: u64 = TICK.as_nanos() as u64;

    fn hit_costs() -> HitCosts {
        HitCosts {
            entry: Duration::from_nanos(1_000),
            ret: Duration::from_nanos(400),
        }
    }

    fn launches(count: u64) -> BTreeMap<u32, BTreeMap<ProbeId, u64>> {
        BTreeMap::from([(PID, BTreeMap::from([(ProbeId::CudaLaunchKernel, count)]))])
    }

    fn under_budget() -> ProbeCosts {
        let controller = BudgetController::new(
            "1%".parse().unwrap(),
            Duration::from_micros(1),
            MIN_CYCLE_PERF_LINKS,
        );
        ProbeCosts::new(hit_costs(), Some((controller, 0)))
    }

    #[test]
    fn without_a_budget_launches_are_reported_as_counted() {
        let mut costs = ProbeCosts::new(hit_costs(), None);
        assert!(!costs.sampled());
        let counts = launches(500);
        assert_eq!(costs.budget_tick(TICK_NS, &counts, &HashMap::new()), None);
        assert_eq!(costs.reported(PID, &counts[&PID]), counts[&PID]);
        let mut calls = counts[&PID].clone();
        costs.process_ended(PID, &mut calls);
        assert_eq!(calls, counts[&PID]);
        assert_eq!(costs.report(TICK_NS), None);
    }

    #[test]
    fn launches_in_a_pause_are_estimated_at_the_last_windows_rate() {
        let mut costs = under_budget();
        // 100 000 launches of 1 µs in a 100 ms tick: 100 % of the time, over 1 %.
        let hits = HashMap::from([(PID, 100_000)]);
        let first = costs.budget_tick(TICK_NS, &launches(100_000), &hits);
        assert_eq!(first, Some(Action::Detach));
        assert_eq!(
            costs.reported(PID, &launches(100_000)[&PID]),
            launches(100_000)[&PID]
        );
        // Two ticks out: nothing counted, 100 000 a tick estimated.
        for tick in 2..=3 {
            let action = costs.budget_tick(tick * TICK_NS, &launches(100_000), &hits);
            assert_eq!(action, Some(Action::Keep));
        }
        let reported = costs.reported(PID, &launches(100_000)[&PID]);
        assert_eq!(reported[&ProbeId::CudaLaunchKernel], 300_000);
        // It ends with 50 more counted since the last tick: they count as they are.
        let mut calls = launches(100_050).remove(&PID).unwrap();
        costs.process_ended(PID, &mut calls);
        assert_eq!(calls[&ProbeId::CudaLaunchKernel], 300_050);
        // Forgotten: a new process with its pid starts from what it counts.
        assert_eq!(costs.reported(PID, &launches(10)[&PID]), launches(10)[&PID]);
        let report = costs.report(3 * TICK_NS).unwrap();
        assert_eq!(report.budget_percent, 1.0);
    }

    #[test]
    fn a_targets_cost_is_its_hits_at_the_measured_prices() {
        let costs = ProbeCosts::new(hit_costs(), None);
        let calls = BTreeMap::from([(ProbeId::CudaLaunchKernel, 10)]);
        let cost = costs.cost_of(&calls, 5, 1_000, 61_000);
        let per_launch = hit_costs().of_calls(&calls).as_nanos() as u64 / 10;
        assert_eq!(cost.estimated_ns, 10 * per_launch + 5 * 1_000);
        assert_eq!(cost.traced_ns, 60_000);
        assert_eq!((cost.entry_hit_ns, cost.return_hit_ns), (1_000, 400));
    }
}
