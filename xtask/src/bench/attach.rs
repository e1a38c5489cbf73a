//! Block 4: `--pid` attach to a running PyTorch process: how long until it is traced,
//! and how many uprobes went in.
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::{
    ATTACH_DURATION_S, ATTACH_TARGET_ARGS, Ctx, RUN_TIMEOUT, Watch, lens_command, lens_probe_pids,
    proc::{Proc, Stream},
    rounds::Rounds,
    torch::parse_time_output,
    wait_teardown,
};
use xtask::error::{Error, Result};
use xtask::torch_venv;

#[derive(Clone, Debug, Default)]
pub(super) struct AttachRun {
    /// lens-probe start → its `tracing pid` line.
    pub(super) tracing_s: f64,
    /// lens-probe start → its `N uprobes attached` line.
    pub(super) attached_s: Option<f64>,
    pub(super) uprobes: Option<u32>,
    /// From the end of `--duration` to lens-probe's exit.
    pub(super) exit_s: f64,
    /// lens-probe's exit → its teardown child gone (the kernel has removed the uprobes).
    pub(super) teardown_s: f64,
    /// `/usr/bin/time`: user + sys seconds and max RSS (KiB) of the whole `--pid` run
    /// (lens-probe has no child it waits for there, so these are its own).
    pub(super) total_cpu_s: Option<f64>,
    pub(super) max_rss_kib: Option<u64>,
}

pub(super) fn parse_uprobes_attached(line: &str) -> Option<u32> {
    let (before, _) = line.split_once(" uprobes attached")?;
    before.rsplit(' ').next()?.parse().ok()
}

pub(super) fn attach_block(ctx: &Ctx, python: &Path, watch: &mut Watch) -> Result<Vec<AttachRun>> {
    watch.check();
    let mut target = torch_venv::python_command(python);
    target
        .current_dir(&ctx.root)
        .arg("-u")
        .arg(ctx.root.join("tests/fixtures/torch/train.py"))
        .args(ATTACH_TARGET_ARGS);
    let mut target = Proc::spawn(
        "attach target",
        &mut target,
        &ctx.logs.join("attach-target.log"),
    )?;
    target.wait_line(Instant::now() + Duration::from_secs(180), "`step 1`", |l| {
        l.text == "step 1"
    })?;
    let target_pid = target.pid;
    let rounds = Rounds::measure(
        ctx.rounds,
        [()],
        watch,
        |(), round| attach_run(ctx, &mut target, round),
        |(), run| {
            format!(
                "attach to pid {target_pid} took {:.3} s; exit {:.3} s after --duration, \
                 teardown {:.3} s after that",
                run.tracing_s, run.exit_s, run.teardown_s
            )
        },
    )?;
    target.drain();
    Ok(rounds.into_runs(()))
}

/// One `--pid` run against the running `target`.
fn attach_run(ctx: &Ctx, target: &mut Proc, round: u32) -> Result<AttachRun> {
    target.drain();
    if !target.running() {
        return Err("the PyTorch process to attach to ended early (see attach-target.log)".into());
    }
    let name = format!("attach-r{round}");
    let pid_file = ctx.out.join(format!("{name}.pid"));
    let time_file = ctx.out.join(format!("{name}.time"));
    let _ = fs::remove_file(&time_file);
    let timed = ctx.time.as_ref().ok().map(|time| {
        let mut timed = Command::new(time);
        timed.arg("-o").arg(&time_file).args(["-f", "%U %S %M"]);
        timed
    });
    let mut cmd = lens_command(ctx, timed, "per_step", &pid_file);
    cmd.args(["--exporter", "console", "-v", "--duration", "3s", "--pid"])
        .arg(target.pid.to_string());
    let before = lens_probe_pids();
    let p = Proc::spawn(&name, &mut cmd, &ctx.logs.join(format!("{name}.log")))?;
    let started = p.started;
    let mut run = AttachRun::default();
    let mut tracing = None;
    let exit = p.finish_ok(Instant::now() + RUN_TIMEOUT, |l| {
        let since = l.at.saturating_duration_since(started).as_secs_f64();
        if l.stream != Stream::Err {
            return;
        }
        if tracing.is_none() && l.text.starts_with("lens-probe: tracing pid") {
            tracing = Some(since);
        }
        if run.uprobes.is_none()
            && let Some(n) = parse_uprobes_attached(&l.text)
        {
            run.uprobes = Some(n);
            run.attached_s = Some(since);
        }
    })?;
    let Some(tracing) = tracing else {
        return Err(Error::Msg(format!(
            "{name}: lens-probe never printed `tracing pid`"
        )));
    };
    run.tracing_s = tracing;
    run.exit_s =
        exit.saturating_duration_since(started).as_secs_f64() - tracing - ATTACH_DURATION_S;
    run.teardown_s = wait_teardown(&name, &before);
    if let Some((cpu, rss)) = fs::read_to_string(&time_file)
        .ok()
        .and_then(|t| parse_time_output(&t))
    {
        run.total_cpu_s = Some(cpu);
        run.max_rss_kib = Some(rss);
    }
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attach_lines() {
        assert_eq!(
            parse_uprobes_attached("lens-probe: 61 uprobes attached (span groups: job)"),
            Some(61)
        );
        assert_eq!(
            parse_uprobes_attached("[2026-01-01T00:00:00Z INFO  lens_probe] 7 uprobes attached"),
            Some(7)
        );
        assert_eq!(parse_uprobes_attached("no"), None);
    }
}
