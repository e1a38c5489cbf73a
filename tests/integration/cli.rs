//! The lens-probe binary as a user runs it: the demo summary, exit codes, and one clear
//! line for each kind of bad input.
use std::process::{Command, Output};

use lens_tests::{assert_one_line_error, stderr_text as stderr};

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

fn lens_probe(args: &[&str]) -> Output {
    Command::new(LENS_PROBE).args(args).output().unwrap()
}

#[test]
fn demo_prints_a_correct_summary_and_exits_with_the_commands_code() {
    if !lens_tests::require_bpf("demo_prints_a_correct_summary") {
        return;
    }
    let json_path = std::env::temp_dir().join(format!("lens-summary-{}.json", std::process::id()));
    let slept_path = std::env::temp_dir().join(format!("lens-slept-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&slept_path);
    let trainer = lens_tests::trainer();
    let output = Command::new(LENS_PROBE)
        .env("LENS_FAKE_SYNC_LOG", &slept_path)
        .args(["--span-groups", "per_step", "--summary-json"])
        .arg(&json_path)
        .args(["--exec", "--"])
        .arg(&trainer)
        .arg("4")
        .output()
        .unwrap();
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("trainer: 4 steps done"),
        "the command's own output passes through"
    );
    assert!(text.contains("lens-probe summary: pid"), "{text}");
    assert!(text.contains("(trainer), exited 0"), "{text}");
    assert!(text.contains("communicator 0xc0ffee00: rank 1/4"), "{text}");
    assert!(
        text.contains("launches: cudaLaunchKernel 40, cudaLaunchKernelExC 4, cudaGraphLaunch 4"),
        "{text}"
    );
    assert!(text.contains("no events lost"), "{text}");
    assert!(text.contains("lens-probe: its own CPU "), "{text}");

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json_path);
    // Its own CPU: loading and attaching alone take some, and two CPUs at most.
    let cpu = &json["lens_probe_cpu"];
    let (user, system, wall) = (
        cpu["user_s"].as_f64().unwrap(),
        cpu["system_s"].as_f64().unwrap(),
        cpu["wall_s"].as_f64().unwrap(),
    );
    assert!(user + system > 0.0 && wall > 0.0, "{cpu}");
    assert!(user + system <= wall * 2.0 + 0.1, "{cpu}");
    let process = &json["processes"][0];
    assert_eq!(process["exit"]["exited"], 0);
    // AllReduce counts 1024·(step+1) float32 over 4 steps: 4·1024·(1+2+3+4) bytes.
    assert_eq!(process["collectives"]["all_reduce"]["calls"], 4);
    assert_eq!(process["collectives"]["all_reduce"]["bytes"], 4 * 1024 * 10);
    assert_eq!(process["collectives"]["broadcast"]["bytes"], 4 * 4096 * 2);
    assert_eq!(process["collectives"]["send"]["bytes"], 4 * 64);
    assert_eq!(process["sync_waits"]["stream"]["calls"], 4);
    // Each wait lies between what the library really slept (its own log) and the caller's
    // clock around the call (the trainer's), so the median lies between the medians of
    // those: exact bounds on any load, not the nominal 20 ms a loaded machine oversleeps.
    let sync_log = std::fs::read_to_string(&slept_path).unwrap();
    let _ = std::fs::remove_file(&slept_path);
    let sorted_ns = |prefix: &str| -> Vec<u64> {
        let mut ns: Vec<u64> = sync_log
            .lines()
            .filter_map(|line| line.strip_prefix(prefix))
            .map(|ns| ns.parse().unwrap())
            .collect();
        ns.sort_unstable();
        ns
    };
    let slept = sorted_ns("stream ");
    let bracket = sorted_ns("stream-call ");
    assert_eq!(slept.len(), 4, "{sync_log}");
    assert_eq!(bracket.len(), 4, "{sync_log}");
    let p50 = process["sync_waits"]["stream"]["p50_ns"].as_u64().unwrap();
    // The summary's histogram keeps 3 significant digits: a quantile may round up by 0.1%.
    let histogram_rounding = bracket[2] / 1000;
    assert!(
        slept[1] <= p50 && p50 <= bracket[2] + histogram_rounding,
        "stream sync p50 {p50} ns, the library slept {slept:?} ns, the caller saw {bracket:?} ns"
    );
    assert_eq!(process["calls"]["ncclGroupStart"], 4);
    assert_eq!(json["losses"]["kernel"]["ring_buffer_full"], 0);
    // What the probes cost the trainer, estimated: each counted call at least an entry
    // hit and at most an entry and a return hit, plus an entry hit at the driver for each
    // runtime launch (the runtime launches through it), within the time it was traced.
    let cost = &process["probe_cost"];
    let field = |key: &str| {
        cost[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key}: {cost}"))
    };
    let calls: u64 = process["calls"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    let runtime_launches: u64 = ["cudaLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch"]
        .iter()
        .map(|name| process["calls"][*name].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(runtime_launches, 48, "{}", process["calls"]);
    let (entry, ret) = (field("entry_hit_ns"), field("return_hit_ns"));
    assert!(entry > 0, "{cost}");
    let estimated = field("estimated_ns");
    assert!(
        calls * entry <= estimated && estimated <= (calls + runtime_launches) * entry + calls * ret,
        "{calls} calls, {runtime_launches} of them runtime launches: {cost}"
    );
    assert!(estimated < field("traced_ns"), "{cost}");
    assert!(text.contains("  probe cost: an estimated "), "{text}");
}

#[test]
fn exec_passes_the_commands_exit_code_through() {
    if !lens_tests::require_bpf("exec_passes_the_commands_exit_code_through") {
        return;
    }
    let output = lens_probe(&["--exec", "--", "sh", "-c", "exit 3"]);
    assert_eq!(output.status.code(), Some(3), "{}", stderr(&output));
    let output = lens_probe(&["--exec", "--", "sh", "-c", "kill -TERM $$"]);
    assert_eq!(output.status.code(), Some(128 + 15), "{}", stderr(&output));
}

#[test]
fn exit_codes_of_processes_it_did_not_start_are_reported() {
    if !lens_tests::require_bpf("exit_codes_of_processes_it_did_not_start_are_reported") {
        return;
    }
    // Two grandchildren of lens-probe (their parent, the shell, reaps them), both
    // training: one exits 7, one is killed by SIGKILL. Only the kernel's exit tracepoint
    // sees how. The shells never train: they get no summary block.
    let trainer = lens_tests::trainer();
    let script = format!(
        "TRAINER_EXIT_CODE=7 '{t}' 1; TRAINER_KILL_SELF=1 '{t}' 1; exit 0",
        t = trainer.display()
    );
    let output = lens_probe(&["--exec", "--", "sh", "-c", &script]);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(0), "{err}");
    assert!(err.contains("(trainer), exited 7\n"), "{err}");
    assert!(err.contains("(trainer), killed by signal 9\n"), "{err}");
    assert!(!err.contains("(sh), exited"), "{err}");
    assert!(
        err.contains("lens-probe: 1 traced process without training activity"),
        "{err}"
    );
}

#[test]
fn a_missing_pid_is_one_line() {
    if !lens_tests::require_bpf("a_missing_pid_is_one_line") {
        return;
    }
    assert_one_line_error(
        &lens_probe(&["--pid", "999999"]),
        1,
        "no process with pid 999999",
    );
}

#[test]
fn a_process_without_the_libraries_is_one_line() {
    if !lens_tests::require_bpf("a_process_without_the_libraries_is_one_line") {
        return;
    }
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let output = lens_probe(&["--pid", &sleeper.id().to_string()]);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert_one_line_error(&output, 1, "maps none of libcudart.so, libnccl.so");
}

#[test]
fn a_command_that_cannot_run_is_one_line() {
    if !lens_tests::require_bpf("a_command_that_cannot_run_is_one_line") {
        return;
    }
    assert_one_line_error(
        &lens_probe(&["--exec", "--", "/nonexistent/train.py"]),
        1,
        "cannot run /nonexistent/train.py",
    );
}

#[test]
fn without_privileges_it_names_the_missing_capabilities() {
    // Run as nobody with no capabilities; needs root to switch user.
    if !lens_tests::require_bpf("without_privileges_it_names_the_missing_capabilities") {
        return;
    }
    let output = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(LENS_PROBE)
        .args(["--pid", "1"])
        .output()
        .unwrap();
    assert_one_line_error(
        &output,
        1,
        "needs root, or the capabilities CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN",
    );
}

#[test]
fn unknown_flags_and_bad_values_are_one_line_exit_2() {
    assert_one_line_error(&lens_probe(&["--frobnicate"]), 2, "--frobnicate");
    assert_one_line_error(&lens_probe(&["--pid", "abc"]), 2, "abc");
    assert_one_line_error(&lens_probe(&[]), 2, "required");
    assert_one_line_error(
        &lens_probe(&["--pid", "1", "--span-groups", "default,steps"]),
        2,
        "unknown span group \"steps\"; valid: all, checkpoint, default",
    );
    assert_one_line_error(&lens_probe(&["--pid", "1", "--exporter", "foo"]), 2, "foo");
    assert_one_line_error(
        &lens_probe(&["--pid", "1", "--duration", "soon"]),
        2,
        "soon",
    );
    assert_one_line_error(
        &lens_probe(&["--pid", "1", "--overhead-budget", "150%"]),
        2,
        "invalid overhead budget '150%': a percentage of wall time above 0 and at most 100",
    );
    let output = Command::new(LENS_PROBE)
        .args(["--pid", "1"])
        .env("LENS_PROBE_OVERHEAD_BUDGET", "lots")
        .output()
        .unwrap();
    assert_one_line_error(&output, 2, "invalid overhead budget 'lots'");
    let output = Command::new(LENS_PROBE)
        .args(["--pid", "1"])
        .env("NEMO_LENS_SPAN_GROUPS", "bogus")
        .output()
        .unwrap();
    assert_one_line_error(&output, 2, "unknown span group \"bogus\"");
}

#[test]
fn the_console_shows_each_processs_span_tree() {
    if !lens_tests::require_bpf("the_console_shows_each_processs_span_tree") {
        return;
    }
    let output = Command::new(LENS_PROBE)
        .args(["--span-groups", "per_step", "--exec", "--"])
        .arg(lens_tests::torch_trainer())
        .args(["2", "1", "2", "0"])
        // 2 kernel launches in each forward pass and each optimizer step.
        .env("TRAINER_LAUNCHES", "2")
        .output()
        .unwrap();
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(0), "{text}");
    let pid = text
        .lines()
        .find_map(|l| l.strip_prefix("lens-probe: [pid ")?.split(']').next())
        .unwrap_or_else(|| panic!("no job header in {text}"));
    // The tree: one line per span, indented by depth, in start order, with its offset
    // from the job's start, its duration and what a person reads of its attributes
    // (short names; everything with -v).
    let tree: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("  [pid {pid}] ")))
        .map(|l| {
            // `{offset:>10}  {indented name:<40} {duration:>10}  attributes`
            let (offset, rest) = l.split_at(10);
            assert!(
                offset.trim_start().starts_with('+') && offset.ends_with('s'),
                "{l}"
            );
            let (label, tail) = rest[2..].split_at(40);
            let attributes = tail.split_whitespace().skip(2);
            std::iter::once(label.trim_end())
                .chain(attributes)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    assert_eq!(
        tree,
        [
            "train.model_init launches=0",
            "train.step iter=0 launches=4",
            "  train.forward_backward microbatches=1 launches=2",
            "  train.optimizer launches=2",
            "train.step iter=1 launches=4",
            "  train.forward_backward microbatches=1 launches=2",
            "  train.optimizer launches=2",
            "train.evaluate launches=0",
        ],
        "{text}"
    );
    let job_line = format!("lens-probe: [pid {pid}] train.job ");
    let job = text.lines().find(|l| l.starts_with(&job_line)).unwrap();
    assert!(job.ends_with("launches=8  exit=0"), "{job}");
}

#[test]
fn a_multi_threaded_target_is_not_stopped_when_it_loads_a_library() {
    if !lens_tests::require_bpf("a_multi_threaded_target_is_not_stopped") {
        return;
    }
    // Stopping and continuing the process would make the other thread's epoll_wait fail
    // with EINTR (exit 3); its library is still probed while it runs on: once lens-probe
    // says it traces the library, the fixture is let go and its 10 launches are counted
    // (however long the attach took on a busy kernel).
    let library = lens_tests::fake_lib_dir().join("libcudart.so.12");
    let go = std::env::temp_dir().join(format!("lens-threads-dlopen-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let mut child = Command::new(LENS_PROBE)
        .args(["--span-groups", "per_step", "--exec", "--"])
        .arg(lens_tests::threads_dlopen())
        .arg(&library)
        .env("THREADS_DLOPEN_GO", &go)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr_pipe = child.stderr.take().unwrap();
    let go_file = go.clone();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut text = String::new();
        for line in std::io::BufReader::new(stderr_pipe)
            .lines()
            .map_while(Result::ok)
        {
            if line.starts_with("lens-probe: tracing 1 process: 1 library") {
                std::fs::write(&go_file, b"").unwrap();
            }
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let output = child.wait_with_output().unwrap();
    let err = reader.join().unwrap();
    let _ = std::fs::remove_file(&go);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}{err}",
        String::from_utf8_lossy(&output.stdout)
    );
    let launches: u32 = err
        .lines()
        .find_map(|l| l.trim().strip_prefix("launches: cudaLaunchKernel "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no launches counted: {err}"));
    assert_eq!(launches, 10, "{err}");
}

#[test]
fn a_summary_that_cannot_be_written_names_the_flag_and_the_path() {
    if !lens_tests::require_bpf("a_summary_that_cannot_be_written_names_the_flag") {
        return;
    }
    // /dev/full opens, and every write to it fails: the trace is done by then, so the
    // command's exit code still goes through, and the error says what and where.
    let output = lens_probe(&[
        "--summary-json",
        "/dev/full",
        "--exec",
        "--",
        "sh",
        "-c",
        "exit 3",
    ]);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(3), "{err}");
    assert!(
        err.contains("lens-probe: --summary-json /dev/full: No space left on device"),
        "{err}"
    );
}

#[test]
fn a_password_in_the_endpoint_is_never_printed_when_export_fails() {
    if !lens_tests::require_bpf("a_password_in_the_endpoint_is_never_printed") {
        return;
    }
    // Nothing listens on port 9 (discard) here: every export fails, and says so.
    let json_path =
        std::env::temp_dir().join(format!("lens-export-lost-{}.json", std::process::id()));
    let output = Command::new(LENS_PROBE)
        .args(["--span-groups", "per_step", "--summary-json"])
        .arg(&json_path)
        .args(["--exec", "--"])
        .arg(lens_tests::trainer())
        .arg("2")
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://user:hunter2@127.0.0.1:9",
        )
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .env("OTEL_EXPORTER_OTLP_TIMEOUT", "2000")
        .output()
        .unwrap();
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(0), "{err}");
    assert!(err.contains("export failed"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    // Every loss stderr reports is in the JSON too.
    let lost: u64 = err
        .lines()
        .find_map(|l| l.split("; ").nth(1)?.split(" lost").next()?.parse().ok())
        .unwrap_or_else(|| panic!("no loss line in {err}"));
    assert!(lost > 0, "{err}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json_path);
    assert_eq!(json["export"]["spans_lost"].as_u64(), Some(lost), "{json}");
    assert_eq!(
        json["export"]["spans_export_failed"].as_u64(),
        Some(lost),
        "{json}"
    );
}

#[test]
fn under_default_groups_the_summary_says_what_was_not_probed() {
    if !lens_tests::require_bpf("under_default_groups_the_summary_says") {
        return;
    }
    let output = Command::new(LENS_PROBE)
        .args(["--exec", "--"])
        .arg(lens_tests::trainer())
        .arg("2")
        .output()
        .unwrap();
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(0), "{err}");
    for what in ["collectives", "launches", "sync waits"] {
        assert!(
            err.contains(&format!("  {what}: not probed under these span groups")),
            "{err}"
        );
    }
    assert!(err.contains("--span-groups per_step"), "{err}");
    assert!(!err.contains("none seen"), "{err}");
}

#[test]
fn one_line_says_what_is_traced_while_the_job_starts() {
    if !lens_tests::require_bpf("one_line_says_what_is_traced_while_the_job_starts") {
        return;
    }
    let output = Command::new(LENS_PROBE)
        .args(["--span-groups", "per_step", "--exec", "--"])
        .arg(lens_tests::torch_trainer())
        .args(["2", "1", "2", "0"])
        .output()
        .unwrap();
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(0), "{text}");
    // The fake trainer's five libraries (runtime, NCCL, libtorch_cpu, libtorch_python,
    // libc10) load at once, before its first call: one line, not one per library, and
    // not the dynamic loader lens-probe follows loads with.
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("lens-probe: tracing "))
        .collect();
    assert_eq!(lines.len(), 1, "{text}");
    let (uprobes, links): (usize, usize) = lines[0]
        .strip_prefix("lens-probe: tracing 1 process: 5 libraries, ")
        .and_then(|rest| rest.strip_suffix(" links"))
        .and_then(|rest| rest.split_once(" uprobes in "))
        .and_then(|(u, l)| Some((u.parse().ok()?, l.parse().ok()?)))
        .unwrap_or_else(|| panic!("{}", lines[0]));
    assert!(uprobes >= 10, "{}", lines[0]);
    assert!(
        links < uprobes,
        "uprobe_multi links on this kernel: {}",
        lines[0]
    );
}

/// What the kernel holds of a process's BPF links on libraries of `dir`, from its fdinfo:
/// (uprobe_multi links, the uprobes in them, perf uprobe links anywhere).
fn kernel_links_of(pid: u32, dir: &std::path::Path) -> (usize, usize, usize) {
    let (mut multi, mut in_multi, mut perf) = (0, 0, 0);
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        if !std::fs::read_link(fd.path())
            .is_ok_and(|l| l.to_string_lossy() == "anon_inode:bpf_link")
        {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            fd.file_name().to_string_lossy()
        ))
        .unwrap_or_default();
        let field = |name: &str| {
            info.lines()
                .find_map(|l| {
                    l.strip_prefix(name)
                        .map(|v| v.trim_start_matches(':').trim().to_string())
                })
                .unwrap_or_default()
        };
        match field("link_type").as_str() {
            "uprobe_multi" | "uretprobe_multi"
                if field("path").starts_with(&*dir.to_string_lossy()) =>
            {
                multi += 1;
                in_multi += field("uprobe_cnt").parse::<usize>().unwrap();
            }
            "perf" if matches!(field("event_type").as_str(), "uprobe" | "uretprobe") => perf += 1,
            _ => {}
        }
    }
    (multi, in_multi, perf)
}

#[test]
fn a_librarys_probes_go_in_as_one_link_per_program_or_as_perf_links_when_asked() {
    let test = "a_librarys_probes_go_in_as_one_link_per_program";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let fixtures = lens_tests::trainer().parent().unwrap().to_path_buf();
    let mut summaries = Vec::new();
    for links in ["auto", "perf"] {
        let dir = std::env::temp_dir().join(format!("lens-links-{links}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let gate = dir.join("go");
        let summary = dir.join("summary.json");
        // The trainer waits at the gate, its libraries loaded, until the links are read.
        let mut probe = Command::new(LENS_PROBE)
            .args([
                "--uprobe-links",
                links,
                "--span-groups",
                "per_step",
                "--summary-json",
            ])
            .arg(&summary)
            .args(["--exec", "--"])
            .arg("env")
            .arg(format!("TRAINER_START_GATE={}", gate.display()))
            .arg(lens_tests::trainer())
            .arg("3")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(probe.stderr.take().unwrap()));
        let status_line = lines
            .by_ref()
            .map_while(Result::ok)
            .find(|l| l.starts_with("lens-probe: tracing "))
            .expect("a line saying what is traced");
        // "lens-probe: tracing 1 process: 2 libraries, U uprobes in L links"
        let numbers: Vec<usize> = status_line
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse().ok())
            .collect();
        let [1, 2, uprobes, said_links] = numbers[..] else {
            panic!("{status_line}");
        };
        let (multi, in_multi, perf) = kernel_links_of(probe.id(), &fixtures);
        std::fs::write(&gate, "").unwrap();
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let status = probe.wait().unwrap();
        assert!(status.success(), "{links}: {status:?}\n{}", rest.join("\n"));
        if links == "auto" {
            // One link per program and library: the kernel removes each in one step.
            assert_eq!(
                (multi, in_multi),
                (said_links, uprobes),
                "{links}: {status_line}"
            );
            assert!(said_links * 2 < uprobes, "{status_line}");
        } else {
            assert_eq!(multi, 0, "{status_line}");
            assert_eq!(said_links, uprobes, "{status_line}");
            // Besides the libraries' probes: libc's file probe, the dynamic loader's.
            assert!(perf >= uprobes, "{perf} perf uprobe links: {status_line}");
        }
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
        summaries.push((uprobes, json["processes"][0].clone()));
        let _ = std::fs::remove_dir_all(&dir);
    }
    // Either way the same probes, and the same calls counted.
    assert_eq!(summaries[0].0, summaries[1].0);
    assert_eq!(summaries[0].1["calls"], summaries[1].1["calls"]);
    assert_eq!(summaries[0].1["launches"], summaries[1].1["launches"]);
    let collectives = &summaries[0].1["collectives"];
    assert_eq!(collectives.as_object().unwrap().len(), 7, "{collectives}");
    for (op, stats) in collectives.as_object().unwrap() {
        for key in ["calls", "bytes", "errors"] {
            assert_eq!(
                stats[key], summaries[1].1["collectives"][op][key],
                "{op} {key}"
            );
        }
    }
    assert_eq!(summaries[0].1["calls"]["ncclGroupStart"], 3);
}

#[test]
fn a_reader_that_stops_reading_does_not_stop_lens_probe() {
    // `lens-probe … 2>&1 | head -2`: the pipe closes after two lines, while the job runs.
    if !lens_tests::require_bpf("a_reader_that_stops_reading_does_not_stop_lens_probe") {
        return;
    }
    use std::io::BufRead;
    let summary =
        std::env::temp_dir().join(format!("lens-closed-pipe-{}.json", std::process::id()));
    let mut probe = lens_tests::lens_probe_command(LENS_PROBE)
        .env("LENS_FAKE_SYNC_MS", "0")
        .args(["--span-groups", "per_step", "--summary-json"])
        .arg(&summary)
        .args(["--exec", "--"])
        .arg(lens_tests::torch_trainer())
        .args(["20", "1", "2", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(probe.stderr.take().unwrap());
    let mut line = String::new();
    for _ in 0..2 {
        line.clear();
        err.read_line(&mut line).unwrap();
    }
    drop(err);
    drop(probe.stdout.take());
    let status = probe.wait().unwrap();
    // It went on: the job's exit code, and its summary written in full.
    assert_eq!(status.code(), Some(0), "{status:?}");
    let text = std::fs::read_to_string(&summary).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    // Every one of the 20 backwards, most of them after the reader had gone.
    let backwards: Vec<u64> = json["processes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["calls"].as_object().cloned().unwrap_or_default())
        .filter(|(name, _)| name.contains("Engine7execute"))
        .filter_map(|(_, count)| count.as_u64())
        .collect();
    assert_eq!(backwards, [20], "{text}");
    let _ = std::fs::remove_file(&summary);
}

#[test]
fn a_command_slow_to_stop_is_waited_for_and_its_exit_code_returned() {
    if !lens_tests::require_bpf("a_command_slow_to_stop_is_waited_for") {
        return;
    }
    use std::io::BufRead;
    // A job that takes 3 s to shut down on SIGTERM, then exits 3: longer than the grace.
    let mut probe = lens_tests::lens_probe_command(LENS_PROBE)
        .args(["--stop-grace", "1s", "--exec", "--", "sh", "-c"])
        .arg("trap 'sleep 3; exit 3' TERM; echo trapped >&2; while :; do sleep 0.1; done")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(probe.stderr.take().unwrap());
    let mut text = String::new();
    // The command runs, traced, with its trap set.
    while !text.contains("trapped") {
        assert_ne!(err.read_line(&mut text).unwrap(), 0, "{text}");
    }
    // SAFETY: our own child.
    unsafe { libc::kill(probe.id() as i32, libc::SIGTERM) };
    std::io::Read::read_to_string(&mut err, &mut text).unwrap();
    let status = probe.wait().unwrap();
    // Waited for, not orphaned: its own exit code (before: 143 after 5 s, the job left
    // running).
    assert_eq!(status.code(), Some(3), "{text}");
    assert!(text.contains("waiting for it"), "{text}");
}

#[test]
fn a_run_that_fails_at_start_leaves_earlier_outputs_as_they_were() {
    let dir = std::env::temp_dir().join(format!("lens-outputs-kept-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let summary = dir.join("summary.json");
    let spans = dir.join("spans.jsonl");
    std::fs::write(&summary, "{\"earlier\": 1}\n").unwrap();
    std::fs::write(&spans, "{\"earlier\": 2}\n").unwrap();
    let output = lens_tests::lens_probe_command(LENS_PROBE)
        .arg("--summary-json")
        .arg(&summary)
        .args(["--exporter", "file", "--export-file"])
        .arg(&spans)
        .args(["--exec", "--", "/nonexistent/train"])
        .output()
        .unwrap();
    assert_ne!(output.status.code(), Some(0), "{}", stderr(&output));
    // Not truncated, and nothing of the failed run's left beside them.
    assert_eq!(
        std::fs::read_to_string(&summary).unwrap(),
        "{\"earlier\": 1}\n"
    );
    assert_eq!(
        std::fs::read_to_string(&spans).unwrap(),
        "{\"earlier\": 2}\n"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}
