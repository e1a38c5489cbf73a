//! GPU memory peaks on the spans that cover them: each process's held bytes as its memory
//! calls changed them (`gpu_memory`), read when a `train.step` (that step's peak) or
//! `train.job` (the run's) goes out.
use std::collections::{HashMap, VecDeque};

use super::{SpanRecord, names};
use crate::semconv;

/// Changes kept per process: steps go out within `spans::pending`'s wait, and a step
/// rarely sees more than a few allocator misses; past this the oldest go.
const KEPT_CHANGES: usize = 4096;

#[derive(Debug, Default)]
struct ProcessMemory {
    /// (when, bytes held from then on), in time order.
    changes: VecDeque<(u64, u64)>,
    peak: u64,
}

#[derive(Debug, Default)]
pub struct MemoryPeaks {
    processes: HashMap<u32, ProcessMemory>,
}

impl MemoryPeaks {
    /// `pid` held `held` bytes from `at_ns` on; `peak` is the most it held so far.
    pub fn record(&mut self, pid: u32, at_ns: u64, held: u64, peak: u64) {
        let process = self.processes.entry(pid).or_default();
        if process.changes.len() == KEPT_CHANGES {
            process.changes.pop_front();
        }
        process.changes.push_back((at_ns, held));
        process.peak = process.peak.max(peak);
    }

    /// Sets the peak attribute of a step (its own) or a job span (the run's), where the
    /// process made memory calls.
    pub fn annotate(&self, span: &mut SpanRecord) {
        let Some(process) = self.processes.get(&span.pid) else {
            return;
        };
        let peak = match span.name {
            names::JOB => process.peak,
            names::STEP => process.peak_between(span.start_ns, span.end_ns),
            _ => return,
        };
        span.attributes
            .push((semconv::DL_GPU_MEMORY_PEAK, peak.into()));
    }

    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }
}

impl ProcessMemory {
    /// The most held in `[start, end]`: what was held at its start, and every change in it.
    fn peak_between(&self, start: u64, end: u64) -> u64 {
        let before = self.changes.partition_point(|&(at, _)| at <= start);
        let at_start = before.checked_sub(1).map_or(0, |i| self.changes[i].1);
        let during = self
            .changes
            .range(before..)
            .take_while(|&&(at, _)| at <= end);
        during.fold(at_start, |peak, &(_, held)| peak.max(held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::groups::SpanGroup;
    use crate::spans::{SpanId, SpanStatus};

    fn span(name: &'static str, start_ns: u64, end_ns: u64) -> SpanRecord {
        SpanRecord {
            id: SpanId(1),
            parent: None,
            name,
            group: SpanGroup::Step,
            pid: 7,
            tid: 7,
            start_ns,
            end_ns,
            attributes: Vec::new(),
            events: Vec::new(),
            status: SpanStatus::Unset,
        }
    }

    #[test]
    fn a_step_gets_the_most_held_while_it_ran_and_the_job_the_runs() {
        let mut peaks = MemoryPeaks::default();
        peaks.record(7, 100, 1_000, 1_000);
        peaks.record(7, 250, 5_000, 5_000);
        peaks.record(7, 260, 2_000, 5_000);
        peaks.record(7, 400, 3_000, 5_000);
        // Held 1 000 at its start, 5 000 for a while inside it.
        let mut first = span(names::STEP, 200, 300);
        peaks.annotate(&mut first);
        assert_eq!(first.int_attr(semconv::DL_GPU_MEMORY_PEAK), Some(5_000));
        // Nothing changed inside it: what was held when it began.
        let mut second = span(names::STEP, 300, 390);
        peaks.annotate(&mut second);
        assert_eq!(second.int_attr(semconv::DL_GPU_MEMORY_PEAK), Some(2_000));
        let mut job = span(names::JOB, 0, 1_000);
        peaks.annotate(&mut job);
        assert_eq!(job.int_attr(semconv::DL_GPU_MEMORY_PEAK), Some(5_000));
        // Other spans, and processes without memory calls, get nothing.
        let mut other = span(names::OPTIMIZER, 200, 300);
        peaks.annotate(&mut other);
        assert!(other.attributes.is_empty());
    }
}
