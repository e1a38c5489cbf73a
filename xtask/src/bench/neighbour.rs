//! Block 10: what tracing one process costs another that lens-probe does not trace. An
//! untraced `hammer launch N` (the neighbour, on CPU 1) calls the fake `cudaLaunchKernel`
//! of the same library file as a twin `hammer launch` looping on CPU 0; each round times
//! the neighbour with the twin untraced ("alone") and with the twin under
//! `lens-probe --span-groups per_step --exec` ("beside"). The twin runs in both, so the
//! two differ only in whether a traced process maps the file: probes planted for every
//! process would make each of the neighbour's calls trap (~0.5–0.8 µs here), probes
//! planted in the traced process only leave it as it was.

use std::fs;
use std::process::Command;
use std::time::{Duration, Instant};

use super::per_kind::parse_loop_time;
use super::proc::{Line, Proc, Stream};
use super::report::{Met, Section, fmt_count, fmt_duration};
use super::rounds::Rounds;
use super::summary::Summary;
use super::{Ctx, RUN_TIMEOUT, Watch, fake_env, lens_command, lens_probe_pids, wait_teardown};
use xtask::error::{Context, Error, Result};

/// The twin's call count: far more than it gets to make before it is killed.
const TWIN_CALLS: &str = "4000000000";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// The twin untraced.
    Alone,
    /// The twin traced with `per_step`.
    Beside,
}

impl Variant {
    const ALL: [Variant; 2] = [Variant::Alone, Variant::Beside];

    fn name(self) -> &'static str {
        match self {
            Variant::Alone => "alone",
            Variant::Beside => "beside",
        }
    }
}

pub(super) struct NeighbourBlock {
    calls: u64,
    /// The neighbour's loop time (s).
    rounds: Rounds<Variant, f64>,
    /// What did not look right: a twin that was not traced, lost events.
    checks: Vec<String>,
}

pub(super) fn block(ctx: &Ctx, watch: &mut Watch, quick: bool) -> Result<NeighbourBlock> {
    let calls: u64 = if quick { 20_000_000 } else { 100_000_000 };
    let mut checks = Vec::new();
    let rounds = Rounds::measure(
        ctx.rounds,
        Variant::ALL,
        watch,
        |variant, round| run(ctx, variant, calls, round, &mut checks),
        |variant, loop_s| {
            format!(
                "untraced hammer launch {calls} {:<6} {:.2} ns per call",
                variant.name(),
                loop_s / calls as f64 * 1e9
            )
        },
    )?;
    Ok(NeighbourBlock {
        calls,
        rounds,
        checks,
    })
}

/// `taskset -c CPU hammer launch N`, with the fixtures' environment.
fn hammer_on(ctx: &Ctx, cpu: &str, calls: &str) -> Command {
    let mut cmd = Command::new("taskset");
    cmd.current_dir(&ctx.root)
        .args(["-c", cpu])
        .arg(ctx.fixtures.join("hammer"))
        .args(["launch", calls]);
    fake_env(&mut cmd);
    cmd
}

/// `hammer: started pid N` → N.
fn parse_started(line: &str) -> Option<u32> {
    line.trim()
        .strip_prefix("hammer: started pid ")?
        .parse()
        .ok()
}

fn run(
    ctx: &Ctx,
    variant: Variant,
    calls: u64,
    round: u32,
    checks: &mut Vec<String>,
) -> Result<f64> {
    let name = format!("neighbour-{}-r{round}", variant.name());
    let deadline = Instant::now() + RUN_TIMEOUT;
    let summary_path = ctx.out.join(format!("{name}.summary.json"));
    let _ = fs::remove_file(&summary_path);
    let before = lens_probe_pids();
    let mut twin_cmd = match variant {
        Variant::Alone => hammer_on(ctx, "0", TWIN_CALLS),
        Variant::Beside => {
            let pid_file = ctx.out.join(format!("{name}.pid"));
            let mut wrapper = Command::new("taskset");
            wrapper.args(["-c", "0"]);
            let mut cmd = lens_command(ctx, Some(wrapper), "per_step", &pid_file);
            let twin = hammer_on(ctx, "0", TWIN_CALLS);
            cmd.args(["--exporter", "file", "--export-file", "/dev/null"])
                .arg("--summary-json")
                .arg(&summary_path)
                .args(["--exec", "--"]);
            super::append_command(&mut cmd, &twin);
            cmd
        }
    };
    twin_cmd.env("HAMMER_SAY_START", "1");
    let mut twin = Proc::spawn(
        &format!("{name} (twin)"),
        &mut twin_cmd,
        &ctx.logs.join(format!("{name}-twin.log")),
    )?;
    // Printed from the twin's `main`: its libraries are loaded and, under `--exec`, their
    // probes attached (lens-probe holds it at each library load until then).
    let mut twin_pid = None;
    twin.wait_line(
        Instant::now() + Duration::from_secs(120),
        "`hammer: started`",
        |l| {
            twin_pid = parse_started(&l.text);
            twin_pid.is_some()
        },
    )?;
    let twin_pid = twin_pid.expect("the line waited for has the pid");
    let mut loop_s = None;
    let result = Proc::spawn(
        &name,
        &mut hammer_on(ctx, "1", &calls.to_string()),
        &ctx.logs.join(format!("{name}.log")),
    )
    .and_then(|neighbour| {
        neighbour.finish_ok(deadline, |l: &Line| {
            if l.stream == Stream::Out
                && let Some(s) = parse_loop_time(&l.text)
            {
                loop_s = Some(s);
            }
        })
    });
    // The twin ends by SIGKILL; under `--exec`, lens-probe ends with it.
    let _ = Command::new("kill")
        .args(["-KILL", &twin_pid.to_string()])
        .status();
    twin.finish(Instant::now() + Duration::from_secs(120), |_| {})?;
    result?;
    if variant == Variant::Beside {
        wait_teardown(&name, &before);
        let json = Summary::read(&summary_path).context(&name)?;
        let twin_calls = json
            .process("hammer", &["launch", TWIN_CALLS])
            .map_or(0, |p| p.calls_of("cudaLaunchKernel"));
        if twin_calls == 0 {
            checks.push(format!(
                "{name}: lens-probe counted no launch of the traced twin: it was not traced"
            ));
        }
    }
    loop_s.ok_or_else(|| Error::Msg(format!("{name}: the neighbour printed no loop time")))
}

impl NeighbourBlock {
    pub(super) fn section(&self) -> Section {
        let per_call = |variant| self.rounds.values(variant, |t| t / self.calls as f64);
        let ns = fmt_duration;
        let ratio = self.rounds.ratio(Variant::Beside, Variant::Alone, |t| *t);
        let rows = vec![
            super::report::row(
                format!(
                    "untraced `hammer launch {}` on CPU 1, a twin `hammer launch` on CPU 0 \
                     untraced (alone), per call",
                    fmt_count(self.calls as f64)
                ),
                &per_call(Variant::Alone),
                ns,
                None,
                "",
                Met::NoTarget,
            ),
            super::report::row(
                "… the same, the twin traced by `lens-probe --span-groups per_step --exec` \
                 (beside) (ratio: to alone)",
                &per_call(Variant::Beside),
                ns,
                ratio,
                "≤ 1.02× alone",
                match ratio {
                    Some(r) => Met::from_bool(r <= 1.02),
                    None => Met::NotMeasured("no value".into()),
                },
            ),
        ];
        Section {
            title: "10. An untraced neighbour of a traced process (the same library file, \
                    the loop's own time per call)"
                .into(),
            rows,
        }
    }

    pub(super) fn notes(&self) -> String {
        let mut n = format!(
            "- Neighbour: `hammer launch {}` (tests/fixtures/hammer.c, not traced, on CPU 1), \
             run while a twin `hammer launch` of the same binary and fake libcudart loops on \
             CPU 0: untraced (alone), or started by `lens-probe --span-groups per_step \
             --exporter file --export-file /dev/null --exec` on CPU 0 (beside; its `main` \
             prints a line once its libraries and their probes are in, and the neighbour \
             starts then). The twin is killed once the neighbour has printed its time. The \
             variants alternate in every round. With probes planted for every process (before \
             issue 33), each of the neighbour's calls trapped: ~0.5–0.8 µs a call here.\n",
            fmt_count(self.calls as f64)
        );
        for check in &self.checks {
            n.push_str(&format!("- **Check failed**: {check}\n"));
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hammer_lines() {
        assert_eq!(parse_started("hammer: started pid 4242\n"), Some(4242));
        assert_eq!(parse_started("hammer: launch 5 calls in 10 ns"), None);
    }
}
