//! The `lens-probe` binary: parse the command line and environment, check privileges,
//! then run a session with its sinks and exporters and say how it ended (exit code).
use std::{collections::BTreeMap, io::Write, process::ExitCode, sync::Arc};

/// mimalloc, not glibc's malloc: a span is allocated on the event loop's thread and freed
/// on the export thread, and glibc's arenas made that hand-over (free, consolidate, move)
/// a third of the event loop's time; with mimalloc the OTLP file export keeps up with
/// 2.5 times the events, for 4 MB more RSS (docs/performance.md, block 5b).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use lens_probe::{
    LensError,
    discovery::NodeFilter,
    events::CollectiveOp,
    export::{
        config::{ExportSettings, ExporterKind},
        otlp::{Destination, ExportStats, OtelPipeline},
        spool::Spool,
    },
    session::{RunReport, Session, StopReason, TraceOptions},
    settings::{
        cli::{Cli, Rejected},
        probe_rules::ProbeRules,
    },
    sink::EventPrinter,
    spans::{SpanBuilder, SpanExporter, console::ConsoleTree, stragglers::OpStragglers},
    summary::Summary,
    sys::{output::OutputFile, privileges, target, teardown, usage::OwnCpu},
    timeline::{DEFAULT_MAX_BYTES, Timeline, TimelineReport, TimelineSettings},
};

fn main() -> ExitCode {
    if std::env::args_os().nth(1).as_deref() == Some(teardown::TEARDOWN_ARG.as_ref()) {
        teardown::close_inherited();
        return ExitCode::SUCCESS;
    }
    let cli = match lens_probe::settings::cli::parse() {
        Ok(cli) => cli,
        Err(Rejected::Info(help)) => {
            let _ = help.print();
            return ExitCode::SUCCESS;
        }
        Err(Rejected::Invalid(line)) => {
            lens_probe::say!("lens-probe: {line}");
            return ExitCode::from(2);
        }
    };
    init_logging(cli.verbose);
    // SIGINT/SIGTERM during start-up wait until the run loop can handle them (flush, exit 0).
    target::hold_stop_signals();
    match run(cli) {
        Ok(code) => teardown::exit_now(code.clamp(0, 255)),
        Err(error) => {
            // One line for people; anything longer (a kernel log) only with -vv.
            let text = error.to_string();
            let mut lines = text.lines();
            lens_probe::say!("lens-probe: {}", lines.next().unwrap_or_default());
            let rest: Vec<&str> = lines.collect();
            if !rest.is_empty() {
                log::debug!("{}", rest.join("\n"));
            }
            ExitCode::from(error.exit_code() as u8)
        }
    }
}

fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => log::LevelFilter::Warn,
        1 => log::LevelFilter::Info,
        _ => log::LevelFilter::Debug,
    };
    env_logger::Builder::new()
        .filter_level(level)
        .format(|out, record| {
            let level = match record.level() {
                log::Level::Error => "error: ",
                log::Level::Warn => "warning: ",
                _ => "",
            };
            writeln!(out, "lens-probe: {level}{}", record.args())
        })
        .init();
}

fn run(cli: Cli) -> Result<i32, LensError> {
    let started = std::time::Instant::now();
    // Settings first: a bad value is reported before anything is loaded or started.
    let export = ExportSettings::from_cli(&cli)?;
    let rules = Arc::new(ProbeRules::load(cli.config.as_deref(), cli.profile)?);
    for warning in rules.warnings(&cli.span_groups) {
        log::warn!("{warning}");
    }
    let timeline_path = cli.perfetto.clone().or(rules.timeline.perfetto.clone());
    let outputs: Vec<(&'static str, &std::path::Path)> = [
        ("--pid-file", cli.pid_file.as_deref()),
        ("--export-file", export.export_file.as_deref()),
        ("--summary-json", cli.summary_json.as_deref()),
        ("--perfetto", timeline_path.as_deref()),
    ]
    .into_iter()
    .filter_map(|(flag, path)| Some((flag, path?)))
    .collect();
    lens_probe::sys::output::check_distinct(&outputs)?;
    // Forked while lens-probe is single-threaded (the exporter starts threads).
    let guardian = start_guardian();
    let mut pipeline = start_export(&export)?;
    let session = new_session(&cli, &export, rules.clone(), guardian)?;
    let summary_file = open_outputs(&cli)?;
    let timeline = open_timeline(&cli, &rules)?;
    let child = start_targets(session, &cli)?;
    let traced = trace(session, &cli, rules, pipeline.as_mut(), timeline)?;
    // Its own cost beside the probe hits: the reader and the exporter, on the node's CPUs
    // (read before the export's last flush, which the metric carries).
    let own_cpu = lens_probe::sys::usage::OwnCpu::now(started.elapsed());
    let export_stats = pipeline
        .as_mut()
        .map(|pipeline| finish_export(pipeline, &export, &traced.report, &own_cpu));
    let at_exit = AtExit {
        traced,
        own_cpu,
        late_attaches: session.late_attaches(),
        export_stats,
    };
    at_exit.report();
    if let Some(file) = summary_file {
        at_exit.write_summary_json(file);
    }
    let Some(child) = child else {
        // Without a command of its own (--pid, --node), lens-probe ends when told to:
        // SIGINT/SIGTERM after the flush is success.
        return Ok(0);
    };
    Ok(wait_for_command(child, &at_exit.traced.report, &cli))
}

/// The guardian lets a target stopped at a library load go if lens-probe dies; without
/// one, tracing still works, with that risk said.
fn start_guardian() -> Option<lens_probe::sys::guardian::Guardian> {
    match lens_probe::sys::guardian::Guardian::start() {
        Ok(guardian) => Some(guardian),
        Err(error) => {
            log::warn!(
                "no guardian process ({error}): if lens-probe is killed, a target stopped at a library load stays stopped"
            );
            None
        }
    }
}

/// The OTLP or file pipeline the spans go to; `None` for the console tree.
fn start_export(export: &ExportSettings) -> Result<Option<OtelPipeline>, LensError> {
    Ok(match export.exporter {
        ExporterKind::Console => None,
        ExporterKind::Otlp => {
            // Opened now, while lens-probe may still create a directory where root may.
            let spool = export
                .spool
                .as_ref()
                .map(|config| {
                    Spool::open(config).map_err(|reason| LensError::Output {
                        flag: "--spool-dir",
                        path: config.dir.clone(),
                        reason: reason.to_string(),
                    })
                })
                .transpose()?;
            Some(OtelPipeline::start(
                Destination::otlp_from_env()?,
                export.service_name.clone(),
                spool,
            )?)
        }
        ExporterKind::File => Some(OtelPipeline::start(
            Destination::File(export.export_file.clone().unwrap_or_default()),
            export.service_name.clone(),
            None,
        )?),
    })
}

fn new_session(
    cli: &Cli,
    export: &ExportSettings,
    rules: Arc<ProbeRules>,
    guardian: Option<lens_probe::sys::guardian::Guardian>,
) -> Result<&'static mut Session, LensError> {
    // Never dropped: its uprobes are let go by a child after we exit (see `sys::teardown`).
    let session: &'static mut Session = Box::leak(Box::new(Session::new(TraceOptions {
        span_groups: cli.span_groups.clone(),
        kernel_logs: cli.verbose >= 2,
        overhead_budget: cli.overhead_budget,
        uprobe_links: cli.uprobe_links,
    })?));
    session.set_export_strategy(export.strategy);
    session.set_hang_timeout(cli.hang_timeout.0);
    session.set_stop_grace(cli.stop_grace);
    session.set_rules(rules);
    if let Some(guardian) = guardian {
        session.set_guardian(guardian);
    }
    Ok(session)
}

/// Writes the pid file and opens the summary file, which is written at exit.
fn open_outputs(cli: &Cli) -> Result<Option<OutputFile>, LensError> {
    // Fork before any runtime thread exists.
    if let Some(path) = &cli.pid_file {
        OutputFile::create("--pid-file", path)?
            .write_all(format!("{}\n", std::process::id()).as_bytes())?;
    }
    // Opened now, while lens-probe may still write where root may: written at exit.
    cli.summary_json
        .as_deref()
        .map(|path| OutputFile::create_replacing("--summary-json", path))
        .transpose()
}

/// The timeline file (`--perfetto`, or `[timeline] perfetto` in the config file),
/// created now, while lens-probe may still write where root may.
fn open_timeline(cli: &Cli, rules: &ProbeRules) -> Result<Option<Timeline>, LensError> {
    let Some(path) = cli.perfetto.clone().or(rules.timeline.perfetto.clone()) else {
        return Ok(None);
    };
    let settings = TimelineSettings {
        path,
        max_bytes: cli
            .perfetto_max_size
            .or(rules.timeline.max_size)
            .unwrap_or(DEFAULT_MAX_BYTES),
    };
    Ok(Some(Timeline::create(&settings)?))
}

/// Attaches to the node's training processes, the --exec command (its pid returned) or
/// the --pid ones, then gives up what tracing no longer needs.
fn start_targets(session: &mut Session, cli: &Cli) -> Result<Option<u32>, LensError> {
    let child = if cli.node {
        let running = session.watch_node(NodeFilter {
            command_line: cli.match_command_line.clone(),
            cgroup: cli.match_cgroup.clone(),
            environment: cli.match_env.clone(),
        })?;
        log::warn!(
            "node mode: {running} training processes running now are traced; watching for new ones"
        );
        None
    } else if cli.exec {
        Some(session.exec(&cli.command)?)
    } else {
        attach_pids(session, &cli.pid)?;
        None
    };
    // Node mode says what it traces in its own line, and runs for days: no status line.
    if !cli.node {
        session.show_attach_status();
    }
    // The event loop (this thread) runs above the job's priority; raising it needs
    // CAP_SYS_NICE, which goes next.
    session.raise_priority();
    // Attached, and the --exec command started with what it had: keep only what is needed.
    privileges::drop_unneeded(cli.node);
    log::info!(
        "{} uprobes attached (span groups: {})",
        session.attacher().uprobe_count(),
        cli.span_groups
    );
    Ok(child)
}

/// What a traced run leaves for the report at exit.
struct Traced {
    summary: Summary,
    report: RunReport,
    stragglers: BTreeMap<CollectiveOp, OpStragglers>,
    timeline: Option<TimelineReport>,
}

/// Runs the event loop until the run ends, feeding the summary, the -v printer and the
/// spans, then warns of rules that matched nothing.
fn trace(
    session: &mut Session,
    cli: &Cli,
    rules: Arc<ProbeRules>,
    pipeline: Option<&mut OtelPipeline>,
    timeline: Option<Timeline>,
) -> Result<Traced, LensError> {
    // Node mode runs for days over many processes: summaries of ended ones are dropped.
    let mut summary = if cli.node {
        Summary::forgetting().for_groups(&cli.span_groups)
    } else {
        Summary::default().for_groups(&cli.span_groups)
    };
    let printer = (cli.verbose >= 1).then(|| EventPrinter::new(std::io::stderr()));
    let exporter: Box<dyn SpanExporter + '_> = match pipeline {
        Some(pipeline) => Box::new(pipeline),
        None => Box::new(ConsoleTree::new(std::io::stderr()).with_all_attributes(cli.verbose >= 1)),
    };
    let timeline_report = timeline.as_ref().map(Timeline::report);
    let exporter: Box<dyn SpanExporter + '_> = match timeline {
        Some(timeline) => Box::new((exporter, timeline)),
        None => exporter,
    };
    let mut spans = SpanBuilder::new(cli.span_groups.clone(), exporter).with_rules(rules);
    let mut sinks = (&mut summary, (printer, &mut spans));
    let report = session.run_blocking(&mut sinks, cli.duration)?;
    let stragglers = spans.stragglers().clone();
    // Closes the timeline: its file is whole after this.
    drop(spans);
    for warning in session
        .attacher()
        .unmatched_rules(&cli.span_groups)
        .into_iter()
        .chain(session.unmatched_python_rules())
    {
        log::warn!("{warning}");
    }
    Ok(Traced {
        summary,
        report,
        stragglers,
        timeline: timeline_report
            .map(|report| report.lock().unwrap_or_else(|e| e.into_inner()).clone()),
    })
}

/// Flushes the pipeline with the run's losses and own CPU, and says what became of the spans.
fn finish_export(
    pipeline: &mut OtelPipeline,
    export: &ExportSettings,
    report: &RunReport,
    own_cpu: &OwnCpu,
) -> ExportStats {
    let events_lost: Vec<(&'static str, u64)> = report
        .losses
        .kernel
        .iter()
        .map(|(cause, count)| (*cause, *count))
        .collect();
    let stats = pipeline.finish(&events_lost, Some(own_cpu));
    report_export(export, stats);
    stats
}

/// Everything the run's end reports, on stderr and in --summary-json.
struct AtExit {
    traced: Traced,
    own_cpu: OwnCpu,
    late_attaches: u64,
    export_stats: Option<ExportStats>,
}

impl AtExit {
    fn report(&self) {
        let report = &self.traced.report;
        lens_probe::say_raw!("{}", self.traced.summary.render(&report.losses));
        lens_probe::say_raw!(
            "{}",
            lens_probe::spans::stragglers::render(&self.traced.stragglers)
        );
        if let Some(timeline) = &self.traced.timeline {
            lens_probe::say_raw!("{}", timeline.render());
        }
        let late_attaches = self.late_attaches;
        if late_attaches > 0 {
            lens_probe::say!(
                "lens-probe: {late_attaches} library loads attached late (the guardian let their \
                 process go on while lens-probe was held up): their first calls were not seen"
            );
        }
        if let Some(budget) = &report.budget {
            lens_probe::say!(
                "lens-probe: overhead budget {}%: launch probes cost an estimated {:.2}% \
                 ({:.0} ns a hit), in for {:.1}% of the time, {} sampled windows",
                budget.budget_percent,
                budget.estimated_percent,
                budget.per_hit_ns,
                budget.sampled_percent,
                budget.windows
            );
        }
        lens_probe::say_raw!("{}", self.own_cpu.render());
    }

    fn write_summary_json(&self, file: OutputFile) {
        let report = &self.traced.report;
        let mut json = self.traced.summary.to_json(&report.losses);
        if let Some(object) = json.as_object_mut() {
            object.insert(
                "lens_probe_cpu".into(),
                serde_json::to_value(self.own_cpu).expect("CPU usage serialises"),
            );
            if let Some(budget) = &report.budget {
                object.insert(
                    "overhead_budget".into(),
                    serde_json::to_value(budget).expect("budget report serialises"),
                );
            }
            // By operation: collectives matched across ranks, times each rank was last.
            let stragglers: BTreeMap<&str, _> = self
                .traced
                .stragglers
                .iter()
                .map(|(op, stats)| (op.name(), stats))
                .collect();
            object.insert(
                "stragglers".into(),
                serde_json::to_value(stragglers).expect("straggler stats serialise"),
            );
            object.insert("late_attaches".into(), self.late_attaches.into());
            if let Some(timeline) = &self.traced.timeline {
                object.insert(
                    "timeline".into(),
                    serde_json::to_value(timeline).expect("timeline report serialises"),
                );
            }
            // Every loss stderr reports is here too: spans the export lost, by cause.
            if let Some(stats) = self.export_stats {
                object.insert(
                    "export".into(),
                    serde_json::json!({
                        "spans_exported": stats.exported,
                        "spans_lost": stats.lost(),
                        "spans_dropped_queue_full": stats.dropped_queue_full,
                        "spans_export_failed": stats.failed,
                        "spans_spooled": stats.spooled,
                        "spans_sent_from_spool": stats.replayed,
                        "spans_dropped_spool_full": stats.spool_dropped,
                        "spans_left_in_spool": stats.left_in_spool,
                    }),
                );
            }
        }
        let json = serde_json::to_string_pretty(&json).expect("summary serialises");
        if let Err(error) = file.write_all((json + "\n").as_bytes()) {
            // The trace is done: the command's exit code still goes through.
            lens_probe::say!("lens-probe: {error}");
        }
    }
}

/// The --exec command's shell exit code, waiting for it if tracing stopped first.
fn wait_for_command(child: u32, report: &RunReport, cli: &Cli) -> i32 {
    let exit = match report.child_exit {
        Some(exit) => exit,
        // Tracing stopped (--duration, a stop signal passed on to the command and its
        // --stop-grace over, or the command is a rank that does not export) while the
        // command runs on: wait for it untraced, passing on any further stop signal, and
        // end with its code (it is never left orphaned).
        None => {
            if let StopReason::Signal(_) = report.stop {
                lens_probe::say!(
                    "lens-probe: the command is still running {} s after the signal passed on \
                     to it: tracing stopped, waiting for it (another Ctrl-C or SIGTERM is passed \
                     on too)",
                    cli.stop_grace.as_secs_f64()
                );
            }
            target::wait_forwarding_stops(child)
        }
    };
    exit.shell_code()
}

/// Attaches every pid given. One that does not train (it maps none of the libraries:
/// a notebook kernel, a monitoring agent) or is gone (a rank that ended between `pgrep`
/// and now) is one warning and skipped while another remains; with a single pid, or
/// when none could be attached, its error is the run's.
fn attach_pids(session: &mut Session, pids: &[u32]) -> Result<(), LensError> {
    let mut unique: Vec<u32> = Vec::with_capacity(pids.len());
    for pid in pids {
        if !unique.contains(pid) {
            unique.push(*pid);
        }
    }
    let mut attached = 0;
    let mut last_error = None;
    for &pid in &unique {
        let result = privileges::check_target(pid).and_then(|()| session.attach_pid(pid));
        match result {
            Ok(()) => attached += 1,
            Err(
                error @ (LensError::NoTracedLibraries { .. }
                | LensError::KernelThread { .. }
                | LensError::NoSuchProcess(_)),
            ) if unique.len() > 1 => {
                log::warn!("{error}: skipped");
                last_error = Some(error);
            }
            Err(error) => return Err(error),
        }
    }
    match last_error {
        Some(error) if attached == 0 => Err(error),
        _ => Ok(()),
    }
}

/// One line on what became of the spans; lost ones are always said.
fn report_export(settings: &ExportSettings, stats: ExportStats) {
    let target = match (&settings.exporter, &settings.export_file) {
        (ExporterKind::File, Some(path)) => path.display().to_string(),
        _ => "the OTLP endpoint".to_string(),
    };
    if stats.lost() == 0 {
        lens_probe::say!("lens-probe: {} spans exported to {target}", stats.exported);
    } else {
        let spool_full = if stats.spool_dropped > 0 {
            format!(", {} dropped from a full spool", stats.spool_dropped)
        } else {
            String::new()
        };
        lens_probe::say!(
            "lens-probe: {} spans exported to {target}; {} lost ({} queue full, {} export \
             failed{spool_full})",
            stats.exported,
            stats.lost(),
            stats.dropped_queue_full,
            stats.failed
        );
        if stats.dropped_queue_full > 0 {
            // Why, and what to do: the probes never wait for the exporter, so spans made
            // faster than it sends them are dropped once its queue is full.
            lens_probe::say!(
                "lens-probe: spans came faster than {target} took them (the export queue was \
                 full, and the traced job is never made to wait): narrower --span-groups \
                 make fewer spans"
            );
        }
    }
    if let Some(spool) = &settings.spool {
        lens_probe::say!(
            "lens-probe: spool {}: {} spans kept there this run, {} sent from it, {} waiting \
             there for the next run",
            spool.dir.display(),
            stats.spooled,
            stats.replayed,
            stats.left_in_spool
        );
    }
}
