//! Event-path throughput: how many events a second the user side takes from the ring
//! buffer, decodes and builds spans from, and where events start to be lost.
//!
//! No traced program can produce enough events for that (one uprobe hit costs ~1 µs), so
//! the kernel side is the generator `bench_emit` (`lens-ebpf/src/bench_gen.rs`, in an
//! object of its own that lens-probe's does not contain): a raw tracepoint program run
//! here with `BPF_PROG_TEST_RUN`. Each run writes up to [`MAX_EVENTS_PER_RUN`]
//! `ncclAllReduce` records into an `EVENTS` ring buffer made and woken as the probes'
//! is (`lens-ebpf/src/ring.rs`), and returns
//! how many did not fit. A producer thread runs it at a paced rate; the calling thread
//! drains the ring buffer as [`Session`](lens_probe::session::Session) does (woken by the
//! kernel past the wakeup threshold, and every 50 ms), decodes every record with
//! [`events::decode`] and feeds the sink (the CLI's chain: summary and span builder).
//!
//! Used by `cargo xtask bench` (through the `throughput` example, `main.rs` beside this
//! file) and by the `throughput` integration test, which includes this file: a bench
//! harness, kept out of the library lens-probe ships.
// Each of its two users takes a part of it.
#![allow(dead_code)]
use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use aya::{
    maps::{MapData, RingBuf},
    programs::{RawTracePoint, RawTracePointRunOptions, TestRun},
};
use serde::Serialize;
use tokio::{io::unix::AsyncFd, sync::oneshot};

use lens_probe::{
    error::{LensError, Result},
    events::{self, Decoded},
    sink::{EventSink, ProcessEnd},
    sys::{privileges, target::ProcessInfo},
};

/// The generator's BPF object (`lens-ebpf/src/bench.rs`), built beside lens-probe's.
static BENCH_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lens-ebpf-bench.o"));

/// The generator program in that object.
pub const PROGRAM: &str = "bench_emit";
/// Events one run of the generator writes at most (its loop bound, in bench_gen.rs).
pub const MAX_EVENTS_PER_RUN: u32 = 64;
/// The element count of the generated collectives (a 4 MiB float32 all-reduce).
pub const EVENT_COUNT: u64 = 1 << 20;
/// What the generated events look like once decoded (bench_gen.rs writes these).
pub const EVENT_COMM: u64 = 0xC0FF_EE00;
pub const EVENT_STREAM: u64 = 0x5000;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    /// Events a second the producer aims at; `None`: as fast as it can.
    pub rate: Option<f64>,
    /// Stop after this many events…
    pub events: Option<u64>,
    /// …or after this long, whichever comes first (at least one must be set).
    pub duration: Option<Duration>,
    /// Events per generator run (1 to [`MAX_EVENTS_PER_RUN`]).
    pub events_per_run: u32,
    /// Pin the producer and the draining thread to these CPUs (producer, consumer). The
    /// kernel wakes the reader on the waker's CPU, so unpinned the two often end up
    /// sharing one core, and the producer's speed then limits what is measured.
    pub pin: Option<(usize, usize)>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            rate: None,
            events: None,
            duration: Some(Duration::from_secs(1)),
            events_per_run: MAX_EVENTS_PER_RUN,
            pin: None,
        }
    }
}

/// What one run measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// Events a second asked for (`None`: unpaced).
    pub target_rate: Option<f64>,
    /// Events the generator was asked to write.
    pub sent: u64,
    /// Of those, not written because the ring buffer was full.
    pub lost_ring_full: u64,
    /// Records read from the ring buffer.
    pub received: u64,
    /// Records that did not decode.
    pub undecodable: u64,
    /// Generator runs (`BPF_PROG_TEST_RUN` calls).
    pub runs: u64,
    /// First run → last run returned, s.
    pub producer_s: f64,
    /// First run → last record drained, s.
    pub elapsed_s: f64,
    /// CPU time of the draining thread (ring buffer, decoding, sinks) over the run, s.
    pub consumer_cpu_s: f64,
    /// CPU time of the producer thread (the generator runs in it, in the kernel), s.
    pub producer_cpu_s: f64,
    /// Drains on a wakeup from the kernel, and on the session's drain timer.
    pub wakeup_drains: u64,
    pub timer_drains: u64,
}

impl Report {
    /// Events lost in all: ring buffer full, not read back, or undecodable.
    pub fn lost(&self) -> u64 {
        self.sent.saturating_sub(self.received) + self.undecodable
    }

    /// Events received a second, over [`Report::elapsed_s`].
    pub fn received_rate(&self) -> f64 {
        if self.elapsed_s > 0.0 {
            self.received as f64 / self.elapsed_s
        } else {
            0.0
        }
    }
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: plain syscall writing into a local.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Pins the calling thread to `cpu`; returns its affinity before, to restore.
fn pin_to(cpu: usize) -> std::io::Result<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is plain bits; the calls only read and write these locals.
    unsafe {
        let mut before: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut before) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(before)
    }
}

fn restore_affinity(set: &libc::cpu_set_t) {
    // SAFETY: as in `pin_to`.
    unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), set) };
}

fn gettid() -> u32 {
    // SAFETY: plain syscall.
    unsafe { libc::gettid() as u32 }
}

/// What the producer thread reports when done.
struct Produced {
    sent: u64,
    lost: u64,
    runs: u64,
    started: Instant,
    ended: Instant,
    cpu: Duration,
}

/// Runs the generator from a thread of its own at `options.rate`, for
/// `options.events` / `options.duration`, while this thread drains the ring buffer into
/// `sink` exactly as a tracing session does. The events carry this process's pid (it is
/// announced to the sink as a target first) and the producer thread's tid.
pub fn run(options: Options, sink: &mut dyn EventSink) -> Result<Report> {
    if options.events.is_none() && options.duration.is_none() {
        return Err(LensError::InvalidSetting {
            key: "throughput".into(),
            value: "no limit".into(),
            reason: "give a number of events or a duration".into(),
        });
    }
    if !(1..=MAX_EVENTS_PER_RUN).contains(&options.events_per_run) {
        return Err(LensError::InvalidSetting {
            key: "events per run".into(),
            value: options.events_per_run.to_string(),
            reason: format!("expected 1 to {MAX_EVENTS_PER_RUN}"),
        });
    }
    privileges::check()?;
    // The generator's own object: its ring buffer is defined and woken as the probes'
    // (lens-ebpf/src/ring.rs, one source for both objects).
    let mut ebpf = aya::Ebpf::load(BENCH_OBJECT)?;
    let ring = lens_probe::bpf::programs::take_event_ring(&mut ebpf)?;
    let program: &mut RawTracePoint = lens_probe::bpf::program_mut(&mut ebpf, PROGRAM)?;
    program.load().map_err(|source| LensError::Program {
        program: PROGRAM,
        source,
    })?;
    let program: &RawTracePoint = program;

    let pid = std::process::id();
    let info = ProcessInfo::read(pid)?;
    sink.on_process_start(&info);

    let before = match options.pin {
        Some((_, consumer)) => Some(pin_to(consumer)?),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let stop = Arc::new(AtomicBool::new(false));
    let (done_tx, done_rx) = oneshot::channel::<Result<Produced>>();
    let report = std::thread::scope(|scope| -> Result<Report> {
        let producer_stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("lens-bench-gen".into())
            .spawn_scoped(scope, move || {
                let produced = produce(program, pid, options, &producer_stop);
                let _ = done_tx.send(produced);
            })?;
        let consumed = runtime.block_on(consume(ring, sink, done_rx));
        // Whatever happened here, the producer must end for the scope to.
        stop.store(true, Ordering::Relaxed);
        consumed
    });
    if let Some(before) = &before {
        restore_affinity(before);
    }
    let report = report?;
    sink.on_process_end(&ProcessEnd {
        pid,
        ..ProcessEnd::default()
    });
    Ok(Report {
        target_rate: options.rate,
        ..report
    })
}

/// The producer: runs the generator, paced, until the limit; says what it sent.
fn produce(
    program: &RawTracePoint,
    pid: u32,
    options: Options,
    stop: &AtomicBool,
) -> Result<Produced> {
    if let Some((producer, _)) = options.pin {
        pin_to(producer)?;
    }
    let cpu0 = thread_cpu();
    let tid = gettid();
    let limit = options.events.unwrap_or(u64::MAX);
    let per_run = u64::from(options.events_per_run);
    let started = Instant::now();
    let deadline = options.duration.map(|d| started + d);
    let (mut sent, mut lost, mut runs) = (0u64, 0u64, 0u64);
    while sent < limit && !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            break;
        }
        if let Some(rate) = options.rate {
            // Paced: never ahead of `rate`; when ahead, sleep until a run is due.
            let due = (now.duration_since(started).as_secs_f64() * rate) as u64;
            if sent >= due {
                let ahead = (sent + per_run - due) as f64 / rate;
                std::thread::sleep(Duration::from_secs_f64(ahead.min(0.001)));
                continue;
            }
        }
        let wanted = per_run.min(limit - sent);
        let mut run = RawTracePointRunOptions::new();
        run.args[0] = u64::from(pid);
        run.args[1] = u64::from(tid);
        run.args[2] = wanted;
        run.args[3] = EVENT_COUNT;
        let result = program.test_run(run).map_err(|source| LensError::Program {
            program: PROGRAM,
            source,
        })?;
        lost += u64::from(result.return_value);
        sent += wanted;
        runs += 1;
    }
    Ok(Produced {
        sent,
        lost,
        runs,
        started,
        ended: Instant::now(),
        cpu: thread_cpu().saturating_sub(cpu0),
    })
}

/// The consumer, as `Session::run` drains: on the kernel's wakeup or every 50 ms, until
/// the producer is done; then one last drain.
async fn consume(
    ring: RingBuf<MapData>,
    sink: &mut dyn EventSink,
    mut done: oneshot::Receiver<Result<Produced>>,
) -> Result<Report> {
    let cpu0 = thread_cpu();
    // SAFETY: the ring buffer owns its fd and keeps it open while inside the AsyncFd.
    let mut ring = unsafe { AsyncFd::register(ring) }.map_err(|e| e.into_parts().1)?;
    let mut tick = tokio::time::interval(lens_probe::session::DRAIN_INTERVAL);
    let mut report = Report::default();
    let produced = loop {
        tokio::select! {
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                drain(guard.get_inner_mut(), sink, &mut report);
                guard.clear_ready();
                report.wakeup_drains += 1;
            }
            _ = tick.tick() => {
                drain(ring.get_mut(), sink, &mut report);
                report.timer_drains += 1;
            }
            produced = &mut done => {
                break produced.map_err(|_| {
                    LensError::Io(std::io::Error::other("the generator thread failed"))
                })??;
            }
        }
    };
    // Every run has returned: all it wrote is in the ring buffer.
    drain(ring.get_mut(), sink, &mut report);
    let ended = Instant::now();
    Ok(Report {
        sent: produced.sent,
        lost_ring_full: produced.lost,
        runs: produced.runs,
        producer_s: produced
            .ended
            .duration_since(produced.started)
            .as_secs_f64(),
        elapsed_s: ended.duration_since(produced.started).as_secs_f64(),
        consumer_cpu_s: thread_cpu().saturating_sub(cpu0).as_secs_f64(),
        producer_cpu_s: produced.cpu.as_secs_f64(),
        ..report
    })
}

/// `Session::drain`: decode in batches (`events::decode_batch`), then hand them on.
fn drain(ring: &mut RingBuf<MapData>, sink: &mut dyn EventSink, report: &mut Report) {
    loop {
        let batch = events::decode_batch(ring);
        if batch.is_empty() {
            return;
        }
        report.received += batch.len() as u64;
        for decoded in batch {
            match decoded {
                Ok(Decoded::Probe(event)) => sink.on_event(&event),
                // The generator sends none; the session would act on them.
                Ok(Decoded::Control(_)) => {}
                Err(_) => report.undecodable += 1,
            }
        }
    }
}
