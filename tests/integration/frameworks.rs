//! Real training frameworks from PyPI (CPU, tiny models from configs, synthetic data, no
//! downloads) run unmodified under lens-probe, each checked against the framework's OWN
//! ground truth: the scripts of `tests/fixtures/frameworks/` record their framework's
//! callbacks and hooks (transformers `TrainerCallback`, Lightning `Callback`, the calls
//! of DDP/FSDP2/DCP/torch.compile/safetensors loops) with `time.monotonic_ns()` into a
//! JSON file (`$LENS_TRUTH`), and each test asserts what a user would check in the tree:
//!
//! - one `train.step` per optimizer step, `dl.iteration` 0..N-1, each with one
//!   `train.forward_backward` (its `dl.microbatch_count` the accumulation) and one
//!   `train.optimizer`;
//! - every collective (`gloo.*`, `nccl.*`) the child of a phase span, never of
//!   `train.job`, and within its parent's time; on a pipeline stage each send and
//!   receive under its step's `train.forward_backward`, or under the `train.step` when
//!   made after the step's last backward pass;
//! - one `train.evaluate` per evaluation; one `train.checkpoint` per save covering at
//!   least 90 % of the framework's save call, its `nemo.checkpoint.files` the files the
//!   save wrote (the same for loads and `train.load_checkpoint`);
//! - each `train.step` within the framework's own step (its step-begin → step-end
//!   callbacks or hooks; from its first batch's fetch where the fixture records it), after
//!   the previous one's end; the median of the step-by-step duration differences within
//!   5 % of the framework's median step time;
//! - exit code 0.
//!
//! Each test gathers every failed check and reports them together (with the outline), so
//! one run shows all that lens-probe got wrong for that framework.
use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    sync::Mutex,
    time::Duration,
};

use lens_probe::{
    export::strategy::ExportStrategy,
    semconv,
    session::{Session, TraceOptions},
    settings::{
        groups::SpanGroups,
        probe_rules::{ProbeRules, Profile},
    },
    spans::{SpanBuilder, SpanLog, SpanRecord, names},
};
use lens_tests::TorchVenv;
use serde_json::Value;

/// The runs share two CPUs: one at a time, so a run's timing is its own.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const SPAN_GROUPS: &str = "per_step";
/// A save (load) span must cover this share of the framework's save (load) call, less the
/// time its thread waited for a CPU meanwhile (issue 38: the framework call whole).
const MIN_CHECKPOINT_COVERAGE: f64 = 0.95;
/// The median step may differ this much from the framework's median step time.
const MAX_STEP_TIME_OFF: f64 = 0.05;

const KEYS: &[&str] = &[
    semconv::DL_RANK,
    semconv::DL_ITERATION,
    semconv::DL_MICROBATCH_COUNT,
    semconv::NEMO_CHECKPOINT_FILES,
];

/// What is launched: a script of `tests/fixtures/frameworks/` with its arguments, by the
/// venv's Python or (`ranks` > 1) by `torchrun --nproc-per-node RANKS`.
struct Launch<'a> {
    script: &'a str,
    args: Vec<String>,
    ranks: u32,
}

/// One traced run: the spans and each rank's ground truth (by rank).
struct Run {
    log: SpanLog,
    truths: Vec<Value>,
    dir: PathBuf,
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lens-fw-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The environment of every run: no hub access, gloo on loopback, every rank exported.
fn run_env(truth: &Path) -> Vec<(String, String)> {
    [
        ("LENS_TRUTH", truth.to_str().unwrap()),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("HF_DATASETS_OFFLINE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("GLOO_SOCKET_IFNAME", "lo"),
        ("NEMO_LENS_EXPORT_STRATEGY", "all_ranks"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn argv(venv: &TorchVenv, launch: &Launch, port: u32) -> Vec<OsString> {
    let mut argv: Vec<OsString> = if launch.ranks > 1 {
        vec![
            venv.dir.join("bin/torchrun").into(),
            "--nproc-per-node".into(),
            launch.ranks.to_string().into(),
            "--master-addr".into(),
            "127.0.0.1".into(),
            "--master-port".into(),
            port.to_string().into(),
        ]
    } else {
        vec![venv.python.clone().into()]
    };
    argv.push(lens_tests::framework_script(launch.script).into());
    argv.extend(launch.args.iter().map(OsString::from));
    argv
}

/// Runs `launch` traced with span groups `per_step` (every rank exported), then reads the
/// truth file(s): `truth.json`, or `truth.rank<N>.json` per rank.
fn trace(venv: &TorchVenv, name: &str, dir: &Path, launch: &Launch) -> Run {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let truth = dir.join("truth.json");
    let mut session = Session::new(TraceOptions {
        span_groups: SPAN_GROUPS.parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    session.set_export_strategy(ExportStrategy::AllRanks);
    // What `lens-probe` runs with: the built-in (framework) rules, no config file.
    let rules = std::sync::Arc::new(ProbeRules::load(None, Profile::default()).unwrap());
    session.set_rules(rules.clone());
    let port = 20_000 + (std::process::id() * 7 + name.len() as u32 * 131) % 20_000;
    let mut cmd: Vec<OsString> = vec!["env".into()];
    cmd.extend(
        run_env(&truth)
            .into_iter()
            .map(|(k, v)| OsString::from(format!("{k}={v}"))),
    );
    cmd.extend(argv(venv, launch, port));
    let started = std::time::Instant::now();
    session.exec(&cmd).unwrap();
    let mut builder =
        SpanBuilder::new(SPAN_GROUPS.parse().unwrap(), SpanLog::default()).with_rules(rules);
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(240)))
        .unwrap();
    eprintln!(
        "{name}: traced run took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let log = builder.into_exporter();
    let files: Vec<PathBuf> = if launch.ranks > 1 {
        (0..launch.ranks)
            .map(|r| dir.join(format!("truth.rank{r}.json")))
            .collect()
    } else {
        vec![truth]
    };
    let truths = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap_or_else(|e| {
                panic!(
                    "{name}: no ground truth {} ({e}): the script failed\n{}",
                    f.display(),
                    log.outline(KEYS)
                )
            });
            serde_json::from_str(&text).unwrap()
        })
        .collect();
    Run {
        log,
        truths,
        dir: dir.to_path_buf(),
    }
}

/// `{start_ns, end_ns}` intervals of a truth list.
fn intervals(truth: &Value, key: &str) -> Vec<(u64, u64)> {
    truth[key]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|i| {
                    (
                        i["start_ns"].as_u64().unwrap(),
                        i["end_ns"].as_u64().unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The framework calls of list `key`, each from its start to its end, or, for DCP's
/// `async_save`, to the background save's completion (`completed_ns`, recorded in the
/// writer thread): the caller's `future.result()` returns after that, once the executor's
/// callbacks have run and the caller has the GIL back, time that is not the save's
/// (docs/spans.md).
fn call_intervals(truth: &Value, key: &str) -> Vec<(u64, u64)> {
    let items = truth[key].as_array().cloned().unwrap_or_default();
    intervals(truth, key)
        .into_iter()
        .zip(&items)
        .map(|((start, end), item)| (start, item["completed_ns"].as_u64().unwrap_or(end)))
        .collect()
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The framework's own step timer: each step's begin→end callbacks (or hooks).
fn framework_step_times_ms(truth: &Value) -> Vec<f64> {
    intervals(truth, "steps")
        .iter()
        .map(|(start, end)| (end - start) as f64 / 1e6)
        .collect()
}

/// The share of `[start, end)` (truth) that `span` covers.
fn coverage(span: &SpanRecord, (start, end): (u64, u64)) -> f64 {
    let overlap = span
        .end_ns
        .min(end)
        .saturating_sub(span.start_ns.max(start));
    overlap as f64 / end.saturating_sub(start).max(1) as f64
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn is_collective(span: &SpanRecord) -> bool {
    span.name.starts_with("gloo.") || span.name.starts_with("nccl.")
}

/// The files one save wrote (the rank's own under DCP), from the truth item.
fn truth_files(item: &Value) -> Option<usize> {
    item.get("own_files")
        .or_else(|| item.get("files"))
        .and_then(Value::as_array)
        .map(Vec::len)
}

/// Every check of one rank (one process) against its truth; failures are appended.
fn check_rank(run: &Run, truth: &Value, fails: &mut Vec<String>) {
    let log = &run.log;
    let pid = truth["pid"].as_u64().unwrap() as u32;
    let who = format!("rank {} (pid {pid})", truth["rank"]);
    let mut fail = |what: String| fails.push(format!("{who}: {what}"));
    let mine: Vec<&SpanRecord> = {
        let mut v: Vec<&SpanRecord> = log.spans.iter().filter(|s| s.pid == pid).collect();
        v.sort_by_key(|s| (s.start_ns, s.id));
        v
    };
    let named = |name: &str| -> Vec<&SpanRecord> {
        mine.iter().copied().filter(|s| s.name == name).collect()
    };
    let by_id = |id| log.spans.iter().find(|s| s.id == id);

    // The job and its exit.
    let Some(job) = named(names::JOB).into_iter().next() else {
        fail("no train.job span".into());
        return;
    };
    if truth["exit"].as_i64() != Some(0) {
        fail(format!("the script's own exit is {}", truth["exit"]));
    }
    let exit = job.int_attr(semconv::PROCESS_EXIT_CODE);
    if exit != Some(0) {
        fail(format!("train.job process.exit.code {exit:?}, want 0"));
    }

    // Steps: one per optimizer step, iterations 0..N-1.
    let steps = named(names::STEP);
    let truth_steps = intervals(truth, "steps");
    if steps.len() != truth_steps.len() {
        fail(format!(
            "{} train.step spans, the framework made {} optimizer steps",
            steps.len(),
            truth_steps.len()
        ));
    }
    let iterations: Vec<Option<i64>> = steps
        .iter()
        .map(|s| s.int_attr(semconv::DL_ITERATION))
        .collect();
    let want: Vec<Option<i64>> = (0..steps.len() as i64).map(Some).collect();
    if iterations != want {
        fail(format!(
            "dl.iteration {iterations:?}, want 0..{}",
            steps.len()
        ));
    }
    // Each step: one forward_backward with the accumulation, one optimizer.
    let truth_mb: Vec<i64> = truth["microbatches"]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_i64().unwrap()).collect())
        .unwrap_or_default();
    let mut shapes = Vec::new();
    let mut microbatches = Vec::new();
    for step in &steps {
        let children = log.children(step);
        let fb: Vec<&&SpanRecord> = children
            .iter()
            .filter(|c| c.name == names::FORWARD_BACKWARD)
            .collect();
        let opt = children
            .iter()
            .filter(|c| c.name == names::OPTIMIZER)
            .count();
        shapes.push((fb.len(), opt));
        microbatches.push(
            fb.first()
                .and_then(|f| f.int_attr(semconv::DL_MICROBATCH_COUNT))
                .unwrap_or(-1),
        );
    }
    if shapes.iter().any(|&s| s != (1, 1)) {
        fail(format!(
            "(forward_backward, optimizer) children per step {shapes:?}, want (1, 1) each"
        ));
    }
    if microbatches != truth_mb[..truth_mb.len().min(microbatches.len())]
        || microbatches.len() != truth_mb.len()
    {
        fail(format!(
            "dl.microbatch_count per step {microbatches:?}, the framework's {truth_mb:?}"
        ));
    }

    // Collectives: one made during a phase of the framework's (a step, an evaluation, a
    // save, a load) is under a phase, never the job; any is within its parent's time.
    // (One outside all of them, a barrier after training, is the job's.)
    let phases: Vec<(u64, u64)> = ["steps", "evaluations", "saves", "loads"]
        .iter()
        .flat_map(|key| intervals(truth, key))
        .collect();
    let during_phase = |c: &SpanRecord| phases.iter().any(|&(s, e)| c.start_ns < e && s < c.end_ns);
    let mut under_job = std::collections::BTreeMap::<&str, usize>::new();
    let mut outside = Vec::new();
    let mut total = 0;
    for c in mine.iter().filter(|s| is_collective(s)) {
        total += 1;
        match c.parent.and_then(by_id) {
            None
            | Some(SpanRecord {
                name: names::JOB, ..
            }) if !during_phase(c) => {}
            None => *under_job.entry(c.name).or_default() += 1,
            Some(p) if p.name == names::JOB => *under_job.entry(c.name).or_default() += 1,
            Some(p) if c.start_ns < p.start_ns || c.end_ns > p.end_ns => {
                outside.push(format!("{} outside its {}", c.name, p.name));
            }
            Some(_) => {}
        }
    }
    if !under_job.is_empty() {
        fail(format!(
            "collectives parented to train.job (of {total}): {under_job:?}"
        ));
    }
    if !outside.is_empty() {
        fail(format!(
            "collectives outside their parent's time: {outside:?}"
        ));
    }

    // Evaluations.
    let evals = named(names::EVALUATE);
    let truth_evals = intervals(truth, "evaluations");
    if evals.len() != truth_evals.len() {
        fail(format!(
            "{} train.evaluate spans, the framework ran {} evaluations",
            evals.len(),
            truth_evals.len()
        ));
    }

    // Saves and loads: count, coverage of the framework's call, files.
    for (span_name, key) in [
        (names::CHECKPOINT, "saves"),
        (names::LOAD_CHECKPOINT, "loads"),
    ] {
        let spans = named(span_name);
        let truth_items = truth[key].as_array().cloned().unwrap_or_default();
        let truth_iv = call_intervals(truth, key);
        if spans.len() != truth_items.len() {
            fail(format!(
                "{} {span_name} spans, the framework made {} {key}",
                spans.len(),
                truth_items.len()
            ));
        }
        // Each framework call against the span that overlaps it most.
        for (i, (iv, item)) in truth_iv.iter().zip(&truth_items).enumerate() {
            let best = spans
                .iter()
                .max_by(|a, b| coverage(a, *iv).total_cmp(&coverage(b, *iv)));
            let Some(best) = best.filter(|s| coverage(s, *iv) > 0.0) else {
                fail(format!(
                    "{key}[{i}] ({:.1} ms) has no {span_name} span over it",
                    ms(iv.1 - iv.0)
                ));
                continue;
            };
            let cov = coverage(best, *iv);
            // Shown with --nocapture: how close a passing run came, and at which end.
            let signed_ms = |span: u64, call: u64| (span as f64 - call as f64) / 1e6;
            eprintln!(
                "rank {}: {key}[{i}] {:.1} ms, {span_name} covers {:.0} % \
                 (starts {:+.1} ms, ends {:+.1} ms from the call's; waited {:.1} ms)",
                truth["rank"],
                ms(iv.1 - iv.0),
                cov * 100.0,
                signed_ms(best.start_ns, iv.0),
                signed_ms(best.end_ns, iv.1),
                item["waited_ns"].as_f64().unwrap_or(0.0) / 1e6,
            );
            // What the span misses may also be time the thread waited for a CPU (a
            // loaded machine delays the sampler that finds the call, never advances it):
            // that wait, which the script read from its schedstat, is allowed on top.
            let call_ns = (iv.1 - iv.0) as f64;
            let waited_ns = item["waited_ns"].as_f64().unwrap_or(0.0);
            let missed_ns = (1.0 - cov) * call_ns;
            if missed_ns > (1.0 - MIN_CHECKPOINT_COVERAGE) * call_ns + waited_ns {
                fail(format!(
                    "{key}[{i}]: {span_name} {:.1} ms covers {:.0} % of the framework's \
                     {:.1} ms call (its thread waited {:.1} ms for a CPU)",
                    ms(best.duration_ns()),
                    cov * 100.0,
                    ms(iv.1 - iv.0),
                    waited_ns / 1e6
                ));
            }
            let files = best.int_attr(semconv::NEMO_CHECKPOINT_FILES);
            let want = truth_files(item).map(|n| n as i64);
            if want.is_some() && files != want {
                fail(format!(
                    "{key}[{i}]: {span_name} nemo.checkpoint.files {files:?}, the call \
                     wrote/read {want:?} ({})",
                    item.get("own_files").or_else(|| item.get("files")).unwrap()
                ));
            }
        }
    }

    // Step time, step by step. The framework's step begins where it fetches its first
    // batch (a fixture that records fetches says when: Lightning fetches before
    // on_train_batch_start), after the previous step ended.
    let fetches: Vec<u64> = truth["fetches"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let mut sorted_steps = steps.clone();
    sorted_steps.sort_by_key(|s| s.start_ns);
    let mut differences = Vec::new();
    for (i, (step, &(start, end))) in sorted_steps.iter().zip(&truth_steps).enumerate() {
        let previous_end = if i == 0 { 0 } else { truth_steps[i - 1].1 };
        let start = fetches
            .iter()
            .copied()
            .find(|&fetch| previous_end < fetch && fetch <= start)
            .unwrap_or(start);
        eprintln!(
            "rank {}: step {i}: starts {:+.2} ms, ends {:+.2} ms from the framework's",
            truth["rank"],
            (step.start_ns as f64 - start as f64) / 1e6,
            (step.end_ns as f64 - end as f64) / 1e6,
        );
        // Exact: a step takes no time of the step before it, and ends (with its
        // optimizer) before the framework's clock after it; the framework's clocks are
        // read outside the calls lens-probe sees.
        if step.start_ns < previous_end || step.end_ns > end || step.end_ns <= start {
            fail(format!(
                "train.step {i} [{}, {}] ns, the framework's step [{start}, {end}] ns \
                 after its previous one's end {previous_end} ns",
                step.start_ns, step.end_ns
            ));
        }
        differences.push(ms(step.duration_ns()) - ms(end - start));
    }
    // Durations compared step by step, the median difference: a step in which a loaded
    // machine kept the thread off the CPU between the framework's clock and its call
    // (3.4 ms in one step of 6 in a DCP run) moves the median of each side's durations
    // but not this.
    let theirs = median(framework_step_times_ms(truth));
    if let (Some(difference), Some(theirs)) = (median(differences), theirs) {
        let off = difference.abs() / theirs;
        if off > MAX_STEP_TIME_OFF {
            fail(format!(
                "train.step durations {difference:+.2} ms from the framework's (median of \
                 the step-by-step differences), its median step {theirs:.2} ms ({:.1} % off)",
                off * 100.0
            ));
        }
    }

    // Any span sticking out of its parent.
    let misnested: Vec<String> = log
        .misnested()
        .into_iter()
        .filter(|(c, _)| c.pid == pid && !is_collective(c))
        .map(|(c, p)| format!("{} outside {}", c.name, p.name))
        .collect();
    if !misnested.is_empty() {
        fail(format!("spans outside their parent: {misnested:?}"));
    }
}

/// All checks of every rank: the failures.
fn check(run: &Run) -> Vec<String> {
    let mut fails = Vec::new();
    for truth in &run.truths {
        check_rank(run, truth, &mut fails);
    }
    fails
}

/// Panics with every failure (and the outline) if any; else removes the run's files.
fn report(name: &str, run: &Run, fails: Vec<String>) {
    let outline = run.log.outline(KEYS);
    if fails.is_empty() {
        let _ = std::fs::remove_dir_all(&run.dir);
        return;
    }
    eprintln!("{name}: lens-probe's tree:\n{outline}");
    panic!(
        "{name}: {} check(s) failed against the framework's own ground truth:\n  {}",
        fails.len(),
        fails.join("\n  ")
    );
}

fn setup(test: &str) -> Option<TorchVenv> {
    if !lens_tests::require_bpf(test) {
        return None;
    }
    lens_tests::torch_venv(test)
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// Runs `script` on `ranks` ranks, traced, with the arguments `args` makes from the
/// run's scratch directory; `None` where the venv or BPF is missing (a skip, or a
/// failure under CI=true).
fn traced(
    test: &str,
    script: &'static str,
    ranks: u32,
    args: impl FnOnce(&Path) -> Vec<String>,
) -> Option<Run> {
    let venv = setup(test)?;
    let dir = temp_dir(test);
    let launch = Launch {
        script,
        args: args(&dir),
        ranks,
    };
    Some(trace(&venv, test, &dir, &launch))
}

/// Every check of `run` against the framework's truth, reported together.
fn assert_matches_truth(test: &str, run: &Run) {
    let fails = check(run);
    report(test, run, fails);
}

// ---- transformers ---------------------------------------------------------------------

#[test]
fn hf_trainer_steps_and_evaluations() {
    let test = "hf_trainer_steps_and_evaluations";
    let Some(run) = traced(test, "hf_trainer.py", 1, |dir| {
        args(&[dir.join("out").to_str().unwrap(), "--no-save"])
    }) else {
        return;
    };
    let truth = &run.truths[0];
    assert_eq!(intervals(truth, "steps").len(), 8, "the run's own shape");
    assert_eq!(truth["on_evaluate"].as_u64(), Some(3));
    assert_matches_truth(test, &run);
}

#[test]
fn hf_trainer_checkpoints() {
    let test = "hf_trainer_checkpoints";
    let Some(run) = traced(test, "hf_trainer.py", 1, |dir| {
        args(&[dir.join("out").to_str().unwrap()])
    }) else {
        return;
    };
    assert_eq!(
        intervals(&run.truths[0], "saves").len(),
        2,
        "the run's own shape"
    );
    assert_matches_truth(test, &run);
}

// ---- Lightning ------------------------------------------------------------------------

#[test]
fn lightning_fit_with_accumulation_and_validation() {
    let test = "lightning_fit_with_accumulation_and_validation";
    let Some(run) = traced(test, "lightning_fit.py", 1, |_| vec![]) else {
        return;
    };
    assert_matches_truth(test, &run);
}

#[test]
fn lightning_fit_validating_under_inference_mode() {
    let test = "lightning_fit_validating_under_inference_mode";
    let Some(run) = traced(test, "lightning_fit.py", 1, |_| {
        args(&["--validate-inference"])
    }) else {
        return;
    };
    assert_matches_truth(test, &run);
}

/// Validation at the end of `fit` (the epoch's), then `validate(ckpt_path=...)`: one
/// `train.evaluate` per validation, and the checkpoint's load a `train.load_checkpoint`
/// beside the validation that follows it, not inside it (issue 38).
#[test]
fn lightning_validation_at_fit_end_and_from_a_checkpoint() {
    let test = "lightning_validation_at_fit_end_and_from_a_checkpoint";
    let Some(run) = traced(test, "lightning_fit.py", 1, |dir| {
        args(&["--end-validation", dir.join("ckpt").to_str().unwrap()])
    }) else {
        return;
    };
    let truth = &run.truths[0];
    assert_eq!(
        intervals(truth, "evaluations").len(),
        2,
        "the run's own shape"
    );
    assert_eq!(intervals(truth, "loads").len(), 1, "the run's own shape");
    let mut fails = check(&run);
    let named = |name: &str| -> Vec<&SpanRecord> {
        run.log.spans.iter().filter(|s| s.name == name).collect()
    };
    // Times in ms from the load call's own start, for the message.
    let (load_start, load_end) = intervals(truth, "loads")[0];
    let from_load = |ns: u64| (ns as f64 - load_start as f64) / 1e6;
    for load in named(names::LOAD_CHECKPOINT) {
        for eval in named(names::EVALUATE) {
            if eval.start_ns < load.end_ns && load.start_ns < eval.end_ns {
                fails.push(format!(
                    "train.evaluate [{:.2}, {:.2}] ms overlaps train.load_checkpoint \
                     [{:.2}, {:.2}] ms (from the load call's start; the call ended at \
                     {:.2}; validations at {:?})",
                    from_load(eval.start_ns),
                    from_load(eval.end_ns),
                    from_load(load.start_ns),
                    from_load(load.end_ns),
                    from_load(load_end),
                    intervals(truth, "evaluations")
                        .iter()
                        .map(|(a, b)| (from_load(*a), from_load(*b)))
                        .collect::<Vec<_>>(),
                ));
            }
        }
    }
    report(test, &run, fails);
}

// ---- torch.distributed over gloo, 2 ranks under torchrun ------------------------------

#[test]
fn ddp_two_gloo_ranks() {
    let test = "ddp_two_gloo_ranks";
    let Some(run) = traced(test, "ddp_train.py", 2, |_| vec![]) else {
        return;
    };
    assert_matches_truth(test, &run);
}

#[test]
fn fsdp2_two_gloo_ranks() {
    let test = "fsdp2_two_gloo_ranks";
    let Some(run) = traced(test, "fsdp2_train.py", 2, |_| vec![]) else {
        return;
    };
    let mut fails = check(&run);
    // FSDP2 all-gathers each layer's parameters in forward and again in backward: every
    // one of them is inside its step's forward_backward.
    for truth in &run.truths {
        let pid = truth["pid"].as_u64().unwrap() as u32;
        let want = truth["collectives"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["op"] == "all_gather_single")
            .count();
        let in_fb = run
            .log
            .spans
            .iter()
            .filter(|s| s.pid == pid && s.name == "gloo.all_gather")
            .filter(|s| {
                s.parent
                    .and_then(|id| run.log.spans.iter().find(|p| p.id == id))
                    .is_some_and(|p| p.name == names::FORWARD_BACKWARD)
            })
            .count();
        if in_fb != want {
            fails.push(format!(
                "rank {}: {in_fb} gloo.all_gather spans inside train.forward_backward, \
                 FSDP2 made {want} all-gathers in forward and backward",
                truth["rank"]
            ));
        }
    }
    report(test, &run, fails);
}

#[test]
fn dcp_save_two_gloo_ranks() {
    let test = "dcp_save_two_gloo_ranks";
    let Some(run) = traced(test, "dcp_checkpoint.py", 2, |dir| {
        args(&[dir.join("ckpt").to_str().unwrap(), "--no-load"])
    }) else {
        return;
    };
    assert_matches_truth(test, &run);
}

#[test]
fn dcp_save_and_load_two_gloo_ranks() {
    let test = "dcp_save_and_load_two_gloo_ranks";
    let Some(run) = traced(test, "dcp_checkpoint.py", 2, |dir| {
        args(&[dir.join("ckpt").to_str().unwrap()])
    }) else {
        return;
    };
    assert_matches_truth(test, &run);
}

#[test]
fn dcp_async_save_two_gloo_ranks() {
    let test = "dcp_async_save_two_gloo_ranks";
    let Some(run) = traced(test, "dcp_checkpoint.py", 2, |dir| {
        args(&[dir.join("ckpt").to_str().unwrap(), "--async", "--no-load"])
    }) else {
        return;
    };
    assert_matches_truth(test, &run);
}

// ---- pipeline parallelism: torch.distributed.pipelining over gloo ----------------------

/// One point-to-point call the schedule made in a step (`truth["p2p"]`), and whether it
/// came after that step's last backward pass had returned (`truth["backward"]`).
struct P2pCall {
    op: String,
    step: u64,
    start_ns: u64,
    end_ns: u64,
    after_last_backward: bool,
}

/// The calls of `truth["p2p"]` made in a step (not those of set-up or tear-down).
fn pipeline_calls(truth: &Value) -> Vec<P2pCall> {
    let backward = truth["backward"].as_array().cloned().unwrap_or_default();
    let last_backward_end = |step: u64| -> u64 {
        backward
            .iter()
            .filter(|b| b["step"].as_u64() == Some(step))
            .filter_map(|b| b["end_ns"].as_u64())
            .max()
            .unwrap_or(u64::MAX)
    };
    truth["p2p"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|call| {
            let step = call["step"].as_u64()?;
            let start_ns = call["start_ns"].as_u64().unwrap();
            Some(P2pCall {
                op: call["op"].as_str().unwrap().to_string(),
                step,
                start_ns,
                end_ns: call["end_ns"].as_u64().unwrap(),
                after_last_backward: start_ns > last_backward_end(step),
            })
        })
        .collect()
}

/// The point-to-point calls of one pipeline stage (rank) against the schedule's own
/// record (every `ProcessGroup.send`/`recv` with the step it was made in, and every
/// backward pass): each call made in a step is one `gloo.send`/`gloo.recv` span, its
/// entry inside the call; one made before that step's last backward pass returned (a
/// forward's send or receive, a gradient's between two backward passes) hangs under the
/// step's `train.forward_backward`, one made after it (the last stage's last gradient
/// send, issue 38 item 5) under the `train.step` itself, beside `forward_backward`, never
/// under a `forward_backward` that ended before the call started. And, from the spans
/// alone, every `gloo.send`/`gloo.recv` of the rank hangs under a
/// `train.forward_backward` or `train.step` whose time holds its start.
fn check_pipeline_p2p(run: &Run, truth: &Value, fails: &mut Vec<String>) {
    let log = &run.log;
    let pid = truth["pid"].as_u64().unwrap() as u32;
    let who = format!("rank {} (pid {pid})", truth["rank"]);
    let mut fail = |what: String| fails.push(format!("{who}: {what}"));
    let by_id = |id| log.spans.iter().find(|s| s.id == id);
    let is_p2p = |s: &SpanRecord| s.pid == pid && (s.name == "gloo.send" || s.name == "gloo.recv");
    // The step a phase span is part of: the step itself, or a forward_backward's parent.
    let step_of = |span: &SpanRecord| -> Option<i64> {
        match span.name {
            names::STEP => span.int_attr(semconv::DL_ITERATION),
            names::FORWARD_BACKWARD => span
                .parent
                .and_then(by_id)
                .filter(|p| p.name == names::STEP)
                .and_then(|p| p.int_attr(semconv::DL_ITERATION)),
            _ => None,
        }
    };

    // From the spans alone: where each send/recv hangs, and that its parent holds it.
    let mut placed = std::collections::BTreeMap::<(&str, &str), usize>::new();
    for c in log.spans.iter().filter(|s| is_p2p(s)) {
        let Some(parent) = c.parent.and_then(by_id) else {
            fail(format!("{} at {} ns has no parent", c.name, c.start_ns));
            continue;
        };
        *placed.entry((c.name, parent.name)).or_default() += 1;
        if parent.name != names::FORWARD_BACKWARD && parent.name != names::STEP {
            fail(format!(
                "{} at {} ns hangs under {}, not a step or its forward_backward",
                c.name, c.start_ns, parent.name
            ));
        }
        if c.start_ns > parent.end_ns {
            fail(format!(
                "{} starts {:.3} ms after its parent {} ended",
                c.name,
                ms(c.start_ns - parent.end_ns),
                parent.name
            ));
        }
        if c.start_ns < parent.start_ns {
            fail(format!(
                "{} starts {:.3} ms before its parent {} began",
                c.name,
                ms(parent.start_ns - c.start_ns),
                parent.name
            ));
        }
    }

    // Against the schedule's own record: each call made in a step.
    let calls = pipeline_calls(truth);
    for call in &calls {
        let (step, name) = (call.step, format!("gloo.{}", call.op));
        let spans: Vec<&SpanRecord> = log
            .spans
            .iter()
            .filter(|s| is_p2p(s) && s.name == name)
            .filter(|s| call.start_ns <= s.start_ns && s.start_ns <= call.end_ns)
            .collect();
        let [span] = spans[..] else {
            fail(format!(
                "step {step}: {} {name} spans inside the schedule's {} call at {} ns \
                 ({:.3} ms long), want 1",
                spans.len(),
                call.op,
                call.start_ns,
                ms(call.end_ns - call.start_ns)
            ));
            continue;
        };
        let want = if call.after_last_backward {
            names::STEP
        } else {
            names::FORWARD_BACKWARD
        };
        let got = span.parent.and_then(by_id).map(|p| (p.name, step_of(p)));
        if got != Some((want, Some(step as i64))) {
            fail(format!(
                "step {step}: the {name} made {} the step's last backward pass hangs under \
                 {got:?}, want {want} of dl.iteration {step}",
                if call.after_last_backward {
                    "after"
                } else {
                    "before"
                },
            ));
        }
    }
    // Shown with --nocapture: what the run had and where lens-probe put it.
    eprintln!(
        "{who}: {} send/recv calls in steps, {} after the step's last backward; spans by \
         (name, parent): {placed:?}",
        calls.len(),
        calls.iter().filter(|c| c.after_last_backward).count()
    );
}

/// `pipeline_train.py --schedule SCHEDULE` on two stages: the steps against the truth as
/// for every framework, and each stage's sends and receives where they belong.
fn pipeline_two_gloo_stages(test: &str, schedule: &str) {
    let Some(run) = traced(test, "pipeline_train.py", 2, |_| {
        args(&["--schedule", schedule])
    }) else {
        return;
    };
    for truth in &run.truths {
        assert_eq!(intervals(truth, "steps").len(), 6, "the run's own shape");
        assert_eq!(
            truth["backward"].as_array().map(Vec::len),
            Some(24),
            "the run's own shape: 4 microbatches' backward passes a step"
        );
    }
    // The case of issue 38 item 5 is in the run: every step, the last stage sends its
    // last gradient after its last backward pass.
    let late: Vec<(u64, String)> = pipeline_calls(&run.truths[1])
        .into_iter()
        .filter(|c| c.after_last_backward)
        .map(|c| (c.step, c.op))
        .collect();
    let want: Vec<(u64, String)> = (0..6).map(|step| (step, "send".to_string())).collect();
    assert_eq!(
        late, want,
        "the run's own shape: the last stage's calls after each step's last backward"
    );
    let mut fails = check(&run);
    for truth in &run.truths {
        check_pipeline_p2p(&run, truth, &mut fails);
    }
    report(test, &run, fails);
}

/// GPipe: all forwards, then all backwards; the last stage sends each gradient after its
/// backward pass, the step's last one after its last backward.
#[test]
fn pipeline_schedule_gpipe_two_gloo_stages() {
    pipeline_two_gloo_stages("pipeline_schedule_gpipe_two_gloo_stages", "gpipe");
}

/// 1F1B: forwards and backwards interleaved; sends and receives between backward passes
/// are the forward-backward's, the last gradient send the step's.
#[test]
fn pipeline_schedule_1f1b_two_gloo_stages() {
    pipeline_two_gloo_stages("pipeline_schedule_1f1b_two_gloo_stages", "1f1b");
}

// ---- torch.compile --------------------------------------------------------------------

#[test]
fn compiled_model_steps_and_eval() {
    let test = "compiled_model_steps_and_eval";
    let Some(run) = traced(test, "compile_train.py", 1, |_| vec![]) else {
        return;
    };
    assert_matches_truth(test, &run);
}

#[test]
fn compiled_model_and_optimizer_step() {
    let test = "compiled_model_and_optimizer_step";
    let Some(run) = traced(test, "compile_train.py", 1, |_| args(&["--compile-opt"])) else {
        return;
    };
    assert_matches_truth(test, &run);
}

// ---- safetensors ----------------------------------------------------------------------

#[test]
fn safetensors_resume_and_save() {
    let test = "safetensors_resume_and_save";
    let Some(venv) = setup(test) else { return };
    let dir = temp_dir("safetensors");
    let ckpt = dir.join("ckpt");
    // A first run (untraced) leaves the checkpoint the traced run resumes from.
    let first = std::process::Command::new(&venv.python)
        .arg(lens_tests::framework_script("safetensors_ckpt.py"))
        .arg(&ckpt)
        .env("LENS_TRUTH", dir.join("first.json"))
        .output()
        .unwrap();
    assert!(first.status.success(), "{first:?}");
    let launch = Launch {
        script: "safetensors_ckpt.py",
        args: args(&[ckpt.to_str().unwrap()]),
        ranks: 1,
    };
    let run = trace(&venv, test, &dir, &launch);
    assert_eq!(
        intervals(&run.truths[0], "loads").len(),
        1,
        "the run resumed"
    );
    let fails = check(&run);
    report(test, &run, fails);
}

// ---- Fabric and Accelerate ----------------------------------------------------------

/// `script CKPT_DIR`: 6 steps, two saves and a load through the framework's own calls,
/// the loaded state equal to the saved one; checked against its truth.
fn saves_and_loads(test: &str, script: &'static str) {
    let Some(run) = traced(test, script, 1, |dir| {
        args(&[dir.join("ckpt").to_str().unwrap()])
    }) else {
        return;
    };
    let truth = &run.truths[0];
    assert_eq!(intervals(truth, "steps").len(), 6, "the run's own shape");
    assert_eq!(intervals(truth, "saves").len(), 2, "the run's own shape");
    assert_eq!(intervals(truth, "loads").len(), 1, "the run's own shape");
    assert_eq!(
        truth["loaded_equal"].as_bool(),
        Some(true),
        "the load restored"
    );
    let fails = check(&run);
    report(test, &run, fails);
}

#[test]
fn fabric_fit_saves_and_loads() {
    saves_and_loads("fabric_fit_saves_and_loads", "fabric_fit.py");
}

#[test]
fn accelerate_accumulation_save_and_load_state() {
    saves_and_loads(
        "accelerate_accumulation_save_and_load_state",
        "accelerate_train.py",
    );
}
