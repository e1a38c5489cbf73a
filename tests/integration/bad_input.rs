//! Bad input (issue 7, item 4): every flag and environment value lens-probe reads gives
//! one clear line naming the key and the valid values, exit 2; the event decoder and the
//! spec parsers are fuzzed (proptest) in the suite.
//!
//! The first half runs the binary on one table of bad values; every run would trace pid 1
//! if the value were accepted, so a row that passes has failed on its value before
//! anything was loaded (and none of these tests needs root). The second half is property
//! tests over the parsers and the decoder, with a fixed seed and no failure files so that
//! CI runs the same cases every time.
use std::{
    collections::BTreeSet,
    ffi::{OsStr, OsString},
    os::unix::ffi::OsStrExt,
    process::Output,
};

use lens_common::record::{
    self as raw, Body, CallTimes, LaunchMark, NONE_I32, Record, RecordHeader, record_bytes,
};
use lens_common::{EventKind, ProbeId, SCOPE_NAME_BYTES};
use lens_probe::{
    budget::OverheadBudget,
    discovery::NodeFilter,
    events::{self, ControlEvent, DecodeError, Decoded, PhaseSignal, ProbeEvent, PythonCaller},
    export::{
        config::{self, ExportSettings},
        strategy::ExportStrategy,
    },
    settings::{
        cli::{self, Cli, Rejected},
        groups::{SpanGroup, SpanGroups},
    },
};
use lens_tests::{assert_one_line_error, stderr_text};
use proptest::{
    prelude::*,
    sample::select,
    test_runner::{Config as ProptestConfig, RngSeed},
};

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

/// lens-probe with these arguments and exactly these of its settings variables.
fn lens_probe<V: AsRef<OsStr>>(args: &[&str], env: &[(&str, V)]) -> Output {
    let mut command = lens_tests::lens_probe_command(LENS_PROBE);
    command.args(args);
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().unwrap()
}

const VALID_GROUPS: &str = "valid: all, checkpoint, default, evaluate, forward_backward, job, \
                            load_checkpoint, model_init, optimizer, per_step, step";
const STRATEGIES: &str = "expected one of single_rank, all_ranks, sampled, first_rank_per_node";
const URL: &str = "expected a URL such as http://collector:4317 (http or https)";
const MILLISECONDS: &str = "expected a whole number of milliseconds, such as 10000";
const HEADERS: &str = "expected comma-separated key=value pairs, values percent-encoded";
const WRITABLE: &str = "expected a file lens-probe can create or overwrite";
const OTLP: (&str, &str) = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317");

/// One bad input: arguments (after the program name), variables, and what the line must
/// say: the key, then what it takes.
type Row = (
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
    &'static [&'static str],
);

#[rustfmt::skip]
const TABLE: &[Row] = &[
    // Flags.
    (&["--pid", "abc"], &[], &["for --pid:", "a positive integer"]),
    (&["--pid", "0"], &[], &["for --pid:", "a positive integer"]),
    (&["--pid", "-7"], &[], &["for --pid:", "a positive integer"]),
    (&["-p", "99999999999"], &[], &["for --pid:", "a positive integer"]),
    (&["--pid"], &[], &["'--pid <PID>...'", "a value is required"]),
    (&["--pid", "1", "--span-groups", "steps"], &[], &["for --span-groups:", "unknown span group \"steps\"", VALID_GROUPS]),
    (&["--pid", "1", "--span-groups", ""], &[], &["for --span-groups:", "empty group name", VALID_GROUPS]),
    (&["--pid", "1", "--span-groups", "job,,step"], &[], &["for --span-groups:", VALID_GROUPS]),
    (&["--pid", "1", "--exporter", "jaeger"], &[], &["for --exporter:", "expected one of otlp, console, file"]),
    (&["--pid", "1", "--exporter", "file"], &[], &["for --exporter:", "needs --export-file PATH (or LENS_PROBE_EXPORT_FILE)"]),
    (&["--pid", "1", "--exporter", "file", "--export-file", "/"], &[], &["for --export-file:", "is a directory", WRITABLE]),
    (&["--pid", "1", "--exporter", "file", "--export-file", "/nonexistent/spans.jsonl"], &[], &["for --export-file:", "directory /nonexistent does not exist", WRITABLE]),
    (&["--pid", "1", "--export-strategy", "round_robin"], &[], &["for --export-strategy:", STRATEGIES]),
    (&["--pid", "1", "--export-rank", "last"], &[], &["for --export-rank:", "must be an integer (-1: the last rank)"]),
    (&["--pid", "1", "--export-rank", "1.5"], &[], &["for --export-rank:", "must be an integer"]),
    (&["--pid", "1", "--export-sample-rate", "2"], &[], &["for --export-sample-rate:", "must be between 0 and 1"]),
    (&["--pid", "1", "--export-sample-rate", "half"], &[], &["for --export-sample-rate:", "a number between 0 and 1"]),
    (&["--pid", "1", "--duration", "soon"], &[], &["for --duration:", "expected a positive duration such as 30s, 5m or 1h"]),
    (&["--pid", "1", "--duration", "0"], &[], &["for --duration:", "expected a positive duration"]),
    (&["--pid", "1", "--duration", "-5"], &[], &["for --duration:", "expected a positive duration"]),
    (&["--pid", "1", "--duration", "1e30"], &[], &["for --duration:", "too long"]),
    (&["--pid", "1", "--duration", ""], &[], &["for --duration:", "expected a positive duration"]),
    (&["--pid", "1", "--overhead-budget", "150%"], &[], &["for --overhead-budget:", "above 0 and at most 100, e.g. 1% or 0.5%"]),
    (&["--pid", "1", "--overhead-budget", "0"], &[], &["for --overhead-budget:", "above 0 and at most 100"]),
    (&["--pid", "1", "--overhead-budget", "-1%"], &[], &["for --overhead-budget:", "above 0 and at most 100"]),
    (&["--pid", "1", "--hang-timeout", "soon"], &[], &["for --hang-timeout:", "positive duration such as 30s, 5m or 1h (or 0 for off)"]),
    (&["--pid", "1", "--hang-timeout", "-3s"], &[], &["for --hang-timeout:", "(or 0 for off)"]),
    (&["--pid", "1", "--uprobe-links", "many"], &[], &["for --uprobe-links:", "unknown uprobe link kind; valid: auto, multi, perf"]),
    (&["--pid", "1", "--summary-json", "/"], &[], &["for --summary-json:", "is a directory", WRITABLE]),
    (&["--pid", "1", "--summary-json", "/nonexistent/summary.json"], &[], &["for --summary-json:", "does not exist", WRITABLE]),
    (&["--pid", "1", "--pid-file", "/nonexistent/dir/lens.pid"], &[], &["for --pid-file:", "directory /nonexistent/dir does not exist", WRITABLE]),
    (&["--pid", "1", "--pid-file", "/proc/version/lens.pid"], &[], &["for --pid-file:", "/proc/version is not a directory", WRITABLE]),
    (&["--node", "--match-env", "novalue"], &[], &["for --match-env:", "expected KEY=VALUE"]),
    (&["--node", "--match-env", "=x"], &[], &["for --match-env:", "expected KEY=VALUE"]),
    (&["--node", "--match", ""], &[], &["for --match:", "expected some text"]),
    (&["--node", "--match-cgroup", ""], &[], &["for --match-cgroup:", "expected some text"]),
    // The variables of the flags: the line names the variable.
    (&["--pid", "1"], &[("NEMO_LENS_SPAN_GROUPS", "bogus")], &["for NEMO_LENS_SPAN_GROUPS:", "unknown span group \"bogus\"", VALID_GROUPS]),
    (&["--pid", "1"], &[("NEMO_LENS_EXPORTER", "jaeger")], &["for NEMO_LENS_EXPORTER:", "expected one of otlp, console, file"]),
    (&["--pid", "1"], &[("NEMO_LENS_EXPORTER", "file")], &["for NEMO_LENS_EXPORTER:", "needs --export-file PATH (or LENS_PROBE_EXPORT_FILE)"]),
    (&["--pid", "1"], &[("NEMO_LENS_EXPORTER", "file"), ("LENS_PROBE_EXPORT_FILE", "/")], &["for LENS_PROBE_EXPORT_FILE:", "is a directory", WRITABLE]),
    (&["--pid", "1"], &[("NEMO_LENS_EXPORT_STRATEGY", "round_robin")], &["for NEMO_LENS_EXPORT_STRATEGY:", STRATEGIES]),
    (&["--pid", "1"], &[("NEMO_LENS_EXPORT_RANK", "x")], &["for NEMO_LENS_EXPORT_RANK:", "must be an integer"]),
    (&["--pid", "1"], &[("NEMO_LENS_EXPORT_SAMPLE_RATE", "1.5")], &["for NEMO_LENS_EXPORT_SAMPLE_RATE:", "must be between 0 and 1"]),
    (&["--pid", "1"], &[("NEMO_LENS_EXPORT_SAMPLE_RATE", "NaN")], &["for NEMO_LENS_EXPORT_SAMPLE_RATE:", "must be between 0 and 1"]),
    (&["--pid", "1"], &[("NEMO_LENS_ENABLED", "maybe")], &["for NEMO_LENS_ENABLED:", "expected 1/0, true/false, yes/no or on/off"]),
    (&["--pid", "1"], &[("LENS_PROBE_OVERHEAD_BUDGET", "lots")], &["for LENS_PROBE_OVERHEAD_BUDGET:", "above 0 and at most 100"]),
    (&["--pid", "1"], &[("LENS_PROBE_HANG_TIMEOUT", "never")], &["for LENS_PROBE_HANG_TIMEOUT:", "(or 0 for off)"]),
    (&["--pid", "1"], &[("LENS_PROBE_UPROBE_LINKS", "0")], &["for LENS_PROBE_UPROBE_LINKS:", "unknown uprobe link kind; valid: auto, multi, perf"]),
    // The flag wins over its variable, and is named.
    (&["--pid", "1", "--span-groups", "steps"], &[("NEMO_LENS_SPAN_GROUPS", "bogus")], &["for --span-groups:"]),
    (&["--pid", "1", "--exporter", "jaeger"], &[("NEMO_LENS_EXPORTER", "zipkin")], &["for --exporter:"]),
    // A blank variable is unset: the next bad value is the one reported.
    (&["--pid", "1", "--exporter", "foo"], &[("NEMO_LENS_SPAN_GROUPS", "")], &["for --exporter:"]),
    (&["--pid", "1", "--exporter", "foo"], &[("LENS_PROBE_OVERHEAD_BUDGET", " ")], &["for --exporter:"]),
    (&["--pid", "1", "--export-strategy", "x"], &[("NEMO_LENS_EXPORTER", ""), ("NEMO_LENS_EXPORT_RANK", " ")], &["for --export-strategy:"]),
    // OpenTelemetry's variables, for the exporter that reads them.
    (&["--pid", "1", "--exporter", "otlp"], &[("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")], &["for OTEL_EXPORTER_OTLP_PROTOCOL:", "expected grpc, http/protobuf or http/json"]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "HTTP")], &["for OTEL_EXPORTER_OTLP_TRACES_PROTOCOL:", "expected grpc, http/protobuf or http/json"]),
    (&["--pid", "1"], &[("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url")], &["for OTEL_EXPORTER_OTLP_ENDPOINT:", "no scheme", URL]),
    (&["--pid", "1"], &[("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4317")], &["for OTEL_EXPORTER_OTLP_ENDPOINT:", "no scheme", URL]),
    (&["--pid", "1"], &[("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://collector:4317")], &["for OTEL_EXPORTER_OTLP_ENDPOINT:", "scheme \"ftp\" is not http or https", URL]),
    (&["--pid", "1"], &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:99999")], &["for OTEL_EXPORTER_OTLP_ENDPOINT:", "port must be a number from 1 to 65535", URL]),
    (&["--pid", "1"], &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://")], &["for OTEL_EXPORTER_OTLP_ENDPOINT:", "no host", URL]),
    (&["--pid", "1"], &[("OTEL_EXPORTER_OTLP_ENDPOINT", " http://collector:4317")], &["for OTEL_EXPORTER_OTLP_ENDPOINT:", "blanks around it", URL]),
    (&["--pid", "1", "--exporter", "otlp"], &[("OTEL_EXPORTER_OTLP_ENDPOINT", "")], &["for OTEL_EXPORTER_OTLP_ENDPOINT:", "empty", URL]),
    (&["--pid", "1"], &[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1 traces")], &["for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:", URL]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "")], &["for OTEL_EXPORTER_OTLP_METRICS_ENDPOINT:", "empty", URL]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc")], &["for OTEL_EXPORTER_OTLP_TIMEOUT:", MILLISECONDS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_TIMEOUT", "10s")], &["for OTEL_EXPORTER_OTLP_TIMEOUT:", MILLISECONDS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_TIMEOUT", "-1")], &["for OTEL_EXPORTER_OTLP_TIMEOUT:", MILLISECONDS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1.5")], &["for OTEL_EXPORTER_OTLP_TRACES_TIMEOUT:", MILLISECONDS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", " 500")], &["for OTEL_EXPORTER_OTLP_METRICS_TIMEOUT:", MILLISECONDS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_HEADERS", "abc")], &["for OTEL_EXPORTER_OTLP_HEADERS", "item 1 has no '='", HEADERS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_HEADERS", "a=1,=x")], &["for OTEL_EXPORTER_OTLP_HEADERS", "item 2 has no key", HEADERS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=")], &["for OTEL_EXPORTER_OTLP_HEADERS", "(api-key) has an empty value", HEADERS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_HEADERS", "bad key=v")], &["for OTEL_EXPORTER_OTLP_HEADERS", "is not an HTTP header name", HEADERS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_HEADERS", "k=%zz")], &["for OTEL_EXPORTER_OTLP_HEADERS", "bad percent-encoding", HEADERS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "k=caf%C3%A9")], &["for OTEL_EXPORTER_OTLP_TRACES_HEADERS", "not visible ASCII", HEADERS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "k")], &["for OTEL_EXPORTER_OTLP_METRICS_HEADERS", HEADERS]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd")], &["for OTEL_EXPORTER_OTLP_COMPRESSION:", "gzip only", "unset it"]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "none")], &["for OTEL_EXPORTER_OTLP_TRACES_COMPRESSION:", "unset it"]),
    (&["--pid", "1"], &[OTLP, ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "")], &["for OTEL_EXPORTER_OTLP_METRICS_COMPRESSION:", "unset it"]),
    (&["--pid", "1"], &[OTLP, ("OTEL_METRIC_EXPORT_INTERVAL", "abc")], &["for OTEL_METRIC_EXPORT_INTERVAL:", "a positive whole number of milliseconds, such as 60000"]),
    (&["--pid", "1"], &[OTLP, ("OTEL_METRIC_EXPORT_INTERVAL", "0")], &["for OTEL_METRIC_EXPORT_INTERVAL:", "a positive whole number of milliseconds"]),
    (&["--pid", "1", "--exporter", "file", "--export-file", "/dev/null"], &[("OTEL_METRIC_EXPORT_INTERVAL", "1s")], &["for OTEL_METRIC_EXPORT_INTERVAL:", "milliseconds"]),
    // The console exporter reads no OTLP variable: the next bad value is the one reported.
    (&["--pid", "1", "--exporter", "console", "--export-rank", "x"], &[("OTEL_EXPORTER_OTLP_TIMEOUT", "abc"), ("OTEL_METRIC_EXPORT_INTERVAL", "x")], &["for --export-rank:"]),
];

#[test]
fn every_bad_value_is_one_line_naming_the_key_and_what_it_takes_exit_2() {
    let mut failures = Vec::new();
    for (args, env, needles) in TABLE {
        let output = lens_probe(args, env);
        let text = stderr_text(&output);
        let line = text.strip_prefix("lens-probe: ").unwrap_or(&text);
        let ok = output.status.code() == Some(2)
            && text.starts_with("lens-probe: ")
            && text.lines().count() == 1
            && needles.iter().all(|needle| line.contains(needle));
        if !ok {
            failures.push(format!(
                "{args:?} {env:?}: exit {:?}, stderr {text:?}, wanted {needles:?}",
                output.status.code()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        TABLE.len(),
        failures.join("\n")
    );
}

#[test]
fn bytes_that_are_not_utf8_are_named_too() {
    let bytes = |b: &[u8]| OsStr::from_bytes(b).to_os_string();
    let cases: [(&str, OsString, &str); 4] = [
        (
            "NEMO_LENS_EXPORTER",
            bytes(b"otl\xff"),
            "for NEMO_LENS_EXPORTER: not valid UTF-8",
        ),
        (
            "NEMO_LENS_SPAN_GROUPS",
            bytes(b"\xffjob"),
            "for NEMO_LENS_SPAN_GROUPS: not valid UTF-8",
        ),
        (
            "NEMO_LENS_ENABLED",
            bytes(b"\xff"),
            "for NEMO_LENS_ENABLED:",
        ),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            bytes(b"http://c\xff:4317"),
            "bad character in the host",
        ),
    ];
    for (key, value, needle) in cases {
        assert_one_line_error(&lens_probe(&["--pid", "1"], &[(key, value)]), 2, needle);
    }
}

#[test]
fn credentials_in_bad_otlp_values_are_not_printed() {
    let output = lens_probe(
        &["--pid", "1"],
        &[
            OTLP,
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "authorization=Bearer%20s3cret,s3cret",
            ),
        ],
    );
    assert_one_line_error(
        &output,
        2,
        "(not shown: it may hold credentials): item 2 has no '='",
    );
    assert!(
        !stderr_text(&output).contains("s3cret"),
        "{}",
        stderr_text(&output)
    );
    let output = lens_probe(
        &["--pid", "1"],
        &[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "https://user:s3cret@collector:99999",
        )],
    );
    assert_one_line_error(&output, 2, "\"https://…@collector:99999\"");
    assert!(
        !stderr_text(&output).contains("s3cret"),
        "{}",
        stderr_text(&output)
    );
}

// Property tests.

/// A fixed seed and no failure files: the same cases on every run.
fn cases(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(0x6c65_6e73),
        ..ProptestConfig::default()
    }
}

/// A record of `B` read from the front of `bytes` (long enough).
fn record_from<B: Body>(bytes: &[u8]) -> Record<B> {
    assert!(bytes.len() >= size_of::<Record<B>>());
    // SAFETY: long enough; a record is plain integers, valid for any bit pattern.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) }
}

fn header_of(bytes: &[u8]) -> RecordHeader {
    assert!(bytes.len() >= size_of::<RecordHeader>());
    // SAFETY: long enough; plain integers, valid for any bit pattern.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) }
}

/// The probes each kind comes from (`None`: the header's probe is not read).
fn probes_of(kind: EventKind) -> Option<Vec<u32>> {
    use ProbeId::*;
    let ids = |ids: &[ProbeId]| Some(ids.iter().map(|&p| p as u32).collect());
    match kind {
        EventKind::Collective => ids(&[
            NcclAllReduce,
            NcclBroadcast,
            NcclReduce,
            NcclAllGather,
            NcclReduceScatter,
            NcclSend,
            NcclRecv,
            NcclAlltoAll,
        ]),
        EventKind::TimedCall => ids(&[
            GlooAllReduce,
            GlooBroadcast,
            GlooReduce,
            GlooAllGather,
            GlooReduceScatter,
            GlooSend,
            GlooRecv,
            GlooBarrier,
        ]),
        EventKind::SyncWait => ids(&[
            CudaStreamSynchronize,
            CudaEventSynchronize,
            CudaDeviceSynchronize,
        ]),
        EventKind::CommInit => ids(&[NcclCommInitRank]),
        EventKind::EventQueried => ids(&[CudaEventQuery]),
        EventKind::Group => ids(&[NcclGroupStart, NcclGroupEnd]),
        EventKind::EventRecorded => ids(&[CudaEventRecord, CudaEventRecordWithFlags]),
        EventKind::PhaseEntry => ids(&[
            TorchScopeExit,
            TorchBackward,
            TorchGradMode,
            TorchInferenceMode,
            CheckpointWriterOpen,
            CheckpointReaderOpen,
            SafetensorsSerializeFile,
            SafetensorsOpen,
            FileOpen,
            FileOpenAt,
        ]),
        EventKind::PhaseReturn => ids(&[
            TorchBackwardReturn,
            CheckpointWriterClose,
            CheckpointReaderClose,
            SafetensorsSerializeFile,
            SafetensorsClose,
        ]),
        EventKind::ScopeEnter => ids(&[TorchScopeEnter]),
        EventKind::ApiCall => ids(&[
            CudaMalloc,
            CudaMallocAsync,
            CudaMallocManaged,
            CudaFree,
            CudaFreeAsync,
            CuMemAlloc,
            CuMemFree,
            CuMemAllocAsync,
            CuMemFreeAsync,
            CuMemCreate,
            CuMemMap,
            CuMemUnmap,
            CuMemRelease,
            CudaGraphLaunch,
            CuGraphLaunch,
            CudaStreamBeginCapture,
            CudaStreamEndCapture,
            CuStreamBeginCapture,
            CuStreamEndCapture,
            CudaGraphInstantiate,
            CudaGraphInstantiateWithFlags,
            CuGraphInstantiate,
            TorchMemoryUsage,
        ]),
        EventKind::RuleEntry | EventKind::RuleReturn => Some(
            (lens_common::RULE_COOKIE_BASE..lens_common::RULE_COOKIE_BASE + lens_common::MAX_RULES)
                .collect(),
        ),
        EventKind::PyStack
        | EventKind::LinkMapChanged
        | EventKind::ProcessForked
        | EventKind::ProcessExec
        | EventKind::ProcessExit => None,
    }
}

/// As `assert_fields`, for the process-lifecycle notices.
fn assert_control_fields(bytes: &[u8], control: &ControlEvent) -> Result<(), TestCaseError> {
    let kind = EventKind::from_u32(header_of(bytes).kind);
    match *control {
        ControlEvent::LinkMapChanged {
            tgid,
            stopped,
            traced,
        } => {
            prop_assert_eq!(kind, Some(EventKind::LinkMapChanged));
            let raw = record_from::<raw::LinkMapChange>(bytes);
            prop_assert_eq!(
                (tgid, stopped, traced),
                (raw.header.tgid, raw.body.stopped == 1, raw.body.traced == 1)
            );
        }
        ControlEvent::ProcessForked { parent, child } => {
            prop_assert_eq!(kind, Some(EventKind::ProcessForked));
            let raw = record_from::<raw::Fork>(bytes);
            prop_assert_eq!((parent, child), (raw.body.parent, raw.header.tgid));
        }
        ControlEvent::ProcessExec { tgid, traced } => {
            prop_assert_eq!(kind, Some(EventKind::ProcessExec));
            let raw = record_from::<raw::Exec>(bytes);
            prop_assert_eq!((tgid, traced), (raw.header.tgid, raw.body.traced == 1));
        }
        ControlEvent::ProcessExit { tgid, wait_status } => {
            prop_assert_eq!(kind, Some(EventKind::ProcessExit));
            let raw = record_from::<raw::Exit>(bytes);
            prop_assert_eq!((tgid, wait_status), (raw.header.tgid, raw.body.wait_status));
        }
    }
    Ok(())
}

/// Every field of the record in `bytes` that the decoded event carries, and the variant
/// for its kind and probe.
fn assert_fields(bytes: &[u8], decoded: &Decoded) -> Result<(), TestCaseError> {
    let event = match decoded {
        Decoded::Control(control) => return assert_control_fields(bytes, control),
        Decoded::Probe(event) => event,
    };
    let header = header_of(bytes);
    let kind = EventKind::from_u32(header.kind);
    prop_assert!(
        probes_of(kind.unwrap()).is_none_or(|probes| probes.contains(&header.probe)),
        "{:?} decoded from probe {}",
        kind,
        header.probe
    );
    prop_assert_eq!(event.tgid(), header.tgid);
    let timing_is = |timing: &events::CallTiming, times: CallTimes| {
        (timing.tgid, timing.tid, timing.start_ns, timing.end_ns)
            == (header.tgid, header.tid, times.start_ns, times.end_ns)
    };
    let instant = |at_ns: u64| CallTimes {
        start_ns: at_ns,
        end_ns: at_ns,
    };
    let mark_is = |(tid, at_ns, launches, epoch): (u32, u64, u64, u64), mark: LaunchMark| {
        (tid, at_ns, launches, epoch) == (header.tid, mark.at_ns, mark.launches, mark.epoch)
    };
    match event {
        ProbeEvent::Collective {
            timing,
            count,
            raw_datatype,
            redop,
            peer,
            comm,
            stream,
            result,
            python_caller,
            ..
        } => {
            prop_assert_eq!(kind, Some(EventKind::Collective));
            let raw = record_from::<raw::CollectiveCall>(bytes).body;
            prop_assert!(timing_is(timing, raw.times));
            prop_assert_eq!(
                (*count, *raw_datatype, *comm, *stream, *result),
                (raw.count, raw.datatype, raw.comm, raw.stream, raw.result)
            );
            prop_assert_eq!(python_caller, &PythonCaller::from_code(raw.python_caller));
            prop_assert_eq!(*peer, (raw.peer != NONE_I32).then_some(raw.peer));
            prop_assert_eq!(redop.is_some(), raw.redop != NONE_I32);
        }
        ProbeEvent::GlooCall { timing, group, .. } => {
            prop_assert_eq!(kind, Some(EventKind::TimedCall));
            let raw = record_from::<raw::TimedCall>(bytes).body;
            prop_assert!(timing_is(timing, raw.times));
            prop_assert_eq!(*group, raw.object);
        }
        ProbeEvent::PyStack {
            tid,
            synchronous,
            since_ns,
            at_ns,
            launches,
            epoch,
            frames,
            ..
        } => {
            prop_assert_eq!(kind, Some(EventKind::PyStack));
            let raw = record_from::<raw::PyStack>(bytes).body;
            prop_assert!(mark_is((*tid, *at_ns, *launches, *epoch), raw.mark));
            prop_assert_eq!(*synchronous, raw.synchronous != 0);
            prop_assert_eq!(*since_ns, (raw.since_ns != 0).then_some(raw.since_ns));
            let walked = (raw.depth as usize).min(lens_common::PY_MAX_WALK);
            prop_assert_eq!(frames.len(), walked.min(lens_common::PY_MAX_DEPTH));
            // The outermost frame walked is the last one.
            if let Some(last) = frames.last() {
                let slot = (walked - 1) % lens_common::PY_MAX_DEPTH;
                prop_assert_eq!(
                    (last.code, last.frame, last.first_local),
                    (raw.code[slot], raw.frame[slot], raw.first_local[slot])
                );
            }
        }
        ProbeEvent::EventRecorded {
            timing,
            event,
            stream,
        } => {
            prop_assert_eq!(kind, Some(EventKind::EventRecorded));
            let raw = record_from::<raw::EventRecord>(bytes).body;
            prop_assert!(timing_is(timing, instant(raw.at_ns)));
            prop_assert_eq!((*event, *stream), (raw.event, raw.stream));
        }
        ProbeEvent::EventQueryComplete {
            timing,
            event,
            not_ready_ns,
        } => {
            prop_assert_eq!(kind, Some(EventKind::EventQueried));
            let raw = record_from::<raw::EventQuery>(bytes).body;
            prop_assert!(timing_is(timing, raw.times));
            prop_assert_eq!(*event, raw.event);
            prop_assert_eq!(
                *not_ready_ns,
                (raw.not_ready_ns != 0).then_some(raw.not_ready_ns)
            );
        }
        ProbeEvent::SyncWait {
            timing,
            handle,
            result,
            python_caller,
            ..
        } => {
            prop_assert_eq!(kind, Some(EventKind::SyncWait));
            let raw = record_from::<raw::SyncCall>(bytes).body;
            prop_assert!(timing_is(timing, raw.times));
            prop_assert_eq!((*handle, *result), (raw.handle, raw.result));
            prop_assert_eq!(python_caller, &PythonCaller::from_code(raw.python_caller));
        }
        ProbeEvent::CommInit {
            timing,
            comm,
            rank,
            nranks,
            comm_id_hash,
            result,
        } => {
            prop_assert_eq!(kind, Some(EventKind::CommInit));
            let raw = record_from::<raw::CommInitCall>(bytes).body;
            prop_assert!(timing_is(timing, raw.times));
            prop_assert_eq!(
                (*comm, *rank, *nranks, *comm_id_hash, *result),
                (raw.comm, raw.rank, raw.nranks, raw.comm_id_hash, raw.result)
            );
        }
        ProbeEvent::Group { timing, open } => {
            prop_assert_eq!(kind, Some(EventKind::Group));
            let raw = record_from::<raw::GroupCall>(bytes).body;
            prop_assert!(timing_is(timing, instant(raw.at_ns)));
            prop_assert_eq!(*open, raw.open != 0);
        }
        ProbeEvent::Phase {
            tid,
            at_ns,
            launches,
            epoch,
            signal,
            ..
        } => {
            let found = (*tid, *at_ns, *launches, *epoch);
            match kind {
                Some(EventKind::PhaseEntry) => {
                    let raw = record_from::<raw::PhaseEntry>(bytes).body;
                    prop_assert!(mark_is(found, raw.mark));
                }
                Some(EventKind::PhaseReturn) => {
                    let raw = record_from::<raw::PhaseReturn>(bytes).body;
                    prop_assert!(mark_is(found, raw.mark));
                }
                Some(EventKind::ScopeEnter) => {
                    let raw = record_from::<raw::ScopeEnter>(bytes).body;
                    prop_assert!(mark_is(found, raw.mark));
                    let len = (raw.name_len as usize).min(SCOPE_NAME_BYTES);
                    let PhaseSignal::ScopeEnter { name, .. } = signal else {
                        return Err(TestCaseError::fail("a scope entry without its name"));
                    };
                    prop_assert_eq!(name, &String::from_utf8_lossy(&raw.name[..len]));
                }
                other => prop_assert!(false, "a phase from a {:?} record", other),
            }
        }
        ProbeEvent::RuleCall {
            tid,
            at_ns,
            launches,
            epoch,
            rule,
            at_return,
            args,
            text,
            ret,
            ..
        } => {
            prop_assert_eq!(Some(*rule), lens_common::rule_index(header.probe));
            let found = (*tid, *at_ns, *launches, *epoch);
            match kind {
                Some(EventKind::RuleEntry) => {
                    let raw = record_from::<raw::RuleEntry>(bytes).body;
                    prop_assert!(mark_is(found, raw.mark));
                    prop_assert_eq!((*at_return, *args), (false, raw.args));
                    let len = (raw.text_len as usize).min(SCOPE_NAME_BYTES);
                    let expected =
                        (len > 0).then(|| String::from_utf8_lossy(&raw.text[..len]).into_owned());
                    prop_assert_eq!(text, &expected);
                }
                Some(EventKind::RuleReturn) => {
                    let raw = record_from::<raw::RuleReturn>(bytes).body;
                    prop_assert!(mark_is(found, raw.mark));
                    prop_assert_eq!((*at_return, *ret), (true, raw.ret));
                }
                other => prop_assert!(false, "a rule call from a {:?} record", other),
            }
        }
        ProbeEvent::ApiCall {
            timing,
            probe,
            args,
            out,
            result,
            memory,
        } => {
            prop_assert_eq!(kind, Some(EventKind::ApiCall));
            let raw = record_from::<raw::ApiCall>(bytes).body;
            prop_assert!(timing_is(timing, raw.times));
            prop_assert_eq!(*probe as u32, header.probe);
            prop_assert_eq!((*args, *out, *result), (raw.args, raw.out, raw.result));
            // The session fills it in; the decoder never guesses it.
            prop_assert!(memory.is_none());
        }
    }
    Ok(())
}

/// A valid kind and a probe it comes from.
fn valid_kind_probe() -> impl Strategy<Value = (u32, u32)> {
    select(EventKind::ALL.to_vec()).prop_flat_map(|kind| {
        let probes = probes_of(kind).unwrap_or_else(|| (0..ProbeId::COUNT as u32 + 4).collect());
        (Just(kind as u32), select(probes))
    })
}

/// The longest record the kernel sends.
const LONGEST_RECORD: usize = size_of::<Record<raw::PyStack>>();

/// `bytes` with the header's kind and probe replaced, cut to the kind's record (a known
/// kind) or left as they are.
fn with_header(mut bytes: Vec<u8>, kind: u32, probe: u32) -> Vec<u8> {
    bytes[..4].copy_from_slice(&kind.to_ne_bytes());
    bytes[4..8].copy_from_slice(&probe.to_ne_bytes());
    if let Some(known) = EventKind::from_u32(kind) {
        bytes.truncate(record_bytes(known));
    }
    bytes
}

proptest! {
    #![proptest_config(cases(3000))]

    /// Any record from the ring buffer decodes or is refused, never a panic; short ones
    /// are refused as such.
    #[test]
    fn the_decoder_takes_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..LONGEST_RECORD + 64)) {
        let known = (bytes.len() >= size_of::<RecordHeader>())
            .then(|| EventKind::from_u32(header_of(&bytes).kind))
            .flatten();
        match events::decode(&bytes) {
            Err(DecodeError::TooShort(n)) => {
                prop_assert_eq!(n, bytes.len());
                prop_assert!(
                    n < size_of::<RecordHeader>() || known.is_some_and(|k| n < record_bytes(k))
                );
            }
            Err(DecodeError::UnknownKind(k)) => {
                prop_assert_eq!(k, header_of(&bytes).kind);
                prop_assert!(known.is_none());
            }
            Err(DecodeError::UnknownProbe(p)) => {
                prop_assert_eq!(p, header_of(&bytes).probe);
                prop_assert!(probes_of(known.unwrap()).is_some_and(|probes| !probes.contains(&p)));
            }
            Ok(event) => assert_fields(&bytes, &event)?,
        }
    }

    /// Any kind and probe with any field values: decoded with every field where it
    /// belongs, or refused for the kind or the probe, exactly when the kernel never sends
    /// that kind from that probe.
    #[test]
    fn the_decoder_takes_any_record(
        bytes in prop::collection::vec(any::<u8>(), LONGEST_RECORD),
        kind in 0u32..EventKind::COUNT as u32 + 3,
        probe in prop_oneof![
            0..ProbeId::COUNT as u32 + 4,
            lens_common::RULE_COOKIE_BASE - 1..lens_common::RULE_COOKIE_BASE + lens_common::MAX_RULES + 1,
            Just(u32::MAX),
        ],
    ) {
        let bytes = with_header(bytes, kind, probe);
        match events::decode(&bytes) {
            Ok(event) => assert_fields(&bytes, &event)?,
            Err(DecodeError::UnknownKind(k)) => {
                prop_assert_eq!(k, kind);
                prop_assert!(EventKind::from_u32(kind).is_none());
            }
            Err(DecodeError::UnknownProbe(p)) => {
                prop_assert_eq!(p, probe);
                let known = EventKind::from_u32(kind);
                prop_assert!(probes_of(known.unwrap()).is_some_and(|probes| !probes.contains(&p)));
            }
            Err(DecodeError::TooShort(n)) => {
                prop_assert!(false, "a whole {} record of {} bytes refused as short", kind, n);
            }
        }
    }

    /// What the kernel side sends always decodes, with its fields.
    #[test]
    fn valid_records_round_trip(
        bytes in prop::collection::vec(any::<u8>(), LONGEST_RECORD),
        (kind, probe) in valid_kind_probe(),
    ) {
        let bytes = with_header(bytes, kind, probe);
        let event = events::decode(&bytes);
        prop_assert!(event.is_ok(), "{:?} for kind {} probe {}", event, kind, probe);
        assert_fields(&bytes, &event.unwrap())?;
    }
}

/// A span group spec word: a valid name in any case, with blanks around it.
fn spec_word(names: Vec<&'static str>) -> impl Strategy<Value = (String, &'static str)> {
    (select(names), any::<u64>(), "[ \t]{0,2}", "[ \t]{0,2}").prop_map(|(name, case, pre, post)| {
        let cased: String = name
            .chars()
            .enumerate()
            .map(|(i, c)| {
                if (case >> (i % 64)) & 1 == 1 {
                    c.to_ascii_uppercase()
                } else {
                    c
                }
            })
            .collect();
        (format!("{pre}{cased}{post}"), name)
    })
}

fn groups_of(name: &str) -> Vec<SpanGroup> {
    match name {
        "default" => SpanGroups::default().iter().collect(),
        "per_step" | "all" => SpanGroup::ALL.to_vec(),
        other => SpanGroup::ALL
            .into_iter()
            .filter(|g| g.name() == other)
            .collect(),
    }
}

proptest! {
    #![proptest_config(cases(2000))]

    #[test]
    fn span_group_specs_never_panic(spec in any::<String>()) {
        if let Err(error) = spec.parse::<SpanGroups>() {
            let text = error.to_string();
            prop_assert_eq!(text.lines().count(), 1, "{}", text);
            prop_assert!(text.contains(VALID_GROUPS), "{}", text);
        }
    }

    #[test]
    fn any_list_of_valid_names_in_any_case_parses(
        words in prop::collection::vec(spec_word(SpanGroups::valid_names()), 1..8),
    ) {
        let spec = words.iter().map(|(word, _)| word.as_str()).collect::<Vec<_>>().join(",");
        let groups: SpanGroups = spec.parse().map_err(|e| TestCaseError::fail(format!("{spec:?}: {e}")))?;
        let expected: BTreeSet<SpanGroup> =
            words.iter().flat_map(|(_, name)| groups_of(name)).collect();
        prop_assert_eq!(groups.iter().collect::<BTreeSet<_>>(), expected);
    }

    #[test]
    fn an_unknown_name_is_rejected_with_the_valid_list(
        words in prop::collection::vec(spec_word(SpanGroups::valid_names()), 0..4),
        unknown in "[a-zA-Z_]{1,16}",
        at in any::<prop::sample::Index>(),
    ) {
        prop_assume!(!SpanGroups::valid_names().contains(&unknown.to_ascii_lowercase().as_str()));
        let mut words: Vec<String> = words.into_iter().map(|(word, _)| word).collect();
        words.insert(at.index(words.len() + 1), unknown.clone());
        let error = words.join(",").parse::<SpanGroups>().unwrap_err().to_string();
        let unknown_span_group = format!("unknown span group {unknown:?}; {VALID_GROUPS}");
        prop_assert!(error.contains(&unknown_span_group), "{}", error);
    }
}

/// A value for a setting: anything, something short and plausible, or a valid one.
fn setting_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[ a-zA-Z0-9_./:%=,@-]{0,16}",
        select(vec![
            "otlp",
            "file",
            "console",
            "OTLP",
            "single_rank",
            "sampled",
            "all_ranks",
            "first_rank_per_node",
            "-1",
            "0",
            "3",
            "0.5",
            "1",
            "1e0",
            "NaN",
            "inf",
            "",
            " ",
            "true",
            "off",
            "grpc",
            "http/json",
            "http://collector:4317",
            "60000",
            "a=b,c=d",
            "/dev/null",
        ])
        .prop_map(str::to_string),
    ]
}

/// The variables the export settings read, and the keys an error may name.
const EXPORT_VARIABLES: [&str; 12] = [
    "NEMO_LENS_EXPORTER",
    "LENS_PROBE_EXPORT_FILE",
    "NEMO_LENS_EXPORT_STRATEGY",
    "NEMO_LENS_EXPORT_RANK",
    "NEMO_LENS_EXPORT_SAMPLE_RATE",
    "NEMO_LENS_ENABLED",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_METRIC_EXPORT_INTERVAL",
];
const EXPORT_FLAGS: [&str; 5] = [
    "--exporter",
    "--export-file",
    "--export-strategy",
    "--export-rank",
    "--export-sample-rate",
];

/// `--pid 1`, with none of the export settings.
fn base_cli() -> Cli {
    let mut cli = <Cli as clap::Parser>::try_parse_from(["lens-probe", "--pid", "1"])
        .expect("a plain command line parses");
    cli.exporter = None;
    cli.export_file = None;
    cli.export_strategy = None;
    cli.export_rank = None;
    cli.export_sample_rate = None;
    cli
}

proptest! {
    #![proptest_config(cases(800))]

    /// Any flags and variables: settings, or one line naming a flag or variable, exit 2.
    #[test]
    fn export_settings_take_any_values(
        flags in prop::collection::vec(prop::option::of(setting_value()), 5),
        env in prop::collection::vec(prop::option::of(setting_value()), EXPORT_VARIABLES.len()),
    ) {
        let mut cli = base_cli();
        cli.exporter = flags[0].clone();
        cli.export_file = flags[1].clone().map(Into::into);
        cli.export_strategy = flags[2].clone();
        cli.export_rank = flags[3].clone();
        cli.export_sample_rate = flags[4].clone();
        let lookup = |key: &str| {
            EXPORT_VARIABLES.iter().position(|k| *k == key).and_then(|i| env[i].clone())
        };
        match ExportSettings::from_cli_and_env(&cli, lookup) {
            Ok(settings) => {
                if let ExportStrategy::Sampled { rate } = settings.strategy {
                    prop_assert!((0.0..=1.0).contains(&rate));
                }
            }
            Err(error) => {
                let text = error.to_string();
                prop_assert_eq!(error.exit_code(), 2, "{}", text);
                prop_assert_eq!(text.lines().count(), 1, "{}", text);
                prop_assert!(
                    EXPORT_VARIABLES.iter().chain(&EXPORT_FLAGS).any(|key| text.contains(&format!("for {key}"))),
                    "names no key: {}", text
                );
            }
        }
    }

    #[test]
    fn export_strategies_are_the_four_names_in_any_case(text in setting_value()) {
        let parsed = text.parse::<ExportStrategy>();
        let known = ExportStrategy::NAMES.contains(&text.trim().to_ascii_lowercase().as_str());
        prop_assert_eq!(parsed.is_ok(), known);
        if let Err(error) = parsed {
            prop_assert!(error.to_string().contains(STRATEGIES));
        }
    }

    #[test]
    fn sample_rates_are_numbers_from_0_to_1(rate in prop_oneof![any::<f64>(), -0.5f64..1.5]) {
        let mut cli = base_cli();
        cli.export_strategy = Some("sampled".into());
        cli.export_sample_rate = Some(rate.to_string());
        match ExportSettings::from_cli_and_env(&cli, |_| None) {
            Ok(settings) => {
                prop_assert!((0.0..=1.0).contains(&rate));
                prop_assert_eq!(settings.strategy, ExportStrategy::Sampled { rate });
            }
            Err(error) => {
                prop_assert!(!(0.0..=1.0).contains(&rate));
                prop_assert!(error.to_string().contains("for --export-sample-rate: must be"));
            }
        }
    }

    #[test]
    fn durations_never_panic(text in prop_oneof![any::<String>(), "[-+0-9.e]{1,12}[a-z]{0,3}"]) {
        if let Ok(duration) = cli::parse_duration(&text) {
            prop_assert!(!duration.is_zero());
            // A deadline of the clock plus it can be represented.
            prop_assert!(duration <= cli::MAX_DURATION);
        }
    }

    #[test]
    fn bare_seconds_are_positive_and_representable(seconds in any::<f64>()) {
        match cli::parse_duration(&seconds.to_string()) {
            Ok(duration) => {
                prop_assert!(seconds > 0.0);
                prop_assert!((duration.as_secs_f64() - seconds).abs() <= seconds * 1e-9 + 1e-9);
            }
            Err(reason) => prop_assert!(
                !(1e-9..=cli::MAX_DURATION.as_secs_f64()).contains(&seconds),
                "{} rejected: {}", seconds, reason
            ),
        }
    }

    #[test]
    fn durations_with_units_round_trip(n in 1u64..1_000_000, unit in select(vec![("s", 1u64), ("m", 60), ("h", 3600)])) {
        match cli::parse_duration(&format!("{n}{}", unit.0)) {
            Ok(duration) => prop_assert_eq!(duration.as_secs(), n * unit.1),
            // Past ten years: refused by name, never wrapped or shortened.
            Err(reason) => {
                prop_assert!(n * unit.1 > cli::MAX_DURATION.as_secs(), "{}", reason);
                prop_assert!(reason.starts_with("longer than 3650 days"), "{}", reason);
            }
        }
    }

    #[test]
    fn overhead_budgets_are_percentages(text in prop_oneof![any::<String>(), "[-+ 0-9.e%]{1,10}"]) {
        match text.parse::<OverheadBudget>() {
            Ok(budget) => {
                prop_assert!(budget.fraction() > 0.0 && budget.fraction() <= 1.0);
                let again: OverheadBudget = budget.to_string().parse().unwrap();
                prop_assert!((again.fraction() - budget.fraction()).abs() < 1e-12);
            }
            Err(reason) => prop_assert!(reason.contains("above 0 and at most 100")),
        }
    }

    #[test]
    fn percent_budgets_within_0_and_100_parse(percent in any::<f64>()) {
        let parsed = format!("{percent}%").parse::<OverheadBudget>();
        prop_assert_eq!(parsed.is_ok(), percent > 0.0 && percent <= 100.0);
    }

    #[test]
    fn match_env_filters_are_key_equals_value(text in any::<String>()) {
        match NodeFilter::parse_env(&text) {
            Ok((key, value)) => {
                prop_assert!(!key.is_empty() && !key.contains('='));
                prop_assert_eq!(format!("{key}={value}"), text);
            }
            Err(reason) => {
                prop_assert!(reason.contains("expected KEY=VALUE"));
                prop_assert!(text.split_once('=').is_none_or(|(key, _)| key.is_empty()));
            }
        }
    }

    #[test]
    fn otlp_endpoints_and_headers_never_panic(text in setting_value()) {
        let _ = config::check_otlp_endpoint(&text);
        if let Err(reason) = config::check_otlp_headers(&text) {
            prop_assert!(reason.contains(HEADERS));
        }
    }

    #[test]
    fn well_formed_endpoints_are_accepted(
        scheme in select(vec!["http", "https", "HTTP"]),
        host in prop_oneof!["[a-z][a-z0-9-]{0,10}(\\.[a-z0-9]{1,6}){0,3}", "[0-9]{1,3}(\\.[0-9]{1,3}){3}", Just("[::1]".to_string())],
        port in prop::option::of(1u16..),
        path in "(/[a-zA-Z0-9_.-]{0,8}){0,3}",
    ) {
        let port = port.map(|p| format!(":{p}")).unwrap_or_default();
        let url = format!("{scheme}://{host}{port}{path}");
        prop_assert_eq!(config::check_otlp_endpoint(&url), Ok(()), "{}", url);
    }

    #[test]
    fn well_formed_headers_are_accepted_and_bad_ones_never_quote_a_value(
        pairs in prop::collection::vec(("[a-zA-Z][a-zA-Z0-9_-]{0,10}", "[a-zA-Z0-9._~-]{1,12}|[a-z]{1,4}%20[a-z]{1,4}"), 1..5),
        secret in "S3CRET[A-Z]{8}",
    ) {
        let list = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
        prop_assert_eq!(config::check_otlp_headers(&list), Ok(()), "{}", list);
        for bad in [format!("{list},{secret}"), format!("{list},k={secret}%G0"), format!("{secret} x={secret}")] {
            let reason = config::check_otlp_headers(&bad).unwrap_err();
            prop_assert!(!reason.contains(&secret), "{}", reason);
        }
    }
}

/// The flags that take a value, and what else a command line with them needs.
const VALUE_FLAGS: [(&str, &[&str]); 16] = [
    ("--pid", &[]),
    ("--span-groups", &["--pid", "1"]),
    ("--exporter", &["--pid", "1"]),
    ("--export-file", &["--pid", "1"]),
    ("--export-strategy", &["--pid", "1"]),
    ("--export-rank", &["--pid", "1"]),
    ("--export-sample-rate", &["--pid", "1"]),
    ("--duration", &["--pid", "1"]),
    ("--overhead-budget", &["--pid", "1"]),
    ("--hang-timeout", &["--pid", "1"]),
    ("--summary-json", &["--pid", "1"]),
    ("--pid-file", &["--pid", "1"]),
    ("--match", &["--node"]),
    ("--match-cgroup", &["--node"]),
    ("--match-env", &["--node"]),
    ("--span-groups", &["--exec", "--", "true"]),
];

proptest! {
    #![proptest_config(cases(1500))]

    /// Any value of any flag: parsed, or one line that names the flag.
    #[test]
    fn command_lines_take_any_value(flag in 0..VALUE_FLAGS.len(), value in setting_value()) {
        let (flag, rest) = VALUE_FLAGS[flag];
        let (before, after) = match rest.iter().position(|a| *a == "--") {
            Some(at) => rest.split_at(at),
            None => (rest, &[][..]),
        };
        let args: Vec<&str> = ["lens-probe"]
            .into_iter()
            .chain(before.iter().copied())
            .chain([flag, value.as_str()])
            .chain(after.iter().copied())
            .collect();
        match cli::parse_from(args.iter().copied()) {
            Ok(_) => {}
            Err(Rejected::Info(_)) => prop_assert!(value.starts_with('-'), "{:?}", args),
            Err(Rejected::Invalid(line)) => {
                prop_assert!(!line.is_empty() && !line.contains('\n'), "{:?}: {:?}", args, line);
                if !value.starts_with('-') {
                    prop_assert!(line.contains(flag), "{:?}: {:?}", args, line);
                }
            }
        }
    }
}

/// A scratch directory of this test process.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lens-hostile-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `--config` is read bounded and never blocks: a device, a FIFO and a huge file are
/// each one line, exit 2, at once (before: /dev/zero was read until the OOM killer
/// came, a FIFO hung forever).
#[test]
fn config_files_that_are_not_small_regular_files_are_refused_at_once() {
    let dir = scratch("config");
    let fifo = dir.join("rules.fifo");
    let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let huge = dir.join("huge.toml");
    // 200 000 rules, 13 MB: over the limit before any parsing.
    let rule = "[[probe]]\nlibrary = \"libfoo.so\"\nsymbol = \"foo\"\ngroup = \"step\"\n";
    std::fs::write(&huge, rule.repeat(200_000)).unwrap();
    for (path, needle) in [
        ("/dev/zero".to_string(), "not a regular file"),
        ("/dev/urandom".to_string(), "not a regular file"),
        (fifo.display().to_string(), "not a regular file"),
        (huge.display().to_string(), "over the 1024 KiB limit"),
    ] {
        let started = std::time::Instant::now();
        let output = lens_probe(&["--pid", "1", "--config", &path], &[] as &[(&str, &str)]);
        assert_one_line_error(&output, 2, needle);
        assert!(stderr_text(&output).contains(&path));
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{path}"
        );
        let output = lens_probe(&["--pid", "1"], &[("NEMO_LENS_CONFIG", path.as_str())]);
        assert_one_line_error(&output, 2, needle);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Files lens-probe creates as root are never written through a symbolic link (a link
/// in a shared directory aimed at /etc/hostname was overwritten with the pid).
#[test]
fn output_files_that_are_symbolic_links_are_refused_and_their_targets_untouched() {
    let dir = scratch("links");
    let target = dir.join("hostname");
    std::fs::write(&target, "precious\n").unwrap();
    for flag in ["--pid-file", "--summary-json", "--export-file"] {
        let link = dir.join(format!("link{flag}"));
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let link = link.display().to_string();
        let mut args = vec!["--pid", "1", flag, &link];
        if flag == "--export-file" {
            args.extend(["--exporter", "file"]);
        }
        let output = lens_probe(&args, &[] as &[(&str, &str)]);
        assert_one_line_error(&output, 2, "symbolic link");
        assert!(
            stderr_text(&output).contains(flag),
            "{}",
            stderr_text(&output)
        );
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious\n");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
