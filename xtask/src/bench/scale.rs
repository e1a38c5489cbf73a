//! Block 11: attaching to many processes at once, as a node's ranks are. N processes that
//! map libtorch (`tests/fixtures/torch/forked_ranks.py`: one imports torch and forks the
//! others) run tiny backward steps; `lens-probe --span-groups per_step --pid` (all N)
//! attaches to them; then they end. Measured: lens-probe's start until its `tracing`
//! line (every process's probes in), per process; the uprobe links it holds; its exit
//! after theirs; and the kernel's removal of the probes after its exit (its teardown
//! processes gone). Every probe goes into each process's own copy of the code (links per
//! process and library), so links, attach and teardown grow with N. One process is the
//! baseline.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use super::proc::{Proc, Stream};
use super::report::{Met, Row, Section, fmt_duration, median};
use super::rounds::Rounds;
use super::{Ctx, RUN_TIMEOUT, Watch, lens_command, lens_probe_pids, wait_teardown};
use xtask::error::{self, Context, Result};
use xtask::torch_venv;

struct Run {
    /// lens-probe's start → its `tracing N processes` line.
    attach_s: f64,
    /// uprobe link descriptors lens-probe holds once it traces them all.
    links: usize,
    /// The processes' end (the stop file) → lens-probe's exit.
    exit_s: f64,
    /// lens-probe's exit → its teardown processes gone (the probes out of the kernel).
    teardown_s: f64,
}

pub(super) struct ScaleBlock {
    /// By process count.
    sizes: Rounds<usize, Run>,
}

pub(super) fn block(
    ctx: &Ctx,
    python: &Path,
    watch: &mut Watch,
    quick: bool,
) -> Result<ScaleBlock> {
    let counts: &[usize] = if quick { &[1, 4, 8] } else { &[1, 8, 64] };
    let sizes = Rounds::measure(
        ctx.rounds,
        counts.iter().copied(),
        watch,
        |count, round| run(ctx, python, count, round),
        |count, run| {
            format!(
                "{count} processes: attached in {:.2} s, {} links, exit {:.2} s after theirs, \
                 probes out {:.2} s after",
                run.attach_s, run.links, run.exit_s, run.teardown_s
            )
        },
    )?;
    Ok(ScaleBlock { sizes })
}

/// How many of `pid`'s descriptors are BPF links.
fn bpf_links(pid: u32) -> usize {
    fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.flatten()
                .filter(|e| {
                    fs::read_link(e.path())
                        .is_ok_and(|target| target.to_string_lossy() == "anon_inode:bpf_link")
                })
                .count()
        })
        .unwrap_or(0)
}

fn run(ctx: &Ctx, python: &Path, count: usize, round: u32) -> Result<Run> {
    let name = format!("scale-{count}-r{round}");
    let stop = ctx.out.join(format!("{name}.stop"));
    let _ = fs::remove_file(&stop);
    let mut ranks = torch_venv::python_command(python);
    ranks
        .current_dir(&ctx.root)
        .env("OMP_NUM_THREADS", "1")
        .arg("-u")
        .arg(ctx.root.join("tests/fixtures/torch/forked_ranks.py"))
        .arg(count.to_string())
        .arg(&stop);
    let mut ranks = Proc::spawn(
        &format!("{name} (ranks)"),
        &mut ranks,
        &ctx.logs.join(format!("{name}-ranks.log")),
    )?;
    let mut pids = Vec::new();
    ranks.wait_line(
        Instant::now() + Duration::from_secs(300),
        "`ready PID…`",
        |l| match l.text.strip_prefix("ready ") {
            Some(list) => {
                pids = list.split_whitespace().map(str::to_owned).collect();
                true
            }
            None => false,
        },
    )?;
    let pid_file = ctx.out.join(format!("{name}.pid"));
    let mut cmd = lens_command(ctx, None, "per_step", &pid_file);
    cmd.args(["--exporter", "file", "--export-file", "/dev/null", "--pid"])
        .args(&pids);
    let before = lens_probe_pids();
    let mut lens = Proc::spawn(&name, &mut cmd, &ctx.logs.join(format!("{name}.log")))?;
    let started = lens.started;
    let mut attached = None;
    lens.wait_line(Instant::now() + RUN_TIMEOUT, "`lens-probe: tracing`", |l| {
        let found = l.stream == Stream::Err && l.text.starts_with("lens-probe: tracing");
        if found {
            attached = Some(l.at.saturating_duration_since(started).as_secs_f64());
        }
        found
    })?;
    let links = bpf_links(lens.pid);
    error::write(&stop, "").context(&name)?;
    let stopped = Instant::now();
    let exited = lens.finish_ok(Instant::now() + RUN_TIMEOUT, |_| {})?;
    let teardown_s = wait_teardown(&name, &before);
    ranks.finish_ok(Instant::now() + Duration::from_secs(120), |_| {})?;
    let _ = fs::remove_file(&stop);
    Ok(Run {
        attach_s: attached.expect("the line waited for was seen"),
        links,
        exit_s: exited.saturating_duration_since(stopped).as_secs_f64(),
        teardown_s,
    })
}

impl ScaleBlock {
    pub(super) fn section(&self) -> Section {
        let secs = fmt_duration;
        let count = |n: f64| format!("{n:.0}");
        let one_attach = median(&self.sizes.values(1, |r| r.attach_s));
        let mut rows: Vec<Row> = Vec::new();
        for (n, runs) in self.sizes.iter() {
            let values = |f: fn(&Run) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
            let per_process = values(|r| r.attach_s)
                .iter()
                .map(|t| t / n as f64)
                .collect::<Vec<_>>();
            let teardown = values(|r| r.teardown_s);
            let teardown_met = median(&teardown).map_or(Met::NotMeasured("no value".into()), |t| {
                Met::from_bool(t <= 1.0)
            });
            rows.extend([
                super::report::row(
                    format!(
                        "**{n} process{}**: lens-probe's start → all traced, per process \
                         (ratio: to 1 process)",
                        if n == 1 { "" } else { "es" }
                    ),
                    &per_process,
                    secs,
                    median(&per_process).zip(one_attach).map(|(p, one)| p / one),
                    "",
                    Met::NoTarget,
                ),
                super::report::row(
                    "  … all of them",
                    &values(|r| r.attach_s),
                    secs,
                    None,
                    "",
                    Met::NoTarget,
                ),
                super::report::row(
                    "  uprobe links lens-probe holds",
                    &values(|r| r.links as f64),
                    count,
                    None,
                    "",
                    Met::NoTarget,
                ),
                super::report::row(
                    "  their end → lens-probe's exit",
                    &values(|r| r.exit_s),
                    secs,
                    None,
                    "",
                    Met::NoTarget,
                ),
                super::report::row(
                    "  lens-probe's exit → the probes out of the kernel (teardown)",
                    &teardown,
                    secs,
                    None,
                    "≤ 1 s",
                    teardown_met,
                ),
            ]);
        }
        Section {
            title: "11. Many traced processes: attach, links and teardown \
                    (`tests/fixtures/torch/forked_ranks.py N`, `--pid` all N, `per_step`)"
                .into(),
            rows,
        }
    }

    pub(super) fn notes(&self) -> String {
        let counts: Vec<String> = self.sizes.iter().map(|(n, _)| n.to_string()).collect();
        format!(
            "- Many processes ({} of them): `forked_ranks.py N STOP` imports torch once and \
             forks N − 1 workers (so that 64 fit in memory), each running a 64×64 matmul's \
             backward every 50 ms; `lens-probe --span-groups per_step --exporter file \
             --export-file /dev/null --pid PID…` is started once all print `ready`. Its \
             `tracing` line comes once every process's probes are in; links are the \
             `anon_inode:bpf_link` descriptors of lens-probe then; the teardown ends when no \
             `lens-probe` process is left (the exec'd closer of `sys/teardown.rs`).\n",
            counts.join(", ")
        )
    }
}
