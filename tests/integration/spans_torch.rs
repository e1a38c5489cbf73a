//! Real PyTorch (PyPI, CPU) running an ordinary training script
//! (`tests/fixtures/torch/train.py`) under lens-probe: the span trees a user would
//! check, and the same run side by side with NeMo Lens' own `managed_span` spans.
use std::{ffi::OsString, path::Path, time::Duration};

use lens_common::ProbeId;
use lens_probe::{
    semconv,
    session::{Session, TraceOptions},
    settings::groups::SpanGroups,
    spans::{SpanBuilder, SpanLog, SpanRecord, SpanStatus, names},
};
use lens_tests::TorchVenv;
use serde_json::Value;

/// `sh -c 'exec python train.py ARGS > STDOUT'`: the shell execs Python in the same
/// process, so it is traced from its first instruction, and Python's stdout (where NeMo
/// Lens' console exporter writes) lands in a file.
fn script(venv: &TorchVenv, args: &[&str], stdout: &Path) -> Vec<OsString> {
    let mut argv: Vec<OsString> = vec![
        "sh".into(),
        "-c".into(),
        format!("exec \"$0\" \"$@\" > '{}'", stdout.display()).into(),
        venv.python.clone().into_os_string(),
        lens_tests::torch_train_script().into_os_string(),
    ];
    argv.extend(args.iter().map(OsString::from));
    argv
}

fn trace(spec: &str, argv: &[OsString], env: &[(&str, &str)]) -> (SpanLog, Session) {
    let mut session = Session::new(TraceOptions {
        span_groups: spec.parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    let mut argv_env: Vec<OsString> = vec!["env".into()];
    argv_env.extend(env.iter().map(|(k, v)| OsString::from(format!("{k}={v}"))));
    argv_env.extend(argv.iter().cloned());
    session.exec(&argv_env).unwrap();
    let mut builder = SpanBuilder::new(spec.parse().unwrap(), SpanLog::default());
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(300)))
        .unwrap();
    let log = builder.into_exporter();
    let job = log.named(names::JOB).next().expect("a job span");
    assert_eq!(job.status, SpanStatus::Unset, "{}", log.outline(&[]));
    (log, session)
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lens-torch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const KEYS: &[&str] = &[
    semconv::DL_ITERATION,
    semconv::DL_MICROBATCH_COUNT,
    semconv::NEMO_CHECKPOINT_FILES,
    semconv::NEMO_SPAN_TRUNCATED,
];

fn steps(range: std::ops::Range<u32>, microbatches: u32) -> String {
    range
        .map(|i| {
            format!(
                "  train.step dl.iteration={i}\n    train.forward_backward \
                 dl.microbatch_count={microbatches}\n    train.optimizer\n"
            )
        })
        .collect()
}

fn assert_nested_in_time(log: &SpanLog) {
    let misnested = log.misnested();
    assert!(
        misnested.is_empty(),
        "children outside their parents: {misnested:#?}"
    );
}

#[test]
fn sgd_with_accumulation_eval_and_checkpoints_gives_the_whole_tree() {
    let test = "sgd_with_accumulation_eval_and_checkpoints";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let Some(venv) = lens_tests::torch_venv(test) else {
        return;
    };
    let dir = temp_dir("sgd");
    let ckpt = dir.to_str().unwrap();
    let args = [
        "--steps",
        "6",
        "--accum",
        "3",
        "--eval-every",
        "3",
        "--ckpt-every",
        "3",
        "--ckpt-dir",
        ckpt,
    ];
    let (log, _) = trace("per_step", &script(&venv, &args, &dir.join("out")), &[]);
    let expected = [
        "train.job\n  train.model_init\n".to_string(),
        steps(0..3, 3),
        "  train.evaluate\n  train.checkpoint nemo.checkpoint.files=1\n".into(),
        steps(3..6, 3),
        "  train.evaluate\n  train.checkpoint nemo.checkpoint.files=1\n".into(),
    ]
    .concat();
    assert_eq!(log.outline(KEYS), expected);
    assert_nested_in_time(&log);
    assert!(dir.join("step6.pt").is_file());
}

#[test]
fn default_groups_give_job_evaluate_and_checkpoint_without_step_probes() {
    let test = "default_groups_without_step_probes";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let Some(venv) = lens_tests::torch_venv(test) else {
        return;
    };
    let dir = temp_dir("default");
    let args = [
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--ckpt-every",
        "4",
        "--ckpt-dir",
        dir.to_str().unwrap(),
    ];
    let (log, session) = trace("default", &script(&venv, &args, &dir.join("out")), &[]);
    assert_eq!(
        log.outline(KEYS),
        "train.job\n  train.evaluate\n  train.evaluate\n  train.checkpoint \
         nemo.checkpoint.files=1\n"
    );
    let attached = session.attacher().attached_by_probe();
    for probe in [
        ProbeId::TorchBackward,
        ProbeId::GlooAllReduce,
        ProbeId::NcclAllReduce,
        ProbeId::CudaLaunchKernel,
    ] {
        assert!(!attached.contains_key(&probe), "{probe:?} attached");
    }
    assert!(attached.contains_key(&ProbeId::TorchScopeEnter));
    assert!(attached.contains_key(&ProbeId::CheckpointWriterOpen));
}

#[test]
fn adam_resumed_from_a_checkpoint_shows_the_load() {
    let test = "adam_resumed_from_a_checkpoint";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let Some(venv) = lens_tests::torch_venv(test) else {
        return;
    };
    let dir = temp_dir("adam");
    let ckpt = dir.to_str().unwrap();
    // A first run (untraced) leaves the checkpoint to resume from.
    let first = std::process::Command::new(&venv.python)
        .arg(lens_tests::torch_train_script())
        .args(["--optimizer", "adam", "--steps", "2", "--eval-every", "0"])
        .args(["--ckpt-every", "2", "--ckpt-dir", ckpt])
        .output()
        .unwrap();
    assert!(first.status.success(), "{first:?}");
    let load = dir.join("step2.pt");
    let args = [
        "--optimizer",
        "adam",
        "--steps",
        "3",
        "--accum",
        "1",
        "--eval-every",
        "0",
        "--ckpt-every",
        "0",
        "--load",
        load.to_str().unwrap(),
    ];
    let (log, _) = trace("per_step", &script(&venv, &args, &dir.join("out")), &[]);
    let expected = [
        "train.job\n  train.model_init\n  train.load_checkpoint nemo.checkpoint.files=1\n"
            .to_string(),
        steps(0..3, 1),
    ]
    .concat();
    assert_eq!(log.outline(KEYS), expected);
    assert_nested_in_time(&log);
}

// ---- Side by side with NeMo Lens ------------------------------------------------------

/// A span as NeMo Lens' console exporter prints it (OpenTelemetry Python's JSON).
#[derive(Debug)]
struct LensSpan {
    name: String,
    span_id: String,
    parent_id: Option<String>,
    start_us: i64,
    end_us: i64,
    iteration: Option<i64>,
}

/// `2026-11-29T20:12:59.459962Z` → µs since the epoch.
fn iso_to_us(text: &str) -> i64 {
    let (date, time) = text.trim_end_matches('Z').split_once('T').unwrap();
    let ymd: Vec<i64> = date.split('-').map(|p| p.parse().unwrap()).collect();
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let hms: Vec<i64> = hms.split(':').map(|p| p.parse().unwrap()).collect();
    let micros: i64 = format!("{frac:0<6}")[..6].parse().unwrap();
    // Days from civil (Howard Hinnant's algorithm).
    let (y, m, d) = (ymd[0] - i64::from(ymd[1] <= 2), ymd[1], ymd[2]);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    ((days * 24 + hms[0]) * 60 + hms[1]) * 60_000_000 + hms[2] * 1_000_000 + micros
}

fn lens_spans(stdout: &Path) -> Vec<LensSpan> {
    let text = std::fs::read_to_string(stdout).unwrap();
    let mut spans: Vec<LensSpan> = serde_json::Deserializer::from_str(&text)
        .into_iter::<Value>()
        .map(|v| {
            let v = v.expect("NeMo Lens console output is JSON");
            LensSpan {
                name: v["name"].as_str().unwrap().to_string(),
                span_id: v["context"]["span_id"].as_str().unwrap().to_string(),
                parent_id: v["parent_id"].as_str().map(str::to_string),
                start_us: iso_to_us(v["start_time"].as_str().unwrap()),
                end_us: iso_to_us(v["end_time"].as_str().unwrap()),
                iteration: v["attributes"][semconv::DL_ITERATION].as_i64(),
            }
        })
        .collect();
    spans.sort_by_key(|s| s.start_us);
    spans
}

fn lens_outline(spans: &[LensSpan]) -> String {
    fn walk(spans: &[LensSpan], span: &LensSpan, depth: usize, out: &mut String) {
        out.push_str(&"  ".repeat(depth));
        out.push_str(&span.name);
        if let Some(i) = span.iteration {
            out.push_str(&format!(" {}={i}", semconv::DL_ITERATION));
        }
        out.push('\n');
        for child in spans
            .iter()
            .filter(|s| s.parent_id.as_deref() == Some(&span.span_id))
        {
            walk(spans, child, depth + 1, out);
        }
    }
    let mut out = String::new();
    for root in spans.iter().filter(|s| s.parent_id.is_none()) {
        walk(spans, root, 0, &mut out);
    }
    out
}

/// Phases whose boundaries both tools place at the same code: compared in duration.
const COMPARED: &[&str] = &[
    names::STEP,
    names::FORWARD_BACKWARD,
    names::OPTIMIZER,
    names::EVALUATE,
    names::CHECKPOINT,
];

#[test]
fn the_same_tree_and_phase_durations_as_nemo_lens() {
    let test = "the_same_tree_and_phase_durations_as_nemo_lens";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let Some(venv) = lens_tests::torch_venv(test) else {
        return;
    };
    let dir = temp_dir("lens");
    let ckpt = dir.to_str().unwrap();
    // A model big enough that every phase is real work (Adam steps and 58 MB checkpoint
    // writes of ~4.8 M parameters), as in a job worth observing: Python-side overheads
    // that a hand-placed span includes and a probe cannot see (state_dict(), torch.save's
    // first-call imports, ~1.5 ms) stay well under 5%.
    let args = [
        "--optimizer",
        "adam",
        "--hidden",
        "65536",
        "--steps",
        "4",
        "--accum",
        "2",
        "--eval-every",
        "2",
        "--ckpt-every",
        "2",
        "--step-sleep",
        "0.04",
        "--ckpt-dir",
        ckpt,
    ];
    let lens_env = [
        ("NEMO_LENS_ENABLED", "1"),
        ("NEMO_LENS_SPAN_GROUPS", "per_step"),
        ("NEMO_LENS_EXPORTER", "console"),
    ];
    // The script with Lens' managed_span calls, under lens-probe: both views of one run.
    let mut with_lens = args.to_vec();
    let run_delays_path = dir.join("run-delays.json");
    with_lens.extend(["--lens", "--run-delays", run_delays_path.to_str().unwrap()]);
    let stdout = dir.join("lens.json");
    let (ours, _) = trace("per_step", &script(&venv, &with_lens, &stdout), &lens_env);
    let lens = lens_spans(&stdout);

    // Same names, same hierarchy, same iterations.
    let ours_outline = ours.outline(&[semconv::DL_ITERATION]);
    assert_eq!(ours_outline, lens_outline(&lens));
    // And the unmodified script gives that tree too.
    let (plain, _) = trace(
        "per_step",
        &script(&venv, &args, &dir.join("plain.out")),
        &[],
    );
    assert_eq!(plain.outline(&[semconv::DL_ITERATION]), ours_outline);

    // Phase durations within 5% of Lens' own, span by span. Where the two spans differ
    // (the code just outside the probed call) a loaded machine can also keep the thread
    // off the CPU: that wait, which the script read from its schedstat around Lens' span,
    // is allowed on top. On an idle machine it is zero.
    let run_delays: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(&run_delays_path).unwrap()).unwrap();
    for name in COMPARED {
        let mine: Vec<&SpanRecord> = ours.named(name).collect();
        let theirs: Vec<&LensSpan> = lens.iter().filter(|s| s.name == *name).collect();
        let waits: Vec<f64> = run_delays
            .iter()
            .filter(|d| d["name"] == *name)
            .map(|d| d["waited_ns"].as_f64().unwrap() / 1e3)
            .collect();
        assert_eq!(mine.len(), theirs.len(), "{name}");
        assert_eq!(waits.len(), theirs.len(), "{name}");
        for (i, ((m, t), waited_us)) in mine.iter().zip(&theirs).zip(&waits).enumerate() {
            let lens_us = (t.end_us - t.start_us) as f64;
            let ours_us = m.duration_ns() as f64 / 1e3;
            let off = (ours_us - lens_us).abs() / lens_us;
            assert!(
                (ours_us - lens_us).abs() <= 0.05 * lens_us + waited_us,
                "{name} #{i}: lens-probe {ours_us:.0} µs, NeMo Lens {lens_us:.0} µs ({:.1}% \
                 off; the thread waited {waited_us:.0} µs for a CPU)",
                off * 100.0
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn torchrun_with_two_gloo_ranks_gives_one_tree_per_rank() {
    let test = "torchrun_with_two_gloo_ranks";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let Some(venv) = lens_tests::torch_venv(test) else {
        return;
    };
    let torchrun = venv.dir.join("bin/torchrun");
    let port = 20_000 + std::process::id() % 20_000;
    let argv: Vec<OsString> = [
        torchrun.to_str().unwrap(),
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port.to_string(),
        lens_tests::torch_train_script().to_str().unwrap(),
        "--distributed",
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--ckpt-every",
        "0",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let (log, _) = trace("per_step", &argv, &[("GLOO_SOCKET_IFNAME", "lo")]);
    // One job per rank; the launcher and its helpers (which never train) give none.
    let jobs: Vec<&SpanRecord> = log.named(names::JOB).collect();
    let mut ranks: Vec<i64> = jobs
        .iter()
        .map(|j| j.int_attr(semconv::DL_RANK).unwrap_or(-1))
        .collect();
    ranks.sort_unstable();
    assert_eq!(
        ranks,
        [0, 1],
        "{}",
        log.outline(&[
            semconv::DL_RANK,
            semconv::PROCESS_PID,
            semconv::NEMO_ATTACHED_MID_RUN
        ])
    );
    for job in jobs {
        assert_eq!(job.int_attr(semconv::DL_WORLD_SIZE), Some(2));
        // Each rank exited cleanly (torchrun reaps them; the kernel's exit tracepoint
        // tells lens-probe): tracing must not disturb a rank.
        assert_eq!(job.int_attr(semconv::PROCESS_EXIT_CODE), Some(0), "{job:?}");
        assert_eq!(job.status, SpanStatus::Unset);
        let phases: Vec<&SpanRecord> = log.children(job);
        let steps: Vec<&&SpanRecord> = phases.iter().filter(|s| s.name == names::STEP).collect();
        assert_eq!(steps.len(), 3);
        for (i, step) in steps.iter().enumerate() {
            assert_eq!(step.int_attr(semconv::DL_ITERATION), Some(i as i64));
            let children = log.children(step);
            let fb = children[0];
            assert_eq!(fb.name, names::FORWARD_BACKWARD);
            assert_eq!(fb.int_attr(semconv::DL_MICROBATCH_COUNT), Some(2));
            // DDP reduces gradients during backward: gloo all_reduce calls inside it.
            let calls = log.children(fb);
            assert!(
                calls.iter().any(|c| c.name == "gloo.all_reduce"),
                "step {i}: {:?}",
                calls.iter().map(|c| c.name).collect::<Vec<_>>()
            );
            assert_eq!(children.last().unwrap().name, names::OPTIMIZER);
        }
    }
    assert_nested_in_time(&log);
}

#[test]
fn attaching_in_the_fifth_step_gives_whole_steps_from_the_next_one() {
    let test = "attaching_in_the_fifth_step";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let Some(venv) = lens_tests::torch_venv(test) else {
        return;
    };
    use std::io::BufRead;
    // The probes are loaded first, so the attach itself is quick.
    let mut session = Session::new(TraceOptions {
        span_groups: "per_step".parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    let mut child = std::process::Command::new(&venv.python)
        .arg(lens_tests::torch_train_script())
        .args(["--steps", "60", "--accum", "2", "--step-sleep", "0.1"])
        .args(["--eval-every", "0", "--ckpt-every", "0", "--print-steps"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    // In the middle of step 4 (the fifth): its forward passes sleep 50 ms each.
    loop {
        let line = lines.next().expect("the script prints its steps").unwrap();
        if line == "step 4" {
            break;
        }
    }
    std::thread::sleep(Duration::from_millis(60));
    let attach_started_ns = lens_probe::spans::monotonic_now_ns();
    session.attach_pid(child.id()).unwrap();
    let drain = std::thread::spawn(move || lines.count());
    let mut builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(120)))
        .unwrap();
    assert!(child.wait().unwrap().success());
    drain.join().unwrap();
    let log = builder.into_exporter();
    // The step running while the probes went in was half-seen: it is skipped. Every
    // reported step began after the attach, is whole, and they count from 0 up to the
    // last of the 60 (a loaded machine may take a few seconds to attach: 5.5 s of steps
    // are left after the fifth).
    let reported: Vec<&SpanRecord> = log.named(names::STEP).collect();
    let n = reported.len() as u32;
    assert!((1..=55).contains(&n), "{n} steps");
    eprintln!("attaching mid-run: {n} whole steps of the last 55 reported");
    assert_eq!(log.outline(KEYS), format!("train.job\n{}", steps(0..n, 2)));
    assert!(reported[0].start_ns >= attach_started_ns);
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(job.attr(semconv::NEMO_ATTACHED_MID_RUN), Some(&true.into()));
    for step in log.named(names::STEP) {
        // Each whole step has both 50 ms forward passes in it.
        assert!(step.duration_ns() >= 100_000_000, "{step:?}");
    }
}
