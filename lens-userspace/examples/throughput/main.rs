//! `throughput`: events per second through lens-probe's user side (ring buffer →
//! decoder → summary and span builder → exporter), fed by the kernel-side generator
//! `bench_emit` (the harness: `harness.rs`, shared with `tests/integration/throughput.rs`). Run by `cargo xtask bench`; as root:
//!
//!     cargo build --release --example throughput -p lens-userspace
//!     target/release/examples/throughput --rate 1000000 --duration 3
//!
//! An example rather than a binary: it is a measuring tool, not something to install
//! with lens-probe (`cargo install` leaves examples out). Prints one JSON line on stdout:
//! the run's `harness::Report`, plus what became of the spans and the
//! CPU time of the export thread.
use std::{path::PathBuf, process::ExitCode, time::Duration};

/// As lens-probe's binary (its `main.rs` says why).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, ValueEnum};
use lens_probe::{
    events::CollectiveOp,
    export::otlp::{Destination, OtelPipeline},
    settings::groups::SpanGroups,
    spans::{SpanBuilder, SpanExporter, SpanRecord},
    summary::Summary,
    timeline::{Timeline, TimelineSettings},
};

mod harness;
use harness as throughput;
use throughput::{MAX_EVENTS_PER_RUN, Options};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Exporter {
    /// Spans are counted and dropped.
    Null,
    /// lens-probe's OTLP pipeline writing OTLP JSON to `--export-file` (the bench's
    /// lens-probe runs use `/dev/null`).
    File,
}

/// Events per second through lens-probe's user side, from a kernel-side generator.
#[derive(Debug, Parser)]
struct Args {
    /// Events per second to aim at; 0 = as fast as the generator goes.
    #[arg(long, default_value_t = 1_000_000)]
    rate: u64,
    /// Seconds to run.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// Stop after this many events instead (or first).
    #[arg(long)]
    events: Option<u64>,
    /// Events per generator run (`BPF_PROG_TEST_RUN` call), at most 64.
    #[arg(long, default_value_t = MAX_EVENTS_PER_RUN)]
    events_per_run: u32,
    #[arg(long, value_enum, default_value_t = Exporter::File)]
    exporter: Exporter,
    #[arg(long, default_value = "/dev/null")]
    export_file: PathBuf,
    /// With `--exporter file`: also write the spans to this Perfetto timeline, as
    /// lens-probe's `--perfetto` does (its size cap lifted).
    #[arg(long)]
    perfetto: Option<PathBuf>,
    #[arg(long, default_value = "per_step")]
    span_groups: SpanGroups,
    /// Run the generator on the last CPU and drain on CPU 0 (unpinned, the kernel's
    /// wakeups tend to put both on one core).
    #[arg(long)]
    pin: bool,
}

#[derive(Default)]
struct NullExporter {
    spans: u64,
}

impl SpanExporter for NullExporter {
    fn export(&mut self, _span: SpanRecord) {
        self.spans += 1;
    }
}

/// CPU time (s) of this process's threads named `name` (`/proc/self/task/*/comm`).
fn threads_cpu_s(name: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            stat.split_whitespace().next()?.parse::<u64>().ok()
        })
        .map(|ns| ns as f64 / 1e9)
        .sum()
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("throughput: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let options = Options {
        rate: (args.rate > 0).then_some(args.rate as f64),
        events: args.events,
        duration: Some(Duration::from_secs_f64(args.duration)),
        events_per_run: args.events_per_run,
        pin: args
            .pin
            .then(|| std::thread::available_parallelism().map_or(1, usize::from))
            .filter(|cpus| *cpus >= 2)
            .map(|cpus| (cpus - 1, 0)),
    };
    let mut summary = Summary::default();
    let mut timeline_json = serde_json::Value::Null;
    let (report, spans, spans_dropped, export_cpu_s) = match args.exporter {
        Exporter::Null => {
            let mut spans = SpanBuilder::new(args.span_groups.clone(), NullExporter::default());
            let report = throughput::run(options, &mut (&mut summary, &mut spans))?;
            (report, spans.exporter().spans, 0, 0.0)
        }
        Exporter::File => {
            let mut pipeline =
                OtelPipeline::start(Destination::File(args.export_file.clone()), None, None)?;
            let timeline = match &args.perfetto {
                Some(path) => Some(Timeline::create(&TimelineSettings {
                    path: path.clone(),
                    max_bytes: 64 << 30,
                })?),
                None => None,
            };
            let timeline_report = timeline.as_ref().map(Timeline::report);
            let exporter: Box<dyn SpanExporter + '_> = match timeline {
                Some(timeline) => Box::new((&mut pipeline, timeline)),
                None => Box::new(&mut pipeline),
            };
            let mut spans = SpanBuilder::new(args.span_groups.clone(), exporter);
            let report = throughput::run(options, &mut (&mut summary, &mut spans))?;
            // Before the writers are joined: what their threads used during the run.
            let timeline_cpu_s = threads_cpu_s("lens-timeline");
            drop(spans);
            if let Some(timeline) = timeline_report {
                let timeline = timeline.lock().unwrap_or_else(|e| e.into_inner()).clone();
                timeline_json = serde_json::json!({
                    "slices": timeline.slices,
                    "bytes": timeline.bytes,
                    "writer_cpu_s": timeline_cpu_s,
                });
            }
            let export_cpu_s = threads_cpu_s("lens-export");
            let stats = pipeline.finish(&[], None);
            (
                report,
                stats.exported,
                stats.dropped_queue_full + stats.failed,
                export_cpu_s,
            )
        }
    };
    let collectives: u64 = summary
        .processes
        .values()
        .filter_map(|p| p.collectives.get(&CollectiveOp::AllReduce))
        .map(|c| c.calls)
        .sum();
    let mut json = serde_json::to_value(&report)?;
    let object = json
        .as_object_mut()
        .expect("a struct serialises as an object");
    object.insert("lost".into(), report.lost().into());
    object.insert("received_rate".into(), report.received_rate().into());
    object.insert("summary_all_reduce_calls".into(), collectives.into());
    object.insert("spans".into(), spans.into());
    object.insert("spans_dropped".into(), spans_dropped.into());
    object.insert("export_cpu_s".into(), export_cpu_s.into());
    object.insert("pinned".into(), options.pin.is_some().into());
    object.insert("timeline".into(), timeline_json);
    println!("{json}");
    Ok(())
}
