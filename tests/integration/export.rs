//! Export end to end: lens-probe sends to a real OTLP collector (rotel, from PyPI) over
//! gRPC and over HTTP, and the assertions are on what the collector received and
//! printed; the OTLP JSON file exporter; one trace per run across ranks; a collector that
//! is down, hangs, or answers slowly; bad settings.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use lens_tests::{FileSpan, RotelCollector, free_port, otlp_file_spans as file_spans};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lens-export-{name}-{}", std::process::id()))
}

/// A span as rotel's detailed debug log prints it.
#[derive(Clone, Debug, Default)]
struct ReceivedSpan {
    trace_id: String,
    parent_id: String,
    id: String,
    name: String,
    attributes: BTreeMap<String, String>,
    resource: BTreeMap<String, String>,
}

/// `     -> key: Type(value)` → (key, value)
fn attribute(line: &str) -> Option<(String, String)> {
    let (key, rest) = line.trim().strip_prefix("-> ")?.split_once(": ")?;
    let value = rest
        .split_once('(')
        .map_or(rest, |(_, v)| v.strip_suffix(')').unwrap_or(v));
    Some((key.to_string(), value.to_string()))
}

fn parse_rotel(text: &str) -> Vec<ReceivedSpan> {
    let mut spans = Vec::new();
    let mut resource = BTreeMap::new();
    let mut current: Option<ReceivedSpan> = None;
    let mut in_resource = false;
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("ResourceSpans #") {
            spans.extend(current.take());
            resource = BTreeMap::new();
        } else if trimmed == "Resource attributes:" {
            in_resource = true;
        } else if trimmed.starts_with("ScopeSpans") {
            in_resource = false;
        } else if trimmed.starts_with("Span #") {
            spans.extend(current.take());
            current = Some(ReceivedSpan {
                resource: resource.clone(),
                ..ReceivedSpan::default()
            });
        } else if let Some((key, value)) = attribute(line) {
            match current.as_mut() {
                Some(span) if !in_resource => span.attributes.insert(key, value),
                _ => resource.insert(key, value),
            };
        } else if let Some(span) = current.as_mut() {
            let field = |prefix: &str| {
                trimmed
                    .strip_prefix(prefix)
                    .map(|rest| rest.trim_start().trim_start_matches(':').trim().to_string())
            };
            if let Some(v) = field("Trace ID") {
                span.trace_id = v;
            } else if let Some(v) = field("Parent ID") {
                span.parent_id = v;
            } else if let Some(v) = field("ID ") {
                span.id = v;
            } else if let Some(v) = field("Name") {
                span.name = v;
            }
        }
    }
    spans.extend(current);
    spans
}

/// lens-probe on the fake torch trainer (2 steps, an evaluation), rank 0 of 1, run id
/// `run-42`, with `env` settings for lens-probe itself.
fn traced_trainer(env: &[(&str, String)]) -> Output {
    let mut command = Command::new(LENS_PROBE);
    command
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_PROTOCOL")
        .args(["--span-groups", "per_step", "--exec", "--", "env"])
        .args([
            "RANK=0",
            "WORLD_SIZE=1",
            "LOCAL_RANK=0",
            "NEMO_LENS_RUN_ID=run-42",
        ])
        .arg(lens_tests::torch_trainer())
        .args(["2", "1", "2", "0"]);
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().unwrap()
}

fn md5_hex(text: &str) -> String {
    // The trace id of a run is md5(run id): computed here independently, with python.
    let output = Command::new("python3")
        .args([
            "-c",
            &format!("import hashlib; print(hashlib.md5({text:?}.encode()).hexdigest())"),
        ])
        .output()
        .unwrap();
    String::from_utf8(output.stdout).unwrap().trim().to_string()
}

fn assert_trainer_spans(spans: &[ReceivedSpan]) {
    let names: Vec<&str> = {
        let mut names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        names.sort_unstable();
        names
    };
    assert_eq!(
        names,
        [
            "train.evaluate",
            "train.forward_backward",
            "train.forward_backward",
            "train.job",
            "train.model_init",
            "train.optimizer",
            "train.optimizer",
            "train.step",
            "train.step",
        ],
        "{spans:#?}"
    );
    let job = spans.iter().find(|s| s.name == "train.job").unwrap();
    assert!(job.parent_id.is_empty());
    assert_eq!(job.trace_id, md5_hex("run-42"));
    for span in spans {
        assert_eq!(span.trace_id, job.trace_id, "one trace");
        let group = span.attributes.get("nemo.span.group").map(String::as_str);
        let (parent, group_name) = match span.name.as_str() {
            "train.job" => (None, "job"),
            "train.forward_backward" | "train.optimizer" => (Some("train.step"), ""),
            other => (Some("train.job"), other.trim_start_matches("train.")),
        };
        if let Some(parent) = parent {
            let parent_ids: Vec<&str> = spans
                .iter()
                .filter(|s| s.name == parent)
                .map(|s| s.id.as_str())
                .collect();
            assert!(parent_ids.contains(&span.parent_id.as_str()), "{span:?}");
        }
        if !group_name.is_empty() {
            assert_eq!(group, Some(group_name), "{span:?}");
        }
        // The resource describes the traced process, from its own environment.
        assert_eq!(
            span.resource.get("service.name").map(String::as_str),
            Some("nemo")
        );
        assert_eq!(
            span.resource.get("nemo.run.id").map(String::as_str),
            Some("run-42")
        );
        assert_eq!(
            span.resource.get("service.instance.id").map(String::as_str),
            Some("run-42-rank0")
        );
        assert_eq!(span.resource.get("dl.rank").map(String::as_str), Some("0"));
        assert_eq!(
            span.resource.get("dl.world_size").map(String::as_str),
            Some("1")
        );
        assert!(span.resource.contains_key("process.pid"));
        assert!(span.resource.contains_key("host.name"));
    }
    let iterations: Vec<&str> = spans
        .iter()
        .filter(|s| s.name == "train.step")
        .map(|s| s.attributes["dl.iteration"].as_str())
        .collect();
    assert_eq!(iterations, ["0", "1"]);
}

fn collector_test(name: &str, protocol: &str) {
    if !lens_tests::require_bpf(name) {
        return;
    }
    let Some(rotel) = lens_tests::rotel(name) else {
        return;
    };
    let collector = RotelCollector::start(&rotel, name);
    let endpoint = match protocol {
        "grpc" => format!("http://127.0.0.1:{}", collector.grpc),
        _ => format!("http://127.0.0.1:{}", collector.http),
    };
    let output = traced_trainer(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol.to_string()),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("9 spans exported to the OTLP endpoint"),
        "{stderr}"
    );
    let text = collector.wait_until(
        |t| t.matches("Span #").count() >= 9 && t.contains("lens_probe.events.lost"),
        "receive 9 spans and the metrics",
    );
    assert_trainer_spans(&parse_rotel(&text));
    // Metrics over the same protocol: two whole steps, the phases by group.
    let steps = metric_points(&text, "dl.step.duration");
    assert_eq!(steps.last().map(|(_, count)| *count), Some(2), "{text}");
    let evaluations: Vec<u64> = metric_points(&text, "dl.phase.duration")
        .into_iter()
        .filter(|(attributes, _)| {
            attributes.get("nemo.span.group").map(String::as_str) == Some("evaluate")
        })
        .map(|(_, count)| count)
        .collect();
    assert_eq!(evaluations.last(), Some(&1), "{text}");
}

#[test]
fn spans_reach_a_real_collector_over_grpc() {
    collector_test("spans_reach_a_real_collector_over_grpc", "grpc");
}

#[test]
fn spans_reach_a_real_collector_over_http() {
    collector_test("spans_reach_a_real_collector_over_http", "http/protobuf");
}

/// lens-probe with the file exporter on `sh -c SCRIPT` (`extra` flags before `--exec`):
/// the spans it wrote and its stderr.
fn run_to_file(file: &str, extra: &[&str], script: &str) -> (Vec<FileSpan>, String) {
    let path = temp_path(file);
    let output = Command::new(LENS_PROBE)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("NEMO_LENS_EXPORT_STRATEGY")
        .args([
            "--span-groups",
            "per_step",
            "--exporter",
            "file",
            "--export-file",
        ])
        .arg(&path)
        .args(extra)
        .args(["--exec", "--", "sh", "-c", script])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let spans = file_spans(&path);
    let _ = std::fs::remove_file(&path);
    (spans, stderr)
}

#[test]
fn two_ranks_share_one_trace_with_distinct_span_ids() {
    let name = "two_ranks_share_one_trace";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let trainer = lens_tests::torch_trainer();
    // Two ranks of one run, started by one shell (followed as its children), with the
    // same (deterministic) behaviour.
    let script = format!(
        "env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 NEMO_LENS_RUN_ID=run-7 {t} 2 1 0 0 & \
         env RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 NEMO_LENS_RUN_ID=run-7 {t} 2 1 0 0; wait",
        t = trainer.display()
    );
    let (spans, stderr) = run_to_file("ranks.jsonl", &["--export-strategy", "all_ranks"], &script);
    let trace_ids: std::collections::BTreeSet<&str> = spans
        .iter()
        .map(|(_, s)| s["traceId"].as_str().unwrap())
        .collect();
    assert_eq!(trace_ids.len(), 1, "one trace for the run");
    assert_eq!(*trace_ids.iter().next().unwrap(), md5_hex("run-7"));
    let span_ids: std::collections::BTreeSet<&str> = spans
        .iter()
        .map(|(_, s)| s["spanId"].as_str().unwrap())
        .collect();
    assert_eq!(span_ids.len(), spans.len(), "span ids are unique");
    let mut ranks: Vec<i64> = spans
        .iter()
        .filter(|(_, s)| s["name"] == "train.job")
        .map(|(resource, _)| {
            resource["dl.rank"]["intValue"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1]);
    // Each rank's job: 2 steps, each with its phases: 1 + 1 + 2 × 3 spans.
    assert_eq!(spans.len(), 2 * 8, "{stderr}");
}

#[test]
fn single_rank_exports_only_the_last_rank() {
    let name = "single_rank_exports_only_the_last_rank";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let trainer = lens_tests::torch_trainer();
    let script = format!(
        "env RANK=0 WORLD_SIZE=2 {t} 1 1 0 0 & env RANK=1 WORLD_SIZE=2 {t} 1 1 0 0; wait",
        t = trainer.display()
    );
    let (spans, stderr) = run_to_file("single.jsonl", &[], &script);
    let ranks: std::collections::BTreeSet<String> = spans
        .iter()
        .map(|(resource, _)| {
            resource["dl.rank"]["intValue"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ranks.into_iter().collect::<Vec<_>>(), ["1"], "{stderr}");
}

#[test]
fn a_collector_that_is_down_costs_spans_not_the_run() {
    let name = "a_collector_that_is_down";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let output = traced_trainer(&[(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        format!("http://127.0.0.1:{}", free_port()),
    )]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(
            "0 spans exported to the OTLP endpoint; 9 lost (0 queue full, 9 export failed)"
        ),
        "{stderr}"
    );
}

fn assert_bad_setting(key: &str, value: &str, needle: &str) {
    let output = Command::new(LENS_PROBE)
        .env(key, value)
        .args(["--pid", "1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{key}={value}: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains(key) && stderr.contains(needle), "{stderr}");
}

#[test]
fn bad_nemo_lens_values_are_one_line_and_exit_2() {
    assert_bad_setting("NEMO_LENS_EXPORT_SAMPLE_RATE", "2", "between 0 and 1");
    assert_bad_setting("NEMO_LENS_EXPORTER", "foo", "otlp");
    assert_bad_setting("NEMO_LENS_ENABLED", "maybe", "true");
    assert_bad_setting("NEMO_LENS_EXPORT_STRATEGY", "some", "single_rank");
    assert_bad_setting("NEMO_LENS_EXPORT_RANK", "last", "integer");
}

/// The data points of metric `name` in rotel's detailed log (all its reports), each as
/// its attributes and its `Value:` or, for histograms, `Count:`.
fn metric_points(text: &str, name: &str) -> Vec<(BTreeMap<String, String>, u64)> {
    let mut points = Vec::new();
    for section in text.split(&format!("-> Name: {name}\n")).skip(1) {
        // The section ends where the next metric or resource (of metrics or spans) begins.
        let section = section
            .split("-> Name: ")
            .next()
            .unwrap_or(section)
            .split("Resource attributes:")
            .next()
            .unwrap_or(section);
        for point in section.split("DataPoints #").skip(1) {
            let attributes: BTreeMap<String, String> =
                point.lines().filter_map(attribute).collect();
            let value = point.lines().find_map(|l| {
                l.trim()
                    .strip_prefix("Value: ")
                    .or_else(|| l.trim().strip_prefix("Count: "))
                    .and_then(|v| v.parse::<f64>().ok())
            });
            if let Some(value) = value {
                points.push((attributes, value as u64));
            }
        }
    }
    points
}

#[test]
fn metrics_reach_a_real_collector() {
    let name = "metrics_reach_a_real_collector";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let Some(rotel) = lens_tests::rotel(name) else {
        return;
    };
    let collector = RotelCollector::start(&rotel, name);
    // 3 steps of 2 microbatches; each backward makes one gloo and one NCCL all_reduce of
    // 1024 float32.
    let output = Command::new(LENS_PROBE)
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{}", collector.grpc),
        )
        .env("OTEL_METRIC_EXPORT_INTERVAL", "200")
        .args(["--span-groups", "per_step", "--exec", "--", "env"])
        .args(["TRAINER_DISTRIBUTED=1", "RANK=0", "WORLD_SIZE=1"])
        .arg(lens_tests::torch_trainer())
        .args(["3", "2", "0", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let text = collector.wait_until(
        |t| t.contains("lens_probe.events.lost"),
        "receive lens-probe's own metrics",
    );
    // Cumulative: the last report holds the totals.
    let last = |metric: &str, key: &str, value: &str| {
        metric_points(&text, metric)
            .into_iter()
            .filter(|(attributes, _)| attributes.get(key).map(String::as_str) == Some(value))
            .map(|(_, v)| v)
            .next_back()
            .unwrap_or_else(|| panic!("no {metric} {key}={value} in:\n{text}"))
    };
    assert_eq!(
        last("dl.collective.calls", "dl.collective.backend", "nccl"),
        6
    );
    assert_eq!(
        last("dl.collective.calls", "dl.collective.backend", "gloo"),
        6
    );
    assert_eq!(
        last("dl.collective.bytes", "dl.collective.op", "all_reduce"),
        6 * 4096
    );
    assert_eq!(
        last("dl.collective.duration", "dl.collective.backend", "nccl"),
        6
    );
    assert_eq!(
        last("dl.phase.duration", "nemo.span.group", "forward_backward"),
        3
    );
    assert_eq!(
        last(
            "lens_probe.events.lost",
            "lens_probe.loss.cause",
            "ring_buffer_full"
        ),
        0
    );
    let steps = metric_points(&text, "dl.step.duration");
    assert_eq!(steps.last().map(|(_, count)| *count), Some(3), "{text}");
    // Its own CPU time, by mode, beside its other health metrics.
    let modes: BTreeSet<String> = metric_points(&text, "lens_probe.cpu.time")
        .into_iter()
        .filter_map(|(attributes, _)| attributes.get("cpu.mode").cloned())
        .collect();
    assert_eq!(
        modes,
        BTreeSet::from(["system".to_string(), "user".to_string()]),
        "{text}"
    );
    // lens-probe's estimate of what its probes cost the trainer: a share of its time,
    // above nothing (it made calls that were probed) and far below all of it.
    let overhead: Vec<f64> = text
        .split("-> Name: lens_probe.overhead\n")
        .skip(1)
        .filter_map(|s| {
            s.lines()
                .find_map(|l| l.trim().strip_prefix("Value: ")?.parse().ok())
        })
        .collect();
    let share = *overhead
        .last()
        .unwrap_or_else(|| panic!("no lens_probe.overhead in:\n{text}"));
    assert!(share > 0.0 && share < 0.5, "lens_probe.overhead {share}");
    // Low cardinality: no pid, tid, stream or communicator handle on any data point.
    for forbidden in ["process.pid", "tid", "stream", "comm"] {
        for metric in [
            "dl.collective.calls",
            "dl.collective.duration",
            "dl.phase.duration",
        ] {
            assert!(
                metric_points(&text, metric)
                    .iter()
                    .all(|(attributes, _)| !attributes.contains_key(forbidden)),
                "{metric} has {forbidden}"
            );
        }
    }
}

#[test]
fn resources_come_from_the_targets_environment_and_root() {
    let name = "resources_come_from_the_targets_environment_and_root";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let path = temp_path("resource.jsonl");
    // The target runs in mount and pid namespaces of its own (as in a container), where a
    // Kubernetes service account namespace file exists (lens-probe's own view has none),
    // with SLURM and downward-API variables that lens-probe's environment does not have.
    let script = format!(
        "mount -t tmpfs none /var/run && \
         mkdir -p /var/run/secrets/kubernetes.io/serviceaccount && \
         echo team-a > /var/run/secrets/kubernetes.io/serviceaccount/namespace && \
         exec env SLURM_JOB_ID=4711 SLURM_JOB_NAME=pretrain SLURM_NNODES=2 SLURM_NTASKS=16 \
           SLURM_PROCID=9 SLURM_LOCALID=1 SLURM_PARTITION=gpu SLURM_CLUSTER_NAME=eos \
           K8S_POD_NAME=pretrain-worker-1 K8S_NODE_NAME=node-17 CUDA_VISIBLE_DEVICES=0,1,2 \
           NEMO_LENS_USER_ID=alice WANDB_PROJECT=llm DEPLOYMENT_ENV=staging \
           {} 1 1 0 0",
        lens_tests::torch_trainer().display()
    );
    let output = Command::new(LENS_PROBE)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .args([
            "--span-groups",
            "per_step",
            "--exporter",
            "file",
            "--export-file",
        ])
        .arg(&path)
        .args(["--export-strategy", "all_ranks", "--exec", "--"])
        .args([
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--pid",
            "--fork",
        ])
        .args(["sh", "-c"])
        .arg(&script)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let spans = file_spans(&path);
    let _ = std::fs::remove_file(&path);
    let (resource, _) = spans
        .iter()
        .find(|(_, s)| s["name"] == "train.job")
        .expect("a job span");
    let value = |key: &str| -> String {
        let v = &resource
            .get(key)
            .unwrap_or_else(|| panic!("no {key} in {resource:#?}"));
        v["stringValue"]
            .as_str()
            .or_else(|| v["intValue"].as_str())
            .map(str::to_string)
            .unwrap_or_else(|| v.to_string())
    };
    for (key, expected) in [
        ("slurm.job.id", "4711"),
        ("slurm.job.name", "pretrain"),
        ("slurm.nnodes", "2"),
        ("slurm.ntasks", "16"),
        ("slurm.partition", "gpu"),
        ("slurm.cluster.name", "eos"),
        ("dl.rank", "9"),
        ("dl.world_size", "16"),
        ("dl.local_rank", "1"),
        ("nemo.run.id", "4711"),
        ("service.instance.id", "4711-rank9"),
        ("k8s.pod.name", "pretrain-worker-1"),
        ("k8s.node.name", "node-17"),
        ("k8s.namespace.name", "team-a"),
        ("host.gpu.count", "3"),
        ("nemo.user.id", "alice"),
        ("wandb.project", "llm"),
        ("deployment.environment", "staging"),
        ("service.name", "nemo"),
        // Pid 1 of its own pid namespace; process.pid is the host's.
        ("process.vpid", "1"),
    ] {
        assert_eq!(value(key), expected, "{key}");
    }
}

#[test]
fn sigterm_flushes_what_was_traced() {
    a_stop_signal_flushes_what_was_traced(libc::SIGTERM, "sigterm_flushes_what_was_traced");
}

#[test]
fn sighup_flushes_what_was_traced_as_sigterm_does() {
    // A closed terminal or ssh session: before, lens-probe died at once (exit 129), with
    // nothing flushed and the job's exit code lost.
    a_stop_signal_flushes_what_was_traced(
        libc::SIGHUP,
        "sighup_flushes_what_was_traced_as_sigterm_does",
    );
}

fn a_stop_signal_flushes_what_was_traced(signal: i32, name: &str) {
    if !lens_tests::require_bpf(name) {
        return;
    }
    let path = temp_path(&format!("{name}.jsonl"));
    // Steps of ~0.2 s, many more than the run lasts; -v prints the events as they come,
    // so the signal goes once four steps have completed (their optimizer scopes ended).
    let mut child = Command::new(LENS_PROBE)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .args([
            "--span-groups",
            "per_step",
            "-v",
            "--exporter",
            "file",
            "--export-file",
        ])
        .arg(&path)
        .args(["--exec", "--", "env", "TRAINER_FORWARD_MS=100"])
        .arg(lens_tests::torch_trainer())
        .args(["1000", "2", "0", "0"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let reader = std::io::BufReader::new(child.stderr.take().unwrap());
    let collected = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut text = String::new();
        let mut zero_grads = 0;
        for line in reader.lines().map_while(Result::ok) {
            if line.contains("Optimizer.zero_grad") {
                zero_grads += 1;
                if zero_grads == 4 {
                    // SAFETY: plain kill(2) of our child.
                    unsafe { libc::kill(pid, signal) };
                }
            }
            if !line.contains("] ") || !line.contains(" at=") {
                text.push_str(&line);
                text.push('\n');
            }
        }
        text
    });
    let status = child.wait().unwrap();
    let stderr = collected.join().unwrap();
    // The command got the signal too: lens-probe exits as it did.
    assert_eq!(status.code(), Some(128 + signal), "{stderr}");
    let spans = file_spans(&path);
    let _ = std::fs::remove_file(&path);
    let steps = spans
        .iter()
        .filter(|(_, s)| s["name"] == "train.step")
        .count();
    assert!(steps >= 3, "{steps} steps flushed: {stderr}");
    let job = spans
        .iter()
        .find(|(_, s)| s["name"] == "train.job")
        .map(|(_, s)| s)
        .expect("the job span is flushed");
    assert_eq!(job["status"]["code"], 2, "error status: {job}");
}

#[test]
fn a_collector_that_hangs_fills_a_bounded_queue_and_the_probe_goes_on() {
    let name = "a_collector_that_hangs";
    if !lens_tests::require_bpf(name) {
        return;
    }
    // Accepts connections and never answers: every export waits for its timeout.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    // ~4 000 fast steps of 7 spans each: more than the 16 384-span queue and the 8
    // exports of 512 spans that wait for their timeout meanwhile.
    let output = Command::new("/usr/bin/time")
        .args(["-f", "maxrss_kib=%M", LENS_PROBE])
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{port}"),
        )
        .args(fast_trainer(4000))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let line = export_line(&stderr);
    // `0 spans exported to the OTLP endpoint; L lost (Q queue full, F export failed)`
    let numbers: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    let [exported, lost, queue_full, failed] = numbers[..] else {
        panic!("{line}");
    };
    assert_eq!(exported, 0, "{line}");
    assert!(queue_full > 0, "the queue overflowed: {line}");
    assert_eq!(lost, queue_full + failed);
    assert!(lost >= 4000 * 7, "every span is accounted for: {line}");
    assert!(
        stderr.contains("spans came faster than the OTLP endpoint took them"),
        "the drops are explained: {stderr}"
    );
    let rss_kib: u64 = stderr
        .lines()
        .find_map(|l| l.strip_prefix("maxrss_kib="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    assert!(rss_kib < 200 * 1024, "lens-probe peaked at {rss_kib} KiB");
}

/// `cuda.kernel.launches` data points in an OTLP JSON lines file, in file order:
/// (launch kind, cumulative value).
fn launch_points(path: &Path) -> Vec<(String, u64)> {
    let mut points = Vec::new();
    for metric in lens_tests::otlp_file_metrics(path, "cuda.kernel.launches") {
        for point in metric["sum"]["dataPoints"].as_array().unwrap() {
            let kind = point["attributes"][0]["value"]["stringValue"]
                .as_str()
                .unwrap()
                .to_string();
            // int64 as a JSON number here; OTLP/JSON also allows a string.
            let value = point["asInt"]
                .as_u64()
                .or_else(|| point["asInt"].as_str().and_then(|v| v.parse().ok()))
                .unwrap();
            points.push((kind, value));
        }
    }
    points
}

#[test]
fn launch_counts_become_metrics_while_the_job_runs() {
    let name = "launch_counts_become_metrics_while_the_job_runs";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let path = temp_path("launches.jsonl");
    // The fake trainer launches 10 kernels, 1 kernel_ex and 1 graph per step; 4 steps
    // 3 s apart, so the 5 s counter readings see the run half-way.
    let output = Command::new(LENS_PROBE)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env("OTEL_METRIC_EXPORT_INTERVAL", "1000")
        .args([
            "--span-groups",
            "per_step",
            "--exporter",
            "file",
            "--export-file",
        ])
        .arg(&path)
        .args(["--exec", "--", "env", "TRAINER_STEP_DELAY_MS=3000"])
        .arg(lens_tests::trainer())
        .arg("4")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let points = launch_points(&path);
    let _ = std::fs::remove_file(&path);
    let kernel: Vec<u64> = points
        .iter()
        .filter(|(kind, _)| kind == "kernel")
        .map(|(_, v)| *v)
        .collect();
    // Cumulative and never counted twice: the last report is the total.
    assert_eq!(kernel.last(), Some(&40), "{points:?}");
    assert!(kernel.windows(2).all(|w| w[0] <= w[1]), "{kernel:?}");
    // Reported before the job ended, not only at its end.
    assert!(
        kernel.iter().any(|v| (1..40).contains(v)),
        "no reading while running: {kernel:?}"
    );
    let last = |kind: &str| {
        points
            .iter()
            .rev()
            .find(|(k, _)| k == kind)
            .map(|(_, v)| *v)
    };
    assert_eq!(last("kernel_ex"), Some(4));
    assert_eq!(last("graph"), Some(4));
}

/// What the slow collector of [`a_slow_collector_loses_nothing_and_busy_answers_are_retried`]
/// received.
#[derive(Debug, Default)]
struct SlowCollectorLog {
    /// Spans in the requests it accepted.
    spans: u64,
    /// Requests answered 503 (to be retried).
    refused: u64,
    /// Requests whose body was gzipped.
    gzipped: u64,
    /// Requests answered 400 (a span named as the collector refuses).
    malformed: u64,
}

/// An OTLP/HTTP collector that answers each trace request after `delay` (a busy but
/// healthy backend), and, with `refuse_first`, the first one with `503` and
/// `Retry-After: 1`; a request holding a span whose name starts with `malformed` is
/// answered `400 Bad Request`, as a collector answers one it cannot take.
fn slow_collector(
    delay: Duration,
    refuse_first: bool,
    malformed: Option<&'static str>,
) -> (u16, Arc<Mutex<SlowCollectorLog>>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let log = Arc::new(Mutex::new(SlowCollectorLog::default()));
    let shared = Arc::clone(&log);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let log = Arc::clone(&shared);
            // A connection per export in flight: each answered on its own thread.
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut stream = stream;
                loop {
                    let mut request_line = String::new();
                    if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
                        return;
                    }
                    let (mut length, mut gzip) = (0usize, false);
                    loop {
                        let mut header = String::new();
                        reader.read_line(&mut header).unwrap();
                        let header = header.trim_end().to_ascii_lowercase();
                        if header.is_empty() {
                            break;
                        }
                        if let Some(value) = header.strip_prefix("content-length:") {
                            length = value.trim().parse().unwrap();
                        }
                        gzip |= header == "content-encoding: gzip";
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).unwrap();
                    let refuse = {
                        let mut log = log.lock().unwrap();
                        let first = refuse_first && log.refused == 0 && log.spans == 0;
                        log.refused += u64::from(first);
                        first
                    };
                    if refuse {
                        let _ = stream.write_all(
                            b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n\
                              Content-Length: 0\r\n\r\n",
                        );
                        continue;
                    }
                    std::thread::sleep(delay);
                    if gzip {
                        let mut plain = Vec::new();
                        flate2::read::GzDecoder::new(&body[..])
                            .read_to_end(&mut plain)
                            .unwrap();
                        body = plain;
                    }
                    let request = <ExportTraceServiceRequest as prost::Message>::decode(&body[..])
                        .expect("an OTLP trace request");
                    let spans: usize = request
                        .resource_spans
                        .iter()
                        .flat_map(|r| &r.scope_spans)
                        .map(|s| s.spans.len())
                        .sum();
                    let refused = malformed.is_some_and(|prefix| {
                        request
                            .resource_spans
                            .iter()
                            .flat_map(|r| &r.scope_spans)
                            .flat_map(|s| &s.spans)
                            .any(|span| span.name.starts_with(prefix))
                    });
                    if refused {
                        log.lock().unwrap().malformed += 1;
                        let _ = stream
                            .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
                        continue;
                    }
                    {
                        let mut log = log.lock().unwrap();
                        log.spans += spans as u64;
                        log.gzipped += u64::from(gzip);
                    }
                    let _ = stream.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n\
                          Content-Length: 0\r\n\r\n",
                    );
                }
            });
        }
    });
    (port, log)
}

#[test]
fn a_slow_collector_loses_nothing_and_busy_answers_are_retried() {
    let name = "a_slow_collector_loses_nothing";
    if !lens_tests::require_bpf(name) {
        return;
    }
    // Every answer takes 3 s (under the 10 s export timeout): exports overlap instead
    // of waiting for each other. The first answer is 503 + Retry-After: the batch is
    // sent again, not lost. Bodies are gzipped, as the standard variable asks.
    let (port, log) = slow_collector(Duration::from_secs(3), true, None);
    let output = Command::new(LENS_PROBE)
        .env(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            format!("http://127.0.0.1:{port}/v1/traces"),
        )
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .env("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        // Metrics go nowhere that answers: only the spans are counted here.
        .env(
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "http://127.0.0.1:9/v1/metrics",
        )
        .args(fast_trainer(300))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let line = export_line(&stderr);
    assert!(!line.contains("lost"), "{line}");
    let exported: u64 = line
        .split_whitespace()
        .find_map(|word| word.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(exported >= 300 * 7, "{line}");
    let log = log.lock().unwrap();
    assert_eq!(log.spans, exported, "the collector counted {log:?}: {line}");
    assert_eq!(log.refused, 1, "{log:?}");
    assert!(log.gzipped > 0, "{log:?}");
}

/// `lens-probe --span-groups per_step --exec` of the fake distributed trainer's `steps`
/// steps as fast as it goes (7 spans each).
fn fast_trainer(steps: u32) -> Vec<String> {
    let steps = steps.to_string();
    [
        "--span-groups",
        "per_step",
        "--exec",
        "--",
        "env",
        "TRAINER_DISTRIBUTED=1",
        "TRAINER_FORWARD_MS=0",
        "TRAINER_INIT_MS=0",
        "LENS_FAKE_BACKWARD_MS=0",
        "LENS_FAKE_COLLECTIVE_MS=0",
    ]
    .into_iter()
    .map(String::from)
    .chain([lens_tests::torch_trainer().display().to_string(), steps])
    .chain(["2", "0", "0"].map(String::from))
    .collect()
}

/// `N spans exported to the OTLP endpoint[; L lost (…)]`, the exit's export line.
fn export_line(stderr: &str) -> &str {
    stderr
        .lines()
        .find(|l| l.contains("spans exported to the OTLP endpoint"))
        .unwrap_or_else(|| panic!("no export line: {stderr}"))
}

/// The fake trainer's `steps` fast steps traced with spans to the OTLP/HTTP endpoint at
/// `port` and the spool `spool`.
fn traced_to_port_with_spool(port: u16, spool: &Path, steps: u32) -> (String, i32) {
    let output = Command::new(LENS_PROBE)
        .env(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            format!("http://127.0.0.1:{port}/v1/traces"),
        )
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .env(
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "http://127.0.0.1:9/v1/metrics",
        )
        .arg("--spool-dir")
        .arg(spool)
        .args(["--span-groups", "per_step", "--exec", "--", "env"])
        .args(["TRAINER_FORWARD_MS=0", "TRAINER_INIT_MS=0"])
        .args(["LENS_FAKE_BACKWARD_MS=0"])
        .arg(lens_tests::torch_trainer())
        .args([&steps.to_string(), "2", "0", "0"])
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&output.stderr).into_owned(),
        output.status.code().unwrap_or(-1),
    )
}

/// `lens-probe: spool DIR: K spans kept there this run, S sent from it, W waiting there
/// for the next run` → (K, S, W).
fn spool_line(stderr: &str) -> (u64, u64, u64) {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("lens-probe: spool "))
        .unwrap_or_else(|| panic!("no spool line: {stderr}"));
    let (_, counts) = line
        .split_once(": ")
        .unwrap()
        .1
        .split_once(": ")
        .unwrap_or(("", line));
    let numbers: Vec<u64> = counts
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    let [kept, sent, waiting] = numbers[..] else {
        panic!("{line}");
    };
    (kept, sent, waiting)
}

fn exported_count(stderr: &str) -> u64 {
    let line = export_line(stderr);
    assert!(!line.contains("lost"), "{line}");
    line.split_whitespace()
        .find_map(|word| word.parse().ok())
        .unwrap_or_else(|| panic!("{line}"))
}

#[test]
fn a_collector_down_then_back_gets_every_span_from_the_spool() {
    let name = "a_collector_down_then_back";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let spool = temp_path("spool-dir");
    let _ = std::fs::remove_dir_all(&spool);
    // Run 1: nothing listens on the endpoint. Every batch fails (after the exporter's
    // retries) and waits in the spool; none is lost.
    let (stderr, code) = traced_to_port_with_spool(free_port(), &spool, 200);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(exported_count(&stderr), 0, "{stderr}");
    let (kept, sent, waiting) = spool_line(&stderr);
    // A step, its forward-backward and its optimizer span each step.
    assert!(kept >= 200 * 3, "{stderr}");
    assert_eq!((sent, waiting), (0, kept), "{stderr}");
    // Run 2 (a new lens-probe, as after a restart): the collector answers. What run 1
    // left is sent first, then this run's own spans; the spool ends empty.
    let (port, log) = slow_collector(Duration::ZERO, false, None);
    let (stderr, code) = traced_to_port_with_spool(port, &spool, 20);
    assert_eq!(code, 0, "{stderr}");
    let exported = exported_count(&stderr);
    assert_eq!(spool_line(&stderr), (0, kept, 0), "{stderr}");
    assert!(exported >= kept + 20 * 3, "{stderr}");
    assert_eq!(log.lock().unwrap().spans, exported, "{stderr}");
    // Every batch gone (the directory's lock file stays).
    let left: Vec<_> = std::fs::read_dir(&spool)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|name| name.to_string_lossy().ends_with(".json"))
        .collect();
    assert!(left.is_empty(), "batches left in the spool: {left:?}");
    let _ = std::fs::remove_dir_all(&spool);
}

#[test]
fn a_spooled_batch_the_collector_refuses_as_malformed_does_not_hold_up_the_rest() {
    let name = "a_spooled_batch_refused_as_malformed";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let spool = temp_path("spool-malformed");
    let _ = std::fs::remove_dir_all(&spool);
    // The collector down: the run's batches wait in the spool.
    let (stderr, code) = traced_to_port_with_spool(lens_tests::free_port(), &spool, 200);
    assert_eq!(code, 0, "{stderr}");
    let (kept, _, waiting) = spool_line(&stderr);
    assert!(kept > 0 && waiting == kept, "{stderr}");
    // The oldest batch made one the collector will refuse at every try.
    let mut batches: Vec<PathBuf> = std::fs::read_dir(&spool)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    batches.sort();
    let oldest = &batches[0];
    let poisoned: u64 = oldest
        .file_stem()
        .and_then(|s| s.to_str()?.split_once('-')?.1.parse().ok())
        .unwrap();
    let text = std::fs::read_to_string(oldest).unwrap();
    assert!(text.contains("\"train."), "{text}");
    std::fs::write(oldest, text.replace("\"train.", "\"malformed.")).unwrap();
    // Back, refusing that batch: it is dropped and counted, every other one sent.
    let (port, log) = slow_collector(Duration::ZERO, false, Some("malformed."));
    let (stderr, code) = traced_to_port_with_spool(port, &spool, 20);
    assert_eq!(code, 0, "{stderr}");
    let (_, sent, waiting) = spool_line(&stderr);
    assert_eq!((sent, waiting), (kept - poisoned, 0), "{stderr}");
    assert!(
        stderr.contains("refused a spooled batch as malformed")
            && stderr.contains(&format!("its {poisoned} spans are dropped")),
        "{stderr}"
    );
    assert_eq!(
        log.lock().unwrap().malformed,
        1,
        "refused once, not retried"
    );
    let _ = std::fs::remove_dir_all(&spool);
}
