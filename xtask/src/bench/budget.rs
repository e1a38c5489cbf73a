//! Block 2c: `--overhead-budget` on a launch-heavy loop. The fake `trainer` with 2 000
//! extra kernel launches per step, each keeping the CPU busy 3 µs as a real launch's
//! host-side work does (`TRAINER_EXTRA_LAUNCHES`, `LENS_FAKE_LAUNCH_NS`), runs
//! uninstrumented, under lens-probe `all`, and under `all --overhead-budget 1%`; the
//! loop's own time is the measure, and the budget's own account (its estimate, the share
//! of time the launch probes were in, the per-hit cost it measured at start-up) comes from
//! `--summary-json`.

use std::fs;
use std::process::Command;
use std::time::Instant;

use super::proc::{Line, Proc, Stream};
use super::report::{Met, Row, Section, fmt_duration, median, row};
use super::rounds::Rounds;
use super::summary::{BudgetAccount as Account, Summary};
use super::{Ctx, RUN_TIMEOUT, Watch, fake_env, lens_command, lens_probe_pids, wait_teardown};
use xtask::error::{Context, Result};

const EXTRA_LAUNCHES: &str = "2000";
const LAUNCH_NS: &str = "3000";
const BUDGET: &str = "1%";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    None,
    All,
    AllBudget,
}

impl Variant {
    const ALL: [Variant; 3] = [Variant::None, Variant::All, Variant::AllBudget];

    fn name(self) -> &'static str {
        match self {
            Variant::None => "none",
            Variant::All => "all",
            Variant::AllBudget => "all-budget",
        }
    }
}

/// Runs `trainer 1` (the probes go in), then times `trainer N` between two clock reads
/// and prints `lens-bench-loop NS`. `$0` is the trainer, `$1` the steps.
const WRAPPER: &str = r#"T="$0"; C="${T%/*}/monotonic_ns"; "$T" 1 >/dev/null || exit 1; s=$("$C"); "$T" "$1" >/dev/null || exit 1; e=$("$C"); echo "lens-bench-loop $((e - s))""#;

fn parse_loop(line: &str) -> Option<f64> {
    let ns: u64 = line.trim().strip_prefix("lens-bench-loop ")?.parse().ok()?;
    Some(ns as f64 / 1e9)
}

pub(super) struct BudgetBlock {
    steps: u64,
    /// The loop's time, and the budget's account where there is one.
    runs: Rounds<Variant, (f64, Option<Account>)>,
}

impl BudgetBlock {
    fn times(&self, variant: Variant) -> Vec<f64> {
        self.runs.values(variant, |(time, _)| *time)
    }

    fn ratio(&self, variant: Variant) -> Option<f64> {
        self.runs.ratio(variant, Variant::None, |(time, _)| *time)
    }

    /// The budget's accounts, in round order.
    fn accounts(&self) -> Vec<Account> {
        self.runs
            .iter()
            .flat_map(|(_, runs)| runs.iter().filter_map(|(_, account)| *account))
            .collect()
    }
}

pub(super) fn block(ctx: &Ctx, watch: &mut Watch, quick: bool) -> Result<BudgetBlock> {
    let steps = if quick { 400 } else { 1500 };
    let runs = Rounds::measure(
        ctx.rounds,
        Variant::ALL,
        watch,
        |variant, round| run(ctx, variant, steps, round),
        |variant, (time, _)| {
            format!(
                "launch-heavy trainer {steps} under {:<10} {:.3} s",
                variant.name(),
                time
            )
        },
    )?;
    Ok(BudgetBlock { steps, runs })
}

fn run(ctx: &Ctx, variant: Variant, steps: u64, round: u32) -> Result<(f64, Option<Account>)> {
    let trainer = ctx.fixtures.join("trainer");
    let name = format!("budget-{}-r{round}", variant.name());
    let log = ctx.logs.join(format!("{name}.log"));
    let deadline = Instant::now() + RUN_TIMEOUT;
    let wrapped = |cmd: &mut Command| {
        cmd.args(["sh", "-c", WRAPPER])
            .arg(&trainer)
            .arg(steps.to_string());
        fake_env(cmd);
        cmd.env("TRAINER_EXTRA_LAUNCHES", EXTRA_LAUNCHES)
            .env("LENS_FAKE_LAUNCH_NS", LAUNCH_NS);
    };
    let mut time = None;
    let mut on_line = |l: &Line| {
        if l.stream == Stream::Out
            && let Some(t) = parse_loop(&l.text)
        {
            time = Some(t);
        }
    };
    let mut account_found = None;
    if variant == Variant::None {
        let mut cmd = Command::new("env");
        cmd.current_dir(&ctx.root);
        wrapped(&mut cmd);
        Proc::spawn(&name, &mut cmd, &log)?.finish_ok(deadline, &mut on_line)?;
    } else {
        let summary_path = ctx.out.join(format!("{name}.summary.json"));
        let _ = fs::remove_file(&summary_path);
        let pid_file = ctx.out.join(format!("{name}.pid"));
        let mut cmd = lens_command(ctx, None, "all", &pid_file);
        cmd.args(["--exporter", "file", "--export-file", "/dev/null"])
            .arg("--summary-json")
            .arg(&summary_path);
        if variant == Variant::AllBudget {
            cmd.args(["--overhead-budget", BUDGET]);
        }
        cmd.args(["--exec", "--"]);
        wrapped(&mut cmd);
        let before = lens_probe_pids();
        Proc::spawn(&name, &mut cmd, &log)?.finish_ok(deadline, &mut on_line)?;
        wait_teardown(&name, &before);
        if variant == Variant::AllBudget {
            let json = Summary::read(&summary_path).context(&name)?;
            account_found = Some(json.overhead_budget.ok_or_else(|| {
                format!("{name}: no overhead_budget in {}", summary_path.display())
            })?);
        }
    }
    let time = time.ok_or_else(|| {
        format!(
            "{name}: the wrapper printed no loop time (output in {})",
            log.display()
        )
    })?;
    Ok((time, account_found))
}

fn percent(value: f64) -> String {
    format!("{value:.2} %")
}

impl BudgetBlock {
    pub(super) fn section(&self) -> Section {
        let label = |what: &str| {
            format!(
                "launch-heavy `trainer {}` ({EXTRA_LAUNCHES} launches of {LAUNCH_NS} ns per \
                 step): {what}",
                self.steps
            )
        };
        let mut rows = vec![
            row(
                label("none"),
                &self.times(Variant::None),
                fmt_duration,
                Some(1.0),
                "",
                Met::NoTarget,
            ),
            row(
                label("`all`"),
                &self.times(Variant::All),
                fmt_duration,
                self.ratio(Variant::All),
                "",
                Met::NoTarget,
            ),
        ];
        let budgeted = self.ratio(Variant::AllBudget);
        rows.push(row(
            label(&format!("`all --overhead-budget {BUDGET}`")),
            &self.times(Variant::AllBudget),
            fmt_duration,
            budgeted,
            "≤ 1.03× (≤ 3 %)",
            budgeted.map_or(Met::NotMeasured("no value".into()), |r| {
                Met::from_bool(r <= 1.03)
            }),
        ));
        let accounts = self.accounts();
        let column = |f: fn(&Account) -> f64| -> Vec<f64> { accounts.iter().map(f).collect() };
        let estimated = column(|a| a.estimated_percent);
        rows.push(row(
            "… lens-probe's own estimate of the launch probes' cost (hits × measured cost / wall time)",
            &estimated,
            percent,
            None,
            "< 1 %",
            median(&estimated).map_or(Met::NotMeasured("no value".into()), |e| {
                Met::from_bool(e < 1.0)
            }),
        ));
        rows.push(row(
            "… share of the time the launch probes were in",
            &column(|a| a.sampled_percent),
            percent,
            None,
            "",
            Met::NoTarget,
        ));
        rows.push(row(
            "… sampled windows",
            &column(|a| a.windows),
            |v| format!("{v:.0}"),
            None,
            "",
            Met::NoTarget,
        ));
        rows.push(row(
            "… one launch-probe hit, as lens-probe measured it at start-up",
            &column(|a| a.per_hit_ns),
            |v| fmt_duration(v / 1e9),
            None,
            "",
            Met::NoTarget,
        ));
        if accounts.is_empty() {
            rows.push(Row::not_measured(
                "… the budget's account",
                "",
                "no `overhead_budget` in the summaries",
            ));
        }
        Section {
            title: "2c. Overhead budget on a launch-heavy loop (ratio: to uninstrumented)".into(),
            rows,
        }
    }

    pub(super) fn notes(&self) -> String {
        format!(
            "- Overhead budget (2c): `trainer {steps}` with `TRAINER_EXTRA_LAUNCHES={EXTRA_LAUNCHES}` \
             and `LENS_FAKE_LAUNCH_NS={LAUNCH_NS}` (each fake launch busy for 3 µs, as a real \
             `cudaLaunchKernel` is on the host), timed between two clock reads after a \
             `trainer 1` that puts the probes in; lens-probe runs `--span-groups all \
             --exporter file --export-file /dev/null --summary-json F --exec`, with and \
             without `--overhead-budget {BUDGET}`. The budget covers the launch probes only: \
             the collective, sync and phase probes (13 calls per step here) stay in and are \
             part of the measured slowdown. Its estimate is its own account (launches counted \
             × the per-hit cost it measured at start-up on a `push %rbp` function of its own, \
             over wall time, for the most-launching process).\n",
            steps = self.steps
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_lines() {
        assert_eq!(parse_loop("lens-bench-loop 1500000000\n"), Some(1.5));
        assert_eq!(parse_loop("trainer: 3 steps done"), None);
    }
}
