//! Why the last rank was late: where each traced process's recent steps spent their time
//! (data loading, forward/backward, optimizer, host syncs), from the spans as they
//! finish, and, for a collective's straggler, the phase in which it spent more than the
//! other ranks' median over those steps.
//!
//! A rank that waits in a collective for a late peer spends that wait inside one of its
//! phases; the time inside collective calls is taken out of the phases, so the waiting
//! ranks do not look slow in the phase they waited in. Calls (fetches, collectives,
//! syncs) are recorded when they return, not when their spans go out: a collective's
//! span is held until its completion is known, often after its step ended.
use std::collections::VecDeque;

use foldhash::HashMap;
use serde::Serialize;

use super::{SpanRecord, names};

/// Steps remembered per process.
const STEPS_KEPT: usize = 8;

/// The phase that made the last rank late (`dl.collective.straggler.cause`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StragglerCause {
    /// Batch fetches (DataLoader `__next__` scopes).
    DataLoading,
    /// Forward and backward passes (the fetches and collective calls in them excluded).
    ForwardBackward,
    Optimizer,
    /// CUDA synchronisation calls.
    HostSync,
    /// None of them is longer than the others' by half the lateness: something outside
    /// the phases (between steps, another thread, the collective itself).
    None,
}

impl StragglerCause {
    pub const fn name(self) -> &'static str {
        match self {
            StragglerCause::DataLoading => "data_loading",
            StragglerCause::ForwardBackward => "forward_backward",
            StragglerCause::Optimizer => "optimizer",
            StragglerCause::HostSync => "host_sync",
            StragglerCause::None => "none",
        }
    }
}

/// Where one step's time went, ns.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct StepTimes {
    data_loading: f64,
    forward_backward: f64,
    optimizer: f64,
    host_sync: f64,
}

impl StepTimes {
    fn add(&mut self, other: &StepTimes) {
        self.data_loading += other.data_loading;
        self.forward_backward += other.forward_backward;
        self.optimizer += other.optimizer;
        self.host_sync += other.host_sync;
    }

    fn scaled(mut self, factor: f64) -> StepTimes {
        self.data_loading *= factor;
        self.forward_backward *= factor;
        self.optimizer *= factor;
        self.host_sync *= factor;
        self
    }
}

/// A timed call of a process, as the builder sees it return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhaseCall {
    /// A batch fetch (its `DataLoader.__next__` scope).
    Fetch,
    Collective,
    Sync,
}

/// Spans and calls of a process's step in progress, as (start, end).
#[derive(Default)]
struct Pending {
    fetches: VecDeque<(u64, u64)>,
    forward_backward: VecDeque<(u64, u64)>,
    optimizer: VecDeque<(u64, u64)>,
    collectives: VecDeque<(u64, u64)>,
    syncs: VecDeque<(u64, u64)>,
}

#[derive(Default)]
pub struct PhaseHistory {
    pending: HashMap<u32, Pending>,
    steps: HashMap<u32, VecDeque<StepTimes>>,
}

/// Intervals kept per kind and process while its step is in progress.
const INTERVALS_KEPT: usize = 4096;

/// Bounded whatever the job does: a step that never ends (or is never seen) keeps the
/// newest. A ring: shifting a full list by one on every call had been a quarter of the
/// reader's CPU on a job without steps (`perf`, fake trainer).
fn push_bounded(list: &mut VecDeque<(u64, u64)>, interval: (u64, u64)) {
    if list.len() >= INTERVALS_KEPT {
        list.pop_front();
    }
    list.push_back(interval);
}

/// Of `intervals`, the time inside [start, end).
fn inside(intervals: &[(u64, u64)], start: u64, end: u64) -> u64 {
    intervals
        .iter()
        .map(|(s, e)| (*e).min(end).saturating_sub((*s).max(start)))
        .sum()
}

impl PhaseHistory {
    /// A finished span of process `span.pid` (the steps and their phases count).
    pub fn record(&mut self, span: &SpanRecord) {
        let pending = match span.name {
            names::STEP => return self.step_ended(span),
            names::FORWARD_BACKWARD | names::OPTIMIZER => self.pending.entry(span.pid).or_default(),
            _ => return,
        };
        let list = match span.name {
            names::FORWARD_BACKWARD => &mut pending.forward_backward,
            _ => &mut pending.optimizer,
        };
        push_bounded(list, (span.start_ns, span.end_ns));
    }

    /// A call of `pid` took [start, end).
    pub fn record_call(&mut self, pid: u32, call: PhaseCall, start: u64, end: u64) {
        let pending = self.pending.entry(pid).or_default();
        let list = match call {
            PhaseCall::Fetch => &mut pending.fetches,
            PhaseCall::Collective => &mut pending.collectives,
            PhaseCall::Sync => &mut pending.syncs,
        };
        push_bounded(list, (start, end));
    }

    fn step_ended(&mut self, step: &SpanRecord) {
        let Some(pending) = self.pending.get_mut(&step.pid) else {
            return;
        };
        let (start, end) = (step.start_ns, step.end_ns);
        let within = |list: &VecDeque<(u64, u64)>| -> Vec<(u64, u64)> {
            list.iter()
                .copied()
                .filter(|(s, _)| *s >= start && *s < end)
                .collect()
        };
        let fetches = within(&pending.fetches);
        let forward_backward = within(&pending.forward_backward);
        let optimizer = within(&pending.optimizer);
        let collectives = within(&pending.collectives);
        let syncs = within(&pending.syncs);
        let own = |phases: &[(u64, u64)]| -> f64 {
            phases
                .iter()
                .map(|(s, e)| {
                    (e - s)
                        .saturating_sub(inside(&collectives, *s, *e))
                        .saturating_sub(inside(&fetches, *s, *e)) as f64
                })
                .sum()
        };
        let times = StepTimes {
            data_loading: fetches.iter().map(|(s, e)| (e - s) as f64).sum(),
            forward_backward: own(&forward_backward),
            optimizer: own(&optimizer),
            host_sync: syncs.iter().map(|(s, e)| (e - s) as f64).sum(),
        };
        for list in [
            &mut pending.fetches,
            &mut pending.forward_backward,
            &mut pending.optimizer,
            &mut pending.collectives,
            &mut pending.syncs,
        ] {
            list.retain(|(s, _)| *s >= end);
        }
        let steps = self.steps.entry(step.pid).or_default();
        if steps.len() == STEPS_KEPT {
            steps.pop_front();
        }
        steps.push_back(times);
    }

    fn mean(&self, pid: u32) -> Option<StepTimes> {
        let steps = self.steps.get(&pid).filter(|s| !s.is_empty())?;
        let mut total = StepTimes::default();
        steps.iter().for_each(|s| total.add(s));
        Some(total.scaled(1.0 / steps.len() as f64))
    }

    /// Why `late` arrived `skew_ns` after the first of `others`: the phase in which its
    /// recent steps took longer than the others' median by at least half the lateness
    /// (host syncs when they account for half of that excess). `None` (the option) when
    /// a process has no whole step yet.
    pub fn cause(&self, late: u32, others: &[u32], skew_ns: u64) -> Option<StragglerCause> {
        let mine = self.mean(late)?;
        let theirs: Vec<StepTimes> = others
            .iter()
            .filter(|pid| **pid != late)
            .map(|pid| self.mean(*pid))
            .collect::<Option<_>>()?;
        if theirs.is_empty() {
            return None;
        }
        let median = |get: fn(&StepTimes) -> f64| {
            let mut values: Vec<f64> = theirs.iter().map(get).collect();
            values.sort_by(f64::total_cmp);
            values[values.len() / 2]
        };
        let excess = |get: fn(&StepTimes) -> f64| get(&mine) - median(get);
        let phases = [
            (StragglerCause::DataLoading, excess(|t| t.data_loading)),
            (
                StragglerCause::ForwardBackward,
                excess(|t| t.forward_backward),
            ),
            (StragglerCause::Optimizer, excess(|t| t.optimizer)),
        ];
        let (phase, most) = phases
            .into_iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .expect("three phases");
        let sync = excess(|t| t.host_sync);
        let enough = skew_ns as f64 / 2.0;
        Some(if sync >= enough && sync >= most / 2.0 {
            StragglerCause::HostSync
        } else if most >= enough && most > 0.0 {
            phase
        } else {
            StragglerCause::None
        })
    }

    pub fn forget(&mut self, pid: u32) {
        self.pending.remove(&pid);
        self.steps.remove(&pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        settings::groups::SpanGroup,
        spans::{SpanId, SpanStatus},
    };

    const MS: u64 = 1_000_000;

    fn span(pid: u32, name: &'static str, start: u64, end: u64) -> SpanRecord {
        SpanRecord {
            id: SpanId(1),
            parent: None,
            name,
            group: SpanGroup::Step,
            pid,
            tid: pid,
            start_ns: start,
            end_ns: end,
            attributes: Vec::new(),
            events: Vec::new(),
            status: SpanStatus::Unset,
        }
    }

    /// A step at `at` of `pid`: `fetch` ms of data loading, `fb` ms of forward/backward
    /// (with a `wait` ms all-reduce at its end), 1 ms of optimizer.
    fn step(history: &mut PhaseHistory, pid: u32, at: u64, fetch: u64, fb: u64, wait: u64) {
        // The forward/backward span holds the fetch, as the phase machine makes it.
        history.record_call(pid, PhaseCall::Fetch, at, at + fetch * MS);
        let fb_start = at;
        let fb_end = fb_start + (fetch + fb + wait) * MS;
        history.record_call(pid, PhaseCall::Collective, fb_end - wait * MS, fb_end);
        history.record(&span(pid, names::FORWARD_BACKWARD, fb_start, fb_end));
        history.record(&span(pid, names::OPTIMIZER, fb_end, fb_end + MS));
        history.record(&span(pid, names::STEP, at, fb_end + MS));
    }

    #[test]
    fn the_late_rank_is_late_in_the_phase_it_spends_longer_in() {
        // Rank 1 fetches for 30 ms, rank 0 for 1 ms and then waits 29 ms in the
        // all-reduce inside its backward.
        let mut history = PhaseHistory::default();
        for k in 0..5 {
            step(&mut history, 100, k * 100 * MS, 1, 5, 29);
            step(&mut history, 101, k * 100 * MS, 30, 5, 0);
        }
        assert_eq!(
            history.cause(101, &[100, 101], 29 * MS),
            Some(StragglerCause::DataLoading)
        );
        // Slow compute instead: rank 1's forward/backward takes 30 ms.
        let mut history = PhaseHistory::default();
        for k in 0..5 {
            step(&mut history, 100, k * 100 * MS, 1, 5, 25);
            step(&mut history, 101, k * 100 * MS, 1, 30, 0);
        }
        assert_eq!(
            history.cause(101, &[100, 101], 25 * MS),
            Some(StragglerCause::ForwardBackward)
        );
    }

    #[test]
    fn lateness_the_phases_do_not_explain_is_none_and_no_steps_no_cause() {
        let mut history = PhaseHistory::default();
        assert_eq!(history.cause(101, &[100, 101], MS), None);
        for k in 0..3 {
            step(&mut history, 100, k * 100 * MS, 1, 5, 0);
            step(&mut history, 101, k * 100 * MS, 1, 5, 0);
        }
        assert_eq!(
            history.cause(101, &[100, 101], 20 * MS),
            Some(StragglerCause::None)
        );
    }

    #[test]
    fn a_step_that_never_ends_keeps_only_its_newest_calls() {
        let mut history = PhaseHistory::default();
        let calls = INTERVALS_KEPT as u64 + 1_000;
        for k in 0..calls {
            history.record_call(7, PhaseCall::Collective, k * MS, k * MS + 1);
        }
        let kept = &history.pending[&7].collectives;
        assert_eq!(kept.len(), INTERVALS_KEPT);
        assert_eq!(kept.front(), Some(&(1_000 * MS, 1_000 * MS + 1)));
        assert_eq!(kept.back(), Some(&((calls - 1) * MS, (calls - 1) * MS + 1)));
    }
}
