//! The notes under the table: how each row was measured, and what may make the numbers
//! less clean than they look.

use super::{
    ATTACH_TARGET_ARGS, Block, CALLS_PER_STEP, Ctx, DONE_MARKER, EVENTS_PER_STEP, FAKE_PROBES,
    PRESETS, Watch,
    attach::AttachRun,
    fake::{Fake, FakeBlock},
    report::{self, fmt_count, fmt_duration, median},
    tables::Results,
    torch::TorchBlock,
};

pub(super) fn notes(ctx: &Ctx, r: &Results, watch: &Watch, slack: bool) -> String {
    let mut n = String::from("How each row was measured:\n\n");
    block_notes(&mut n, r);
    slack_note(&mut n, slack);
    pytorch_notes(&mut n, ctx, r.python.torch.as_ref());
    if let Some(runs) = r.python.attach.as_deref() {
        attach_note(&mut n, runs);
    }
    teardown_note(&mut n, r);
    check_notes(&mut n, ctx, r, watch);
    n
}

/// Each block's own notes.
fn block_notes(n: &mut String, r: &Results) {
    if let Some(fake) = &r.fixtures.fake {
        fake_notes(n, fake);
    }
    if let Some(budget) = &r.fixtures.budget {
        n.push_str(&budget.notes());
    }
    if let Some(python) = &r.python.sampler {
        n.push_str(&python.notes());
    }
    if let Some(teardown) = &r.python.teardown {
        n.push_str(&teardown.notes());
    }
    if let Some(frameworks) = &r.python.frameworks {
        n.push_str(&frameworks.notes());
    }
    if let Some(recompute) = &r.python.recompute {
        n.push_str(&recompute.notes());
    }
    if let Some(hangs) = &r.fixtures.hangs {
        n.push_str(&hangs.notes());
    }
    if let Some(per_kind) = &r.fixtures.per_kind {
        n.push_str(&per_kind.notes());
    }
    if let Some(neighbour) = &r.fixtures.neighbour {
        n.push_str(&neighbour.notes());
    }
    if let Some(scale) = &r.python.scale {
        n.push_str(&scale.notes());
    }
    if let Some(throughput) = &r.fixtures.throughput {
        n.push_str(&throughput.notes());
    }
}

fn slack_note(n: &mut String, slack: bool) {
    if slack {
        n.push_str(
            "- The timer slack of every process started is 1 ns (`/proc/self/timerslack_ns`, \
             inherited): the fake syncs are `nanosleep(0)`, which otherwise take ~70 µs each \
             (the default 50 µs slack) and make the step mostly sleep. Probe costs are \
             unchanged by it.\n",
        );
    } else {
        n.push_str("- The timer slack could not be lowered: the fake syncs sleep ~70 µs each.\n");
    }
}

/// How the PyTorch loop and lens-probe's use of the machine during it were measured.
fn pytorch_notes(n: &mut String, ctx: &Ctx, torch: Option<&TorchBlock>) {
    if let Some(torch) = torch {
        let args = ctx.sizes.torch_args().join(" ");
        n.push_str(&format!(
            "- PyTorch: `python -u -c WRAPPER tests/fixtures/torch/train.py {args}` with the \
             torch venv's Python (CPU), plain or under `lens-probe --span-groups PRESET \
             --exporter console --exec -- python …` (console tree to a log file). WRAPPER runs \
             the script with `runpy` as `__main__` and prints `{DONE_MARKER}` when its `main()` \
             returns (train.py is not changed; the interpreter's exit, ~0.8 s with torch, is \
             left out). Loop time: from the arrival of the `step 0` line to the arrival of \
             that marker ({} steps).\n",
            torch.steps
        ));
        n.push_str(
            "- CPU and RSS of the `per_step` PyTorch runs come from `/proc/PID` of lens-probe \
             (`--pid-file`): the loop's CPU is the change of its threads' \
             `/proc/PID/task/*/schedstat` run times between `step 0` and the end of the loop; \
             the CPU from its start is `/proc/PID/stat` utime + stime at the loop's end; RSS \
             is VmHWM / VmRSS then. `/usr/bin/time` is not used around `--exec` runs: its \
             user, sys and max RSS include the children lens-probe waits for, the traced \
             Python (~820 MB max RSS). It is used around the `--pid` runs, which have none.\n",
        );
    }
    n.push_str(
        "- `all` and `per_step` enable the same eight span groups today \
         (lens-userspace/src/settings/groups.rs): their rows differ by noise only.\n",
    );
    if let Some(torch) = torch {
        let base = torch.times(None);
        if let (Some(m), Some((lo, hi))) = (median(&base), report::min_max(&base))
            && base.len() > 1
        {
            let spread = (hi - lo) / m * 100.0;
            n.push_str(&format!(
                "- The uninstrumented PyTorch loop itself varied by {spread:.1} % (min to max) \
                 over the rounds on this machine: smaller differences are noise{}.\n",
                if spread > 0.5 {
                    ", so the 0.5 % target cannot be resolved here"
                } else {
                    ""
                }
            ));
        }
    }
}

fn attach_note(n: &mut String, runs: &[AttachRun]) {
    let uprobes = runs
        .iter()
        .find_map(|r| r.uprobes)
        .map_or("?".into(), |n| n.to_string());
    n.push_str(&format!(
        "- Attach: one `python -u train.py {}` runs throughout; each round runs \
         `lens-probe --span-groups per_step --exporter console -v --duration 3s --pid PID` \
         ({uprobes} uprobes), under `/usr/bin/time -f '%U %S %M'` when there is one, and \
         times its stderr lines from its start.\n",
        ATTACH_TARGET_ARGS.join(" ")
    ));
}

/// How long the kernel took to remove lens-probe's probes after each preset's runs.
fn teardown_note(n: &mut String, r: &Results) {
    let torch = r.python.torch.as_ref();
    let mut teardowns = Vec::new();
    for preset in PRESETS {
        let fake_t: Vec<f64> = r
            .fixtures
            .fake
            .iter()
            .flat_map(|fake| fake.runs(Fake::Lens(preset)))
            .filter_map(|r| r.teardown_s)
            .collect();
        if let Some(m) = median(&fake_t) {
            teardowns.push(format!("fake trainer `{preset}` {}", fmt_duration(m)));
        }
    }
    if let Some(torch) = torch {
        for preset in PRESETS {
            let t: Vec<f64> = torch
                .runs(Some(preset))
                .iter()
                .filter_map(|r| r.teardown_s)
                .collect();
            if let Some(m) = median(&t) {
                teardowns.push(format!("PyTorch `{preset}` {}", fmt_duration(m)));
            }
        }
    }
    if !teardowns.is_empty() {
        n.push_str(&format!(
            "- lens-probe exits at once and leaves a child holding the probes' descriptors; \
             the kernel removes the uprobes (~0.1 s each) when it closes them. Each run waits \
             for that child before the next starts. Exit → teardown done, medians: {}.\n",
            teardowns.join(", ")
        ));
    }
}

/// What was not measured, or may make the numbers less clean than they look.
fn check_notes(n: &mut String, ctx: &Ctx, r: &Results, watch: &Watch) {
    if let Some(fake) = &r.fixtures.fake {
        if let Some(why) = &fake.bpftrace_skipped {
            n.push_str(&format!("- bpftrace not measured: {why}.\n"));
        }
        for m in &fake.count_mismatches {
            n.push_str(&format!("- **Check**: {m}.\n"));
        }
    }
    if let Err(why) = &ctx.python
        && (r.blocks.contains(Block::Torch) || r.blocks.contains(Block::Attach))
    {
        n.push_str(&format!("- PyTorch rows not measured: {why}.\n"));
    }
    if watch.foreign.is_empty() {
        n.push_str("- No other lens-probe or bpftrace process was seen between the runs.\n");
    } else {
        let list: Vec<&str> = watch.foreign.iter().map(String::as_str).collect();
        n.push_str(&format!(
            "- **Other tracers were running during the bench** ({}): they share the CPUs and \
             the uprobes of shared library files (the torch venv's), so these numbers are \
             not clean.\n",
            list.join(", ")
        ));
    }
    n.push_str(&format!(
        "- Logs of every run: `{}`.\n",
        ctx.logs
            .strip_prefix(&ctx.root)
            .unwrap_or(&ctx.logs)
            .display()
    ));
}

/// The fake trainer's notes (blocks 1, 2a, 5).
pub(super) fn fake_notes(n: &mut String, fake: &FakeBlock) {
    let steps = fake.steps;
    n.push_str(&format!(
        "- Fake trainer: `LENS_FAKE_SYNC_MS=0 sh -c 'trainer 1; t0; trainer {steps}; t1'` with \
         the fixtures built into `target/bench-fixtures`; the time is `trainer {steps}`'s own \
         (`monotonic_ns`, a fixture reading `CLOCK_MONOTONIC`, around it, after a `trainer 1` \
         that has the libraries' probes \
         attached), not lens-probe's start-up or teardown. lens-probe runs as \
         `target/release/lens-probe --span-groups PRESET --exporter file --export-file /dev/null \
         --summary-json F --exec -- sh -c …`; bpftrace \
         runs `uprobe:LIB:FUNC,… {{ @ = count(); }}` on the same {} functions (started first, \
         the trainer runs once its `BEGIN` has fired, then SIGINT). {} probed calls per timed \
         run ({CALLS_PER_STEP} per step + `ncclCommInitRank`, from the `per_step` runs' \
         `--summary-json`); events: {EVENTS_PER_STEP} per step.\n",
        FAKE_PROBES.len(),
        fmt_count(fake.calls() as f64),
    ));
    n.push_str(
        "- Per probed call = (traced − uninstrumented time of the same round) / calls, \
         median over the rounds. lens-probe puts return probes on 10 of the 24 calls of a \
         step (collectives, syncs), bpftrace's floor row has entry probes only; the \
         entries + returns row is the kernel floor for lens-probe's probe set.\n",
    );
    n.push_str(
        "- The fake trainer's lens-probe runs export to a file (`/dev/null`) rather than the \
         console: the console tree keeps every span of a top-level phase until it ends and \
         then links children by scanning all of them (quadratic). The fake trainer never ends \
         its first phase, so 20 000 steps cost lens-probe ~3 min of CPU after the trainer \
         has exited (measured by hand; outside the timed part, but too long for a bench).\n",
    );
}
