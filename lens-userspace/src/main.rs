use std::{io::Write, process::ExitCode};

use clap::Parser;
use lens_probe::{
    LensError,
    cli::Cli,
    session::{Session, StopReason, TraceOptions},
    sink::EventPrinter,
    spans::{SpanBuilder, console::ConsoleTree},
    summary::Summary,
    target::{self, ExitStatus},
};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            use clap::error::ErrorKind;
            if matches!(
                error.kind(),
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
            ) {
                let _ = error.print();
                return ExitCode::SUCCESS;
            }
            // One line: clap's first line, without its "error: " prefix.
            let rendered = error.render().to_string();
            let first = rendered.lines().next().unwrap_or("invalid arguments");
            eprintln!("lens-probe: {}", first.trim_start_matches("error: "));
            return ExitCode::from(2);
        }
    };
    init_logging(cli.verbose);
    match run(cli) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(error) => {
            // One line for people; anything longer (a kernel log) only with -vv.
            let text = error.to_string();
            let mut lines = text.lines();
            eprintln!("lens-probe: {}", lines.next().unwrap_or_default());
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
    let mut session = Session::new(TraceOptions {
        span_groups: cli.span_groups.clone(),
        kernel_logs: cli.verbose >= 2,
    })?;
    // Fork before any runtime thread exists.
    let child = if cli.exec {
        Some(session.exec(&cli.command)?)
    } else {
        for pid in &cli.pid {
            session.attach_pid(*pid)?;
        }
        None
    };
    log::info!(
        "{} uprobes attached (span groups: {})",
        session.attacher().uprobe_count(),
        cli.span_groups
    );

    let mut summary = Summary::default();
    let printer = (cli.verbose >= 1).then(|| EventPrinter::new(std::io::stderr()));
    let mut spans = SpanBuilder::new(cli.span_groups.clone(), ConsoleTree::new(std::io::stderr()));
    let mut sinks = (&mut summary, (printer, &mut spans));
    let report = session.run_blocking(&mut sinks, cli.duration)?;

    eprint!("{}", summary.render(&report.losses));
    if let Some(path) = &cli.summary_json {
        let json = serde_json::to_string_pretty(&summary.to_json(&report.losses))
            .expect("summary serialises");
        std::fs::write(path, json + "\n")?;
    }

    let Some(child) = child else {
        return Ok(match report.stop {
            StopReason::Signal(signal) => 128 + signal,
            _ => 0,
        });
    };
    let exit = match report.child_exit {
        Some(exit) => exit,
        // Tracing stopped (--duration) while the command runs on: wait for it untraced.
        None if report.stop == StopReason::Duration => wait_blocking(child),
        None => match report.stop {
            StopReason::Signal(signal) => ExitStatus::Signaled(signal),
            _ => ExitStatus::Unknown,
        },
    };
    Ok(exit.shell_code())
}

fn wait_blocking(pid: u32) -> ExitStatus {
    loop {
        if let Some(status) = target::try_wait_child(pid) {
            return status;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
