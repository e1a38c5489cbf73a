//! The traced processes, as a component: each target's facts (who it is, whether we
//! started it, its `TARGETS` flags, how it ended), the process started with `--exec`, and
//! the rules that follow a target through fork and exec and decide when its launches
//! count. It owns its state; the session does the attaching and the kernel's maps.
use std::{collections::HashMap, os::fd::OwnedFd};

use lens_common::TARGET_STOP_ON_LINK_MAP_CHANGE;

use crate::sys::target::{ExitStatus, ProcessInfo};

pub(super) struct Target {
    pub(super) info: ProcessInfo,
    /// Started by us (`--exec`): we can collect its exit status.
    pub(super) own_child: bool,
    /// `TARGET_*` flags of its `TARGETS` entry (a fork inherits them).
    flags: u32,
    /// Its pidfd, until the event loop watches it.
    pidfd: Option<OwnedFd>,
    /// The sink was told its launches are being counted.
    launches_counted: bool,
    /// ... at some time.
    launches_seen: bool,
    /// How it ended, as the kernel's exit tracepoint said (its parent reaps it, not us).
    pub(super) exit: Option<ExitStatus>,
    /// When lens-probe began tracing it (monotonic clock): its call counts start there.
    pub(super) traced_since_ns: u64,
}

/// How a process became a target.
pub(super) enum Arrival {
    /// Attached while it ran (`--pid`, node mode): its pidfd, when the event loop does not
    /// watch it yet.
    Attached(Option<OwnedFd>),
    /// Started by us (`--exec`), stopped at each library load.
    Started(OwnedFd),
    /// Forked by target `parent`, whose flags it inherits.
    Forked { parent: u32 },
}

/// A change in whether a target's launches are counted, for the sinks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LaunchCounting {
    pub(super) pid: u32,
    pub(super) counted: bool,
    /// Where its count starts (0: with the process).
    pub(super) since_ns: u64,
}

#[derive(Default)]
pub(super) struct TargetTable {
    targets: HashMap<u32, Target>,
    /// The process started with `--exec`, and how it ended.
    child: Option<u32>,
    child_exit: Option<ExitStatus>,
}

impl TargetTable {
    /// `info` becomes a target at `now_ns`. Returns the flags of its `TARGETS` entry.
    pub(super) fn add(&mut self, info: ProcessInfo, arrival: Arrival, now_ns: u64) -> u32 {
        let pid = info.pid;
        let (own_child, flags, pidfd) = match arrival {
            Arrival::Attached(pidfd) => (false, 0, pidfd),
            Arrival::Started(pidfd) => {
                self.child = Some(pid);
                (true, TARGET_STOP_ON_LINK_MAP_CHANGE, Some(pidfd))
            }
            Arrival::Forked { parent } => (false, self.flags_of(parent), None),
        };
        self.targets.insert(
            pid,
            Target {
                info,
                own_child,
                flags,
                pidfd,
                launches_counted: false,
                launches_seen: false,
                exit: None,
                traced_since_ns: now_ns,
            },
        );
        flags
    }

    /// The flags a process started by us is registered with, before it is a target.
    pub(super) const STARTED_FLAGS: u32 = TARGET_STOP_ON_LINK_MAP_CHANGE;

    /// The `TARGETS` flags of `pid` (0 when it is not a target).
    pub(super) fn flags_of(&self, pid: u32) -> u32 {
        self.targets.get(&pid).map_or(0, |t| t.flags)
    }

    pub(super) fn contains(&self, pid: u32) -> bool {
        self.targets.contains_key(&pid)
    }

    pub(super) fn get(&self, pid: u32) -> Option<&Target> {
        self.targets.get(&pid)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.targets.len()
    }

    /// Every target's pid, in order.
    pub(super) fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.targets.keys().copied().collect();
        pids.sort_unstable();
        pids
    }

    /// The targets lens-probe started, in order.
    pub(super) fn own_children(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .targets
            .iter()
            .filter(|(_, t)| t.own_child)
            .map(|(pid, _)| *pid)
            .collect();
        pids.sort_unstable();
        pids
    }

    /// `pid`'s pidfd, once: the event loop now watches it.
    pub(super) fn take_pidfd(&mut self, pid: u32) -> Option<OwnedFd> {
        self.targets.get_mut(&pid)?.pidfd.take()
    }

    /// The kernel saw `pid` exit with `status` (its parent reaps it).
    pub(super) fn exited(&mut self, pid: u32, status: ExitStatus) {
        if let Some(target) = self.targets.get_mut(&pid) {
            target.exit = Some(status);
        }
    }

    /// `pid` runs a new program, `info` now: a new job for the sinks, whose launch
    /// counting starts afresh. Returns what it is, if it is a target.
    pub(super) fn executed(&mut self, pid: u32, mut info: ProcessInfo) -> Option<&ProcessInfo> {
        let target = self.targets.get_mut(&pid)?;
        info.traced_from_start = true;
        target.info = info;
        target.launches_counted = false;
        target.launches_seen = false;
        Some(&target.info)
    }

    /// `pid` is traced no more, having ended with `exit` (when known).
    pub(super) fn remove(&mut self, pid: u32, exit: Option<ExitStatus>) -> Option<Target> {
        let target = self.targets.remove(&pid)?;
        if self.child == Some(pid) {
            self.child_exit = exit;
        }
        Some(target)
    }

    /// How the process started with `--exec` ended, once it did.
    pub(super) fn child_exit(&self) -> Option<ExitStatus> {
        self.child_exit
    }

    /// The rank of `pid`, as its environment says.
    pub(super) fn rank_of(&self, pid: u32) -> Option<i64> {
        let target = self.targets.get(&pid)?;
        target.info.rank.as_ref().map(|rank| rank.rank)
    }

    /// The targets whose launches began or stopped being counted at `now_ns`, as
    /// `counts_launches` says of each now (their launch probes went in or out).
    pub(super) fn launch_counting(
        &mut self,
        counts_launches: impl Fn(u32) -> bool,
        now_ns: u64,
    ) -> Vec<LaunchCounting> {
        let mut changes = Vec::new();
        for (pid, target) in &mut self.targets {
            let counted = counts_launches(*pid);
            if counted == target.launches_counted {
                continue;
            }
            // A process traced from its start had its libraries probed as they loaded,
            // before any launch: its count starts with it.
            let since_ns = if counted && !target.launches_seen && target.info.traced_from_start {
                0
            } else {
                now_ns
            };
            target.launches_counted = counted;
            target.launches_seen |= counted;
            changes.push(LaunchCounting {
                pid: *pid,
                counted,
                since_ns,
            });
        }
        changes.sort_unstable_by_key(|change| change.pid);
        changes
    }

    /// Every target's launches stop being counted (the launch probes go out): the ones
    /// whose launches were.
    pub(super) fn stop_counting_launches(&mut self) -> Vec<u32> {
        let mut stopped: Vec<u32> = self
            .targets
            .iter_mut()
            .filter_map(|(pid, t)| std::mem::take(&mut t.launches_counted).then_some(*pid))
            .collect();
        stopped.sort_unstable();
        stopped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::target::RankInfo;

    fn info(pid: u32, traced_from_start: bool) -> ProcessInfo {
        ProcessInfo {
            pid,
            name: "python".into(),
            command_line: vec!["python".into(), "train.py".into()],
            traced_from_start,
            rank: None,
            view: Default::default(),
        }
    }

    fn pidfd() -> OwnedFd {
        crate::sys::target::pidfd_open(std::process::id()).unwrap()
    }

    #[test]
    fn a_fork_inherits_its_parents_flags_and_the_started_child_ends_the_run() {
        let mut table = TargetTable::default();
        let flags = table.add(info(10, true), Arrival::Started(pidfd()), 5);
        assert_eq!(flags, TargetTable::STARTED_FLAGS);
        assert_eq!(
            table.add(info(11, true), Arrival::Forked { parent: 10 }, 6),
            flags
        );
        assert_eq!(table.add(info(20, false), Arrival::Attached(None), 7), 0);
        assert_eq!(
            table.add(info(21, true), Arrival::Forked { parent: 20 }, 8),
            0
        );
        assert_eq!(table.own_children(), vec![10]);
        assert!(table.take_pidfd(10).is_some());
        assert!(table.take_pidfd(10).is_none(), "watched once");
        table.exited(11, ExitStatus::Exited(3));
        assert_eq!(
            table.remove(11, None).unwrap().exit,
            Some(ExitStatus::Exited(3))
        );
        assert_eq!(table.child_exit(), None, "a fork's end is not the run's");
        table.remove(10, Some(ExitStatus::Exited(0)));
        assert_eq!(table.child_exit(), Some(ExitStatus::Exited(0)));
        assert_eq!(table.pids(), vec![20, 21]);
    }

    #[test]
    fn launches_count_from_the_start_only_the_first_time_of_a_process_traced_from_it() {
        let mut table = TargetTable::default();
        table.add(info(1, true), Arrival::Attached(None), 0);
        table.add(info(2, false), Arrival::Attached(None), 0);
        let change = |pid, counted, since_ns| LaunchCounting {
            pid,
            counted,
            since_ns,
        };
        assert_eq!(
            table.launch_counting(|_| true, 100),
            vec![change(1, true, 0), change(2, true, 100)]
        );
        assert!(table.launch_counting(|_| true, 150).is_empty(), "no change");
        // An overhead budget's pause, then a window: counted from the window's start.
        assert_eq!(table.stop_counting_launches(), vec![1, 2]);
        assert!(table.stop_counting_launches().is_empty());
        assert_eq!(
            table.launch_counting(|pid| pid == 1, 300),
            vec![change(1, true, 300)]
        );
        // A new program: a new job, whose count starts with it.
        let mut new = info(1, false);
        new.rank = Some(RankInfo {
            rank: 3,
            world_size: Some(4),
            local_rank: Some(3),
        });
        assert!(table.executed(1, new).unwrap().traced_from_start);
        assert_eq!(table.rank_of(1), Some(3));
        assert_eq!(
            table.launch_counting(|pid| pid == 1, 400),
            vec![change(1, true, 0)]
        );
        assert!(table.executed(99, info(99, false)).is_none());
    }
}
