//! The report's table: one section per block, as rows of measured values against their
//! targets (the notes under it: [`super::notes`]).

use super::{
    Block, Blocks, Ctx, FAKE_PROBES, Missing, PRESETS,
    attach::AttachRun,
    budget,
    fake::{Fake, FakeBlock},
    frameworks, hangs, neighbour, per_kind, python, recompute,
    report::{Met, Row, Section, fmt_count, fmt_duration, median, row},
    rounds::ratio_to,
    scale, teardown, throughput,
    torch::{TorchBlock, Usage},
};

pub(super) fn pct(fraction: f64) -> String {
    format!("{:.2} % of a core", fraction * 100.0)
}

pub(super) fn megabytes(kib: f64) -> String {
    format!("{:.1} MB", kib * 1024.0 / 1e6)
}

/// What the blocks that ran measured.
pub(super) struct Results {
    pub(super) blocks: Blocks,
    pub(super) fixtures: FixtureResults,
    pub(super) python: PythonResults,
}

/// The blocks on the fixtures' fake libraries and the kernel-side generator.
#[derive(Default)]
pub(super) struct FixtureResults {
    pub(super) fake: Option<FakeBlock>,
    pub(super) per_kind: Option<per_kind::PerKindBlock>,
    pub(super) neighbour: Option<neighbour::NeighbourBlock>,
    pub(super) throughput: Option<throughput::ThroughputBlock>,
    pub(super) budget: Option<budget::BudgetBlock>,
    pub(super) hangs: Option<hangs::HangsBlock>,
}

/// The blocks on real Python processes.
#[derive(Default)]
pub(super) struct PythonResults {
    pub(super) torch: Option<TorchBlock>,
    pub(super) attach: Option<Vec<AttachRun>>,
    /// The stack sampler's.
    pub(super) sampler: Option<python::PythonBlock>,
    pub(super) teardown: Option<teardown::TeardownBlock>,
    pub(super) frameworks: Option<frameworks::FrameworksBlock>,
    pub(super) scale: Option<scale::ScaleBlock>,
    pub(super) recompute: Option<recompute::RecomputeBlock>,
}

/// The table's sections, in order, for the blocks that ran.
pub(super) fn sections(ctx: &Ctx, r: &Results) -> Vec<Section> {
    let (torch, attach) = (r.python.torch.as_ref(), r.python.attach.as_deref());
    let mut out = Vec::new();
    if let Some(fake) = &r.fixtures.fake {
        out.push(trainer_cost_section(fake));
    }
    if let Some(per_kind) = &r.fixtures.per_kind {
        out.push(per_kind.section());
    }
    if let Some(neighbour) = &r.fixtures.neighbour {
        out.push(neighbour.section());
    }
    if let Some(scale) = &r.python.scale {
        out.push(scale.section());
    }
    let torch_wanted = r.blocks.contains(Block::Torch);
    if r.fixtures.fake.is_some() || torch_wanted {
        out.push(slowdown_section(
            ctx,
            r.fixtures.fake.as_ref(),
            torch,
            torch_wanted,
        ));
    }
    if let Some(budget) = &r.fixtures.budget {
        out.push(budget.section());
    }
    if let Some(python) = &r.python.sampler {
        out.push(python.section());
    }
    if let Some(hangs) = &r.fixtures.hangs {
        out.push(hangs.section());
    }
    if let Some(teardown) = &r.python.teardown {
        out.push(teardown.section());
    }
    if let Some(frameworks) = &r.python.frameworks {
        out.push(frameworks.section());
    }
    if let Some(recompute) = &r.python.recompute {
        out.push(recompute.section());
    }
    if r.blocks.contains(Block::Attach) {
        out.push(attach_section(ctx, attach));
    }
    if torch_wanted || r.blocks.contains(Block::Attach) {
        out.push(usage_section(ctx, torch, torch_wanted, attach));
    }
    if let Some(fake) = &r.fixtures.fake {
        out.push(trainer_throughput_section(fake));
    }
    if let Some(throughput) = &r.fixtures.throughput {
        out.push(throughput.section());
    }
    out
}

/// Section 1: Per-hit cost on the fake trainer.
pub(super) fn trainer_cost_section(fake: &FakeBlock) -> Section {
    let none = fake.times(Fake::None);
    let calls = fake.calls();
    let mut rows = vec![row(
        format!("uninstrumented `trainer {}`", fake.steps),
        &none,
        fmt_duration,
        Some(1.0),
        "",
        Met::NoTarget,
    )];
    let bpf = Fake::Bpftrace { returns: false };
    let bpf_ret = Fake::Bpftrace { returns: true };
    let lens = Fake::Lens("per_step");
    let entries = FAKE_PROBES.len();
    let returns = FAKE_PROBES.iter().filter(|p| p.2).count();
    let labelled = [
        (
            bpf,
            format!("bpftrace `count()` on the {entries} entry points (kernel floor)"),
        ),
        (
            bpf_ret,
            format!(
                "bpftrace `count()` on the {entries} entries + the {returns} return probes lens-probe uses"
            ),
        ),
        (lens, "lens-probe `--span-groups per_step`".to_owned()),
    ];
    for (variant, label) in &labelled {
        match (variant, &fake.bpftrace_skipped) {
            (Fake::Bpftrace { .. }, Some(why)) => rows.push(Row::not_measured(label, "", why)),
            _ => rows.push(row(
                label.clone(),
                &fake.times(*variant),
                fmt_duration,
                ratio_to(&fake.times(*variant), &none),
                "",
                Met::NoTarget,
            )),
        }
    }
    let floor = median(&fake.per_call(bpf));
    for (variant, label) in &labelled {
        let label = format!("per probed call: {label}");
        let values = fake.per_call(*variant);
        let ratio = median(&values).zip(floor).map(|(v, f)| v / f);
        let (target, met) = match variant {
            Fake::Lens(_) => (
                "≤ 1.05× bpftrace",
                ratio.map_or(Met::NotMeasured("no bpftrace".into()), |r| {
                    Met::from_bool(r <= 1.05)
                }),
            ),
            _ => ("", Met::NoTarget),
        };
        match (variant, &fake.bpftrace_skipped) {
            (Fake::Bpftrace { .. }, Some(why)) => rows.push(Row::not_measured(label, "", why)),
            _ => rows.push(row(label, &values, fmt_duration, ratio, target, met)),
        }
    }
    // What users read (`probe cost` in the summary, `lens_probe.overhead`) against what
    // the run measured.
    let ratios = fake.estimate_over_measured();
    let ratio = median(&ratios);
    rows.push(row(
        "lens-probe's own estimate of its cost (`probe_cost`) ÷ the measured `per_step` slowdown",
        &ratios,
        |r| format!("{r:.2}"),
        ratio,
        "0.7 – 1.3",
        ratio.map_or(Met::NotMeasured("no estimate".into()), |r| {
            Met::from_bool((0.7..=1.3).contains(&r))
        }),
    ));
    // The rest of the slowdown: lens-probe's user side shares the machine's CPUs with the
    // trainer (not pinned here, as a job would not be).
    rows.push(row(
        "lens-probe's own CPU over its `per_step` run (every thread, start-up included; \
         the trainer and it share the CPUs)",
        &fake.tracer_cpu(),
        fmt_duration,
        None,
        "",
        Met::NoTarget,
    ));
    Section {
        title: format!(
            "1. Per-hit cost on the fake libraries (`trainer {}`: {} probed calls per run; ratio of the per-call rows: to bpftrace's floor)",
            fake.steps,
            fmt_count(calls as f64)
        ),
        rows,
    }
}

/// Section 2: Slowdown per preset: (a) the fake trainer, (b) PyTorch when `torch_wanted`.
pub(super) fn slowdown_section(
    ctx: &Ctx,
    fake: Option<&FakeBlock>,
    torch: Option<&TorchBlock>,
    torch_wanted: bool,
) -> Section {
    let no_torch = ctx.python.as_ref().err().map_or("", Missing::as_str);
    let mut rows = Vec::new();
    if let Some(fake) = fake {
        let none = fake.times(Fake::None);
        rows.push(row(
            format!(
                "(a) fake trainer, launch-heavy, `trainer {}`: none",
                fake.steps
            ),
            &none,
            fmt_duration,
            Some(1.0),
            "",
            Met::NoTarget,
        ));
        for preset in PRESETS {
            let t = fake.times(Fake::Lens(preset));
            rows.push(row(
                format!("(a) fake trainer: `{preset}`"),
                &t,
                fmt_duration,
                ratio_to(&t, &none),
                "",
                Met::NoTarget,
            ));
        }
    }
    match torch {
        Some(torch) => {
            let base = torch.times(None);
            rows.push(row(
                format!("(b) PyTorch `train.py` loop ({} steps): none", torch.steps),
                &base,
                fmt_duration,
                Some(1.0),
                "",
                Met::NoTarget,
            ));
            for preset in PRESETS {
                let t = torch.times(Some(preset));
                let ratio = ratio_to(&t, &base);
                let (target, met) = if preset == "per_step" {
                    (
                        "≤ 1.005× (≤ 0.5 %)",
                        ratio.map_or(Met::NotMeasured("no value".into()), |r| {
                            Met::from_bool(r <= 1.005)
                        }),
                    )
                } else {
                    ("", Met::NoTarget)
                };
                rows.push(row(
                    format!("(b) PyTorch loop: `{preset}`"),
                    &t,
                    fmt_duration,
                    ratio,
                    target,
                    met,
                ));
            }
        }
        None if torch_wanted => rows.push(Row::not_measured(
            "(b) PyTorch loop: `per_step`",
            "≤ 1.005× (≤ 0.5 %)",
            no_torch,
        )),
        None => {}
    }
    Section {
        title: "2. Training-loop slowdown per preset (ratio: to uninstrumented)".into(),
        rows,
    }
}

/// Section 3: Attach time.
pub(super) fn attach_section(ctx: &Ctx, attach: Option<&[AttachRun]>) -> Section {
    let no_torch = ctx.python.as_ref().err().map_or("", Missing::as_str);
    let rows = match attach {
        Some(runs) => {
            let tracing: Vec<f64> = runs.iter().map(|r| r.tracing_s).collect();
            let attached: Vec<f64> = runs.iter().filter_map(|r| r.attached_s).collect();
            let exit: Vec<f64> = runs.iter().map(|r| r.exit_s).collect();
            let teardown: Vec<f64> = runs.iter().map(|r| r.teardown_s).collect();
            let uprobes = runs.iter().find_map(|r| r.uprobes);
            let met = median(&tracing).map_or(Met::NotMeasured("no value".into()), |m| {
                Met::from_bool(m <= 1.0)
            });
            vec![
                row(
                    "`--pid` to a running PyTorch process, `per_step`: lens-probe start → `tracing pid`",
                    &tracing,
                    fmt_duration,
                    None,
                    "≤ 1 s",
                    met,
                ),
                row(
                    format!(
                        "… → `{} uprobes attached`",
                        uprobes.map_or("N".into(), |n| n.to_string())
                    ),
                    &attached,
                    fmt_duration,
                    None,
                    "",
                    Met::NoTarget,
                ),
                row(
                    "end of `--duration 3s` → lens-probe exited",
                    &exit,
                    fmt_duration,
                    None,
                    "",
                    Met::NoTarget,
                ),
                row(
                    "lens-probe exited → its child holding the probes gone (kernel teardown)",
                    &teardown,
                    fmt_duration,
                    None,
                    "",
                    Met::NoTarget,
                ),
            ]
        }
        None => vec![Row::not_measured(
            "`--pid` attach to a running PyTorch process",
            "≤ 1 s",
            no_torch,
        )],
    };
    Section {
        title: "3. Attach time".into(),
        rows,
    }
}

/// Section 4: lens-probe's CPU and memory.
pub(super) fn usage_section(
    ctx: &Ctx,
    torch: Option<&TorchBlock>,
    torch_wanted: bool,
    attach: Option<&[AttachRun]>,
) -> Section {
    let no_torch = ctx.python.as_ref().err().map_or("", Missing::as_str);
    let mut rows = Vec::new();
    let cpu_target = "≤ 1 % of a core";
    let rss_target = "≤ 50 MB";
    let met_max = |values: &[f64], limit: f64| {
        median(values).map_or(Met::NotMeasured("no value".into()), |m| {
            Met::from_bool(m <= limit)
        })
    };
    let mb_limit = 50e6 / 1024.0;
    match torch {
        Some(torch) => {
            let usage: Vec<(f64, &Usage)> = torch
                .runs(Some("per_step"))
                .iter()
                .filter_map(|r| Some((r.loop_s, r.usage.as_ref()?)))
                .collect();
            let pick = |f: &dyn Fn(f64, &Usage) -> Option<f64>| -> Vec<f64> {
                usage.iter().filter_map(|(l, u)| f(*l, u)).collect()
            };
            let loop_cpu = pick(&|l, u| Some(u.loop_cpu_s? / l));
            let start_cpu = pick(&|_, u| u.to_loop_end_cpu_s);
            let start_cpu_share = pick(&|l, u| Some(u.to_loop_end_cpu_s? / l));
            let peak = pick(&|_, u| Some(u.peak_rss_kib? as f64));
            let end_rss = pick(&|_, u| Some(u.loop_end_rss_kib? as f64));
            rows.push(row(
                "`--exec`: lens-probe CPU during the loop (all its threads, `step 0` → loop end) / loop time",
                &loop_cpu,
                pct,
                None,
                cpu_target,
                met_max(&loop_cpu, 0.01),
            ));
            rows.push(row(
                "`--exec`: lens-probe CPU from its start to the loop's end (BPF load, symbols, attach included), seconds",
                &start_cpu,
                |v| format!("{v:.2} s"),
                None,
                "",
                Met::NoTarget,
            ));
            rows.push(row(
                "… the same / loop time",
                &start_cpu_share,
                pct,
                None,
                cpu_target,
                met_max(&start_cpu_share, 0.01),
            ));
            rows.push(row(
                "`--exec`: lens-probe peak RSS until the loop's end (VmHWM)",
                &peak,
                megabytes,
                None,
                rss_target,
                met_max(&peak, mb_limit),
            ));
            rows.push(row(
                "`--exec`: lens-probe RSS at the loop's end (VmRSS)",
                &end_rss,
                megabytes,
                None,
                rss_target,
                met_max(&end_rss, mb_limit),
            ));
        }
        None if torch_wanted => rows.push(Row::not_measured(
            "lens-probe CPU and RSS during a PyTorch loop",
            cpu_target,
            no_torch,
        )),
        None => {}
    }
    match (attach, &ctx.time) {
        (Some(runs), Ok(_)) => {
            let cpu: Vec<f64> = runs.iter().filter_map(|r| r.total_cpu_s).collect();
            let rss: Vec<f64> = runs
                .iter()
                .filter_map(|r| Some(r.max_rss_kib? as f64))
                .collect();
            rows.push(row(
                "`--pid`, 3 s: lens-probe CPU over its whole run (`/usr/bin/time` user+sys)",
                &cpu,
                |v| format!("{v:.2} s"),
                None,
                "",
                Met::NoTarget,
            ));
            rows.push(row(
                "`--pid`, 3 s: lens-probe max RSS (`/usr/bin/time` %M)",
                &rss,
                megabytes,
                None,
                rss_target,
                met_max(&rss, mb_limit),
            ));
        }
        (Some(_), Err(why)) => rows.push(Row::not_measured(
            "`--pid`: lens-probe CPU and max RSS",
            rss_target,
            why.as_str(),
        )),
        (None, _) => {}
    }
    Section {
        title: "4. lens-probe CPU and memory (PyTorch, `per_step`)".into(),
        rows,
    }
}

/// Section 5: the events the fake trainer sends, bounded by its uprobes' cost (block 5b
/// measures the user side itself).
pub(super) fn trainer_throughput_section(fake: &FakeBlock) -> Section {
    let per_step_runs = fake.runs(Fake::Lens("per_step"));
    let rates: Vec<f64> = per_step_runs
        .iter()
        .filter_map(|r| Some(r.summary.as_ref()?.events as f64 / r.elapsed_s))
        .collect();
    let lost: u64 = fake
        .runs
        .iter()
        .flat_map(|(_, runs)| runs)
        .filter_map(|r| Some(r.summary.as_ref()?.lost))
        .sum();
    let lens_runs = fake
        .runs
        .iter()
        .filter(|(v, _)| matches!(v, Fake::Lens(_)))
        .map(|(_, r)| r.len())
        .sum::<usize>();
    let rows = vec![
        row(
            "events/s sent and received (7 collectives + 3 sync waits per step) / trainer time, `per_step`",
            &rates,
            |r| format!("{} /s", fmt_count(r)),
            None,
            "(the rate target: 5b)",
            Met::NoTarget,
        ),
        Row {
            what: format!("events lost over all {lens_runs} lens-probe runs on the fake trainer"),
            median: fmt_count(lost as f64),
            spread: "—".into(),
            ratio: "—".into(),
            target: "0".into(),
            met: Met::from_bool(lost == 0),
        },
    ];
    Section {
        title: "5. Event throughput (fake trainer, `per_step`: as many events as its uprobes let it send)".into(),
        rows,
    }
}
