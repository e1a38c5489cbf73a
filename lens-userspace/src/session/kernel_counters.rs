//! The per-kernel launch counters (`KERNEL_COUNTS`, `step` group on), as a component: it
//! takes the phase marks of each batch (they say which epochs are complete), reads the
//! counters of the processes whose marks carry new launches, names their kernels and hands
//! the launches to the sink; it forgets a process that ends. Its state is its own; the
//! kernel's maps come in through [`KernelCountMaps`], so the logic is tested without BPF.
use std::collections::HashMap;

use lens_common::{HandleKey, KernelKey};

use crate::{
    bpf::maps::LaunchMaps,
    events::ProbeEvent,
    gpu_kernels::{KernelLaunches, KernelNames},
    sink::EventSink,
};

/// What the component needs of the kernel: the per-kernel counters, and the names CUDA
/// modules registered for their host stubs.
pub(super) trait KernelCountMaps {
    /// The counters of the processes `wanted` says yes to.
    fn counters_of(&self, wanted: &dyn Fn(u32) -> bool) -> Vec<(KernelKey, u64)>;
    fn remove_counter(&mut self, key: &KernelKey);
    /// Every counter of `pid`, gone.
    fn forget_counters(&mut self, pid: u32);
    /// Where `pid` registered the name of host stub `function`, if it did.
    fn registered_name(&self, pid: u32, function: u64) -> Option<u64>;
}

impl KernelCountMaps for LaunchMaps {
    fn counters_of(&self, wanted: &dyn Fn(u32) -> bool) -> Vec<(KernelKey, u64)> {
        self.kernel_counts
            .keys_of(wanted)
            .into_iter()
            .filter_map(|key| Some((key, self.kernel_counts.get(&key)?)))
            .collect()
    }

    fn remove_counter(&mut self, key: &KernelKey) {
        self.kernel_counts.remove(key);
    }

    fn forget_counters(&mut self, pid: u32) {
        self.kernel_counts.forget(pid);
    }

    fn registered_name(&self, pid: u32, function: u64) -> Option<u64> {
        self.kernel_registry.get(&HandleKey {
            tgid: pid,
            _pad: 0,
            handle: function,
        })
    }
}

/// The per-kernel launch counters as read so far.
#[derive(Default)]
pub(super) struct KernelCounters {
    names: KernelNames,
    /// Each counter's value at the last read.
    seen: HashMap<KernelKey, u64>,
    /// The newest epoch each process's phase marks opened: counters of older epochs are
    /// complete and are removed once read.
    epochs: HashMap<u32, u64>,
    /// Each process's launch total as the newest mark read carried it: a batch of marks
    /// that carry no more launches has nothing new to read, and the read is skipped
    /// (walking even an empty hash map visits every bucket: it was a tenth of
    /// lens-probe's CPU on a CPU-only loop).
    launches_read: HashMap<u32, u64>,
}

impl KernelCounters {
    /// Takes a batch's events before they go on (phase marks may close steps, so the
    /// launches before them are handed to the sink first: every one of them has been
    /// counted by now).
    pub(super) fn on_batch<'a>(
        &mut self,
        events: impl Iterator<Item = &'a ProbeEvent>,
        maps: &mut dyn KernelCountMaps,
        sink: &mut dyn EventSink,
    ) {
        let mut marked = Vec::new();
        for event in events {
            let Some((tgid, epoch, launches)) = mark_of(event) else {
                continue;
            };
            let newest = self.epochs.entry(tgid).or_default();
            *newest = (*newest).max(epoch);
            // Marks carry the launch total: none since the last read, nothing new to read.
            let read = self.launches_read.entry(tgid).or_default();
            if launches > *read {
                *read = launches;
                if !marked.contains(&tgid) {
                    marked.push(tgid);
                }
            }
        }
        if !marked.is_empty() {
            self.read(&marked, false, maps, sink);
        }
    }

    /// Reads the counters of `pids` (all of them with `all`, for a process that ended)
    /// and hands what is new to the sink, named. Counters of epochs older than the newest
    /// mark seen are complete: they are removed once read.
    pub(super) fn read(
        &mut self,
        pids: &[u32],
        all: bool,
        maps: &mut dyn KernelCountMaps,
        sink: &mut dyn EventSink,
    ) {
        let mut new: HashMap<u32, Vec<(KernelKey, u64)>> = HashMap::new();
        for (key, value) in maps.counters_of(&|pid| pids.contains(&pid)) {
            let seen = self.seen.entry(key).or_default();
            let delta = value.saturating_sub(*seen);
            *seen = value;
            let newest = self.epochs.get(&key.tgid).copied().unwrap_or(0);
            if all || u64::from(key.epoch) < newest {
                maps.remove_counter(&key);
                self.seen.remove(&key);
            }
            if delta > 0 {
                new.entry(key.tgid).or_default().push((key, delta));
            }
        }
        for (pid, entries) in new {
            let functions: Vec<(u64, bool)> = entries
                .iter()
                .map(|(key, _)| (key.function(), key.driver()))
                .collect();
            // Stubs without a symbol are named as their module registered them.
            let registered = |function: u64| maps.registered_name(pid, function);
            let names = self.names.resolve(pid, &functions, &registered);
            let launches: Vec<KernelLaunches> = entries
                .iter()
                .zip(names)
                .map(|((key, launches), name)| KernelLaunches {
                    epoch: key.epoch.into(),
                    name,
                    launches: *launches,
                })
                .collect();
            sink.on_kernel_launches(pid, &launches);
        }
    }

    /// Forgets `pid` (it ended, or runs a new program whose kernels are new), here and
    /// in the kernel.
    pub(super) fn forget(&mut self, pid: u32, maps: &mut dyn KernelCountMaps) {
        maps.forget_counters(pid);
        self.seen.retain(|key, _| key.tgid != pid);
        self.epochs.remove(&pid);
        self.launches_read.remove(&pid);
        self.names.forget(pid);
    }
}

/// A phase mark's process, the epoch it opens and the launches it carries: the events
/// that say launches before them are complete.
fn mark_of(event: &ProbeEvent) -> Option<(u32, u64, u64)> {
    match *event {
        ProbeEvent::Phase {
            tgid,
            epoch,
            launches,
            ..
        }
        | ProbeEvent::RuleCall {
            tgid,
            epoch,
            launches,
            ..
        }
        | ProbeEvent::PyStack {
            tgid,
            epoch,
            launches,
            ..
        } => Some((tgid, epoch, launches)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::sink::SinkInput;

    /// The kernel's side: counters by key, no registered names.
    #[derive(Default)]
    struct FakeMaps {
        counters: BTreeMap<KernelKey, u64>,
        /// How often the counters were walked.
        walks: std::cell::Cell<usize>,
    }

    impl KernelCountMaps for FakeMaps {
        fn counters_of(&self, wanted: &dyn Fn(u32) -> bool) -> Vec<(KernelKey, u64)> {
            self.walks.set(self.walks.get() + 1);
            self.counters
                .iter()
                .filter(|(key, _)| wanted(key.tgid))
                .map(|(key, value)| (*key, *value))
                .collect()
        }
        fn remove_counter(&mut self, key: &KernelKey) {
            self.counters.remove(key);
        }
        fn forget_counters(&mut self, pid: u32) {
            self.counters.retain(|key, _| key.tgid != pid);
        }
        fn registered_name(&self, _: u32, _: u64) -> Option<u64> {
            None
        }
    }

    impl FakeMaps {
        fn count(&mut self, tgid: u32, epoch: u32, launches: u64) {
            // A handle outside any mapping: named by its address, whatever runs the test.
            let key = KernelKey {
                tgid,
                epoch,
                function: 0x10 | KernelKey::DRIVER,
            };
            *self.counters.entry(key).or_default() += launches;
        }
    }

    /// Launches handed to the sink: (pid, epoch, launches).
    #[derive(Default)]
    struct Launches(Vec<(u32, u64, u64)>);

    impl EventSink for Launches {
        fn on(&mut self, input: &SinkInput<'_>) {
            if let SinkInput::KernelLaunches { pid, launches } = input {
                for kernel in launches.iter() {
                    self.0.push((*pid, kernel.epoch, kernel.launches));
                }
            }
        }
    }

    fn mark(tgid: u32, epoch: u64, launches: u64) -> ProbeEvent {
        ProbeEvent::Phase {
            tgid,
            tid: tgid,
            at_ns: 0,
            launches,
            epoch,
            signal: crate::events::PhaseSignal::BackwardStart,
        }
    }

    #[test]
    fn a_mark_hands_on_the_launches_before_it_and_removes_the_closed_epochs_counters() {
        let (mut counters, mut maps, mut sink) = (
            KernelCounters::default(),
            FakeMaps::default(),
            Launches::default(),
        );
        maps.count(7, 1, 5);
        counters.on_batch([mark(7, 2, 5)].iter(), &mut maps, &mut sink);
        assert_eq!(sink.0, [(7, 1, 5)]);
        assert!(maps.counters.is_empty(), "epoch 1 is complete: removed");
        // The open epoch is read as it grows, its counter left in place.
        maps.count(7, 2, 3);
        counters.on_batch([mark(7, 2, 8)].iter(), &mut maps, &mut sink);
        assert_eq!(maps.counters.len(), 1, "the open epoch's counter stays");
        maps.count(7, 2, 1);
        counters.on_batch([mark(7, 3, 9)].iter(), &mut maps, &mut sink);
        assert_eq!(sink.0, [(7, 1, 5), (7, 2, 3), (7, 2, 1)]);
        assert!(maps.counters.is_empty());
    }

    #[test]
    fn marks_that_carry_no_new_launches_read_nothing() {
        let (mut counters, mut maps, mut sink) = (
            KernelCounters::default(),
            FakeMaps::default(),
            Launches::default(),
        );
        maps.count(7, 1, 2);
        counters.on_batch([mark(7, 2, 2)].iter(), &mut maps, &mut sink);
        assert_eq!(maps.walks.get(), 1);
        // Marks of 7 carrying the same total: the counters are not walked again.
        counters.on_batch([mark(7, 3, 2), mark(7, 4, 2)].iter(), &mut maps, &mut sink);
        assert_eq!(maps.walks.get(), 1);
        // A mark with more launches is read, and only its own process's counters.
        maps.count(8, 1, 4);
        maps.count(7, 4, 1);
        counters.on_batch([mark(7, 5, 3)].iter(), &mut maps, &mut sink);
        assert_eq!(sink.0, [(7, 1, 2), (7, 4, 1)]);
        assert_eq!(maps.counters.len(), 1, "8's counter is not 7's to read");
    }

    #[test]
    fn a_process_that_ends_has_every_counter_read_then_forgotten() {
        let (mut counters, mut maps, mut sink) = (
            KernelCounters::default(),
            FakeMaps::default(),
            Launches::default(),
        );
        maps.count(7, 1, 2);
        counters.on_batch([mark(7, 1, 2)].iter(), &mut maps, &mut sink);
        maps.count(7, 1, 3);
        counters.read(&[7], true, &mut maps, &mut sink);
        counters.forget(7, &mut maps);
        assert_eq!(sink.0, [(7, 1, 2), (7, 1, 3)]);
        assert!(maps.counters.is_empty());
        // A new program in the same pid starts its epochs over.
        maps.count(7, 1, 1);
        counters.on_batch([mark(7, 2, 1)].iter(), &mut maps, &mut sink);
        assert_eq!(sink.0.last(), Some(&(7, 1, 1)));
    }
}
