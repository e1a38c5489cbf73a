//! Block 3: the real PyTorch script `tests/fixtures/torch/train.py` per preset: loop time,
//! and lens-probe's own CPU and memory during the `per_step` runs, read from `/proc`.
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use super::{
    Ctx, DONE_MARKER, PRESETS, RUN_TIMEOUT, TORCH_WRAPPER, Watch, lens_command, lens_probe_pids,
    proc::{Proc, Stream},
    rounds::Rounds,
    scrub_lens_env, wait_teardown,
};
use xtask::error::{Error, Result};

/// lens-probe's own resource use over one PyTorch `--exec` run, read from `/proc` (not
/// with `/usr/bin/time`: its figures include the children lens-probe waits for, i.e. the
/// traced Python).
#[derive(Clone, Debug, Default)]
pub(super) struct Usage {
    /// CPU time of all its threads from `step 0` to the end of the loop (schedstat, ns).
    pub(super) loop_cpu_s: Option<f64>,
    /// Its user + sys time from its start to the end of the loop (`/proc/PID/stat`: all
    /// its threads, ended ones too; not its children).
    pub(super) to_loop_end_cpu_s: Option<f64>,
    /// VmHWM at the end of the loop, KiB: its peak RSS until then.
    pub(super) peak_rss_kib: Option<u64>,
    /// VmRSS at the end of the loop, KiB.
    pub(super) loop_end_rss_kib: Option<u64>,
}

pub(super) struct TorchRun {
    pub(super) loop_s: f64,
    pub(super) usage: Option<Usage>,
    /// lens-probe's exit → its teardown child gone.
    pub(super) teardown_s: Option<f64>,
}

pub(super) struct TorchBlock {
    pub(super) steps: u32,
    /// By preset, `None` = uninstrumented.
    pub(super) runs: Rounds<Option<&'static str>, TorchRun>,
}

impl TorchBlock {
    pub(super) fn runs(&self, preset: Option<&'static str>) -> &[TorchRun] {
        self.runs.runs(preset)
    }

    pub(super) fn times(&self, preset: Option<&'static str>) -> Vec<f64> {
        self.runs.values(preset, |r| r.loop_s)
    }
}

/// Sum of the CPU time (ns) of every thread of `pid` (`/proc/PID/task/*/schedstat`).
pub(super) fn process_cpu_ns(pid: u32) -> Option<u64> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        let text = fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        total += text
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(total)
}

/// utime + stime of `pid` in clock ticks (`/proc/PID/stat` fields 14 and 15).
pub(super) fn process_stat_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

pub(super) fn status_kib(pid: u32, key: &str) -> Option<u64> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_prefix(key)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
}

/// `/usr/bin/time -f '%U %S %M'` output: (user + sys seconds, max RSS KiB). The last line
/// (a first line says so when the command failed).
pub(super) fn parse_time_output(text: &str) -> Option<(f64, u64)> {
    let last = text.lines().rev().find(|l| !l.trim().is_empty())?;
    let mut f = last.split_whitespace();
    let user: f64 = f.next()?.parse().ok()?;
    let sys: f64 = f.next()?.parse().ok()?;
    let rss: u64 = f.next()?.parse().ok()?;
    Some((user + sys, rss))
}

pub(super) fn read_pid_file(path: &Path) -> Option<u32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

pub(super) fn torch_block(ctx: &Ctx, python: &Path, watch: &mut Watch) -> Result<TorchBlock> {
    let presets = std::iter::once(None).chain(PRESETS.map(Some));
    let runs = Rounds::measure(
        ctx.rounds,
        presets,
        watch,
        |preset, round| torch_run(ctx, python, preset, round),
        |preset, run| {
            format!(
                "train.py loop ({} steps) under {:<9} {:.3} s",
                ctx.sizes.torch_steps,
                preset.unwrap_or("none"),
                run.loop_s
            )
        },
    )?;
    Ok(TorchBlock {
        steps: ctx.sizes.torch_steps,
        runs,
    })
}

pub(super) fn torch_run(
    ctx: &Ctx,
    python: &Path,
    preset: Option<&'static str>,
    round: u32,
) -> Result<TorchRun> {
    let name = format!("torch-{}-r{round}", preset.unwrap_or("none"));
    let log = ctx.logs.join(format!("{name}.log"));
    let script = ctx.root.join("tests/fixtures/torch/train.py");
    let measure = preset == Some("per_step");
    let pid_file = ctx.out.join(format!("{name}.pid"));
    let mut cmd = match preset {
        None => Command::new(python),
        Some(preset) => {
            let mut cmd = lens_command(ctx, None, preset, &pid_file);
            cmd.args(["--exporter", "console", "--exec", "--"])
                .arg(python);
            cmd
        }
    };
    cmd.current_dir(&ctx.root)
        .args(["-u", "-c", TORCH_WRAPPER])
        .arg(&script)
        .args(ctx.sizes.torch_args());
    scrub_lens_env(&mut cmd);

    let mut step0 = None;
    let mut done = None;
    let mut usage = Usage::default();
    let mut lens_pid = None;
    let mut cpu0 = None;
    let before = lens_probe_pids();
    let p = Proc::spawn(&name, &mut cmd, &log)?;
    p.finish_ok(Instant::now() + RUN_TIMEOUT, |l| {
        if l.stream != Stream::Out {
            return;
        }
        if l.text == "step 0" && step0.is_none() {
            step0 = Some(l.at);
            if measure {
                lens_pid = read_pid_file(&pid_file);
                cpu0 = lens_pid.and_then(process_cpu_ns);
            }
        } else if l.text == DONE_MARKER {
            done = Some(l.at);
            if let Some(pid) = lens_pid {
                let cpu1 = process_cpu_ns(pid);
                if let (Some(a), Some(b)) = (cpu0, cpu1) {
                    usage.loop_cpu_s = Some(b.saturating_sub(a) as f64 / 1e9);
                }
                usage.to_loop_end_cpu_s =
                    process_stat_ticks(pid).map(|t| t as f64 / ctx.clock_ticks);
                usage.loop_end_rss_kib = status_kib(pid, "VmRSS:");
                usage.peak_rss_kib = status_kib(pid, "VmHWM:");
            }
        }
    })?;
    let teardown_s = preset.map(|_| wait_teardown(&name, &before));
    let (Some(step0), Some(done)) = (step0, done) else {
        return Err(Error::Msg(format!(
            "{name}: no `step 0` / `{DONE_MARKER}` line (output in {})",
            log.display()
        )));
    };
    Ok(TorchRun {
        loop_s: done.saturating_duration_since(step0).as_secs_f64(),
        usage: measure.then_some(usage),
        teardown_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_lines() {
        assert_eq!(parse_time_output("1.50 0.25 51234\n"), Some((1.75, 51234)));
        assert_eq!(
            parse_time_output("Command exited with non-zero status 1\n0.10 0.20 300\n"),
            Some((0.30000000000000004, 300))
        );
        assert_eq!(parse_time_output(""), None);
    }
}
