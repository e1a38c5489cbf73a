//! Block 12: activation checkpointing, a loop that switches grad mode hundreds of times a
//! step. `tests/fixtures/torch/recompute_loop.py` (8 small layers, each under
//! `torch.utils.checkpoint`, ~5 ms a step here) runs untraced, under the default groups
//! and under `per_step`; the loop's own time is the measure. Grad mode is the evaluation
//! signal, read where Python sets it (`torch._C._set_grad_enabled`: 64 of the loop's
//! ~157 switches a step; autograd's C++ guards make the rest); the kernel follows each
//! thread's and sends only what the phase rules can tell apart
//! (`lens-ebpf/src/grad_mode.rs`).

use std::path::Path;
use std::process::Command;

use super::commands::timed_loop;
use super::report::{Met, Section, fmt_duration, median, row};
use super::rounds::Rounds;
use super::summary::Summary;
use super::{Ctx, Watch};
use xtask::error::Result;

/// The traced variants, by span groups (`None`: untraced).
/// `evaluate` alone is the grad-mode signal's own cost; the default groups add the
/// framework save rules' Python sampler (`checkpoint`), `per_step` the step probes.
const VARIANTS: [Option<&str>; 4] = [None, Some("evaluate"), Some("default"), Some("per_step")];

/// The target for `per_step` on this loop.
const TARGET: f64 = 1.05;

/// Grad-mode switches timed per run of `grad_mode_calls.py`, traced and untraced.
const SWITCHES: u32 = 200_000;

/// The loop's warm-up steps (`recompute_loop.py`), probed too.
const WARM_UP_STEPS: u32 = 5;

/// The grad-mode probes, by symbol: torch's Python binding, libc10's `set_enabled`.
const GRAD_MODE_SYMBOLS: [&str; 2] = [
    "_ZN5torch8autogradL16set_grad_enabledEP7_objectS2_S2_",
    "_ZN3c108GradMode11set_enabledEb",
];

fn parse_loop(line: &str) -> Option<f64> {
    line.trim().strip_prefix("recompute_loop ")?.parse().ok()
}

fn parse_switch(line: &str) -> Option<f64> {
    let ns: f64 = line.trim().strip_prefix("grad_mode_calls ")?.parse().ok()?;
    Some(ns * 1e-9)
}

pub(super) struct RecomputeBlock {
    steps: u32,
    rounds: Rounds<Option<&'static str>, f64>,
    /// Grad-mode probe hits a step under `evaluate` (its first round's summary).
    grad_hits_per_step: Option<f64>,
    /// `grad_mode_calls.py`'s time per switch, untraced and under `evaluate`.
    switches: Rounds<Option<&'static str>, f64>,
}

pub(super) fn block(
    ctx: &Ctx,
    python: &Path,
    watch: &mut Watch,
    quick: bool,
) -> Result<RecomputeBlock> {
    let steps = if quick { 200 } else { 600 };
    let rounds = Rounds::measure(
        ctx.rounds,
        VARIANTS,
        watch,
        |groups, round| run(ctx, python, groups, steps, round),
        |groups, time| {
            format!(
                "recompute_loop.py {steps} under {:<9} {time:.3} s",
                groups.unwrap_or("none")
            )
        },
    )?;
    let grad_hits_per_step = grad_hits(&summary_path(ctx)).map(|hits| {
        let steps = f64::from(steps + WARM_UP_STEPS);
        hits as f64 / steps
    });
    let switches = Rounds::measure(
        ctx.rounds,
        [None, Some("evaluate")],
        watch,
        |groups, round| switch_cost(ctx, python, groups, round),
        |groups, time| {
            format!(
                "grad_mode_calls.py {SWITCHES} under {:<9} {:.0} ns a call",
                groups.unwrap_or("none"),
                time * 1e9
            )
        },
    )?;
    Ok(RecomputeBlock {
        steps,
        rounds,
        grad_hits_per_step,
        switches,
    })
}

/// The `evaluate` runs' summary (the first round's).
fn summary_path(ctx: &Ctx) -> std::path::PathBuf {
    ctx.out.join("recompute-evaluate.json")
}

/// Grad-mode probe hits in the summary at `path`, all processes together.
fn grad_hits(path: &Path) -> Option<u64> {
    let summary = Summary::read(path).ok()?;
    let hits = summary
        .processes
        .iter()
        .flat_map(|p| &p.calls)
        .filter(|(symbol, _)| GRAD_MODE_SYMBOLS.contains(&symbol.as_str()))
        .map(|(_, hits)| hits)
        .sum();
    Some(hits)
}

fn run(
    ctx: &Ctx,
    python: &Path,
    groups: Option<&'static str>,
    steps: u32,
    round: u32,
) -> Result<f64> {
    let name = format!("recompute-{}-r{round}", groups.unwrap_or("none"));
    let mut target = Command::new(python);
    target
        .arg(ctx.root.join("tests/fixtures/torch/recompute_loop.py"))
        .arg(steps.to_string());
    let summary = summary_path(ctx);
    let summary_args = [std::ffi::OsStr::new("--summary-json"), summary.as_os_str()];
    let lens_args: &[&std::ffi::OsStr] = match groups {
        Some("evaluate") if round == 1 => &summary_args,
        _ => &[],
    };
    timed_loop(
        ctx,
        &name,
        target,
        groups.map(|g| (g, lens_args)),
        parse_loop,
    )
}

fn switch_cost(ctx: &Ctx, python: &Path, groups: Option<&'static str>, round: u32) -> Result<f64> {
    let name = format!("grad-mode-calls-{}-r{round}", groups.unwrap_or("none"));
    let mut target = Command::new(python);
    target
        .arg(ctx.root.join("tests/fixtures/torch/grad_mode_calls.py"))
        .arg(SWITCHES.to_string());
    timed_loop(
        ctx,
        &name,
        target,
        groups.map(|g| (g, &[][..])),
        parse_switch,
    )
}

impl RecomputeBlock {
    pub(super) fn section(&self) -> Section {
        let label = |what: &str| {
            format!(
                "`recompute_loop.py {}` (8 checkpointed layers, ~150 grad-mode switches a \
                 step): {what}",
                self.steps
            )
        };
        let mut rows = vec![row(
            label("untraced"),
            &self.rounds.values(None, |t| *t),
            fmt_duration,
            Some(1.0),
            "",
            Met::NoTarget,
        )];
        for groups in VARIANTS.into_iter().flatten() {
            let ratio = self.rounds.ratio(Some(groups), None, |t| *t);
            let (target, met) = if groups == "per_step" {
                (
                    "≤ 1.05×",
                    ratio.map_or(Met::NotMeasured("no value".into()), |r| {
                        Met::from_bool(r <= TARGET)
                    }),
                )
            } else {
                ("", Met::NoTarget)
            };
            rows.push(row(
                label(&format!("`--span-groups {groups}`")),
                &self.rounds.values(Some(groups), |t| *t),
                fmt_duration,
                ratio,
                target,
                met,
            ));
        }
        rows.extend(self.grad_mode_rows());
        Section {
            title: "12. Activation checkpointing: grad mode switched hundreds of times a step \
                    (ratio: to untraced)"
                .into(),
            rows,
        }
    }

    /// The grad-mode probe's own share of a step, from counts and a per-hit cost measured
    /// apart: the loop times above move by more than it between rounds on a noisy VM.
    fn grad_mode_rows(&self) -> Vec<super::report::Row> {
        // Per round: the traced switch less the untraced one of the same round.
        let untraced = self.switches.runs(None);
        let per_hit: Vec<f64> = self
            .switches
            .runs(Some("evaluate"))
            .iter()
            .zip(untraced)
            .map(|(traced, plain)| traced - plain)
            .collect();
        let mut rows = vec![row(
            format!(
                "grad-mode probe, a hit: `grad_mode_calls.py {SWITCHES}` (`torch._C.\
                 _set_grad_enabled` in a loop) under `evaluate` less untraced, per call"
            ),
            &per_hit,
            fmt_duration,
            None,
            "",
            Met::NoTarget,
        )];
        let step = median(self.rounds.runs(None)).map(|t| t / f64::from(self.steps));
        let what = "grad-mode probe, a step: its hits (`--summary-json`) × the cost of a hit";
        rows.push(match (self.grad_hits_per_step, median(&per_hit), step) {
            (Some(hits), Some(hit), Some(step)) => {
                let cost = hits * hit;
                row(
                    format!(
                        "{what} ({hits:.0} hits); ratio: 1 + its share of the untraced step \
                         ({})",
                        fmt_duration(step)
                    ),
                    &[cost],
                    fmt_duration,
                    Some(1.0 + cost / step),
                    "",
                    Met::NoTarget,
                )
            }
            (None, ..) => super::report::Row::not_measured(
                what,
                "",
                "the `evaluate` run wrote no readable summary",
            ),
            _ => super::report::Row::not_measured(what, "", "no untraced time"),
        });
        rows
    }

    pub(super) fn notes(&self) -> String {
        format!(
            "- Activation checkpointing (12): `tests/fixtures/torch/recompute_loop.py {}` on \
             the torch venv's python (8 linear layers of width 128, batch 16, each under \
             `torch.utils.checkpoint(use_reentrant=False)`, one intra-op thread) untraced and \
             under `lens-probe --span-groups G --exporter file --export-file /dev/null \
             --exec`; the loop's own time (`time.perf_counter` around it, after 5 warm-up \
             steps). The grad-mode probe's share: its hits in the `evaluate` run's \
             `--summary-json` (warm-up steps included) times its cost a hit, \
             `tests/fixtures/torch/grad_mode_calls.py {SWITCHES}` under `evaluate` less \
             untraced, round by round.\n",
            self.steps
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_lines() {
        assert_eq!(parse_loop("recompute_loop 3.250000\n"), Some(3.25));
        assert_eq!(parse_loop("bench_loop 1.0"), None);
        let switch = parse_switch("grad_mode_calls 1500.0\n").unwrap();
        assert!((switch - 1.5e-6).abs() < 1e-12, "{switch}");
        assert_eq!(parse_switch("recompute_loop 3.25"), None);
    }
}
