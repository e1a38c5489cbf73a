//! GPU memory through real uprobes: `memory_user` allocates and frees in an exact
//! pattern (its header in `tests/fixtures/memory_user.c`) through the fake runtime, which
//! calls the fake driver as the real one does, and through the driver directly. Run as a
//! user runs lens-probe (default span groups), with the summary JSON and the OTLP file.
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use serde_json::Value;

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");
const MIB: u64 = 1024 * 1024;

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lens-memory-{}-{name}", std::process::id()))
}

/// `lens-probe --summary-json S --exporter file --export-file E --exec -- env ENV memory_user ARGS`.
fn lens_probe_command(summary: &Path, export: &Path, env: &[&str], args: &[&str]) -> Command {
    let mut command = Command::new(LENS_PROBE);
    command
        .arg("--summary-json")
        .arg(summary)
        .args(["--exporter", "file", "--export-file"])
        .arg(export)
        .args(["--exec", "--", "env"])
        .args(env)
        .arg(lens_tests::memory_user())
        .args(args);
    command
}

/// The one traced process's block of the summary JSON.
fn summary_process(path: &Path) -> Value {
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let processes = json["processes"].as_array().unwrap();
    assert_eq!(processes.len(), 1, "{json}");
    processes[0].clone()
}

/// An attribute of an OTLP JSON span (or event, or data point): its value as text.
fn attribute(item: &Value, key: &str) -> Option<String> {
    item["attributes"]
        .as_array()?
        .iter()
        .find(|kv| kv["key"] == key)
        .map(|kv| {
            let value = &kv["value"];
            value["intValue"]
                .as_str()
                .map(str::to_string)
                .or_else(|| value["intValue"].as_i64().map(|v| v.to_string()))
                .or_else(|| value["stringValue"].as_str().map(str::to_string))
                .unwrap_or_else(|| value.to_string())
        })
}

fn spans_named<'a>(spans: &'a [lens_tests::FileSpan], name: &str) -> Vec<&'a Value> {
    spans
        .iter()
        .map(|(_, span)| span)
        .filter(|span| span["name"] == name)
        .collect()
}

/// The `name` spans of memory calls, as (failed, slow): a call is a span only when it
/// failed or took `SLOW_CALL_NS` or more, which each span must show. How many calls are
/// slow depends on the machine (a loaded one makes any call slow), so tests look for the
/// calls they made slow or failed among these, not at how many there are.
fn memory_call_spans<'a>(
    spans: &'a [lens_tests::FileSpan],
    name: &str,
) -> (Vec<&'a Value>, Vec<&'a Value>) {
    let nanos = |span: &Value, key: &str| span[key].as_str().unwrap().parse::<u64>().unwrap();
    let (failed, slow): (Vec<&Value>, Vec<&Value>) = spans_named(spans, name)
        .into_iter()
        .partition(|span| span["status"]["code"] == 2);
    for span in &slow {
        let took = nanos(span, "endTimeUnixNano") - nanos(span, "startTimeUnixNano");
        assert!(
            took >= lens_probe::gpu_memory::SLOW_CALL_NS,
            "a fast call that did not fail is not a span: {span}"
        );
    }
    (failed, slow)
}

/// The newest value of a gauge in the OTLP file's metric lines.
fn last_gauge(path: &Path, name: &str) -> Option<String> {
    let metric = lens_tests::otlp_file_metrics(path, name).pop()?;
    let point = metric["gauge"]["dataPoints"].as_array()?.last()?.clone();
    point["asInt"]
        .as_str()
        .map(str::to_string)
        .or_else(|| point["asInt"].as_u64().map(|v| v.to_string()))
}

fn finished(output: &Output) -> String {
    let text = lens_tests::stderr_text(output);
    assert_eq!(output.status.code(), Some(0), "{text}");
    text
}

#[test]
fn held_and_peak_memory_count_each_allocation_once_runtime_or_driver() {
    if !lens_tests::require_bpf("held_and_peak_memory_count_each_allocation_once") {
        return;
    }
    let (summary, export) = (temp("held.json"), temp("held.jsonl"));
    // cudaFree waits 200 ms: a free that synchronised, which gets a span.
    let output = lens_probe_command(&summary, &export, &["LENS_FAKE_FREE_US=200000"], &[])
        .output()
        .unwrap();
    let text = finished(&output);
    assert!(text.contains("no events lost"), "{text}");
    assert!(
        text.contains("GPU memory: peak 13.0 MiB held, 6.0 MiB at the end; 13 memory calls"),
        "{text}"
    );

    let process = summary_process(&summary);
    let memory = &process["gpu_memory"];
    assert_eq!(memory["peak_bytes"], 13 * MIB, "{process}");
    assert_eq!(memory["held_bytes"], 6 * MIB, "{process}");
    assert_eq!(memory["calls"], 13, "{process}");
    assert_eq!(memory["out_of_memory"], 0, "{process}");
    // The runtime's own driver calls are not counted again: only the direct ones are.
    let calls = &process["calls"];
    assert_eq!(calls["cudaMalloc"], 3, "{calls}");
    assert_eq!(calls["cuMemAlloc_v2"], 1, "{calls}");
    assert_eq!(calls["cuMemFree_v2"], 1, "{calls}");
    assert_eq!(calls["cuMemAllocAsync"], Value::Null, "{calls}");
    assert_eq!(calls["cuMemCreate"], 1, "{calls}");
    assert_eq!(calls["cudaMallocManaged"], 1, "{calls}");

    let spans = lens_tests::otlp_file_spans(&export);
    let (failed_frees, slow_frees) = memory_call_spans(&spans, "cuda.free");
    assert!(failed_frees.is_empty(), "{failed_frees:?}");
    // The free the fixture makes slow (the 2 MiB one) is a span, with what it did.
    let slow_free = slow_frees
        .iter()
        .find(|span| attribute(span, "dl.gpu.memory.bytes") == Some((2 * MIB).to_string()));
    let slow_free = slow_free.unwrap_or_else(|| panic!("the slow free: {spans:?}"));
    assert_eq!(
        attribute(slow_free, "dl.gpu.memory.held"),
        Some((5 * MIB).to_string())
    );
    // The fast calls are counted, not spanned (checked span by span: each is slow).
    let (failed_mallocs, _) = memory_call_spans(&spans, "cuda.malloc");
    assert!(failed_mallocs.is_empty(), "{failed_mallocs:?}");
    let jobs = spans_named(&spans, "train.job");
    assert_eq!(jobs.len(), 1);
    assert_eq!(
        attribute(jobs[0], "dl.gpu.memory.peak"),
        Some((13 * MIB).to_string())
    );
    assert_eq!(
        last_gauge(&export, "hw.gpu.memory.usage"),
        Some((6 * MIB).to_string())
    );
    assert_eq!(
        last_gauge(&export, "dl.gpu.memory.peak"),
        Some((13 * MIB).to_string())
    );
    let _ = std::fs::remove_file(&summary);
    let _ = std::fs::remove_file(&export);
}

/// Runs `command` (lens-probe) until its out-of-memory line, then opens `gate` (the
/// traced program waits there after its failed allocation: the line must come while it
/// still runs, not from its exit). Returns the line and the rest of lens-probe's stderr.
fn out_of_memory_line(mut command: Command, gate: &Path) -> (String, String) {
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    let line = loop {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            let _ = child.wait();
            panic!("lens-probe ended without an out-of-memory line:\n{seen}");
        }
        seen.push_str(&line);
        if line.contains("out of GPU memory") {
            break line;
        }
    };
    std::fs::write(gate, b"").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    let status = child.wait().unwrap();
    let _ = std::fs::remove_file(gate);
    assert_eq!(status.code(), Some(0), "{seen}{rest}");
    (line, rest)
}

#[test]
fn a_failed_allocation_is_reported_at_once_with_what_was_asked_and_held() {
    if !lens_tests::require_bpf("a_failed_allocation_is_reported_at_once") {
        return;
    }
    let (summary, export, gate) = (temp("oom.json"), temp("oom.jsonl"), temp("oom.gate"));
    let _ = std::fs::remove_file(&gate);
    let gate_env = format!("MEMORY_USER_GATE={}", gate.display());
    let command = lens_probe_command(&summary, &export, &[&gate_env], &["oom"]);
    let (line, rest) = out_of_memory_line(command, &gate);
    assert!(
        line.contains("cudaMalloc of 1024.0 GiB failed, 6.0 MiB held (peak 13.0 MiB)"),
        "{line}"
    );

    let process = summary_process(&summary);
    assert_eq!(process["gpu_memory"]["out_of_memory"], 1, "{process}");
    assert_eq!(process["gpu_memory"]["calls"], 14, "{process}");
    assert!(
        rest.contains("14 memory calls (") && rest.contains(", 1 out of memory"),
        "{rest}"
    );

    let spans = lens_tests::otlp_file_spans(&export);
    let (mallocs, _) = memory_call_spans(&spans, "cuda.malloc");
    assert_eq!(mallocs.len(), 1, "the failed one: {spans:?}");
    let failed = mallocs[0];
    assert_eq!(failed["status"]["code"], 2, "an error: {failed}");
    let events = failed["events"].as_array().unwrap();
    let oom = events
        .iter()
        .find(|e| e["name"] == "gpu.out_of_memory")
        .unwrap();
    assert_eq!(
        attribute(oom, "dl.gpu.memory.bytes"),
        Some((1024 * 1024 * MIB).to_string())
    );
    assert_eq!(
        attribute(oom, "dl.gpu.memory.held"),
        Some((6 * MIB).to_string())
    );
    // The span it ran in (the job: default groups) carries the event too.
    let job = spans_named(&spans, "train.job")[0];
    let job_events = job["events"].as_array().unwrap();
    assert!(
        job_events.iter().any(|e| e["name"] == "gpu.out_of_memory"),
        "{job}"
    );
    let _ = std::fs::remove_file(&summary);
    let _ = std::fs::remove_file(&export);
}

/// A Python program whose function `load_the_batch_onto_the_gpu` asks the fake runtime
/// (ctypes) for 1 TiB, then waits at a gate file.
const PYTHON_OOM: &str = r#"
import ctypes, os, sys, time

cudart = ctypes.CDLL(sys.argv[1])

def load_the_batch_onto_the_gpu(gate):
    pointer = ctypes.c_void_p()
    rc = cudart.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(1 << 40))
    while not os.path.exists(gate):
        time.sleep(0.005)
    return rc

sys.exit(0 if load_the_batch_onto_the_gpu(sys.argv[2]) == 2 else 1)
"#;

#[test]
fn a_failed_allocation_names_the_python_function_that_asked() {
    if !lens_tests::require_bpf("a_failed_allocation_names_the_python_function") {
        return;
    }
    let python = "/usr/bin/python3.11";
    let (script, export, gate) = (temp("oom.py"), temp("py-oom.jsonl"), temp("py-oom.gate"));
    let _ = std::fs::remove_file(&gate);
    std::fs::write(&script, PYTHON_OOM).unwrap();
    let mut command = Command::new(LENS_PROBE);
    command
        .args(["--exporter", "file", "--export-file"])
        .arg(&export)
        .args(["--exec", "--", python])
        .arg(&script)
        .arg(lens_tests::fake_lib_dir().join("libcudart.so.12"))
        .arg(&gate);
    let (line, _) = out_of_memory_line(command, &gate);
    assert!(
        line.contains("cudaMalloc of 1.0 TiB failed")
            || line.contains("cudaMalloc of 1024.0 GiB failed"),
        "{line}"
    );
    let script_name = script.display().to_string();
    assert!(
        line.contains(&format!("in load_the_batch_onto_the_gpu ({script_name}:")),
        "{line}"
    );
    let spans = lens_tests::otlp_file_spans(&export);
    let (failed, _) = memory_call_spans(&spans, "cuda.malloc");
    assert_eq!(failed.len(), 1, "the failed one: {spans:?}");
    let failed = failed[0];
    let oom = failed["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "gpu.out_of_memory")
        .unwrap();
    let stack = attribute(oom, "code.stacktrace").unwrap();
    let frames: Vec<&str> = stack.lines().collect();
    assert!(
        frames[0].starts_with("load_the_batch_onto_the_gpu ("),
        "{stack}"
    );
    assert!(frames[1].starts_with("<module> ("), "{stack}");
    let _ = std::fs::remove_file(&script);
    let _ = std::fs::remove_file(&export);
}

#[test]
fn pytorchs_allocator_totals_are_counted_and_sent_only_at_a_new_peak() {
    use lens_common::ProbeId;
    use lens_probe::{
        events::ProbeEvent,
        session::{Session, TraceOptions},
        sink::EventLog,
        summary::Summary,
    };
    if !lens_tests::require_bpf("pytorchs_allocator_totals_are_counted") {
        return;
    }
    // memory_user reports six totals to the fake libc10's reportMemoryUsageToProfiler
    // (its header): peaks 6 MiB allocated and 8 MiB reserved, three of the six new.
    let mut session = Session::new(TraceOptions {
        span_groups: "per_step".parse().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    let c10 = lens_tests::fake_torch_dir().join("libc10.so");
    session
        .exec(&[
            "env".into(),
            format!("MEMORY_USER_C10={}", c10.display()).into(),
            lens_tests::memory_user().into_os_string(),
        ])
        .unwrap();
    let mut sinks = (EventLog::default(), Summary::default());
    session
        .run_blocking(&mut sinks, Some(std::time::Duration::from_secs(60)))
        .unwrap();
    let (log, summary) = sinks;
    let reports: Vec<(u64, u64)> = log
        .events
        .iter()
        .filter_map(|event| match event {
            ProbeEvent::ApiCall {
                probe: ProbeId::TorchMemoryUsage,
                args,
                ..
            } => Some((args[2] / MIB, args[3] / MIB)),
            _ => None,
        })
        .collect();
    assert_eq!(reports, [(1, 2), (3, 4), (6, 8)]);
    let process = summary
        .processes
        .values()
        .find(|p| p.calls.contains_key(&ProbeId::TorchMemoryUsage))
        .expect("memory_user's summary");
    assert_eq!(process.calls[&ProbeId::TorchMemoryUsage], 6);
    let memory = process.memory.as_ref().unwrap();
    assert_eq!(
        (
            memory.torch_allocated_peak_bytes,
            memory.torch_reserved_peak_bytes
        ),
        (6 * MIB, 8 * MIB)
    );
    let text = summary.render(&Default::default());
    assert!(
        text.contains("PyTorch's allocator: peak 6.0 MiB allocated to tensors, 8.0 MiB reserved"),
        "{text}"
    );
}
