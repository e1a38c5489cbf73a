//! `--overhead-budget`: a ceiling on what the fine-grained probes (kernel launches) may
//! cost the job. lens-probe estimates that cost itself, as launches counted × the cost of
//! one probe hit (measured at start-up on this machine) against wall time, for the
//! process that launches most. Above the budget the launch probes go out and come back
//! only for sampled windows, whose length and spacing hold the estimate under the budget.
//! Spans inside a window carry exact launch counts (marked sampled); metrics scale the
//! counts by the share of time sampled.
//!
//! Only launches are sampled: the collective, sync and phase probes give the spans
//! themselves and are few per step.
use std::{collections::HashMap, fmt, str::FromStr, time::Duration};

/// How often the controller looks at the launch counters.
pub const TICK: Duration = Duration::from_millis(100);
/// A sampled window lasts at least this long (several steps of a fast loop).
const MIN_WINDOW: Duration = Duration::from_millis(250);
/// Cycle (window + pause) of at least this long when each launch probe is a perf link of
/// its own: taking one out costs the kernel ~0.1 s (an RCU grace period), and all of them
/// must be out before they go in again.
pub const MIN_CYCLE_PERF_LINKS: Duration = Duration::from_secs(2);
/// ... and when a library's launch probes go in and out as one uprobe_multi link (a
/// grace period per library and program: a few tenths of a second at most).
pub const MIN_CYCLE_MULTI_LINKS: Duration = Duration::from_millis(500);
/// Aim below the budget: the rate of launches changes between windows.
const HEADROOM: f64 = 0.8;
/// Probes are in at least this share of the time (at most ~8 min between windows).
const MIN_DUTY: f64 = 0.0005;

/// A share of wall time, from `1%`, `0.5%` or `1` (percent).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OverheadBudget(f64);

impl OverheadBudget {
    pub fn fraction(self) -> f64 {
        self.0
    }
}

impl FromStr for OverheadBudget {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let number = text.trim().trim_end_matches('%').trim();
        match number.parse::<f64>() {
            Ok(percent) if percent > 0.0 && percent <= 100.0 => Ok(OverheadBudget(percent / 100.0)),
            _ => Err(format!(
                "invalid overhead budget '{text}': a percentage of wall time above 0 and at \
                 most 100, e.g. 1% or 0.5%"
            )),
        }
    }
}

impl fmt::Display for OverheadBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}%", self.0 * 100.0)
    }
}

/// What the controller wants done with the launch probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Keep,
    /// Take them out (a window or full-time counting ends).
    Detach,
    /// Put them in (a sampled window begins).
    Attach,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    /// In all the time (the estimate is within the budget).
    Full,
    /// In, for a sampled window that ends at `until` (seconds since start).
    Window { until: f64 },
    /// Out until `until`; the window after it lasts `window` seconds.
    Paused { until: f64, window: f64 },
}

/// The controller: fed the launch counters every [`TICK`], it says when the launch probes
/// go in and out. Times are seconds since the controller started.
#[derive(Debug)]
pub struct BudgetController {
    budget: f64,
    per_hit_s: f64,
    /// The shortest window + pause (`MIN_CYCLE_*`).
    min_cycle_s: f64,
    state: State,
    /// Launch counters per process at the last tick.
    last: HashMap<u32, u64>,
    last_at: f64,
    /// Estimated probe time per process, seconds, since start.
    spent: HashMap<u32, f64>,
    /// Time the probes were in, and how many windows were sampled.
    in_time: f64,
    windows: u64,
    duty: f64,
}

/// What the budget did, for the exit summary.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct BudgetReport {
    pub budget_percent: f64,
    pub per_hit_ns: f64,
    /// Estimated launch-probe time of the most-launching process / wall time, percent.
    pub estimated_percent: f64,
    /// Share of the wall time the launch probes were in, percent.
    pub sampled_percent: f64,
    pub windows: u64,
}

impl BudgetController {
    /// `min_cycle`: how often the launch probes can go out and in again
    /// ([`MIN_CYCLE_PERF_LINKS`], [`MIN_CYCLE_MULTI_LINKS`]).
    pub fn new(budget: OverheadBudget, per_hit: Duration, min_cycle: Duration) -> BudgetController {
        BudgetController {
            budget: budget.fraction(),
            per_hit_s: per_hit.as_secs_f64(),
            min_cycle_s: min_cycle.as_secs_f64(),
            state: State::Full,
            last: HashMap::new(),
            last_at: 0.0,
            spent: HashMap::new(),
            in_time: 0.0,
            windows: 0,
            duty: 1.0,
        }
    }

    /// Whether the probes are in now.
    pub fn probes_in(&self) -> bool {
        !matches!(self.state, State::Paused { .. })
    }

    /// Share of time the probes are meant to be in (1 when always).
    pub fn duty(&self) -> f64 {
        self.duty
    }

    /// One tick at `now` with every traced process's launch counter so far.
    pub fn tick(&mut self, now: f64, launches: &HashMap<u32, u64>) -> Action {
        let elapsed = (now - self.last_at).max(1e-6);
        let mut worst = 0.0f64;
        for (&pid, &count) in launches {
            let new = count.saturating_sub(self.last.get(&pid).copied().unwrap_or(0));
            let cost = new as f64 * self.per_hit_s;
            *self.spent.entry(pid).or_default() += cost;
            worst = worst.max(cost / elapsed);
        }
        self.last = launches.clone();
        if self.probes_in() {
            self.in_time += elapsed;
        }
        self.last_at = now;

        let target = self.budget * HEADROOM;
        match self.state {
            State::Full if worst > self.budget => {
                self.pause(now, worst, target);
                Action::Detach
            }
            State::Window { until } if now >= until => {
                if worst <= target {
                    self.state = State::Full;
                    self.duty = 1.0;
                    Action::Keep
                } else {
                    self.pause(now, worst, target);
                    Action::Detach
                }
            }
            State::Paused { until, window } if now >= until => {
                self.state = State::Window {
                    until: now + window,
                };
                self.windows += 1;
                Action::Attach
            }
            _ => Action::Keep,
        }
    }

    /// The probes cost `rate` of the time while in: take them out for a pause such that
    /// window / (window + pause) × rate stays at `target`.
    fn pause(&mut self, now: f64, rate: f64, target: f64) {
        self.duty = (target / rate).clamp(MIN_DUTY, 1.0);
        let window = MIN_WINDOW.as_secs_f64().max(self.duty * self.min_cycle_s);
        // A window ends at the first tick after its end: up to a tick longer.
        let longest = window + TICK.as_secs_f64();
        let pause = (longest / self.duty - longest).max(self.min_cycle_s - window);
        self.state = State::Paused {
            until: now + pause,
            window,
        };
    }

    pub fn report(&self, now: f64) -> BudgetReport {
        let wall = now.max(1e-9);
        let worst = self.spent.values().copied().fold(0.0, f64::max);
        BudgetReport {
            budget_percent: self.budget * 100.0,
            per_hit_ns: self.per_hit_s * 1e9,
            estimated_percent: worst / wall * 100.0,
            sampled_percent: (self.in_time / wall * 100.0).min(100.0),
            windows: self.windows,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(text: &str) -> OverheadBudget {
        text.parse().unwrap()
    }

    #[test]
    fn parses_percentages() {
        assert_eq!(budget("1%").fraction(), 0.01);
        assert_eq!(budget("0.5%").fraction(), 0.005);
        assert_eq!(budget("2").fraction(), 0.02);
        for bad in ["0", "0%", "-1%", "101%", "abc", ""] {
            let error = bad.parse::<OverheadBudget>().unwrap_err();
            assert!(error.contains("e.g. 1%"), "{bad}: {error}");
        }
    }

    /// A process launching `rate` kernels per second, probes costing 1 µs a hit, under a
    /// 1% budget: the controller's decisions, simulated tick by tick for `seconds`.
    fn simulate(rate: f64, seconds: f64) -> (BudgetController, f64) {
        simulate_cycle(rate, seconds, MIN_CYCLE_PERF_LINKS)
    }

    fn simulate_cycle(rate: f64, seconds: f64, min_cycle: Duration) -> (BudgetController, f64) {
        let mut controller =
            BudgetController::new(budget("1%"), Duration::from_micros(1), min_cycle);
        let mut counted = 0u64;
        let mut t = 0.0;
        let tick = TICK.as_secs_f64();
        while t < seconds {
            if controller.probes_in() {
                counted += (rate * tick) as u64;
            }
            t += tick;
            controller.tick(t, &HashMap::from([(7, counted)]));
        }
        let spent = counted as f64 * 1e-6;
        (controller, spent / seconds)
    }

    #[test]
    fn within_budget_the_probes_stay_in() {
        // 5 000 launches/s × 1 µs = 0.5% < 1%.
        let (controller, overhead) = simulate(5_000.0, 30.0);
        assert!(controller.probes_in());
        assert_eq!(controller.report(30.0).windows, 0);
        assert!((overhead - 0.005).abs() < 1e-4, "{overhead}");
    }

    #[test]
    fn over_budget_sampling_holds_the_overhead_under_it() {
        // 100 000 launches/s × 1 µs = 10%: ten times the budget.
        let (controller, overhead) = simulate(100_000.0, 120.0);
        assert!(overhead < 0.01, "overhead {overhead}");
        assert!(overhead > 0.002, "sampled too little: {overhead}");
        let report = controller.report(120.0);
        assert!(report.windows >= 5, "{report:?}");
        assert!((report.estimated_percent - overhead * 100.0).abs() < 0.05);
        assert!(controller.duty() < 0.1);
    }

    #[test]
    fn one_link_per_library_samples_in_shorter_cycles_under_the_same_budget() {
        // 16 000 launches/s × 1 µs = 1.6%: the probes in half of the time.
        let (perf, perf_overhead) = simulate_cycle(16_000.0, 60.0, MIN_CYCLE_PERF_LINKS);
        let (multi, multi_overhead) = simulate_cycle(16_000.0, 60.0, MIN_CYCLE_MULTI_LINKS);
        let (perf_windows, multi_windows) = (perf.report(60.0).windows, multi.report(60.0).windows);
        // Windows of ~0.3 s every ~0.7 s against ~1.1 s every ~2.3 s.
        assert!(
            multi_windows >= 2 * perf_windows,
            "{multi_windows} windows against {perf_windows}"
        );
        for overhead in [perf_overhead, multi_overhead] {
            assert!(overhead < 0.01 && overhead > 0.005, "overhead {overhead}");
        }
    }

    #[test]
    fn a_rate_that_drops_brings_the_probes_back_full_time() {
        let mut controller =
            BudgetController::new(budget("1%"), Duration::from_micros(1), MIN_CYCLE_PERF_LINKS);
        assert_eq!(
            controller.tick(0.1, &HashMap::from([(1, 10_000)])),
            Action::Detach
        );
        let mut t = 0.1;
        let mut action = Action::Keep;
        while action != Action::Attach {
            t += 0.1;
            action = controller.tick(t, &HashMap::from([(1, 10_000)]));
            assert!(t < 10.0, "never sampled again");
        }
        // The window sees almost no launches: back to full time.
        while controller.probes_in() && !matches!(controller.state, State::Full) {
            t += 0.1;
            controller.tick(t, &HashMap::from([(1, 10_010)]));
        }
        assert!(matches!(controller.state, State::Full));
        assert_eq!(controller.duty(), 1.0);
    }
}
