//! Block 6: the Python sampler's cost. `tests/fixtures/python/bench_loop.py` (a
//! CPU-bound pure-Python loop of fixed work, 20 000 small calls per `train_step`) runs on
//! pyenv's CPython 3.11 uninstrumented and under lens-probe with a Python rule naming its
//! `train_step` (so the sampler reads its stacks on every CPU clock tick, 1 ms); the
//! loop's own time is the measure.

use std::path::PathBuf;
use std::process::Command;

use super::commands::timed_loop;
use super::report::{Met, Row, Section, fmt_duration, row};
use super::rounds::Rounds;
use super::{Ctx, Watch};
use xtask::error::{self, Result};

const PYTHON: &str = "/root/.pyenv/versions/3.11.7/bin/python3.11";
const RULES: &str = "[[probe]]\npython = \"__main__:train_step\"\ngroup = \"step\"\n";

fn parse_loop(line: &str) -> Option<f64> {
    line.trim().strip_prefix("bench_loop ")?.parse().ok()
}

pub(super) struct PythonBlock {
    steps: u64,
    /// The loop's time, untraced (`false`) and sampled (`true`).
    rounds: Rounds<bool, f64>,
    skipped: Option<String>,
}

pub(super) fn block(ctx: &Ctx, watch: &mut Watch, quick: bool) -> Result<PythonBlock> {
    let steps = if quick { 200 } else { 800 };
    if !std::path::Path::new(PYTHON).exists() {
        return Ok(PythonBlock {
            steps,
            rounds: Rounds::default(),
            skipped: Some(format!("no {PYTHON}")),
        });
    }
    let config = ctx.out.join("python-rules.toml");
    error::write(&config, RULES)?;
    let rounds = Rounds::measure(
        ctx.rounds,
        [false, true],
        watch,
        |sampled, round| run(ctx, sampled.then_some(&config), steps, round),
        |sampled, time| {
            format!(
                "bench_loop.py {steps} {} {:.3} s",
                if sampled { "sampled" } else { "untraced" },
                time
            )
        },
    )?;
    Ok(PythonBlock {
        steps,
        rounds,
        skipped: None,
    })
}

fn run(ctx: &Ctx, config: Option<&PathBuf>, steps: u64, round: u32) -> Result<f64> {
    let name = format!(
        "python-{}-r{round}",
        if config.is_some() { "sampled" } else { "none" }
    );
    let mut target = Command::new(PYTHON);
    target
        .arg(ctx.root.join("tests/fixtures/python/bench_loop.py"))
        .arg(steps.to_string());
    let lens_args = config.map(|config| [std::ffi::OsStr::new("--config"), config.as_os_str()]);
    let traced = lens_args.as_ref().map(|args| ("all", &args[..]));
    timed_loop(ctx, &name, target, traced, parse_loop)
}

impl PythonBlock {
    pub(super) fn section(&self) -> Section {
        let label = |what: &str| {
            format!(
                "pure-Python `bench_loop.py {}` (CPython 3.11, 20 000 calls a step): {what}",
                self.steps
            )
        };
        let rows = match &self.skipped {
            Some(why) => vec![Row::not_measured(label("sampled"), "≤ 1.01×", why)],
            None => {
                let ratio = self.rounds.ratio(true, false, |t| *t);
                vec![
                    row(
                        label("untraced"),
                        &self.rounds.values(false, |t| *t),
                        fmt_duration,
                        Some(1.0),
                        "",
                        Met::NoTarget,
                    ),
                    row(
                        label("a Python rule on `train_step` (sampled every 1 ms)"),
                        &self.rounds.values(true, |t| *t),
                        fmt_duration,
                        ratio,
                        "≤ 1.01×",
                        ratio.map_or(Met::NotMeasured("no value".into()), |r| {
                            Met::from_bool(r <= 1.01)
                        }),
                    ),
                ]
            }
        };
        Section {
            title: "6. Python functions: the stack sampler (ratio: to untraced)".into(),
            rows,
        }
    }

    pub(super) fn notes(&self) -> String {
        format!(
            "- Python sampler (6): `{PYTHON} tests/fixtures/python/bench_loop.py {}` \
             untraced and under `lens-probe --span-groups all --exporter file --export-file \
             /dev/null --config F --exec` with one rule `python = \"__main__:train_step\"`; \
             the loop's own time (`time.perf_counter` around it). The cost does not grow with \
             the Python calls: one BPF run per CPU clock tick (1 ms) while the thread runs, a \
             record only when the outermost 32 frames change (docs/python.md).\n",
            self.steps
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_lines() {
        assert_eq!(parse_loop("bench_loop 1.250000\n"), Some(1.25));
        assert_eq!(parse_loop("train_loop: 3 steps"), None);
    }
}
