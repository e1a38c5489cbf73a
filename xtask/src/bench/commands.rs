//! The command lines the blocks run: lens-probe's, the target's it starts, and the
//! environment they run in.

use std::fs;
use std::path::Path;
use std::process::Command;

use xtask::torch_venv;

use super::Ctx;

/// How a command is shown in logs and messages.
pub(super) fn shown(cmd: &Command) -> String {
    torch_venv::display(cmd)
}

/// `lens-probe --span-groups PRESET --pid-file PID_FILE` (run through `wrapper`, e.g.
/// `/usr/bin/time`, when given), the environment's NeMo Lens / OTLP settings removed.
pub(super) fn lens_command(
    ctx: &Ctx,
    wrapper: Option<Command>,
    preset: &str,
    pid_file: &Path,
) -> Command {
    let _ = fs::remove_file(pid_file);
    let mut cmd = match wrapper {
        Some(mut wrapper) => {
            wrapper.arg(&ctx.lens);
            wrapper
        }
        None => Command::new(&ctx.lens),
    };
    scrub_lens_env(&mut cmd);
    cmd.current_dir(&ctx.root)
        .args(["--span-groups", preset])
        .arg("--pid-file")
        .arg(pid_file);
    cmd
}

/// Appends `target` (program, arguments and environment changes) to `cmd`: the command
/// a `lens-probe … --exec --` runs.
pub(super) fn append_command(cmd: &mut Command, target: &Command) {
    cmd.arg(target.get_program()).args(target.get_args());
    for (key, value) in target.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
}

pub(super) fn scrub_lens_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if key.starts_with("NEMO_LENS_")
            || key.starts_with("OTEL_")
            || key.starts_with("LENS_PROBE_")
            || key == "PYTHONHOME"
            || key == "PYTHONPATH"
        {
            cmd.env_remove(key);
        }
    }
}

pub(super) fn fake_env(cmd: &mut Command) {
    cmd.env("LENS_FAKE_SYNC_MS", "0")
        .env("TRAINER_STEP_DELAY_MS", "0")
        .env("TRAINER_START_DELAY_MS", "0")
        .env_remove("LENS_FAKE_SYNC_LOG");
}

/// A script's loop time, as the line `parse` reads it on its stdout: `target` run alone
/// (`traced` is `None`) or under `lens-probe --span-groups G --exporter file
/// --export-file /dev/null [LENS_ARGS] --exec -- TARGET` (`traced`: `(G, LENS_ARGS)`),
/// its teardown waited for. `name` names the run's log.
pub(super) fn timed_loop(
    ctx: &Ctx,
    name: &str,
    mut target: Command,
    traced: Option<(&str, &[&std::ffi::OsStr])>,
    parse: fn(&str) -> Option<f64>,
) -> xtask::error::Result<f64> {
    use super::proc::{Proc, Stream};
    let log = ctx.logs.join(format!("{name}.log"));
    let deadline = std::time::Instant::now() + super::RUN_TIMEOUT;
    let mut time = None;
    let mut on_line = |l: &super::proc::Line| {
        if l.stream == Stream::Out
            && let Some(t) = parse(&l.text)
        {
            time = Some(t);
        }
    };
    match traced {
        None => {
            Proc::spawn(name, &mut target, &log)?.finish_ok(deadline, &mut on_line)?;
        }
        Some((groups, lens_args)) => {
            let pid_file = ctx.out.join(format!("{name}.pid"));
            let mut cmd = lens_command(ctx, None, groups, &pid_file);
            cmd.args(["--exporter", "file", "--export-file", "/dev/null"])
                .args(lens_args)
                .args(["--exec", "--"]);
            append_command(&mut cmd, &target);
            let before = super::lens_probe_pids();
            Proc::spawn(name, &mut cmd, &log)?.finish_ok(deadline, &mut on_line)?;
            super::wait_teardown(name, &before);
        }
    }
    time.ok_or_else(|| {
        xtask::error::Error::Msg(format!(
            "{name}: {} printed no loop time (output in {})",
            shown(&target),
            log.display()
        ))
    })
}
