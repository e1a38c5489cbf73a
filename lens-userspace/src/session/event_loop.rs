//! The event loop: pump the ring buffer, the exit watchers, the ticks and the stop
//! signals into the sink until the targets exit, a signal arrives or the time is up.
use std::time::Duration;

use aya::maps::{MapData, RingBuf};
use aya_log::EbpfLogger;
use lens_common::LossCause;
use log::debug;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{Signal, SignalKind, signal},
    sync::mpsc,
    time::{Interval, MissedTickBehavior},
};

use crate::{
    error::Result,
    hangs::{self},
    sink::EventSink,
    summary::Losses,
    sys::target::{self, ExitStatus},
};

use super::{CALL_COUNTS_INTERVAL, DRAIN_INTERVAL, RunReport, Session, StopReason};

impl Session {
    pub(super) fn losses(&self) -> Losses {
        let mut losses = Losses {
            undecodable: self.events.undecodable,
            ..Losses::default()
        };
        for cause in LossCause::ALL {
            losses
                .kernel
                .insert(cause.name(), self.bpf.maps.losses.total(cause));
        }
        losses
    }

    /// Pumps events into `sink` until every target exited, SIGINT/SIGTERM/SIGHUP, or
    /// `limit`.
    pub async fn run(
        &mut self,
        sink: &mut dyn EventSink,
        limit: Option<Duration>,
    ) -> Result<RunReport> {
        let mut inputs = self.open_inputs(sink)?;
        let mut ticks = Ticks::new();
        let mut stopping = Stopping {
            deadline: limit.map(|limit| tokio::time::Instant::now() + limit),
            ..Stopping::default()
        };
        self.sync_launch_counting(sink);
        // Node mode watches for new processes until told to stop.
        while !self.targets.is_empty() || self.selection.node.is_some() {
            if !self
                .turn(&mut inputs, &mut ticks, &mut stopping, sink)
                .await?
            {
                break;
            }
            // Libraries attached while draining may have put launch probes in.
            self.sync_launch_counting(sink);
            if stopping.stop.is_some()
                && (stopping.grace_deadline.is_none() || self.targets.own_children().is_empty())
            {
                break;
            }
        }
        Ok(self.close_inputs(inputs, stopping.stop, sink))
    }

    /// The ring buffer and the kernel's logs registered with the runtime, the targets
    /// announced to `sink` and their exits watched, the stop signals caught.
    fn open_inputs(&mut self, sink: &mut dyn EventSink) -> Result<LoopInputs> {
        let ring = register(self.events.ring.take().expect("run is called once"))?;
        self.raise_priority();
        let logger = match self.events.logger.take() {
            Some(logger) => Some(register(logger)?),
            None => None,
        };
        let (exit_tx, exits) = mpsc::unbounded_channel::<u32>();
        self.events.exit_tx = Some(exit_tx);
        for pid in self.targets.pids() {
            let Some(target) = self.targets.get(pid) else {
                continue;
            };
            self.hangs
                .process_started(&target.info, target.info.traced_from_start);
            sink.on_process_start(&target.info);
            if let Some(pidfd) = self.targets.take_pidfd(pid) {
                self.watch_exit(pid, pidfd)?;
            }
        }
        let inputs = LoopInputs {
            ring,
            logger,
            exits,
            sigint: signal(SignalKind::interrupt())?,
            sigterm: signal(SignalKind::terminate())?,
            sighup: signal(SignalKind::hangup())?,
        };
        // Handlers in place: a stop signal held since start-up is delivered now.
        target::release_stop_signals();
        Ok(inputs)
    }

    /// Waits for the next input and handles it. `false`: the loop ends now (the time is
    /// up, or the grace after a stop signal).
    async fn turn(
        &mut self,
        inputs: &mut LoopInputs,
        ticks: &mut Ticks,
        stopping: &mut Stopping,
        sink: &mut dyn EventSink,
    ) -> Result<bool> {
        let grace = async {
            match stopping.grace_deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let until_deadline = async {
            match stopping.deadline {
                Some(at) if stopping.stop.is_none() => tokio::time::sleep_until(at).await,
                _ => std::future::pending().await,
            }
        };
        let log_ready = async {
            match inputs.logger.as_mut() {
                Some(logger) => logger.readable_mut().await.map(|mut g| {
                    g.get_inner_mut().flush();
                    g.clear_ready();
                }),
                None => std::future::pending().await,
            }
        };
        let ring = &mut inputs.ring;
        tokio::select! {
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                self.drain(guard.get_inner_mut(), sink);
                guard.clear_ready();
            }
            _ = ticks.drain.tick() => {
                self.drain(ring.get_mut(), sink);
                self.print_attach_status();
                self.python.expire_armed_loads(&mut self.bpf.maps.python);
            }
            // Under a budget its tick reads the counters (and scales the launches).
            _ = ticks.counts.tick(), if !self.costs.sampled() => {
                for (pid, calls) in self.call_counts() {
                    self.report_call_counts(pid, &calls, &calls, sink);
                }
            }
            _ = ticks.budget.tick(), if self.costs.sampled() => self.budget_tick(sink),
            _ = ticks.hangs.tick(), if self.hangs.watching() => {
                self.drain(ring.get_mut(), sink);
                self.check_hangs(sink);
            }
            _ = log_ready => {}
            Some(pid) = inputs.exits.recv() => {
                self.drain(ring.get_mut(), sink);
                // What was traced is said before it ends: a job shorter than the drain
                // tick (or one whose tick lost the race to its exit) still gets its line.
                self.print_attach_status();
                let exit = match self.targets.get(pid) {
                    Some(t) if t.own_child => wait_child(pid).await,
                    Some(t) => Some(t.exit.unwrap_or(ExitStatus::Unknown)),
                    None => Some(ExitStatus::Unknown),
                };
                self.finish_target(pid, exit, sink);
            }
            _ = inputs.sigint.recv() => self.on_signal(libc::SIGINT, stopping),
            _ = inputs.sigterm.recv() => self.on_signal(libc::SIGTERM, stopping),
            _ = inputs.sighup.recv() => self.on_signal(libc::SIGHUP, stopping),
            _ = until_deadline => {
                stopping.stop = Some(StopReason::Duration);
                return Ok(false);
            }
            _ = grace => return Ok(false),
        }
        Ok(true)
    }

    /// The last events drained, every target still here finished, the ring buffer given
    /// back: what the run did.
    fn close_inputs(
        &mut self,
        mut inputs: LoopInputs,
        stop: Option<StopReason>,
        sink: &mut dyn EventSink,
    ) -> RunReport {
        self.drain(inputs.ring.get_mut(), sink);
        for pid in self.targets.pids() {
            // Never leave a child of ours stopped at a library load.
            if self.targets.get(pid).is_some_and(|t| t.own_child) {
                target::resume(pid);
            }
            self.finish_target(pid, None, sink);
        }
        self.events.ring = Some(inputs.ring.into_inner());
        self.events.exit_tx = None;
        let budget = self.costs.report(crate::spans::monotonic_now_ns());
        RunReport {
            stop: stop.unwrap_or(StopReason::TargetsExited),
            losses: self.losses(),
            child_exit: self.targets.child_exit(),
            budget,
        }
    }

    /// [`Session::run`] on a single-threaded runtime of its own, for callers that are not
    /// async (the CLI, tests).
    pub fn run_blocking(
        &mut self,
        sink: &mut dyn EventSink,
        limit: Option<Duration>,
    ) -> Result<RunReport> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(self.run(sink, limit))
    }

    /// SIGINT/SIGTERM/SIGHUP: pass it on to the children we started and give them a grace
    /// period to exit (their exit is then traced); processes we attached to are left alone.
    fn on_signal(&mut self, signal: i32, stopping: &mut Stopping) {
        if stopping.stop.is_some() {
            return;
        }
        stopping.stop = Some(StopReason::Signal(signal));
        let children = self.targets.own_children();
        for pid in &children {
            // SAFETY: plain signal send to our own child.
            unsafe { libc::kill(*pid as libc::pid_t, signal) };
            target::resume(*pid);
        }
        if !children.is_empty() {
            stopping.grace_deadline = Some(tokio::time::Instant::now() + self.stop_grace);
        }
    }
}

/// What the loop waits on besides its clocks.
struct LoopInputs {
    ring: AsyncFd<RingBuf<MapData>>,
    logger: Option<AsyncFd<EbpfLogger<&'static dyn log::Log>>>,
    /// Pids whose exit a watcher saw.
    exits: mpsc::UnboundedReceiver<u32>,
    sigint: Signal,
    sigterm: Signal,
    sighup: Signal,
}

/// The loop's clocks.
struct Ticks {
    /// The ring buffer drained when no wakeup came.
    drain: Interval,
    /// The call counters read (without a budget).
    counts: Interval,
    /// The overhead budget's controller.
    budget: Interval,
    /// Hung collectives looked for.
    hangs: Interval,
}

impl Ticks {
    fn new() -> Ticks {
        let mut ticks = Ticks {
            drain: tokio::time::interval(DRAIN_INTERVAL),
            counts: tokio::time::interval(CALL_COUNTS_INTERVAL),
            budget: tokio::time::interval(crate::budget::TICK),
            hangs: tokio::time::interval(hangs::CHECK_INTERVAL),
        };
        ticks
            .hangs
            .set_missed_tick_behavior(MissedTickBehavior::Delay);
        // Ticks missed while the loop was busy are not made up in a burst: the controller
        // measures rates over the time that really passed.
        ticks
            .budget
            .set_missed_tick_behavior(MissedTickBehavior::Delay);
        ticks
    }
}

/// When the loop stops.
#[derive(Default)]
struct Stopping {
    /// Why, once known.
    stop: Option<StopReason>,
    /// `--duration`'s end.
    deadline: Option<tokio::time::Instant>,
    /// After a stop signal passed on to our children: how long they are traced on.
    grace_deadline: Option<tokio::time::Instant>,
}

/// Registers an fd-owning value with the runtime's reactor.
pub(super) fn register<T: std::os::fd::AsRawFd>(inner: T) -> std::io::Result<AsyncFd<T>> {
    // SAFETY: every `T` here (ring buffer, logger, pidfd) owns its fd and keeps it open
    // and unchanged for as long as it lives inside the AsyncFd.
    unsafe { AsyncFd::register(inner) }.map_err(|error| error.into_parts().1)
}

/// The pidfd said our child is gone; reap it (it may take a moment to become waitable).
pub(super) async fn wait_child(pid: u32) -> Option<ExitStatus> {
    for _ in 0..200 {
        if let Some(status) = target::try_wait_child(pid) {
            return Some(status);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// The event loop's thread runs at a higher priority than the jobs it traces while the
/// session lasts (nice `EVENT_LOOP_NICE`, restored after). On a node whose cores the job keeps
/// busy, a loop at the job's priority falls seconds behind: Python stacks are named from
/// the target's memory when they are read, and a process that ended meanwhile took its
/// names with it (a save just before a job's end went unseen). The loop's CPU time is
/// what its events cost, whatever its priority; only when it runs changes.
pub(super) struct EventLoopPriority {
    pub(super) tid: libc::id_t,
    pub(super) was: libc::c_int,
}

pub(super) const EVENT_LOOP_NICE: libc::c_int = -5;

impl EventLoopPriority {
    pub(super) fn raise() -> Option<EventLoopPriority> {
        // SAFETY: plain system calls on this thread's own scheduling priority.
        unsafe {
            let tid = libc::gettid() as libc::id_t;
            *libc::__errno_location() = 0;
            let was = libc::getpriority(libc::PRIO_PROCESS, tid);
            if *libc::__errno_location() != 0 || was <= EVENT_LOOP_NICE {
                return None;
            }
            if libc::setpriority(libc::PRIO_PROCESS, tid, EVENT_LOOP_NICE) != 0 {
                debug!(
                    "the event loop keeps nice {was}: {}",
                    std::io::Error::last_os_error()
                );
                return None;
            }
            Some(EventLoopPriority { tid, was })
        }
    }
}

impl Drop for EventLoopPriority {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, self.tid, self.was) };
    }
}
