//! Kernel launches per span, without an event per launch: the kernel keeps one running
//! total per process and stamps it on every phase mark, so a span's launches are the
//! difference between the totals at its two ends. A count is given only for a span during
//! all of which the launch probes were in (an overhead budget takes them out between its
//! sampled windows; a `--pid` attach puts them in mid-run).
//!
//! Launches per kernel work the same way, one level down: each phase mark opens a new
//! epoch of its process, the kernel counts launches per (epoch, kernel), and a span's
//! kernels are those of the epochs between its two marks.
use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::Arc,
};

/// Phase marks remembered per process: enough for the longest step of a real loop (a few
/// dozen marks per step) many times over; older spans simply get no count.
const MARKS_KEPT: usize = 4096;
/// Counting windows remembered per process.
const WINDOWS_KEPT: usize = 256;
/// Epochs whose kernels are remembered per process, at most (steps take theirs away as
/// they end).
const EPOCHS_KEPT: usize = 4096;
/// The epoch of the last mark, the process's end, that closes every span still open.
pub const LAST_EPOCH: u64 = u64::MAX;

#[derive(Debug, Default)]
pub struct LaunchLedger {
    /// `(at_ns, launches counted so far, epoch opened)`, in arrival order (nearly time
    /// order).
    marks: VecDeque<(u64, u64, u64)>,
    /// Marks older than the first one kept were dropped.
    trimmed: bool,
    /// `[start, end)` intervals in which the launch probes were in; `None`: still in.
    windows: VecDeque<(u64, Option<u64>)>,
    /// The windows are an overhead budget's samples, not the whole run.
    sampled: bool,
    /// Launches per kernel, by epoch.
    kernels: BTreeMap<u64, HashMap<Arc<str>, u64>>,
}

impl LaunchLedger {
    /// A phase mark: the process's launches so far, and the epoch it opens (a mark the
    /// kernel opened no epoch for passes the epoch of the mark before it).
    pub fn record_mark(&mut self, at_ns: u64, launches: u64, epoch: u64) {
        if self.marks.len() == MARKS_KEPT {
            self.marks.pop_front();
            self.trimmed = true;
        }
        self.marks.push_back((at_ns, launches, epoch));
    }

    /// `launches` of kernel `name` in `epoch`, as the kernel counted them.
    pub fn add_kernel_launches(&mut self, epoch: u64, name: Arc<str>, launches: u64) {
        *self
            .kernels
            .entry(epoch)
            .or_default()
            .entry(name)
            .or_default() += launches;
        while self.kernels.len() > EPOCHS_KEPT {
            self.kernels.pop_first();
        }
    }

    /// The `limit` kernels launched most often between `start_ns` and `end_ns` (most
    /// first, then by name), when every launch then was counted; the epochs before the
    /// end are forgotten (`take`: a step's kernels are only asked for once).
    pub fn top_kernels(
        &mut self,
        start_ns: u64,
        end_ns: u64,
        limit: usize,
    ) -> Option<Vec<(Arc<str>, u64)>> {
        self.between(start_ns, end_ns)?;
        let first = self.epoch_at(start_ns, true)?;
        let last = self.epoch_at(end_ns, false)?;
        let mut totals: HashMap<Arc<str>, u64> = HashMap::new();
        for (_, kernels) in self.kernels.range(first..last) {
            for (name, launches) in kernels {
                *totals.entry(name.clone()).or_default() += launches;
            }
        }
        // What follows the end belongs to later spans.
        self.kernels = self.kernels.split_off(&last);
        let mut top: Vec<(Arc<str>, u64)> = totals.into_iter().collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        top.truncate(limit);
        Some(top)
    }

    /// The epoch open at `at_ns`: that of the latest mark at or before it
    /// (`first_at_instant` as in [`Self::total_at`]); 0 before the first mark.
    fn epoch_at(&self, at_ns: u64, first_at_instant: bool) -> Option<u64> {
        let mut found = None;
        for &(at, _, epoch) in self.marks.iter().rev() {
            if at > at_ns {
                continue;
            }
            if found.is_some() && (at < at_ns || !first_at_instant) {
                break;
            }
            found = Some(epoch);
            if at < at_ns || !first_at_instant {
                break;
            }
        }
        if found.is_some() {
            return found;
        }
        (!self.trimmed).then_some(0)
    }

    /// The launch probes went in (`counting`) or out at `at_ns`. `sampled`: they go in and
    /// out under an overhead budget.
    pub fn set_counting(&mut self, counting: bool, at_ns: u64, sampled: bool) {
        self.sampled |= sampled;
        match (counting, self.windows.back_mut()) {
            (true, Some((_, None))) => {}
            (true, _) => {
                if self.windows.len() == WINDOWS_KEPT {
                    self.windows.pop_front();
                }
                self.windows.push_back((at_ns, None));
            }
            (false, Some((_, end @ None))) => *end = Some(at_ns),
            (false, _) => {}
        }
    }

    /// Whether the counts come from an overhead budget's sampled windows.
    pub fn sampled(&self) -> bool {
        self.sampled
    }

    /// The total at `at_ns`: that of the latest mark at or before it (`first_at_instant`:
    /// of several marks at that very instant, the first — a span that opens there opens
    /// with it). Before the first mark, 0 if that mark still shows none (and no older
    /// mark was dropped).
    fn total_at(&self, at_ns: u64, first_at_instant: bool) -> Option<u64> {
        let mut found = None;
        for &(at, launches, _) in self.marks.iter().rev() {
            if at > at_ns {
                continue;
            }
            if found.is_some() && (at < at_ns || !first_at_instant) {
                break;
            }
            found = Some(launches);
            if at < at_ns || !first_at_instant {
                break;
            }
        }
        if found.is_some() {
            return found;
        }
        let first = self.marks.front().map_or(0, |(_, launches, _)| *launches);
        (!self.trimmed && first == 0).then_some(0)
    }

    /// Launches made by the process between `start_ns` and `end_ns`, when the launch
    /// probes were in for all of it.
    pub fn between(&self, start_ns: u64, end_ns: u64) -> Option<u64> {
        let covered = self
            .windows
            .iter()
            .any(|&(from, to)| from <= start_ns && to.is_none_or(|to| end_ns <= to));
        if !covered {
            return None;
        }
        Some(
            self.total_at(end_ns, false)?
                .saturating_sub(self.total_at(start_ns, true)?),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_difference_between_marks_inside_a_window() {
        let mut ledger = LaunchLedger::default();
        ledger.set_counting(true, 100, false);
        ledger.record_mark(200, 0, 0);
        ledger.record_mark(300, 12, 0);
        ledger.record_mark(400, 20, 0);
        assert_eq!(ledger.between(200, 300), Some(12));
        assert_eq!(ledger.between(200, 400), Some(20));
        // An end between two marks takes the earlier mark.
        assert_eq!(ledger.between(300, 350), Some(0));
        // Two marks at one instant: a span opens with the first, ends with the last.
        ledger.record_mark(500, 20, 0);
        ledger.record_mark(500, 26, 0);
        ledger.record_mark(600, 30, 0);
        assert_eq!(ledger.between(500, 600), Some(10));
        assert_eq!(ledger.between(400, 500), Some(6));
        assert!(!ledger.sampled());
    }

    #[test]
    fn no_count_for_a_span_the_probes_did_not_cover() {
        let mut ledger = LaunchLedger::default();
        ledger.record_mark(100, 0, 0);
        assert_eq!(ledger.between(100, 100), None, "probes never in");
        ledger.set_counting(true, 150, true);
        ledger.record_mark(200, 5, 0);
        ledger.set_counting(false, 250, true);
        ledger.record_mark(300, 5, 0);
        ledger.set_counting(true, 350, true);
        ledger.record_mark(400, 9, 0);
        ledger.record_mark(500, 15, 0);
        assert_eq!(ledger.between(100, 200), None, "began before the window");
        assert_eq!(ledger.between(200, 300), None, "ended after the window");
        assert_eq!(ledger.between(400, 500), Some(6));
        assert!(ledger.sampled());
    }

    #[test]
    fn before_the_first_mark_only_a_fresh_process_counts_from_zero() {
        let mut ledger = LaunchLedger::default();
        ledger.set_counting(true, 0, false);
        ledger.record_mark(100, 7, 0);
        assert_eq!(
            ledger.between(50, 100),
            None,
            "launches before the first mark"
        );
        let mut fresh = LaunchLedger::default();
        fresh.set_counting(true, 0, false);
        fresh.record_mark(100, 0, 0);
        fresh.record_mark(200, 4, 0);
        assert_eq!(fresh.between(50, 200), Some(4));
    }

    #[test]
    fn kernels_of_a_span_are_those_of_the_epochs_between_its_marks() {
        let mut ledger = LaunchLedger::default();
        ledger.set_counting(true, 0, false);
        let gemm: Arc<str> = Arc::from("gemm");
        let relu: Arc<str> = Arc::from("relu");
        // Launches before the first mark (epoch 0), then marks opening epochs 1..=3.
        ledger.add_kernel_launches(0, gemm.clone(), 5);
        ledger.record_mark(100, 5, 1);
        ledger.add_kernel_launches(1, gemm.clone(), 2);
        ledger.add_kernel_launches(1, relu.clone(), 3);
        ledger.record_mark(200, 10, 2);
        ledger.add_kernel_launches(2, relu.clone(), 4);
        ledger.record_mark(300, 14, 3);
        ledger.add_kernel_launches(3, gemm.clone(), 9);
        assert_eq!(
            ledger.top_kernels(100, 300, 10),
            Some(vec![(relu.clone(), 7), (gemm.clone(), 2)])
        );
        assert_eq!(ledger.top_kernels(300, 300, 1), Some(vec![]));
        // The process's end closes what is open: epoch 3 counts.
        ledger.record_mark(400, 23, LAST_EPOCH);
        assert_eq!(ledger.top_kernels(300, 400, 1), Some(vec![(gemm, 9)]));
        assert!(ledger.kernels.is_empty(), "taken by the spans that ended");
    }

    #[test]
    fn no_kernels_for_a_span_the_probes_did_not_cover() {
        let mut ledger = LaunchLedger::default();
        ledger.record_mark(100, 0, 1);
        ledger.add_kernel_launches(1, Arc::from("gemm"), 1);
        ledger.record_mark(200, 1, 2);
        assert_eq!(ledger.top_kernels(100, 200, 10), None);
    }

    #[test]
    fn memory_is_bounded() {
        let mut ledger = LaunchLedger::default();
        for i in 0..(MARKS_KEPT as u64 * 3) {
            ledger.record_mark(i, i, 0);
            ledger.set_counting(i % 2 == 0, i, true);
        }
        assert_eq!(ledger.marks.len(), MARKS_KEPT);
        assert!(ledger.windows.len() <= WINDOWS_KEPT);
        assert_eq!(ledger.between(0, 1), None, "trimmed history is not guessed");
        for epoch in 0..(EPOCHS_KEPT as u64 * 2) {
            ledger.add_kernel_launches(epoch, Arc::from("k"), 1);
        }
        assert_eq!(ledger.kernels.len(), EPOCHS_KEPT);
    }
}
