//! Block 9: unmodified framework loops on CPU, untraced and under `default` and
//! `per_step`, interleaved: a transformers `Trainer` run and a 2-rank DDP run under
//! torchrun (gloo). The time is the training loop's own, from the framework's ground truth
//! (`tests/fixtures/frameworks/_truth.py`: its first step's start to its last step's end,
//! on the slowest rank), so Python's start-up, imports and lens-probe's attach are left
//! out.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Deserialize;

use super::proc::{Line, Proc};
use super::report::{Met, Row, Section, fmt_duration, row};
use super::rounds::{Rounds, ratio_to};
use super::{
    Ctx, RUN_TIMEOUT, Watch, append_command, lens_command, lens_probe_pids, wait_teardown,
};
use xtask::error::{self, Error, Result};
use xtask::torch_venv;

/// The variants of every scenario: untraced, then each preset.
const VARIANTS: [Option<&str>; 3] = [None, Some("default"), Some("per_step")];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    /// `hf_trainer.py DIR --no-save`: 8 optimizer steps of a tiny GPT-2, evaluations.
    HfTrainer,
    /// `torchrun --nproc-per-node 2 ddp_train.py`: DDP over gloo.
    Ddp,
}

impl Scenario {
    const ALL: [Scenario; 2] = [Scenario::HfTrainer, Scenario::Ddp];

    fn ranks(self) -> u32 {
        match self {
            Scenario::HfTrainer => 1,
            Scenario::Ddp => 2,
        }
    }

    /// Steps per run (`LENS_FW_STEPS`): loops of a few seconds, not the tests' fraction
    /// of one, so that a 2-core VM's noise is small beside them.
    fn steps(self, quick: bool) -> u32 {
        match (self, quick) {
            (_, true) => 8,
            (Scenario::HfTrainer, false) => 40,
            (Scenario::Ddp, false) => 60,
        }
    }

    fn what(self) -> &'static str {
        match self {
            Scenario::HfTrainer => "transformers `Trainer` (`hf_trainer.py --no-save`)",
            Scenario::Ddp => "2-rank DDP under torchrun, gloo (`ddp_train.py`)",
        }
    }
}

/// A scenario and its variant (`None`: untraced).
type Case = (Scenario, Option<&'static str>);

pub(super) struct FrameworksBlock {
    /// Each case's loop time (seconds) and steps, as the ground truth counted them.
    rounds: Rounds<Case, (f64, usize)>,
}

impl FrameworksBlock {
    fn times(&self, scenario: Scenario, variant: Option<&'static str>) -> Vec<f64> {
        self.rounds
            .values((scenario, variant), |(seconds, _)| *seconds)
    }

    /// Steps per run: the first, untraced run's.
    fn steps(&self, scenario: Scenario) -> usize {
        self.rounds
            .runs((scenario, None))
            .first()
            .map_or(0, |(_, steps)| *steps)
    }
}

pub(super) fn block(
    ctx: &Ctx,
    python: &Path,
    watch: &mut Watch,
    quick: bool,
) -> Result<FrameworksBlock> {
    let cases = Scenario::ALL
        .into_iter()
        .flat_map(|scenario| VARIANTS.map(|variant| (scenario, variant)));
    let rounds = Rounds::measure(
        ctx.rounds,
        cases,
        watch,
        |(scenario, variant), round| run(ctx, python, scenario, variant, round, quick),
        |(scenario, variant), (seconds, steps)| {
            format!(
                "{scenario:?} {}: {steps} steps in {}",
                variant.unwrap_or("untraced"),
                fmt_duration(*seconds)
            )
        },
    )?;
    Ok(FrameworksBlock { rounds })
}

/// One run; returns its loop time (seconds) and steps.
fn run(
    ctx: &Ctx,
    python: &Path,
    scenario: Scenario,
    variant: Option<&str>,
    round: u32,
    quick: bool,
) -> Result<(f64, usize)> {
    let name = format!("fw-{scenario:?}-{}-r{round}", variant.unwrap_or("none")).to_lowercase();
    let dir = ctx.out.join(&name);
    let _ = fs::remove_dir_all(&dir);
    error::create_dir_all(&dir)?;
    let truth = dir.join("truth.json");
    let mut target = torch_venv::python_command(python);
    let scripts = ctx.root.join("tests/fixtures/frameworks");
    match scenario {
        Scenario::HfTrainer => {
            target
                .arg(scripts.join("hf_trainer.py"))
                .arg(dir.join("out"))
                .arg("--no-save");
        }
        Scenario::Ddp => {
            // torchrun's own Python entry point, run by the venv's interpreter.
            let port = 29_400 + round * 10 + variant.map_or(0, |v| v.len() as u32);
            target
                .args(["-m", "torch.distributed.run", "--nproc-per-node"])
                .arg(scenario.ranks().to_string())
                .args(["--master-addr", "127.0.0.1", "--master-port"])
                .arg(port.to_string())
                .arg(scripts.join("ddp_train.py"));
        }
    }
    target
        .env("LENS_TRUTH", &truth)
        .env("LENS_FW_STEPS", scenario.steps(quick).to_string())
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .env("GLOO_SOCKET_IFNAME", "lo")
        .env("OMP_NUM_THREADS", "1");
    let log = ctx.logs.join(format!("{name}.log"));
    let before = lens_probe_pids();
    let mut cmd = match variant {
        None => target,
        Some(preset) => {
            let pid_file = ctx.out.join(format!("{name}.pid"));
            let mut cmd = lens_command(ctx, None, preset, &pid_file);
            cmd.args(["--exporter", "file", "--export-file", "/dev/null"])
                .args(["--exec", "--"]);
            append_command(&mut cmd, &target);
            cmd
        }
    };
    Proc::spawn(&name, &mut cmd, &log)?
        .finish_ok(Instant::now() + RUN_TIMEOUT, &mut |_: &Line| {})?;
    if variant.is_some() {
        wait_teardown(&name, &before);
    }
    let files: Vec<PathBuf> = match scenario.ranks() {
        1 => vec![truth],
        n => (0..n)
            .map(|r| dir.join(format!("truth.rank{r}.json")))
            .collect(),
    };
    let mut slowest = 0.0f64;
    let mut steps = 0;
    for file in &files {
        let (seconds, n) =
            loop_time(file).map_err(|e| format!("{name}: {e} (output in {})", log.display()))?;
        slowest = slowest.max(seconds);
        steps = n;
    }
    let _ = fs::remove_dir_all(&dir);
    Ok((slowest, steps))
}

/// What the bench reads of a ground-truth file (`tests/fixtures/frameworks/_truth.py`).
#[derive(Deserialize)]
struct Truth {
    #[serde(default)]
    steps: Vec<TruthStep>,
}

/// One optimizer step; `end_ns` is `null` for a step that never ended.
#[derive(Deserialize)]
struct TruthStep {
    start_ns: Option<u64>,
    end_ns: Option<u64>,
}

/// The training loop's time in one ground-truth file: its first step's start to its
/// last step's end, and its steps.
fn loop_time(file: &Path) -> Result<(f64, usize)> {
    let text = fs::read_to_string(file).map_err(|e| {
        format!(
            "no ground truth {} ({e}): the script failed",
            file.display()
        )
    })?;
    let truth: Truth = serde_json::from_str(&text).map_err(|e| Error::json(file, e))?;
    let (Some(first), Some(last)) = (truth.steps.first(), truth.steps.last()) else {
        return Err(Error::Msg(format!("{}: no steps", file.display())));
    };
    match (first.start_ns, last.end_ns) {
        (Some(start), Some(end)) if end > start => {
            Ok(((end - start) as f64 / 1e9, truth.steps.len()))
        }
        _ => Err(Error::Msg(format!(
            "{}: steps without times",
            file.display()
        ))),
    }
}

impl FrameworksBlock {
    pub(super) fn section(&self) -> Section {
        let mut rows: Vec<Row> = Vec::new();
        for scenario in Scenario::ALL {
            let base = self.times(scenario, None);
            if base.is_empty() {
                continue;
            }
            let steps = self.steps(scenario);
            rows.push(row(
                format!("{}, {steps} steps: untraced", scenario.what()),
                &base,
                fmt_duration,
                Some(1.0),
                "",
                Met::NoTarget,
            ));
            for preset in VARIANTS.into_iter().flatten() {
                let times = self.times(scenario, Some(preset));
                rows.push(row(
                    format!("same, lens-probe `{preset}`"),
                    &times,
                    fmt_duration,
                    ratio_to(&times, &base),
                    "",
                    Met::NoTarget,
                ));
            }
        }
        Section {
            title: "9. Framework loops, unmodified, on CPU (ratio: to untraced)".into(),
            rows,
        }
    }

    pub(super) fn notes(&self) -> String {
        "- Frameworks (9): `tests/fixtures/frameworks/hf_trainer.py DIR --no-save` (a \
         transformers `Trainer`, tiny GPT-2 from a config, 40 optimizer steps of 2 \
         microbatches, an evaluation every 3) and `python -m torch.distributed.run \
         --nproc-per-node 2 ddp_train.py` (DDP over gloo on loopback, 60 steps), with \
         `OMP_NUM_THREADS=1` (`LENS_FW_STEPS` sets the steps; 8 with `--quick`); untraced, and under `lens-probe --span-groups PRESET \
         --exporter file --export-file /dev/null --exec`, interleaved in every round. The \
         time is the loop's own as the framework's callbacks saw it (first step's start to \
         last step's end, `time.monotonic_ns()`, the slowest rank), so start-up, imports \
         and lens-probe's attach are left out.\n"
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loop_time_runs_from_the_first_step_to_the_last() {
        let dir = std::env::temp_dir().join(format!("fw-bench-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("truth.json");
        fs::write(
            &file,
            r#"{"steps": [{"start_ns": 1000000000, "end_ns": 1200000000},
                          {"start_ns": 1300000000, "end_ns": 3500000000}]}"#,
        )
        .unwrap();
        assert_eq!(loop_time(&file).unwrap(), (2.5, 2));
        fs::write(&file, r#"{"steps": []}"#).unwrap();
        assert!(
            loop_time(&file)
                .unwrap_err()
                .to_string()
                .contains("no steps")
        );
        fs::write(
            &file,
            r#"{"rank": 0, "steps": [{"start_ns": 5, "end_ns": null}], "evaluations": []}"#,
        )
        .unwrap();
        assert!(
            loop_time(&file)
                .unwrap_err()
                .to_string()
                .contains("without times")
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
