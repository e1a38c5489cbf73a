//! Block 8: how long the kernel keeps lens-probe's probes after it exits. lens-probe
//! leaves its probes' descriptors to a child that closes them and exits; the kernel
//! removes the uprobes as they close (one RCU grace period per link, ~0.1 s on this
//! VM), so the time from lens-probe's exit to that child's is the teardown, during which
//! the job still pays for every probe and every other uprobe user on the node waits.
//! Measured with `--uprobe-links perf` (one link per uprobe) against `auto` (one
//! uprobe_multi link per program and library), interleaved, for a torch `per_step` run
//! and for a configured rule matching thousands of libtorch_cpu functions.

use std::process::Command;
use std::time::Instant;

use super::proc::{Line, Proc, Stream};
use super::report::{Met, Row, Section, fmt_duration, row};
use super::rounds::{Rounds, ratio_to};
use super::{
    Ctx, RUN_TIMEOUT, Watch, append_command, lens_command, lens_probe_pids, wait_teardown,
};
use xtask::error::{self, Result};
use xtask::torch_venv;

/// What a configured rule matches in libtorch_cpu: with perf links, 2 × this many links.
const RULE_MATCHES_MULTI: u32 = 4096;
/// The same rule with perf links is capped lower: 8192 perf links take the kernel ~15
/// minutes a round to remove. The per-link cost carries over.
const RULE_MATCHES_PERF: u32 = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    /// `tests/fixtures/torch/train.py`, 2 steps, `per_step`.
    TorchPerStep,
    /// `import torch` under `per_step` and a `--config` rule `_ZN*` in libtorch_cpu.
    Rule,
}

/// One run: lens-probe's status line (uprobes, links) and the teardown.
#[derive(Clone, Copy, Debug)]
struct Run {
    uprobes: u64,
    links: u64,
    teardown_s: f64,
}

/// The runs of each scenario, by `--uprobe-links` value.
pub(super) struct TeardownBlock {
    rounds: Rounds<(Scenario, &'static str), Run>,
}

/// The variants, in the order they run in a round.
const CASES: [(Scenario, &str); 4] = [
    (Scenario::TorchPerStep, "perf"),
    (Scenario::TorchPerStep, "auto"),
    (Scenario::Rule, "perf"),
    (Scenario::Rule, "auto"),
];

pub(super) fn block(
    ctx: &Ctx,
    python: &std::path::Path,
    watch: &mut Watch,
) -> Result<TeardownBlock> {
    let config = ctx.out.join("teardown-rule.toml");
    let rounds = Rounds::measure(
        ctx.rounds,
        CASES,
        watch,
        |(scenario, links), round| run(ctx, python, &config, scenario, links, round),
        |(scenario, links), run| {
            format!(
                "teardown {scenario:?} --uprobe-links {links:<4} {} uprobes in {} links: {:.3} s",
                run.uprobes, run.links, run.teardown_s
            )
        },
    )?;
    Ok(TeardownBlock { rounds })
}

fn run(
    ctx: &Ctx,
    python: &std::path::Path,
    config: &std::path::Path,
    scenario: Scenario,
    links: &str,
    round: u32,
) -> Result<Run> {
    let name = format!("teardown-{scenario:?}-{links}-r{round}").to_lowercase();
    let log = ctx.logs.join(format!("{name}.log"));
    let pid_file = ctx.out.join(format!("{name}.pid"));
    let mut cmd: Command = lens_command(ctx, None, "per_step", &pid_file);
    cmd.args(["--exporter", "file", "--export-file", "/dev/null"])
        .args(["--uprobe-links", links]);
    if scenario == Scenario::Rule {
        let matches = if links == "perf" {
            RULE_MATCHES_PERF
        } else {
            RULE_MATCHES_MULTI
        };
        error::write(
            config,
            format!(
                "[[probe]]\nlibrary = \"libtorch_cpu.so\"\nsymbol = \"_ZN*\"\n\
                 group = \"step\"\nmax_matches = {matches}\nnoexcept = true\n"
            ),
        )?;
        cmd.arg("--config").arg(config);
    }
    cmd.args(["--exec", "--"]);
    let mut target = torch_venv::python_command(python);
    match scenario {
        Scenario::TorchPerStep => target
            .arg(ctx.root.join("tests/fixtures/torch/train.py"))
            .args(["--steps", "2"]),
        Scenario::Rule => target.args(["-c", "import torch"]),
    };
    append_command(&mut cmd, &target);
    let mut said: Option<(u64, u64)> = None;
    let mut on_line = |l: &Line| {
        if l.stream == Stream::Err
            && let Some(counts) = parse_status_line(&l.text)
        {
            said = Some(counts);
        }
    };
    let before = lens_probe_pids();
    Proc::spawn(&name, &mut cmd, &log)?.finish_ok(Instant::now() + RUN_TIMEOUT, &mut on_line)?;
    let teardown_s = wait_teardown(&name, &before);
    let (uprobes, links) = said.ok_or_else(|| {
        format!(
            "{name}: no `lens-probe: tracing …` line (output in {})",
            log.display()
        )
    })?;
    Ok(Run {
        uprobes,
        links,
        teardown_s,
    })
}

/// `lens-probe: tracing 1 process: 4 libraries, 2157 uprobes in 27 links` → (2157, 27).
fn parse_status_line(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix("lens-probe: tracing ")?;
    let (_, counts) = rest.rsplit_once(", ")?;
    let (uprobes, links) = counts.strip_suffix(" links")?.split_once(" uprobes in ")?;
    Some((uprobes.parse().ok()?, links.parse().ok()?))
}

impl TeardownBlock {
    pub(super) fn section(&self) -> Section {
        let teardowns = |runs: &[Run]| runs.iter().map(|r| r.teardown_s).collect::<Vec<_>>();
        let shape = |runs: &[Run]| {
            runs.last().map_or(String::new(), |r| {
                format!("{} uprobes in {} links", r.uprobes, r.links)
            })
        };
        let mut rows: Vec<Row> = Vec::new();
        for (what, scenario) in [
            (
                "torch `train.py` 2 steps, `per_step`",
                Scenario::TorchPerStep,
            ),
            ("`import torch` + a `_ZN*` rule", Scenario::Rule),
        ] {
            let perf = self.rounds.runs((scenario, "perf"));
            let multi = self.rounds.runs((scenario, "auto"));
            let (perf_s, multi_s) = (teardowns(perf), teardowns(multi));
            rows.push(row(
                format!("{what}, perf links ({})", shape(perf)),
                &perf_s,
                fmt_duration,
                Some(1.0),
                "",
                Met::NoTarget,
            ));
            let ratio = ratio_to(&multi_s, &perf_s);
            let max_s = multi_s.iter().copied().fold(0.0, f64::max);
            rows.push(row(
                format!("{what}, uprobe_multi links ({})", shape(multi)),
                &multi_s,
                fmt_duration,
                ratio,
                "≤ 1 s",
                if multi_s.is_empty() {
                    Met::NotMeasured("no value".into())
                } else {
                    Met::from_bool(max_s <= 1.0)
                },
            ));
        }
        Section {
            title: "8. Teardown: lens-probe's exit → its probes out of the kernel (ratio: to \
                    perf links)"
                .into(),
            rows,
        }
    }

    pub(super) fn notes(&self) -> String {
        format!(
            "- Teardown (8): lens-probe `--span-groups per_step --uprobe-links L --exec` on \
             the torch fixture (`train.py --steps 2`) and on `python -c 'import torch'` with \
             a `--config` rule `_ZN*` in libtorch_cpu (max_matches {RULE_MATCHES_MULTI} with \
             uprobe_multi links; {RULE_MATCHES_PERF} with perf links, since {} perf links \
             take the kernel minutes to remove), L = perf and auto interleaved. Teardown: \
             from lens-probe's exit until the child that holds its probes' descriptors has \
             closed them and exited (the kernel removes a link as its descriptor closes). \
             The links column is lens-probe's own status line, checked against the \
             kernel's fdinfo in `tests/integration/cli.rs`.\n",
            2 * RULE_MATCHES_MULTI
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_line_gives_uprobes_and_links() {
        assert_eq!(
            parse_status_line(
                "lens-probe: tracing 1 process: 4 libraries, 2157 uprobes in 27 links"
            ),
            Some((2157, 27))
        );
        assert_eq!(
            parse_status_line("lens-probe: tracing pid 12 (python)"),
            None
        );
    }
}
