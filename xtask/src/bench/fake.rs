//! Block 1: the fake `trainer` (tests/fixtures) uninstrumented, under lens-probe with each
//! preset and under bpftrace `count()` on the same functions: per-hit cost, launch-heavy
//! slowdown per preset and event throughput (from `--summary-json`).
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::{
    CALLS_PER_PROCESS, CALLS_PER_STEP, Ctx, DRIVER_HITS_PER_STEP, FAKE_PROBES, FAKE_WRAPPER,
    PRESETS, RUN_TIMEOUT, Watch, fake_env, lens_command, lens_probe_pids,
    proc::{Line, Proc, Stream},
    report::median,
    rounds::Rounds,
    summary::Summary,
    wait_teardown,
};
use xtask::error::{Context, Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fake {
    None,
    Lens(&'static str),
    /// bpftrace `count()` on the entries; with `returns`, also on the return probes
    /// lens-probe uses.
    Bpftrace {
        returns: bool,
    },
}

impl Fake {
    fn name(self) -> &'static str {
        match self {
            Fake::None => "none",
            Fake::Lens(preset) => preset,
            Fake::Bpftrace { returns: false } => "bpftrace",
            Fake::Bpftrace { returns: true } => "bpftrace-ret",
        }
    }
}

/// What `--summary-json` says about the timed trainer process, and the run's losses.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct TrainerSummary {
    pub(super) calls: u64,
    pub(super) events: u64,
    pub(super) lost: u64,
    /// lens-probe's own estimate of what its probes cost the process (`probe_cost`).
    pub(super) estimated_cost_s: Option<f64>,
    /// lens-probe's own CPU (every thread, start-up included) over its run.
    pub(super) tracer_cpu_s: Option<f64>,
}

/// The trainer process run with `steps` (not the `trainer 1` warm-up) in a summary.
pub(super) fn trainer_summary(summary: &Summary, steps: u64) -> Result<TrainerSummary> {
    let steps = steps.to_string();
    let process = summary
        .process("trainer", &[&steps])
        .ok_or_else(|| format!("no `trainer {steps}` process in the summary"))?;
    Ok(TrainerSummary {
        calls: process.calls.values().sum(),
        events: process.events(),
        lost: summary.lost(),
        estimated_cost_s: process.probe_cost.map(|c| c.estimated_ns as f64 / 1e9),
        tracer_cpu_s: summary.tracer_cpu_s(),
    })
}

pub(super) fn parse_elapsed(line: &str) -> Option<f64> {
    let ns: u64 = line
        .trim()
        .strip_prefix("lens-bench elapsed_ns=")?
        .parse()
        .ok()?;
    Some(ns as f64 / 1e9)
}

/// bpftrace's final `@: N` line.
pub(super) fn parse_bpftrace_count(line: &str) -> Option<u64> {
    line.trim().strip_prefix("@: ")?.trim().parse().ok()
}

pub(super) fn bpftrace_script(fixtures: &Path, returns: bool) -> String {
    let probe = |kind: &str, lib: &str, func: &str| {
        format!("{kind}:{}:{func}", fixtures.join(lib).display())
    };
    let entries: Vec<String> = FAKE_PROBES
        .iter()
        .map(|(lib, func, _)| probe("uprobe", lib, func))
        .collect();
    let mut script = format!(
        "BEGIN {{ printf(\"lens-bench-ready\\n\"); }}\n{}\n{{ @ = count(); }}\n",
        entries.join(",\n")
    );
    if returns {
        let rets: Vec<String> = FAKE_PROBES
            .iter()
            .filter(|(_, _, ret)| *ret)
            .map(|(lib, func, _)| probe("uretprobe", lib, func))
            .collect();
        script.push_str(&format!("{}\n{{ @ret = count(); }}\n", rets.join(",\n")));
    }
    script
}

pub(super) struct FakeRun {
    pub(super) elapsed_s: f64,
    pub(super) summary: Option<TrainerSummary>,
    pub(super) bpftrace_count: Option<u64>,
    /// lens-probe's exit → its teardown child gone.
    pub(super) teardown_s: Option<f64>,
}

pub(super) struct FakeBlock {
    pub(super) steps: u64,
    pub(super) runs: Rounds<Fake, FakeRun>,
    /// Why bpftrace was not measured.
    pub(super) bpftrace_skipped: Option<String>,
    /// bpftrace counts that differ from the fixture's documented pattern.
    pub(super) count_mismatches: Vec<String>,
}

impl FakeBlock {
    pub(super) fn runs(&self, variant: Fake) -> &[FakeRun] {
        self.runs.runs(variant)
    }

    pub(super) fn times(&self, variant: Fake) -> Vec<f64> {
        self.runs.values(variant, |r| r.elapsed_s)
    }

    /// Probed calls of one timed run: the per_step summaries' count, else the pattern's.
    pub(super) fn calls(&self) -> u64 {
        let counted: Vec<f64> = self
            .runs(Fake::Lens("per_step"))
            .iter()
            .filter_map(|r| r.summary.as_ref().map(|s| s.calls as f64))
            .collect();
        median(&counted).map_or(self.steps * CALLS_PER_STEP + CALLS_PER_PROCESS, |c| {
            c as u64
        })
    }

    /// Per round: lens-probe's own CPU over the `per_step` run.
    pub(super) fn tracer_cpu(&self) -> Vec<f64> {
        self.runs(Fake::Lens("per_step"))
            .iter()
            .filter_map(|run| run.summary.as_ref()?.tracer_cpu_s)
            .collect()
    }

    /// Per round: lens-probe's own estimate of its probes' cost to the `per_step` run over
    /// the slowdown measured (its time − the uninstrumented time of the same round).
    pub(super) fn estimate_over_measured(&self) -> Vec<f64> {
        self.runs(Fake::Lens("per_step"))
            .iter()
            .zip(self.times(Fake::None))
            .filter_map(|(run, base)| {
                let estimate = run.summary.as_ref()?.estimated_cost_s?;
                let slowdown = run.elapsed_s - base;
                (slowdown > 0.0).then(|| estimate / slowdown)
            })
            .collect()
    }

    /// Per round: (time of `variant` − uninstrumented time of the same round) / calls.
    pub(super) fn per_call(&self, variant: Fake) -> Vec<f64> {
        let calls = self.calls() as f64;
        self.runs
            .over_base(variant, Fake::None, |r| r.elapsed_s, calls)
    }
}

pub(super) fn fake_block(ctx: &Ctx, watch: &mut Watch) -> Result<FakeBlock> {
    let steps = ctx.sizes.trainer_steps;
    let mut variants = vec![Fake::None];
    variants.extend(PRESETS.map(Fake::Lens));
    if ctx.bpftrace.is_ok() {
        variants.push(Fake::Bpftrace { returns: false });
        variants.push(Fake::Bpftrace { returns: true });
    }
    let mut count_mismatches = Vec::new();
    let runs = Rounds::measure(
        ctx.rounds,
        variants,
        watch,
        |variant, round| {
            let run = fake_run(ctx, variant, round)?;
            if let Some(count) = run.bpftrace_count {
                // The warm-up `trainer 1` and the timed run.
                let expected =
                    (CALLS_PER_STEP + DRIVER_HITS_PER_STEP) * (steps + 1) + 2 * CALLS_PER_PROCESS;
                if count != expected {
                    count_mismatches.push(format!(
                        "{} round {round}: bpftrace counted {count} calls, expected {expected}",
                        variant.name()
                    ));
                }
            }
            Ok(run)
        },
        |variant, run| {
            format!(
                "trainer {steps} under {:<12} {:.3} s",
                variant.name(),
                run.elapsed_s
            )
        },
    )?;
    Ok(FakeBlock {
        steps,
        runs,
        bpftrace_skipped: ctx.bpftrace.as_ref().err().map(ToString::to_string),
        count_mismatches,
    })
}

pub(super) fn fake_run(ctx: &Ctx, variant: Fake, round: u32) -> Result<FakeRun> {
    let steps = ctx.sizes.trainer_steps.to_string();
    let trainer = ctx.fixtures.join("trainer");
    let name = format!("fake-{}-r{round}", variant.name());
    let log = ctx.logs.join(format!("{name}.log"));
    let deadline = Instant::now() + RUN_TIMEOUT;
    let wrapper = |cmd: &mut Command| {
        cmd.args(["sh", "-c", FAKE_WRAPPER])
            .arg(&trainer)
            .arg(&steps);
    };
    let mut elapsed = None;
    let mut on_line = |l: &Line| {
        if l.stream == Stream::Out
            && let Some(s) = parse_elapsed(&l.text)
        {
            elapsed = Some(s);
        }
    };
    let mut summary = None;
    let mut bpftrace_count = None;
    let mut teardown_s = None;
    match variant {
        Fake::None => {
            let mut cmd = Command::new("sh");
            cmd.current_dir(&ctx.root)
                .args(["-c", FAKE_WRAPPER])
                .arg(&trainer)
                .arg(&steps);
            fake_env(&mut cmd);
            Proc::spawn(&name, &mut cmd, &log)?.finish_ok(deadline, &mut on_line)?;
        }
        Fake::Lens(preset) => {
            let summary_path = ctx.out.join(format!("{name}.summary.json"));
            let _ = fs::remove_file(&summary_path);
            let pid_file = ctx.out.join(format!("{name}.pid"));
            let mut cmd = lens_command(ctx, None, preset, &pid_file);
            // The console tree would hold every span of the run in memory (the fake trainer
            // never ends its first phase) and print it at exit: see the notes.
            cmd.args(["--exporter", "file", "--export-file", "/dev/null"])
                .arg("--summary-json")
                .arg(&summary_path)
                .args(["--exec", "--"]);
            wrapper(&mut cmd);
            fake_env(&mut cmd);
            let before = lens_probe_pids();
            Proc::spawn(&name, &mut cmd, &log)?.finish_ok(deadline, &mut on_line)?;
            teardown_s = Some(wait_teardown(&name, &before));
            let json = Summary::read(&summary_path).context(&name)?;
            summary = Some(
                trainer_summary(&json, ctx.sizes.trainer_steps)
                    .context(format!("{name}: {}", summary_path.display()))?,
            );
        }
        Fake::Bpftrace { returns } => {
            let program = ctx.bpftrace.as_ref().map_err(Clone::clone)?;
            let mut bt = Command::new(program);
            bt.current_dir(&ctx.root).args([
                "-B",
                "none",
                "-e",
                &bpftrace_script(&ctx.fixtures, returns),
            ]);
            let mut bt = Proc::spawn(&format!("{name} (bpftrace)"), &mut bt, &log)?;
            // BEGIN runs once every probe is attached.
            bt.wait_line(
                Instant::now() + Duration::from_secs(120),
                "its BEGIN probe ran",
                |l| l.text.trim() == "lens-bench-ready",
            )?;
            let mut cmd = Command::new("sh");
            cmd.current_dir(&ctx.root)
                .args(["-c", FAKE_WRAPPER])
                .arg(&trainer)
                .arg(&steps);
            fake_env(&mut cmd);
            let trainer_log = ctx.logs.join(format!("{name}.trainer.log"));
            let result =
                Proc::spawn(&name, &mut cmd, &trainer_log)?.finish_ok(deadline, &mut on_line);
            bt.signal("INT");
            bt.finish(Instant::now() + Duration::from_secs(120), |l| {
                if let Some(n) = parse_bpftrace_count(&l.text) {
                    bpftrace_count = Some(n);
                }
            })?;
            result?;
            if bpftrace_count.is_none() {
                return Err(Error::Msg(format!(
                    "{name}: bpftrace printed no count (output in {})",
                    log.display()
                )));
            }
        }
    }
    let elapsed_s = elapsed.ok_or_else(|| {
        format!(
            "{name}: the wrapper printed no elapsed time (output in {})",
            log.display()
        )
    })?;
    Ok(FakeRun {
        elapsed_s,
        summary,
        bpftrace_count,
        teardown_s,
    })
}

#[cfg(test)]
mod tests {
    use super::super::summary::Summary;
    use super::super::{CALLS_PER_STEP, DRIVER_HITS_PER_STEP};
    use super::*;

    #[test]
    fn wrapper_lines() {
        assert_eq!(
            parse_elapsed("lens-bench elapsed_ns=1500000000\n"),
            Some(1.5)
        );
        assert_eq!(parse_elapsed("trainer: 3 steps done"), None);
        assert_eq!(parse_bpftrace_count("@: 1101"), Some(1101));
        assert_eq!(parse_bpftrace_count("@ret: 5"), None);
    }

    #[test]
    fn summary_of_the_timed_trainer() {
        let doc = r#"{"losses": {"kernel": {"ring_buffer_full": 2, "unmatched_return": 1}, "undecodable": 0},
          "processes": [
            {"name": "sh", "command_line": ["sh", "-c", "x"], "calls": {}},
            {"name": "trainer", "command_line": ["/f/trainer", "1"], "calls": {"ncclAllReduce": 1}},
            {"name": "trainer", "command_line": ["/f/trainer", "40"],
             "calls": {"cudaLaunchKernel": 400, "ncclAllReduce": 40, "ncclCommInitRank": 1},
             "collectives": {"all_reduce": {"calls": 40, "bytes": 9}, "send": {"calls": 40}},
             "sync_waits": {"stream": {"calls": 40, "p50_ns": 3}},
             "probe_cost": {"estimated_ns": 2500000, "traced_ns": 90000000}}
          ],
          "lens_probe_cpu": {"user_s": 1.25, "system_s": 0.5, "wall_s": 3.0}}"#;
        let json = serde_json::from_str::<Summary>(doc).unwrap();
        assert_eq!(
            trainer_summary(&json, 40).unwrap(),
            TrainerSummary {
                calls: 441,
                events: 120,
                lost: 3,
                estimated_cost_s: Some(0.0025),
                tracer_cpu_s: Some(1.75),
            }
        );
        assert!(trainer_summary(&json, 7).is_err());
    }

    #[test]
    fn bpftrace_probes_the_per_step_functions() {
        let script = bpftrace_script(Path::new("/fx"), false);
        assert!(script.starts_with("BEGIN { printf(\"lens-bench-ready\\n\"); }\n"));
        assert!(script.contains("uprobe:/fx/libcudart.so.12:cudaLaunchKernel,\n"));
        // The driver's launch functions the fake runtime calls: lens-probe's probes are
        // hit there too.
        assert!(script.contains("uprobe:/fx/libcuda.so.1:cuLaunchKernel,\n"));
        assert!(script.contains("uprobe:/fx/libnccl.so.2:ncclCommInitRank\n{ @ = count(); }"));
        assert_eq!(script.matches("uprobe:").count(), 19);
        assert!(!script.contains("uretprobe"));
        let with_returns = bpftrace_script(Path::new("/fx"), true);
        assert_eq!(with_returns.matches("uretprobe:").count(), 11);
        assert!(with_returns.ends_with("{ @ret = count(); }\n"));
        // 24 calls a step: 10 + 1 launches, 7 collectives, group start and end, 1 graph
        // launch, 3 syncs; every one of those functions is probed.
        assert_eq!(CALLS_PER_STEP, 10 + 1 + 7 + 2 + 1 + 3);
        // Each runtime launch (10 + 1 kernels, 1 graph) reaches the driver once.
        assert_eq!(DRIVER_HITS_PER_STEP, 10 + 1 + 1);
    }
}
