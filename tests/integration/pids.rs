//! `--pid` as people type it on a node: several pids after one flag (as `$(pgrep python)`
//! gives them), a pid that does not train among them, and the pid of a launcher whose
//! workers already run.
use std::{
    process::{Child, Command, Stdio},
    time::Duration,
};

use lens_probe::{
    semconv,
    session::{Session, TraceOptions},
    spans::{SpanBuilder, SpanLog, names},
};
use lens_tests::stderr_text;

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

/// The fake trainer, `steps` steps 100 ms apart (its libraries are mapped from start).
fn trainer(steps: u32) -> Child {
    Command::new(lens_tests::trainer())
        .arg(steps.to_string())
        .env("TRAINER_STEP_DELAY_MS", "100")
        .env("LENS_FAKE_SYNC_MS", "0")
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn several_pids_after_one_flag_trace_the_trainers_and_skip_an_idle_process() {
    if !lens_tests::require_bpf("several_pids_after_one_flag") {
        return;
    }
    let mut first = trainer(40);
    let mut second = trainer(40);
    // A python that does not train (a notebook kernel, a monitoring agent).
    let mut idle = Command::new("sleep").arg("60").spawn().unwrap();
    let json = std::env::temp_dir().join(format!("lens-pids-{}.json", std::process::id()));
    let pids = [first.id(), idle.id(), second.id()].map(|p| p.to_string());
    let output = Command::new(LENS_PROBE)
        .args(["--span-groups", "per_step", "--summary-json"])
        .arg(&json)
        .args(["--duration", "20s", "--pid"])
        .args(&pids)
        .output()
        .unwrap();
    let err = stderr_text(&output);
    idle.kill().unwrap();
    idle.wait().unwrap();
    assert!(first.wait().unwrap().success());
    assert!(second.wait().unwrap().success());
    assert_eq!(output.status.code(), Some(0), "{err}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("skipped")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0].contains(&format!("process {} (sleep)", idle.id())),
        "{err}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    let traced: Vec<u64> = summary["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["calls"]["ncclAllReduce"].as_u64() > Some(0))
        .map(|p| p["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(traced.len(), 2, "{summary}");
    assert!(traced.contains(&first.id().into()) && traced.contains(&second.id().into()));
}

#[test]
fn only_pids_that_do_not_train_are_an_error() {
    if !lens_tests::require_bpf("only_pids_that_do_not_train") {
        return;
    }
    let mut idle = Command::new("sleep").arg("60").spawn().unwrap();
    let pid = idle.id().to_string();
    let output = Command::new(LENS_PROBE)
        .args(["--pid", &pid, &pid])
        .output()
        .unwrap();
    idle.kill().unwrap();
    idle.wait().unwrap();
    let err = stderr_text(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("maps none of"), "{err}");
}

#[test]
fn a_launchers_running_workers_are_traced_with_their_ranks() {
    if !lens_tests::require_bpf("a_launchers_running_workers") {
        return;
    }
    // A launcher (a shell, as torchrun's agent or mpirun would be) whose two workers
    // already run when lens-probe is pointed at it.
    let trainer = lens_tests::trainer();
    let script = format!(
        "RANK=0 WORLD_SIZE=2 '{t}' 30 & RANK=1 WORLD_SIZE=2 '{t}' 30 & wait",
        t = trainer.display()
    );
    let mut launcher = Command::new("sh")
        .args(["-c", &script])
        .env("TRAINER_STEP_DELAY_MS", "100")
        .env("LENS_FAKE_SYNC_MS", "0")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Both workers started (the shell forks them at once).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while lens_probe::target::descendants(launcher.id()).len() < 2 {
        assert!(std::time::Instant::now() < deadline, "no workers");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut session = Session::new(TraceOptions {
        span_groups: "per_step".parse().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
    })
    .unwrap();
    session.attach_pid(launcher.id()).unwrap();
    let mut builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(60)))
        .unwrap();
    assert!(launcher.wait().unwrap().success());
    let log = builder.into_exporter();
    let mut ranks: Vec<i64> = log
        .named(names::JOB)
        .map(|job| job.int_attr(semconv::DL_RANK).unwrap_or(-1))
        .collect();
    ranks.sort_unstable();
    // The launcher itself never trains: no job of its own.
    assert_eq!(ranks, [0, 1], "{}", log.outline(&[semconv::DL_RANK]));
    for job in log.named(names::JOB) {
        assert_eq!(job.attr(semconv::NEMO_ATTACHED_MID_RUN), Some(&true.into()));
        assert!(!log.children(job).is_empty(), "{}", log.outline(&[]));
    }
}
