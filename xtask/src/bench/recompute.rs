//! Block 12: activation checkpointing, a loop that switches grad mode hundreds of times a
//! step. `tests/fixtures/torch/recompute_loop.py` (8 small layers, each under
//! `torch.utils.checkpoint`, ~5 ms a step here) runs untraced, under the default groups
//! and under `per_step`; the measure is its mean step, the slowest tenth left out (the
//! host's bursts: see the script). Grad mode is the evaluation
//! signal, read where Python sets it (`torch._C._set_grad_enabled`: 64 of the loop's
//! ~157 switches a step; autograd's C++ guards make the rest); the kernel follows each
//! thread's and sends only what the phase rules can tell apart
//! (`lens-ebpf/src/grad_mode.rs`). Beside them, bpftrace `count()` on the binding
//! alone: what its traps cost the loop with no lens-probe at all, the floor of any
//! per-call grad-mode signal.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::commands::timed_loop;
use super::fake::parse_bpftrace_count;
use super::proc::Proc;
use super::report::{Met, Section, fmt_duration, median, row};
use super::rounds::Rounds;
use super::summary::Summary;
use super::{Ctx, Watch};
use xtask::error::Result;

/// How the loop runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tracer {
    Untraced,
    /// bpftrace `count()` on the grad-mode binding (`GRAD_MODE_SYMBOLS[0]`) alone.
    TrapFloor,
    /// lens-probe with these span groups.
    Lens(&'static str),
}

impl Tracer {
    /// What its runs are called in the bench's output and logs.
    fn label(self) -> &'static str {
        match self {
            Tracer::Untraced => "none",
            Tracer::TrapFloor => "bpftrace",
            Tracer::Lens(groups) => groups,
        }
    }
}

/// The lens-probe variants, by span groups: `evaluate` alone is the grad-mode signal's
/// own cost; the default groups add the framework save rules' Python sampler
/// (`checkpoint`), `per_step` the step probes.
const GROUPS: [&str; 3] = ["evaluate", "default", "per_step"];

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

/// The loop's step, the slowest tenth left out (`recompute_loop.py`).
fn parse_step(line: &str) -> Option<f64> {
    line.trim().strip_prefix("recompute_step ")?.parse().ok()
}

fn parse_switch(line: &str) -> Option<f64> {
    let ns: f64 = line.trim().strip_prefix("grad_mode_calls ")?.parse().ok()?;
    Some(ns * 1e-9)
}

pub(super) struct RecomputeBlock {
    steps: u32,
    rounds: Rounds<Tracer, f64>,
    /// Why the trap floor was not measured, if it was not.
    no_floor: Option<String>,
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
    let library = libtorch_python(python);
    let no_floor = match (&ctx.bpftrace, &library) {
        (Err(missing), _) => Some(missing.0.clone()),
        (_, None) => Some("no libtorch_python.so in the torch venv".to_owned()),
        _ => None,
    };
    let variants = [Tracer::Untraced]
        .into_iter()
        .chain(no_floor.is_none().then_some(Tracer::TrapFloor))
        .chain(GROUPS.map(Tracer::Lens));
    let rounds = Rounds::measure(
        ctx.rounds,
        variants,
        watch,
        |tracer, round| match (tracer, &library) {
            (Tracer::TrapFloor, Some(library)) => {
                under_bpftrace(ctx, python, library, steps, round)
            }
            _ => run(ctx, python, tracer, steps, round),
        },
        |tracer, time| {
            format!(
                "recompute_loop.py {steps} under {:<9} {:.3} ms a step",
                tracer.label(),
                time * 1e3
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
        no_floor,
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

/// The loop, untraced (also under bpftrace: `tracer` names the run) or under lens-probe.
fn run(ctx: &Ctx, python: &Path, tracer: Tracer, steps: u32, round: u32) -> Result<f64> {
    let name = format!("recompute-{}-r{round}", tracer.label());
    let groups = match tracer {
        Tracer::Lens(groups) => Some(groups),
        _ => None,
    };
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
        parse_step,
    )
}

/// The venv's `torch/lib/libtorch_python.so` (`PYTHON` is `VENV/bin/python`).
fn libtorch_python(python: &Path) -> Option<PathBuf> {
    let lib = python.parent()?.parent()?.join("lib");
    std::fs::read_dir(lib)
        .ok()?
        .flatten()
        .map(|entry| {
            entry
                .path()
                .join("site-packages/torch/lib/libtorch_python.so")
        })
        .find(|path| path.is_file())
}

/// The loop under bpftrace `count()` on the grad-mode binding of `library`, started
/// first: the traps alone. Fails unless bpftrace counted hits.
fn under_bpftrace(ctx: &Ctx, python: &Path, library: &Path, steps: u32, round: u32) -> Result<f64> {
    let name = format!("recompute-bpftrace-r{round}");
    let program = ctx
        .bpftrace
        .as_ref()
        .map_err(|missing| xtask::error::Error::Msg(missing.0.clone()))?;
    let script = format!(
        "BEGIN {{ printf(\"lens-bench-ready\\n\"); }}\nuprobe:{}:{} {{ @ = count(); }}\n",
        library.display(),
        GRAD_MODE_SYMBOLS[0]
    );
    let mut bt = Command::new(program);
    bt.args(["-B", "none", "-e", &script]);
    let mut bt = Proc::spawn(
        &format!("{name} (bpftrace)"),
        &mut bt,
        &ctx.logs.join(format!("{name}.bpftrace.log")),
    )?;
    // BEGIN runs once every probe is attached.
    bt.wait_line(
        Instant::now() + Duration::from_secs(120),
        "its BEGIN probe ran",
        |l| l.text.trim() == "lens-bench-ready",
    )?;
    let time = run(ctx, python, Tracer::TrapFloor, steps, round);
    bt.signal("INT");
    let mut hits = None;
    bt.finish(Instant::now() + Duration::from_secs(120), |l| {
        hits = hits.or(parse_bpftrace_count(&l.text));
    })?;
    let time = time?;
    match hits {
        Some(hits) if hits > 0 => Ok(time),
        _ => Err(xtask::error::Error::Msg(format!(
            "{name}: bpftrace counted no grad-mode call ({hits:?})"
        ))),
    }
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
                 step), a step (the slowest tenth left out): {what}",
                self.steps
            )
        };
        let mut rows = vec![row(
            label("untraced"),
            &self.rounds.values(Tracer::Untraced, |t| *t),
            fmt_duration,
            Some(1.0),
            "",
            Met::NoTarget,
        )];
        let floor = label(
            "bpftrace `count()` on `torch._C._set_grad_enabled` alone, no lens-probe (the \
             kernel's traps: the floor of a per-call grad-mode signal)",
        );
        rows.push(match &self.no_floor {
            None => row(
                floor,
                &self.rounds.values(Tracer::TrapFloor, |t| *t),
                fmt_duration,
                self.rounds
                    .ratio(Tracer::TrapFloor, Tracer::Untraced, |t| *t),
                "",
                Met::NoTarget,
            ),
            Some(why) => super::report::Row::not_measured(&floor, "", why),
        });
        for groups in GROUPS {
            let ratio = self
                .rounds
                .ratio(Tracer::Lens(groups), Tracer::Untraced, |t| *t);
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
                &self.rounds.values(Tracer::Lens(groups), |t| *t),
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
        let step = median(self.rounds.runs(Tracer::Untraced));
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
             --exec`, and untraced under bpftrace `-e 'uprobe:LIBTORCH_PYTHON:\
             _ZN5torch8autogradL16set_grad_enabledEP7_objectS2_S2_ {{ @ = count(); }}'` \
             started first; the mean of the steps' own times (`time.perf_counter` around \
             each, after 5 warm-up steps), the slowest tenth left out: the host's bursts of \
             milliseconds, which moved whole-loop times by ±10 % between rounds here, \
             would drown costs of microseconds a step. The grad-mode probe's share: its hits in the `evaluate` run's \
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
        assert_eq!(parse_step("recompute_step 0.005250000\n"), Some(0.00525));
        assert_eq!(parse_step("recompute_loop 3.250000"), None);
        let switch = parse_switch("grad_mode_calls 1500.0\n").unwrap();
        assert!((switch - 1.5e-6).abs() < 1e-12, "{switch}");
        assert_eq!(parse_switch("recompute_loop 3.25"), None);
    }
}
