//! Block 7: what hang detection costs a job that does not hang. The fake `trainer` runs
//! under lens-probe `per_step` with `--hang-timeout 0` (off) and `--hang-timeout 1s` (a
//! look at the calls in flight every second, the most often it looks), interleaved; the
//! trainer's own elapsed time is the measure. Nothing of it runs in the kernel, so the
//! only cost is lens-probe's: a map walk a second, on the cores the job shares.

use std::time::Instant;

use super::fake::parse_elapsed;
use super::proc::{Line, Proc, Stream};
use super::report::{Met, Row, Section, fmt_duration, row};
use super::rounds::{Rounds, ratio_to};
use super::{
    Ctx, FAKE_WRAPPER, RUN_TIMEOUT, Watch, fake_env, lens_command, lens_probe_pids, wait_teardown,
};
use xtask::error::{Error, Result};

/// The variants, as `--hang-timeout` values.
const TIMEOUTS: [&str; 2] = ["0", "1s"];

pub(super) struct HangsBlock {
    steps: u64,
    /// The trainer's time, by `--hang-timeout`.
    rounds: Rounds<&'static str, f64>,
}

pub(super) fn block(ctx: &Ctx, watch: &mut Watch) -> Result<HangsBlock> {
    let steps = ctx.sizes.trainer_steps;
    let rounds = Rounds::measure(
        ctx.rounds,
        TIMEOUTS,
        watch,
        |timeout, round| run(ctx, timeout, round),
        |timeout, time| format!("trainer {steps} per_step --hang-timeout {timeout:<3} {time:.3} s"),
    )?;
    Ok(HangsBlock { steps, rounds })
}

fn run(ctx: &Ctx, timeout: &str, round: u32) -> Result<f64> {
    let name = format!("hangs-{timeout}-r{round}");
    let log = ctx.logs.join(format!("{name}.log"));
    let pid_file = ctx.out.join(format!("{name}.pid"));
    let mut cmd = lens_command(ctx, None, "per_step", &pid_file);
    cmd.args(["--exporter", "file", "--export-file", "/dev/null"])
        .args(["--hang-timeout", timeout])
        .args(["--exec", "--", "sh", "-c", FAKE_WRAPPER])
        .arg(ctx.fixtures.join("trainer"))
        .arg(ctx.sizes.trainer_steps.to_string());
    fake_env(&mut cmd);
    let mut elapsed = None;
    let mut on_line = |l: &Line| {
        if l.stream == Stream::Out
            && let Some(s) = parse_elapsed(&l.text)
        {
            elapsed = Some(s);
        }
    };
    let before = lens_probe_pids();
    Proc::spawn(&name, &mut cmd, &log)?.finish_ok(Instant::now() + RUN_TIMEOUT, &mut on_line)?;
    wait_teardown(&name, &before);
    elapsed.ok_or_else(|| {
        Error::Msg(format!(
            "{name}: the wrapper printed no elapsed time (output in {})",
            log.display()
        ))
    })
}

impl HangsBlock {
    pub(super) fn section(&self) -> Section {
        let label = |what: &str| format!("fake `trainer {}`, `per_step`: {what}", self.steps);
        let [off, on] = TIMEOUTS.map(|timeout| self.rounds.values(timeout, |t| *t));
        let ratio = ratio_to(&on, &off);
        let rows: Vec<Row> = vec![
            row(
                label("`--hang-timeout 0` (off)"),
                &off,
                fmt_duration,
                Some(1.0),
                "",
                Met::NoTarget,
            ),
            row(
                label("`--hang-timeout 1s` (a look every second)"),
                &on,
                fmt_duration,
                ratio,
                "no measurable change",
                ratio.map_or(Met::NotMeasured("no value".into()), |r| {
                    Met::from_bool(r <= 1.01)
                }),
            ),
        ];
        Section {
            title: "7. Hang detection without a hang (ratio: to --hang-timeout 0)".into(),
            rows,
        }
    }

    pub(super) fn notes(&self) -> String {
        format!(
            "- Hang detection (7): `trainer {}` under `lens-probe --span-groups per_step \
             --exporter file --export-file /dev/null --hang-timeout T --exec`, T = 0 and 1s \
             interleaved; the wrapper's elapsed time. `1s` makes lens-probe walk the kernel's \
             map of calls in flight and compare its per-communicator counters once a \
             second (the default, 5m, looks as often: the timeout only decides when a \
             collective counts as hung); nothing runs in the kernel for it \
             (docs/hangs.md).\n",
            self.steps
        )
    }
}
