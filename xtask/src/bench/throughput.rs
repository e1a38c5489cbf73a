//! Block 5b: event throughput of lens-probe's user side, and where loss starts. A traced
//! program cannot send a million events a second here (one uprobe hit is ~1 µs), so the
//! events come from the kernel-side generator `bench_emit` (lens-ebpf/src/bench_gen.rs, an
//! object of its own) written into a ring buffer made as the probes' is, drained, decoded and built into spans as a tracing
//! session does: `target/release/examples/throughput` (lens-userspace/examples), which
//! prints one JSON report per run.

use std::process::Command;
use std::time::Instant;

use super::proc::{Proc, Stream};
use super::report::{Met, Row, Section, fmt_count, median, min_max};
use super::rounds::Rounds;
use super::{Ctx, RUN_TIMEOUT, Watch, scrub_lens_env};
use serde::Deserialize;
use xtask::error::{Error, Result};

/// Target rates (events/s); `None`: as fast as the producer goes.
const RATES: [Option<u64>; 6] = [
    Some(250_000),
    Some(500_000),
    Some(1_000_000),
    Some(1_500_000),
    Some(2_000_000),
    None,
];

/// The issue's target rate.
const TARGET: f64 = 1e6;

/// A paced run counts as "held" when it received at least this share of its target (the
/// producer shares two cores with the consumer and may fall short).
const HELD: f64 = 0.97;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Exporter {
    /// Summary + span builder, spans counted and dropped: the event path itself.
    Null,
    /// Summary + span builder + lens-probe's OTLP file exporter to /dev/null (as the
    /// bench's lens-probe runs).
    File,
    /// The same, and the Perfetto timeline (`--perfetto`) written to a file beside the
    /// logs: its cost against `File`.
    Timeline,
}

impl Exporter {
    const ALL: [Exporter; 3] = [Exporter::Null, Exporter::File, Exporter::Timeline];

    fn arg(self) -> &'static str {
        match self {
            Exporter::Null => "null",
            Exporter::File | Exporter::Timeline => "file",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Exporter::Timeline => "file+timeline",
            other => other.arg(),
        }
    }

    /// The target rates it runs at: the timeline at the target and unpaced only, where
    /// its cost shows against the file exporter.
    fn rates(self) -> Vec<Option<u64>> {
        match self {
            Exporter::Timeline => vec![Some(TARGET as u64), None],
            _ => RATES.to_vec(),
        }
    }
}

/// What the timeline wrote in one run (the throughput example's `timeline`).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
struct TimelineRun {
    slices: u64,
    bytes: u64,
    writer_cpu_s: f64,
}

/// One run's report, the JSON line `examples/throughput` prints (other fields ignored).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
struct GenRun {
    sent: u64,
    received: u64,
    lost: u64,
    received_rate: f64,
    elapsed_s: f64,
    consumer_cpu_s: f64,
    producer_cpu_s: f64,
    spans: u64,
    spans_dropped: u64,
    export_cpu_s: f64,
    #[serde(default)]
    timeline: Option<TimelineRun>,
}

impl GenRun {
    fn parse(line: &str) -> Option<GenRun> {
        serde_json::from_str(line.trim()).ok()
    }

    /// Share of a core the draining thread used.
    fn consumer_share(&self) -> f64 {
        self.consumer_cpu_s / self.elapsed_s.max(1e-9)
    }

    /// No event lost and, paced, the target rate reached.
    fn held(&self, rate: Option<u64>) -> bool {
        self.lost == 0 && rate.is_none_or(|r| self.received_rate >= HELD * r as f64)
    }
}

pub(super) struct ThroughputBlock {
    duration_s: f64,
    rounds: u32,
    /// By exporter and target rate (`None`: unpaced).
    runs: Rounds<(Exporter, Option<u64>), GenRun>,
}

pub(super) fn block(ctx: &Ctx, watch: &mut Watch, quick: bool) -> Result<ThroughputBlock> {
    let duration_s = if quick { 1.0 } else { 2.0 };
    // 14 runs a round: three rounds at most keep the block under two minutes.
    let rounds = ctx.rounds.min(3);
    let cases = Exporter::ALL
        .into_iter()
        .flat_map(|e| e.rates().into_iter().map(move |r| (e, r)));
    let runs = Rounds::measure(
        rounds,
        cases,
        watch,
        |(exporter, rate), round| run(ctx, exporter, rate, duration_s, round),
        |(exporter, rate), run| {
            format!(
                "generator at {} /s, {} exporter: {} /s received, {} lost, consumer {:.0} % of \
                 a core, {} spans dropped",
                rate.map_or("unpaced".into(), |r| fmt_count(r as f64)),
                exporter.name(),
                fmt_count(run.received_rate),
                run.lost,
                run.consumer_share() * 100.0,
                run.spans_dropped
            )
        },
    )?;
    Ok(ThroughputBlock {
        duration_s,
        rounds,
        runs,
    })
}

fn run(
    ctx: &Ctx,
    exporter: Exporter,
    rate: Option<u64>,
    duration_s: f64,
    round: u32,
) -> Result<GenRun> {
    let name = format!(
        "throughput-{}-{}-r{round}",
        exporter.name(),
        rate.map_or("unpaced".into(), |r| r.to_string())
    );
    let log = ctx.logs.join(format!("{name}.log"));
    let timeline = ctx.logs.join(format!("{name}.perfetto-trace"));
    let mut cmd = Command::new(ctx.root.join("target/release/examples/throughput"));
    scrub_lens_env(&mut cmd);
    cmd.current_dir(&ctx.root)
        .args(["--rate", &rate.unwrap_or(0).to_string()])
        .args(["--duration", &duration_s.to_string()])
        .args(["--exporter", exporter.arg()])
        .arg("--pin");
    if exporter == Exporter::Timeline {
        cmd.arg("--perfetto").arg(&timeline);
    }
    let mut report = None;
    Proc::spawn(&name, &mut cmd, &log)?.finish_ok(Instant::now() + RUN_TIMEOUT, |l| {
        if l.stream == Stream::Out
            && let Some(run) = GenRun::parse(&l.text)
        {
            report = Some(run);
        }
    })?;
    // Its size is in the report; the file itself is not kept (hundreds of MB).
    let _ = std::fs::remove_file(&timeline);
    report.ok_or_else(|| Error::Msg(format!("{name}: no report (output in {})", log.display())))
}

fn per_second(r: f64) -> String {
    format!("{} /s", fmt_count(r))
}

impl ThroughputBlock {
    fn runs(&self, exporter: Exporter, rate: Option<u64>) -> &[GenRun] {
        self.runs.runs((exporter, rate))
    }

    /// The highest target rate held (no loss, rate reached) in every round, and for
    /// `spans` also no span dropped by the export queue.
    fn highest_held(&self, exporter: Exporter, spans: bool) -> Option<u64> {
        RATES
            .iter()
            .filter_map(|r| *r)
            .filter(|&r| {
                let runs = self.runs(exporter, Some(r));
                !runs.is_empty()
                    && runs
                        .iter()
                        .all(|run| run.held(Some(r)) && (!spans || run.spans_dropped == 0))
            })
            .max()
    }

    pub(super) fn section(&self) -> Section {
        let mut rows = Vec::new();
        for exporter in Exporter::ALL {
            for rate in exporter.rates() {
                let runs = self.runs(exporter, rate);
                let values: Vec<f64> = runs.iter().map(|r| r.received_rate).collect();
                let lost: u64 = runs.iter().map(|r| r.lost).sum();
                let share: Vec<f64> = runs.iter().map(GenRun::consumer_share).collect();
                let dropped: Vec<f64> = runs.iter().map(|r| r.spans_dropped as f64).collect();
                let export_share: Vec<f64> = runs
                    .iter()
                    .map(|r| r.export_cpu_s / r.elapsed_s.max(1e-9))
                    .collect();
                let chain = match exporter {
                    Exporter::Null => "span builder, spans counted",
                    Exporter::File => "span builder → OTLP file exporter (/dev/null)",
                    Exporter::Timeline => {
                        "span builder → OTLP file exporter (/dev/null) and the timeline (a file)"
                    }
                };
                let mut what = format!(
                    "{}, {chain}: events/s received; lost {}; consumer thread {:.0} % of a core",
                    rate.map_or("unpaced".into(), |r| format!("at {}", per_second(r as f64))),
                    fmt_count(lost as f64),
                    median(&share).unwrap_or(f64::NAN) * 100.0,
                );
                if exporter != Exporter::Null {
                    what.push_str(&format!(
                        ", export thread {:.0} %; spans dropped (export queue full) {}",
                        median(&export_share).unwrap_or(f64::NAN) * 100.0,
                        fmt_count(median(&dropped).unwrap_or(f64::NAN))
                    ));
                }
                let (target, met) = match (exporter, rate) {
                    (Exporter::Null, Some(r)) if r as f64 == TARGET => (
                        "≥ 1 000 000 /s, zero loss",
                        Met::from_bool(
                            !runs.is_empty() && runs.iter().all(|run| run.held(Some(r))),
                        ),
                    ),
                    _ => ("", Met::NoTarget),
                };
                rows.push(super::report::row(
                    what,
                    &values,
                    per_second,
                    rate.and_then(|r| Some(median(&values)? / r as f64)),
                    target,
                    met,
                ));
            }
        }
        let highest = self.highest_held(Exporter::Null, false);
        rows.push(Row {
            what: "highest target rate with zero loss in every round (and the rate reached), \
                   span builder"
                .into(),
            median: highest.map_or("none".into(), |r| per_second(r as f64)),
            spread: "—".into(),
            ratio: "—".into(),
            target: "≥ 1 000 000 /s, zero loss".into(),
            met: Met::from_bool(highest.is_some_and(|r| r as f64 >= TARGET)),
        });
        let per_event: Vec<f64> = self
            .runs(Exporter::Null, None)
            .iter()
            .filter(|r| r.received > 0)
            .map(|r| r.consumer_cpu_s / r.received as f64)
            .collect();
        rows.push(super::report::row(
            "consumer thread CPU per event, unpaced, span builder (its capacity: 1 s / this)",
            &per_event,
            super::report::fmt_duration,
            None,
            "",
            Met::NoTarget,
        ));
        rows.extend(self.timeline_rows());
        let highest_file = self.highest_held(Exporter::File, true);
        rows.push(Row {
            what: "… the same with the OTLP file exporter, no span dropped either".into(),
            median: highest_file.map_or("none of the rates".into(), |r| per_second(r as f64)),
            spread: "—".into(),
            ratio: "—".into(),
            target: "".into(),
            met: Met::NoTarget,
        });
        Section {
            title: "5b. Event throughput of the user side (kernel-side generator → ring buffer → \
                    decoder → summary and span builder; ratio: received / target rate)"
                .into(),
            rows,
        }
    }

    /// The timeline's cost: events/s with it against the file exporter alone, run for
    /// run, and what it writes per span.
    fn timeline_rows(&self) -> Vec<Row> {
        let mut rows = Vec::new();
        for rate in Exporter::Timeline.rates() {
            let with = self.runs(Exporter::Timeline, rate);
            let without = self.runs(Exporter::File, rate);
            let ratios: Vec<f64> = with
                .iter()
                .zip(without)
                .filter(|(_, w)| w.received_rate > 0.0)
                .map(|(t, w)| t.received_rate / w.received_rate)
                .collect();
            rows.push(super::report::row(
                format!(
                    "timeline on / off, {}: events/s received with the timeline over without \
                     (same round)",
                    rate.map_or("unpaced".into(), |r| format!("at {}", per_second(r as f64)))
                ),
                &ratios,
                |v| format!("{v:.2}"),
                median(&ratios),
                "",
                Met::NoTarget,
            ));
        }
        let timelines: Vec<&TimelineRun> = Exporter::Timeline
            .rates()
            .into_iter()
            .flat_map(|rate| self.runs(Exporter::Timeline, rate))
            .filter_map(|run| run.timeline.as_ref())
            .filter(|t| t.slices > 0)
            .collect();
        let per_span: Vec<f64> = timelines
            .iter()
            .map(|t| t.bytes as f64 / t.slices as f64)
            .collect();
        rows.push(super::report::row(
            "timeline bytes per span (an all-reduce with its attributes, names interned)",
            &per_span,
            |v| format!("{v:.0} B"),
            None,
            "",
            Met::NoTarget,
        ));
        let writer: Vec<f64> = self
            .runs(Exporter::Timeline, None)
            .iter()
            .filter_map(|run| {
                let t = run.timeline.as_ref()?;
                (t.slices > 0).then(|| t.writer_cpu_s / t.slices as f64)
            })
            .collect();
        rows.push(super::report::row(
            "timeline writer thread CPU per span, unpaced (placing, encoding, writing)",
            &writer,
            super::report::fmt_duration,
            None,
            "",
            Met::NoTarget,
        ));
        rows
    }

    pub(super) fn notes(&self) -> String {
        let producer: Vec<f64> = self
            .runs(Exporter::Null, None)
            .iter()
            .filter(|r| r.sent > 0)
            .map(|r| r.producer_cpu_s / r.sent as f64)
            .collect();
        let spread = |v: &[f64]| {
            min_max(v).map_or(String::new(), |(lo, hi)| {
                format!(" ({:.0}–{:.0} ns)", lo * 1e9, hi * 1e9)
            })
        };
        format!(
            "- Event throughput (5b): `target/release/examples/throughput --rate R --duration {} \
             --exporter null|file [--perfetto FILE] --pin` ({} round{}). A producer thread (pinned to the last \
             CPU) runs the BPF program \
             `bench_emit` (lens-ebpf/src/bench_gen.rs, in an object of its own that \
             lens-probe's does not contain) with `BPF_PROG_TEST_RUN`, 64 events a run, paced \
             to R; each event is an 80-byte `ncclAllReduce` record written into an `EVENTS` \
             ring buffer made and woken as the probes' is (lens-ebpf/src/ring.rs: a forced \
             wakeup each time the data waiting crosses a multiple of 256 KiB, none otherwise). The main thread (pinned to CPU 0: \
             unpinned, the kernel wakes it on the producer's CPU and the two share one core) \
             drains it as \
             lens-probe's session does (on a wakeup, or every 50 ms; `events::decode`, then the \
             summary and the span builder; the throughput example's harness). Lost = not written (ring buffer full) + not received + \
             undecodable. A rate is held when nothing was lost and at least {:.0} % of it \
             arrived: producer, consumer and export thread share the two cores. The probes \
             never wait for the reader: a reader slower than the producer loses events (counted), \
             it does not slow the traced job down (unpaced the producer spent {} ns of CPU per \
             event{}, median). `file+timeline` adds `--perfetto` (the timeline lens-probe \
             writes, to a file beside the bench's logs, removed after its size is read): its \
             on/off ratio compares each run with the file exporter's run of the same round \
             and rate; on two cores its writer thread takes CPU from the producer and the \
             reader.\n",
            self.duration_s,
            self.rounds,
            if self.rounds == 1 { "" } else { "s" },
            HELD * 100.0,
            median(&producer).map_or("?".into(), |v| format!("{:.0}", v * 1e9)),
            spread(&producer),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports() {
        let line = r#"{"consumer_cpu_s":0.5,"elapsed_s":2.0,"export_cpu_s":0.0,"lost":0,"lost_ring_full":0,"producer_cpu_s":0.1,"producer_s":2.0,"received":1990000,"received_rate":995000.0,"runs":31094,"sent":1990000,"spans":1990001,"spans_dropped":0,"summary_all_reduce_calls":1990000,"target_rate":1000000.0,"timer_drains":100,"undecodable":0,"wakeup_drains":100}"#;
        let run = GenRun::parse(line).unwrap();
        assert_eq!(run.received, 1_990_000);
        assert_eq!(run.consumer_share(), 0.25);
        assert!(run.held(Some(1_000_000)));
        assert!(!run.held(Some(2_000_000)));
        assert!(run.held(None));
        assert!(
            !GenRun {
                lost: 1,
                ..run.clone()
            }
            .held(None)
        );
        assert_eq!(GenRun::parse("throughput: no privileges"), None);
        let block = ThroughputBlock {
            duration_s: 1.0,
            rounds: 1,
            runs: Rounds::from(vec![
                ((Exporter::Null, Some(500_000)), vec![run.clone()]),
                ((Exporter::Null, Some(1_000_000)), vec![run.clone()]),
                ((Exporter::Null, Some(2_000_000)), vec![run]),
            ]),
        };
        assert_eq!(block.highest_held(Exporter::Null, false), Some(1_000_000));
        assert_eq!(block.highest_held(Exporter::File, true), None);
    }

    #[test]
    fn the_timeline_is_compared_with_the_file_exporter_run_for_run() {
        let line = r#"{"consumer_cpu_s":0.5,"elapsed_s":1.0,"export_cpu_s":0.1,"lost":0,"producer_cpu_s":0.1,"received":1000,"received_rate":800000.0,"sent":1000,"spans":1000,"spans_dropped":0,"timeline":{"slices":1000,"bytes":150000,"writer_cpu_s":0.002}}"#;
        let with = GenRun::parse(line).unwrap();
        assert_eq!(with.timeline.as_ref().unwrap().bytes, 150_000);
        let without = GenRun {
            received_rate: 1_000_000.0,
            timeline: None,
            ..with.clone()
        };
        let block = ThroughputBlock {
            duration_s: 1.0,
            rounds: 1,
            runs: Rounds::from(vec![
                ((Exporter::File, None), vec![without]),
                ((Exporter::Timeline, None), vec![with]),
            ]),
        };
        let rows = block.timeline_rows();
        let unpaced = rows.iter().find(|r| r.what.contains("unpaced")).unwrap();
        assert_eq!(unpaced.median, "0.80");
        let bytes = rows
            .iter()
            .find(|r| r.what.contains("bytes per span"))
            .unwrap();
        assert_eq!(bytes.median, "150 B");
    }
}
