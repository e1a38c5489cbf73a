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
use super::report::{Met, Section, fmt_duration, row};
use super::rounds::Rounds;
use super::{Ctx, Watch};
use xtask::error::Result;

/// The traced variants, by span groups (`None`: untraced).
/// `evaluate` alone is the grad-mode signal's own cost; the default groups add the
/// framework save rules' Python sampler (`checkpoint`), `per_step` the step probes.
const VARIANTS: [Option<&str>; 4] = [None, Some("evaluate"), Some("default"), Some("per_step")];

/// The target for `per_step` on this loop.
const TARGET: f64 = 1.05;

fn parse_loop(line: &str) -> Option<f64> {
    line.trim().strip_prefix("recompute_loop ")?.parse().ok()
}

pub(super) struct RecomputeBlock {
    steps: u32,
    rounds: Rounds<Option<&'static str>, f64>,
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
    Ok(RecomputeBlock { steps, rounds })
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
    timed_loop(ctx, &name, target, groups.map(|g| (g, &[][..])), parse_loop)
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
        Section {
            title: "12. Activation checkpointing: grad mode switched hundreds of times a step \
                    (ratio: to untraced)"
                .into(),
            rows,
        }
    }

    pub(super) fn notes(&self) -> String {
        format!(
            "- Activation checkpointing (12): `tests/fixtures/torch/recompute_loop.py {}` on \
             the torch venv's python (8 linear layers of width 128, batch 16, each under \
             `torch.utils.checkpoint(use_reentrant=False)`, one intra-op thread) untraced and \
             under `lens-probe --span-groups G --exporter file --export-file /dev/null \
             --exec`; the loop's own time (`time.perf_counter` around it, after 5 warm-up \
             steps).\n",
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
    }
}
