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

/// The pids whose `ncclAllReduce` calls the `--summary-json` at `json` counts (the file
/// is removed).
fn pids_that_all_reduced(json: &std::path::Path) -> Vec<u64> {
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let _ = std::fs::remove_file(json);
    summary["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["calls"]["ncclAllReduce"].as_u64() > Some(0))
        .map(|p| p["pid"].as_u64().unwrap())
        .collect()
}

#[test]
fn several_pids_after_one_flag_trace_the_trainers_and_skip_an_idle_process() {
    if !lens_tests::require_bpf("several_pids_after_one_flag") {
        return;
    }
    let mut first = trainer(40);
    let mut second = trainer(40);
    // A python that does not train (a notebook kernel, a monitoring agent).
    let mut idle = Command::new("python3")
        .args(["-c", "import time; time.sleep(60)"])
        .spawn()
        .unwrap();
    // Past pyenv's shim, if python3 is one: the interpreter itself.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(format!("/proc/{}/comm", idle.id()))
        .is_ok_and(|comm| comm.starts_with("python"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "python3 never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
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
        warnings[0].contains(&format!("process {} (python", idle.id())),
        "{err}"
    );
    let traced = pids_that_all_reduced(&json);
    assert_eq!(traced.len(), 2, "{traced:?}");
    assert!(traced.contains(&first.id().into()) && traced.contains(&second.id().into()));
}

#[test]
fn a_pid_gone_since_pgrep_is_skipped_and_the_others_traced() {
    if !lens_tests::require_bpf("a_pid_gone_since_pgrep") {
        return;
    }
    let mut alive = trainer(20);
    // A rank that ended between `pgrep` and lens-probe's start: its pid, reaped.
    let mut ended = Command::new("true").spawn().unwrap();
    let gone = ended.id();
    ended.wait().unwrap();
    let json = std::env::temp_dir().join(format!("lens-pid-gone-{}.json", std::process::id()));
    let output = Command::new(LENS_PROBE)
        .args(["--span-groups", "per_step", "--summary-json"])
        .arg(&json)
        .args(["--duration", "20s", "--pid"])
        .args([alive.id().to_string(), gone.to_string()])
        .output()
        .unwrap();
    let err = stderr_text(&output);
    assert!(alive.wait().unwrap().success());
    assert_eq!(output.status.code(), Some(0), "{err}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("skipped")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(warnings[0].contains(&format!("pid {gone}")), "{err}");
    assert_eq!(pids_that_all_reduced(&json), [u64::from(alive.id())]);
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
    while lens_probe::sys::target::descendants(launcher.id()).len() < 2 {
        assert!(std::time::Instant::now() < deadline, "no workers");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut session = Session::new(TraceOptions {
        span_groups: "per_step".parse().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
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

#[test]
fn a_running_torchrun_launchers_workers_are_traced_with_their_ranks() {
    let name = "a_running_torchrun_launchers_workers";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let Some(venv) = lens_tests::torch_venv(name) else {
        return;
    };
    let scratch = |what: &str| {
        std::env::temp_dir().join(format!("lens-pids-torchrun-{}.{what}", std::process::id()))
    };
    let (log, stop, export) = (scratch("log"), scratch("stop"), scratch("jsonl"));
    let _ = std::fs::remove_file(&stop);
    // A real torchrun with two DDP workers over gloo, mid-run (both past their third
    // step) when lens-probe is pointed at the launcher's pid. They train until the test
    // names the step both end before, once lens-probe has exported 20 steps of each.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut torchrun = Command::new(venv.dir.join("bin/torchrun"))
        .args(["--nproc-per-node", "2", "--master-addr", "127.0.0.1"])
        .arg(format!("--master-port={port}"))
        .arg(lens_tests::torch_train_script())
        .args(["--distributed", "--steps", "5000", "--step-sleep", "0.02"])
        .args(["--batch", "4", "--accum", "1", "--print-steps"])
        .args(["--eval-every", "100000", "--ckpt-every", "100000"])
        .arg("--stop-file")
        .arg(&stop)
        .env("GLOO_SOCKET_IFNAME", "lo")
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let stdout = torchrun.stdout.take().unwrap();
    let latest_step = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let latest = std::sync::Arc::clone(&latest_step);
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut past_third = 0;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            // Both workers write to one pipe: lines can run together ("step 3step 3").
            for step in line
                .split("step ")
                .filter_map(|n| n.trim().parse::<u64>().ok())
            {
                latest.fetch_max(step, std::sync::atomic::Ordering::Relaxed);
                if step == 3 {
                    past_third += 1;
                    if past_third == 2 {
                        let _ = tx.send(());
                    }
                }
            }
        }
    });
    let fail = |torchrun: &mut std::process::Child, what: &str| -> ! {
        let _ = torchrun.kill();
        panic!(
            "{what}:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    };
    if rx.recv_timeout(Duration::from_secs(120)).is_err() {
        fail(
            &mut torchrun,
            "torchrun's workers never reached their third step",
        );
    }
    let probe = Command::new(LENS_PROBE)
        .args([
            "--span-groups",
            "per_step",
            "--export-strategy",
            "all_ranks",
        ])
        .args(["--exporter", "file", "--export-file"])
        .arg(&export)
        .args(["--pid", &torchrun.id().to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rank = |resource: &std::collections::BTreeMap<String, serde_json::Value>| {
        // OTLP JSON writes an int as a string: {"intValue": "1"}.
        resource
            .get(semconv::DL_RANK)
            .and_then(|v| v["intValue"].as_str()?.parse().ok())
            .unwrap_or(-1)
    };
    let steps_of = |spans: &[lens_tests::FileSpan], worker: i64| {
        spans
            .iter()
            .filter(|(resource, span)| rank(resource) == worker && span["name"] == names::STEP)
            .count()
    };
    // The exported file grows a batch at a time (each line whole once written).
    let exported = || {
        let text = std::fs::read_to_string(&export).unwrap_or_default();
        let whole = text.rfind('\n').map_or("", |end| &text[..=end]);
        let path = scratch("jsonl.whole");
        std::fs::write(&path, whole).unwrap();
        let spans = lens_tests::otlp_file_spans(&path);
        let _ = std::fs::remove_file(&path);
        spans
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let spans = exported();
        if steps_of(&spans, 0) >= 20 && steps_of(&spans, 1) >= 20 {
            break;
        }
        if std::time::Instant::now() > deadline {
            fail(
                &mut torchrun,
                "lens-probe exported fewer than 20 steps of each rank",
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // Both ranks end before the same step, well ahead of either.
    let last = latest_step.load(std::sync::atomic::Ordering::Relaxed) + 25;
    let partial = scratch("stop.partial");
    std::fs::write(&partial, last.to_string()).unwrap();
    std::fs::rename(&partial, &stop).unwrap();
    let output = probe.wait_with_output().unwrap();
    let err = stderr_text(&output);
    assert!(torchrun.wait().unwrap().success());
    assert_eq!(output.status.code(), Some(0), "{err}");
    let spans = lens_tests::otlp_file_spans(&export);
    for path in [&log, &stop, &export] {
        let _ = std::fs::remove_file(path);
    }
    let mut job_ranks: Vec<i64> = spans
        .iter()
        .filter(|(_, span)| span["name"] == names::JOB)
        .map(|(resource, _)| rank(resource))
        .collect();
    job_ranks.sort_unstable();
    // The launcher (torchrun's agent) never trains: no job of its own.
    assert_eq!(job_ranks, [0, 1], "{err}");
    for job in spans.iter().filter(|(_, span)| span["name"] == names::JOB) {
        let attached_mid_run = job.1["attributes"].as_array().unwrap().iter().any(|kv| {
            kv["key"] == semconv::NEMO_ATTACHED_MID_RUN && kv["value"]["boolValue"] == true
        });
        assert!(attached_mid_run, "{:?}", job.1);
    }
}
