//! The timeline (`--perfetto FILE`) end to end, as a user checks it: every span of a run
//! is a slice on its process's tracks (the same spans the OTLP file gets), two ranks side
//! by side with their collectives joined by one flow, a file that still opens after
//! lens-probe is killed, the size cap, and bad settings. Files are read back with the
//! crate's own reader (`lens_probe::timeline::replay`, which orders packets as Perfetto's
//! trace processor does) and with Perfetto's own protos (PyPI `perfetto`, in the venv).
use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsString,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use lens_probe::timeline::replay::{Replayed, replay};
use lens_tests::{FileSpan, assert_one_line_error, otlp_file_spans, stderr_text};
use serde_json::Value;

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

/// The traced runs go one at a time: a killed lens-probe's uprobes leave the kernel one
/// by one, and the next attach queues behind them; two runs side by side on a 2-core
/// machine only make each slower.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A fresh directory of this test's own.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lens-timeline-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The node's name as the kernel has it (what the process tracks are named with).
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string()
}

fn read_timeline(path: &Path) -> Replayed {
    let bytes =
        std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    replay(&bytes)
}

/// A timeline as its user expects to find it: nothing Perfetto would complain of, every
/// packet whole, one writer's sequence.
fn assert_whole(timeline: &Replayed) {
    assert!(
        timeline.problems.is_empty(),
        "problems: {:#?}",
        timeline.problems
    );
    assert!(!timeline.truncated, "the file ends inside a packet");
    assert_eq!(timeline.sequences.len(), 1, "{:?}", timeline.sequences);
}

/// The top-level tracks: uuid → name.
fn process_tracks(timeline: &Replayed) -> BTreeMap<u64, String> {
    timeline
        .tracks
        .iter()
        .filter(|(_, track)| track.parent.is_none())
        .map(|(uuid, track)| (*uuid, track.name.clone()))
        .collect()
}

/// How many of each name.
fn count_names<'a>(names: impl Iterator<Item = &'a str>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for name in names {
        *counts.entry(name.to_string()).or_default() += 1;
    }
    counts
}

/// An OTLP JSON `AnyValue` as the timeline's annotations show it (text).
fn any_value_text(value: &Value) -> String {
    if let Some(text) = value["stringValue"].as_str() {
        text.to_string()
    } else if let Some(int) = value.get("intValue") {
        // OTLP JSON writes 64-bit integers as strings.
        int.as_str().map_or_else(|| int.to_string(), str::to_string)
    } else if let Some(flag) = value["boolValue"].as_bool() {
        flag.to_string()
    } else if let Some(double) = value["doubleValue"].as_f64() {
        double.to_string()
    } else {
        panic!("unexpected OTLP value {value}")
    }
}

fn nanos(span: &Value, key: &str) -> u64 {
    span[key]
        .as_str()
        .and_then(|v| v.parse().ok())
        .or_else(|| span[key].as_u64())
        .unwrap_or_else(|| panic!("no {key} in {span}"))
}

/// What identifies a span in both outputs: its name, its duration (both clocks are the
/// same monotonic one shifted to wall-clock time, so durations agree to the ns) and its
/// attributes as text.
type SpanKey = (String, u64, BTreeMap<String, String>);

fn otlp_keys(spans: &[FileSpan]) -> BTreeMap<SpanKey, usize> {
    let mut keys = BTreeMap::new();
    for (_, span) in spans {
        let attributes = span["attributes"]
            .as_array()
            .map(|list| {
                list.iter()
                    .map(|kv| {
                        (
                            kv["key"].as_str().unwrap().to_string(),
                            any_value_text(&kv["value"]),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let key = (
            span["name"].as_str().unwrap().to_string(),
            nanos(span, "endTimeUnixNano") - nanos(span, "startTimeUnixNano"),
            attributes,
        );
        *keys.entry(key).or_default() += 1;
    }
    keys
}

fn slice_keys(timeline: &Replayed) -> BTreeMap<SpanKey, usize> {
    let mut keys = BTreeMap::new();
    for slice in &timeline.slices {
        let mut annotations = slice.annotations.clone();
        // The one annotation that is not an attribute: an error status's message.
        annotations.remove("status.error");
        let key = (
            slice.name.clone(),
            slice.end_ns - slice.start_ns,
            annotations,
        );
        *keys.entry(key).or_default() += 1;
    }
    keys
}

fn int_resource(resource: &BTreeMap<String, Value>, key: &str) -> i64 {
    any_value_text(&resource[key]).parse().unwrap()
}

/// The summary JSON lens-probe wrote.
fn summary(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Kills and reaps a process this test started, however the test ends.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ---- Perfetto's own protos ---------------------------------------------------------

/// Decodes a trace with PyPI `perfetto`'s compiled protos, as Perfetto's own tools
/// would, and prints what it holds as JSON: packets, fields the protos do not know (a
/// wrong field number shows up there), tracks, slice begins (names and annotation names
/// resolved through the sequence's interned data, values as text, flows), ends,
/// instants, counters, sequences; and what the trace processor would drop or could not
/// name: packets that need incremental state on a sequence never cleared, iids never
/// interned.
const PERFETTO_DECODE: &str = r#"
import json, sys
from google.protobuf import unknown_fields
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE

def unknown(message):
    count = len(unknown_fields.UnknownFieldSet(message))
    for field, value in message.ListFields():
        if field.message_type is not None:
            for item in (value if field.is_repeated else [value]):
                count += unknown(item)
    return count

def text(annotation):
    kind = annotation.WhichOneof("value")
    value = getattr(annotation, kind) if kind else ""
    if kind == "bool_value":
        return "true" if value else "false"
    return str(value)

trace = pb.Trace()
with open(sys.argv[1], "rb") as f:
    trace.ParseFromString(f.read())
out = {"packets": 0, "unknown_fields": unknown(trace), "tracks": {}, "begins": [],
       "ends": 0, "instants": 0, "counters": 0, "sequences": [], "dropped": 0,
       "unresolved": 0}
interned = {}
def name_of(message, table, field):
    global out
    if message.WhichOneof("name_field") == field:
        iid = getattr(message, field)
        if iid not in table:
            out["unresolved"] += 1
        return table.get(iid, "")
    return message.name

for packet in trace.packet:
    out["packets"] += 1
    sequence = packet.trusted_packet_sequence_id
    if sequence not in out["sequences"]:
        out["sequences"].append(sequence)
    if packet.sequence_flags & CLEARED:
        interned[sequence] = ({}, {})
    state = interned.get(sequence)
    if state is None and (packet.sequence_flags & NEEDS or packet.HasField("interned_data")):
        out["dropped"] += 1
        continue
    if packet.HasField("interned_data"):
        for entry in packet.interned_data.event_names:
            state[0][entry.iid] = entry.name
        for entry in packet.interned_data.debug_annotation_names:
            state[1][entry.iid] = entry.name
    if packet.HasField("track_descriptor"):
        d = packet.track_descriptor
        out["tracks"][str(d.uuid)] = {
            "name": d.name,
            "parent": d.parent_uuid if d.HasField("parent_uuid") else None,
        }
    elif packet.HasField("track_event"):
        e = packet.track_event
        if e.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            out["begins"].append({
                "name": name_of(e, state[0], "name_iid"),
                "track": e.track_uuid,
                "flows": list(e.flow_ids),
                "annotations": {name_of(a, state[1], "name_iid"): text(a)
                                for a in e.debug_annotations},
            })
        elif e.type == pb.TrackEvent.TYPE_SLICE_END:
            out["ends"] += 1
        elif e.type == pb.TrackEvent.TYPE_INSTANT:
            out["instants"] += 1
        elif e.type == pb.TrackEvent.TYPE_COUNTER:
            out["counters"] += 1
print(json.dumps(out))
"#;

/// The venv's Python when it has PyPI `perfetto`; otherwise the skip rule applies (a
/// venv made before `perfetto` joined the requirements skips the same way).
fn perfetto_python(test: &str) -> Option<PathBuf> {
    let venv = lens_tests::torch_venv(test)?;
    let imports = Command::new(&venv.python)
        .args([
            "-c",
            "from perfetto.protos.perfetto.trace import perfetto_trace_pb2",
        ])
        .env_remove("PYTHONHOME")
        .env_remove("PYTHONPATH")
        .output()
        .is_ok_and(|o| o.status.success());
    if !imports {
        lens_tests::skip(
            test,
            "PyPI perfetto",
            "the PyTorch venv has no `perfetto` package; run `cargo xtask setup`",
        );
        return None;
    }
    Some(venv.python)
}

/// Perfetto's protos read `path` as the crate's reader did: the same tracks, slices (with
/// their flows and annotations), instants and counters, every field known, every name
/// found in the sequence's interned data.
fn assert_perfetto_reads_the_same(test: &str, path: &Path, timeline: &Replayed) {
    let Some(python) = perfetto_python(test) else {
        return;
    };
    let output = Command::new(python)
        .args(["-c", PERFETTO_DECODE])
        .arg(path)
        .env_remove("PYTHONHOME")
        .env_remove("PYTHONPATH")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "Perfetto's protos cannot read {}: {}",
        path.display(),
        stderr_text(&output)
    );
    let decoded: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        decoded["unknown_fields"], 0,
        "fields Perfetto does not know"
    );
    let slices = timeline.slices.len() as u64;
    assert_eq!(
        decoded["packets"].as_u64().unwrap(),
        timeline.tracks.len() as u64
            + 2 * slices
            + timeline.instants.len() as u64
            + timeline.counters.len() as u64,
        "one packet per track, two per slice, one per instant and counter value"
    );
    let tracks: BTreeMap<u64, (String, Option<u64>)> = decoded["tracks"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(uuid, track)| {
            (
                uuid.parse().unwrap(),
                (
                    track["name"].as_str().unwrap().to_string(),
                    track["parent"].as_u64(),
                ),
            )
        })
        .collect();
    let replayed: BTreeMap<u64, (String, Option<u64>)> = timeline
        .tracks
        .iter()
        .map(|(uuid, track)| (*uuid, (track.name.clone(), track.parent)))
        .collect();
    assert_eq!(tracks, replayed);
    assert_eq!(decoded["begins"].as_array().unwrap().len() as u64, slices);
    assert_eq!(decoded["ends"].as_u64().unwrap(), slices);
    assert_eq!(
        decoded["instants"].as_u64().unwrap(),
        timeline.instants.len() as u64
    );
    assert_eq!(
        decoded["counters"].as_u64().unwrap(),
        timeline.counters.len() as u64
    );
    type Begin = (String, u64, Vec<u64>, BTreeMap<String, String>);
    let mut begins: Vec<Begin> = decoded["begins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["name"].as_str().unwrap().to_string(),
                b["track"].as_u64().unwrap(),
                b["flows"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|f| f.as_u64().unwrap())
                    .collect(),
                b["annotations"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                    .collect(),
            )
        })
        .collect();
    let mut expected: Vec<Begin> = timeline
        .slices
        .iter()
        .map(|s| {
            (
                s.name.clone(),
                s.track,
                s.flow_ids.clone(),
                s.annotations.clone(),
            )
        })
        .collect();
    begins.sort();
    expected.sort();
    assert_eq!(begins, expected);
    let sequences: Vec<u64> = decoded["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_u64().unwrap())
        .collect();
    assert_eq!(
        sequences,
        timeline
            .sequences
            .iter()
            .map(|s| u64::from(*s))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        (decoded["dropped"].as_u64(), decoded["unresolved"].as_u64()),
        (Some(0), Some(0)),
        "packets Perfetto would drop (incremental state never cleared), names never interned"
    );
}

/// Where a traced run of the fake trainer left its outputs.
struct Outputs {
    spans_file: PathBuf,
    timeline_file: PathBuf,
    summary_file: PathBuf,
}

/// lens-probe (`--span-groups all`, spans to an OTLP file, the timeline, the summary
/// JSON, and `extra`) running `prefix… trainer STEPS` in `dir`; the trainer's stdout is
/// kept for the caller.
fn traced_trainer(
    dir: &Path,
    extra: &[&str],
    prefix: &[&str],
    steps: &str,
) -> (std::process::Output, Outputs) {
    let outputs = Outputs {
        spans_file: dir.join("spans.jsonl"),
        timeline_file: dir.join("run.perfetto-trace"),
        summary_file: dir.join("summary.json"),
    };
    let output = lens_tests::lens_probe_command(LENS_PROBE)
        .args([
            "--span-groups",
            "all",
            "--exporter",
            "file",
            "--export-file",
        ])
        .arg(&outputs.spans_file)
        .arg("--perfetto")
        .arg(&outputs.timeline_file)
        .arg("--summary-json")
        .arg(&outputs.summary_file)
        .args(extra)
        .args(["--exec", "--"])
        .args(prefix)
        .arg(lens_tests::trainer())
        .arg(steps)
        .output()
        .unwrap();
    (output, outputs)
}

// ---- One rank: the timeline holds what the OTLP file holds ---------------------------

#[test]
fn every_span_of_a_run_is_a_slice_under_its_process_track() {
    let test = "every_span_of_a_run_is_a_slice";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let _serial = serial();
    let dir = scratch("one-rank");
    let (
        output,
        Outputs {
            spans_file,
            timeline_file,
            summary_file,
        },
    ) = traced_trainer(&dir, &[], &[], "3");
    let stderr = stderr_text(&output);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "trainer: 3 steps done\n"
    );

    let timeline = read_timeline(&timeline_file);
    assert_whole(&timeline);
    let spans = otlp_file_spans(&spans_file);
    assert!(spans.len() > 10, "{} spans", spans.len());
    // One slice per span the OTLP file got, name by name, and each with its span's
    // duration and attributes.
    assert_eq!(timeline.slices.len(), spans.len());
    assert_eq!(
        count_names(timeline.slices.iter().map(|s| s.name.as_str())),
        count_names(spans.iter().map(|(_, s)| s["name"].as_str().unwrap()))
    );
    assert_eq!(slice_keys(&timeline), otlp_keys(&spans));

    // One process track, named after the traced process, and every slice under it.
    let pids: BTreeSet<i64> = spans
        .iter()
        .map(|(resource, _)| int_resource(resource, "process.pid"))
        .collect();
    assert_eq!(pids.len(), 1, "{pids:?}");
    let pid = *pids.first().unwrap();
    let roots = process_tracks(&timeline);
    assert_eq!(
        roots.values().collect::<Vec<_>>(),
        [&format!("rank 0 · {} · pid {pid}", host())],
        "{:#?}",
        timeline.tracks
    );
    let process = *roots.keys().next().unwrap();
    for slice in &timeline.slices {
        assert_eq!(timeline.root_of(slice.track), process, "{slice:?}");
        // Parents and children are on tracks of their own: no track stacks slices.
        assert_eq!(slice.depth, 0, "{slice:?}");
    }
    // The job on the process track itself, around everything else.
    let jobs: Vec<_> = timeline
        .slices
        .iter()
        .filter(|s| s.name == "train.job")
        .collect();
    assert_eq!(jobs.len(), 1);
    let job = jobs[0];
    assert_eq!(job.track, process);
    for slice in &timeline.slices {
        assert!(
            job.start_ns <= slice.start_ns && slice.end_ns <= job.end_ns,
            "{slice:?} outside the job {job:?}"
        );
    }
    // The rest on the process's main thread: its phases on the thread's own track, its
    // calls on `calls` lanes under it.
    let main: Vec<u64> = timeline
        .tracks_named(&format!("main thread {pid}"))
        .collect();
    assert_eq!(main.len(), 1, "{:#?}", timeline.tracks);
    assert_eq!(timeline.tracks[&main[0]].parent, Some(process));
    for slice in timeline.slices.iter().filter(|s| s.name != "train.job") {
        let track = &timeline.tracks[&slice.track];
        if slice.name.starts_with("nccl.") || slice.name.starts_with("cuda.") {
            assert!(
                track.name.starts_with("calls") && track.parent == Some(main[0]),
                "{slice:?} on {track:?}"
            );
        } else {
            assert_eq!(slice.track, main[0], "{slice:?} on {track:?}");
        }
    }

    // What the summary says of it, on stderr and in the JSON.
    let bytes = std::fs::metadata(&timeline_file).unwrap().len();
    let line = format!(
        "lens-probe: timeline {}: {} slices, ",
        timeline_file.display(),
        spans.len()
    );
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with(&line)).count(),
        1,
        "no {line:?} in {stderr}"
    );
    assert!(!stderr.contains("size cap"), "{stderr}");
    let json = summary(&summary_file);
    assert_eq!(
        json["timeline"],
        serde_json::json!({
            "path": timeline_file,
            "slices": spans.len(),
            "bytes": bytes,
            "max_bytes": 1u64 << 30,
            "spans_past_cap": 0,
            "spans_dropped": 0,
        })
    );

    assert_perfetto_reads_the_same(test, &timeline_file, &timeline);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- Two ranks under torchrun: side by side, collectives joined ----------------------

#[test]
fn two_gloo_ranks_are_side_by_side_with_their_collectives_joined() {
    let test = "two_gloo_ranks_side_by_side";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let Some(venv) = lens_tests::torch_venv(test) else {
        return;
    };
    let _serial = serial();
    let dir = scratch("two-ranks");
    let (spans_file, timeline_file) = (dir.join("spans.jsonl"), dir.join("ranks.perfetto-trace"));
    let port = 20_000 + (std::process::id() * 3 + 17) % 20_000;
    let torchrun: Vec<OsString> = vec![
        "env".into(),
        "GLOO_SOCKET_IFNAME=lo".into(),
        venv.dir.join("bin/torchrun").into(),
        "--nproc-per-node".into(),
        "2".into(),
        "--master-addr".into(),
        "127.0.0.1".into(),
        "--master-port".into(),
        port.to_string().into(),
        lens_tests::torch_train_script().into(),
        "--distributed".into(),
        "--steps".into(),
        "3".into(),
        "--eval-every".into(),
        "0".into(),
        "--ckpt-every".into(),
        "0".into(),
    ];
    let output = lens_tests::lens_probe_command(LENS_PROBE)
        .args([
            "--span-groups",
            "per_step",
            "--export-strategy",
            "all_ranks",
        ])
        .args(["--exporter", "file", "--export-file"])
        .arg(&spans_file)
        .arg("--perfetto")
        .arg(&timeline_file)
        .arg("--exec")
        .arg("--")
        .args(&torchrun)
        .stdout(Stdio::null())
        .output()
        .unwrap();
    let stderr = stderr_text(&output);
    assert_eq!(output.status.code(), Some(0), "{stderr}");

    let timeline = read_timeline(&timeline_file);
    assert_whole(&timeline);
    let spans = otlp_file_spans(&spans_file);
    assert_eq!(
        count_names(timeline.slices.iter().map(|s| s.name.as_str())),
        count_names(spans.iter().map(|(_, s)| s["name"].as_str().unwrap()))
    );

    // A process track per rank, named after the rank and pid the spans carry; the
    // launcher, which never trains, has none.
    let host = host();
    let mut expected: BTreeSet<String> = BTreeSet::new();
    for (resource, span) in &spans {
        if span["name"] == "train.job" {
            expected.insert(format!(
                "rank {} · {host} · pid {}",
                int_resource(resource, "dl.rank"),
                int_resource(resource, "process.pid")
            ));
        }
    }
    let roots = process_tracks(&timeline);
    let names: BTreeSet<String> = roots.values().cloned().collect();
    assert_eq!(names, expected);
    assert_eq!(names.len(), 2, "{names:?}");
    let rank_of = |track: u64| -> String {
        let name = &roots[&timeline.root_of(track)];
        name.split(" · ").next().unwrap().to_string()
    };
    let ranks: BTreeSet<String> = roots.keys().map(|uuid| rank_of(*uuid)).collect();
    assert_eq!(
        ranks,
        BTreeSet::from(["rank 0".to_string(), "rank 1".to_string()])
    );

    // Each rank's steps on its own tracks, and a collective bytes count for each.
    for rank in &ranks {
        let steps = timeline
            .slices
            .iter()
            .filter(|s| s.name == "train.step" && &rank_of(s.track) == rank)
            .count();
        assert_eq!(steps, 3, "{rank}");
        let bytes_track = timeline
            .tracks_named("collective bytes per step")
            .find(|uuid| &rank_of(*uuid) == rank)
            .unwrap_or_else(|| panic!("{rank}: no collective bytes counter"));
        assert!(timeline.tracks[&bytes_track].counter);
        let points = timeline
            .counters
            .iter()
            .filter(|c| c.track == bytes_track)
            .count();
        assert_eq!(points, 3, "{rank}");
    }

    // The gloo collectives: one flow per (communicator, seq), the same on both ranks,
    // and a flow joins nothing else.
    let mut by_call: BTreeMap<(String, String), Vec<&lens_probe::timeline::replay::Slice>> =
        BTreeMap::new();
    for slice in timeline
        .slices
        .iter()
        .filter(|s| s.name.starts_with("gloo."))
    {
        if let (Some(comm), Some(seq)) = (
            slice.annotations.get("dl.collective.comm_id"),
            slice.annotations.get("dl.collective.seq"),
        ) {
            by_call
                .entry((comm.clone(), seq.clone()))
                .or_default()
                .push(slice);
        }
    }
    assert!(!by_call.is_empty(), "no gloo slice with a communicator");
    let mut flows: BTreeMap<u64, (String, String)> = BTreeMap::new();
    let mut joined = 0;
    for (call, slices) in &by_call {
        let ids: BTreeSet<&Vec<u64>> = slices.iter().map(|s| &s.flow_ids).collect();
        assert_eq!(ids.len(), 1, "{call:?}: {slices:#?}");
        let id = ids.first().unwrap();
        assert_eq!(id.len(), 1, "{call:?}: {slices:#?}");
        if let Some(other) = flows.insert(id[0], call.clone()) {
            panic!("flow {:x} joins {other:?} and {call:?}", id[0]);
        }
        let on: BTreeSet<String> = slices.iter().map(|s| rank_of(s.track)).collect();
        assert_eq!(on.len(), slices.len(), "one slice per rank: {slices:#?}");
        if on.len() == 2 {
            joined += 1;
        }
    }
    assert!(
        joined >= 1,
        "no collective seen on both ranks: {by_call:#?}"
    );

    assert_perfetto_reads_the_same(test, &timeline_file, &timeline);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- lens-probe killed: the file opens, up to its last flush -------------------------

#[test]
fn a_timeline_opens_after_lens_probe_is_killed() {
    let test = "a_timeline_opens_after_lens_probe_is_killed";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let _serial = serial();
    let dir = scratch("sigkill");
    let timeline_file = dir.join("killed.perfetto-trace");
    // A trainer that runs until the test ends it: 100 000 steps of ~45 ms.
    let trainer = KillOnDrop(
        Command::new(lens_tests::trainer())
            .arg("100000")
            .env("TRAINER_STEP_DELAY_MS", "10")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let probe_log = dir.join("probe.log");
    let mut probe = KillOnDrop(
        lens_tests::lens_probe_command(LENS_PROBE)
            .args(["--span-groups", "all", "--perfetto"])
            .arg(&timeline_file)
            .args(["--pid", &trainer.0.id().to_string()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&probe_log).unwrap())
            .spawn()
            .unwrap(),
    );
    // Until the file holds a slice: attaching takes long on a busy machine, so the
    // deadline only catches a hang.
    let deadline = Instant::now() + Duration::from_secs(120);
    let seen = loop {
        if let Some(status) = probe.0.try_wait().unwrap() {
            panic!(
                "lens-probe exited ({status}): {}",
                std::fs::read_to_string(&probe_log).unwrap_or_default()
            );
        }
        if timeline_file.exists() {
            let slices = read_timeline(&timeline_file).slices.len();
            if slices >= 1 {
                break slices;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no slice in the timeline after 120 s: {}",
            std::fs::read_to_string(&probe_log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // SAFETY: kill(2) of our own child.
    assert_eq!(unsafe { libc::kill(probe.0.id() as i32, libc::SIGKILL) }, 0);
    probe.0.wait().unwrap();
    // No exit summary: the file holds what the writer thread had flushed. It writes
    // whole chunks of whole spans (a slice's begin and end in one), so nothing is left
    // open and the file ends at a packet's end: `truncated` would need the kernel to
    // cut a write of a few KiB short at the kill, which a regular file's write does not
    // do in practice.
    let timeline = read_timeline(&timeline_file);
    assert_whole(&timeline);
    assert!(
        timeline.slices.len() >= seen,
        "{} slices, {seen} seen before the kill",
        timeline.slices.len()
    );
    let roots = process_tracks(&timeline);
    assert_eq!(
        roots.values().collect::<Vec<_>>(),
        [&format!("rank 0 · {} · pid {}", host(), trainer.0.id())]
    );
    // Nothing else beside it (the hidden file it was written to was renamed into place).
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["killed.perfetto-trace", "probe.log"]);
    // The trainer runs on, untraced.
    let mut trainer = trainer;
    assert!(trainer.0.try_wait().unwrap().is_none(), "the trainer died");
    assert_perfetto_reads_the_same(test, &timeline_file, &timeline);
    drop(trainer);
    lens_tests::wait_for_lens_probe_teardown();
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- The size cap -------------------------------------------------------------------

#[test]
fn a_timeline_stops_at_its_size_cap_and_says_how_much_is_missing() {
    let test = "a_timeline_stops_at_its_size_cap";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let _serial = serial();
    let dir = scratch("cap");
    // 10 slices a step at ~200 bytes each (names interned): 1500 steps make ~3 MiB.
    let (
        output,
        Outputs {
            spans_file,
            timeline_file,
            summary_file,
        },
    ) = traced_trainer(
        &dir,
        &["--perfetto-max-size", "1MiB"],
        &["env", "LENS_FAKE_SYNC_MS=0"],
        "1500",
    );
    let stderr = stderr_text(&output);
    assert_eq!(output.status.code(), Some(0), "{stderr}");

    let bytes = std::fs::metadata(&timeline_file).unwrap().len();
    assert!(bytes <= 1 << 20, "{bytes} bytes");
    // Stopped at the cap, not long before it: one more span would not have fitted.
    assert!(bytes > (1 << 20) - (16 << 10), "{bytes} bytes");
    let timeline = read_timeline(&timeline_file);
    assert_whole(&timeline);

    let json = summary(&summary_file);
    let report = &json["timeline"];
    let slices = report["slices"].as_u64().unwrap();
    let past_cap = report["spans_past_cap"].as_u64().unwrap();
    assert!(past_cap > 0, "{report}");
    assert_eq!(report["spans_dropped"], 0, "{report}");
    assert_eq!(slices, timeline.slices.len() as u64);
    assert_eq!(report["bytes"].as_u64(), Some(bytes));
    assert_eq!(report["max_bytes"].as_u64(), Some(1 << 20));
    // Every span the OTLP file got is in the timeline or counted as missing from it.
    assert_eq!(json["export"]["spans_lost"], 0, "{json}");
    let spans = otlp_file_spans(&spans_file);
    assert_eq!(slices + past_cap, spans.len() as u64);

    // Said once as it happened, once in the summary.
    let about_cap: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("reached its size cap"))
        .collect();
    let shown = timeline_file.display();
    assert_eq!(
        about_cap,
        [
            format!(
                "lens-probe: warning: timeline {shown} reached its size cap (1.0 MiB, \
                 --perfetto-max-size): nothing more is written to it"
            ),
            format!(
                "lens-probe: timeline {shown} reached its size cap (1.0 MiB, \
                 --perfetto-max-size): {past_cap} spans after it are not in it"
            ),
        ],
        "{stderr}"
    );
    let summary_line = format!("lens-probe: timeline {shown}: {slices} slices, ");
    assert_eq!(
        stderr
            .lines()
            .filter(|l| l.starts_with(&summary_line))
            .count(),
        1,
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- Settings -------------------------------------------------------------------------

/// lens-probe with these arguments and exactly these of its settings variables.
fn lens_probe(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = lens_tests::lens_probe_command(LENS_PROBE);
    command.args(args);
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().unwrap()
}

/// One bad input: arguments, variables, and what the one line says.
type Row<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a [&'a str]);

#[test]
fn bad_timeline_settings_are_one_line_each() {
    const WRITABLE: &str = "expected a file lens-probe can create or overwrite";
    let dir = scratch("bad");
    let config = |name: &str, text: &str| -> String {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    let not_a_string = config("number.toml", "[timeline]\nperfetto = 3\n");
    let unknown_key = config("unknown.toml", "[timeline]\nperfeto = \"x.pftrace\"\n");
    let bad_size = config("size.toml", "[timeline]\nmax_size = \"lots\"\n");
    let missing_dir = config(
        "dir.toml",
        "[timeline]\nperfetto = \"/nonexistent-dir/x.pftrace\"\n",
    );
    let not_a_table = config("table.toml", "timeline = \"x.pftrace\"\n");
    #[rustfmt::skip]
    let rows: &[Row] = &[
        (&["--pid", "1", "--perfetto", "/nonexistent-dir/x"], &[], &["for --perfetto:", "directory /nonexistent-dir does not exist", WRITABLE]),
        (&["--pid", "1", "--perfetto", "/"], &[], &["for --perfetto:", "is a directory", WRITABLE]),
        (&["--pid", "1"], &[("LENS_PROBE_PERFETTO", "/nonexistent-dir/x")], &["for LENS_PROBE_PERFETTO:", "does not exist"]),
        (&["--pid", "1", "--perfetto-max-size", "lots"], &[], &["for --perfetto-max-size:", "expected a size such as 1GiB"]),
        (&["--pid", "1", "--perfetto-max-size", "10KiB"], &[], &["for --perfetto-max-size:", "at least 1MiB"]),
        (&["--pid", "1", "--perfetto-max-size", "3 parsecs"], &[], &["for --perfetto-max-size:", "unknown unit"]),
        (&["--pid", "1"], &[("LENS_PROBE_PERFETTO_MAX_SIZE", "lots")], &["for LENS_PROBE_PERFETTO_MAX_SIZE:", "expected a size"]),
        (&["--pid", "1", "--config", &not_a_string], &[], &[&not_a_string, "[timeline] perfetto must be a string"]),
        (&["--pid", "1", "--config", &unknown_key], &[], &[&unknown_key, "unknown key \"perfeto\"", "valid: perfetto, max_size"]),
        (&["--pid", "1", "--config", &bad_size], &[], &[&bad_size, "[timeline] max_size:", "expected a size"]),
        (&["--pid", "1", "--config", &missing_dir], &[], &[&missing_dir, "[timeline] perfetto:", "does not exist"]),
        (&["--pid", "1", "--config", &not_a_table], &[], &[&not_a_table, "timeline must be a table"]),
        (&["--pid", "1", "--exporter", "file", "--export-file", "/tmp/lens-shared.out", "--perfetto", "/tmp/lens-shared.out"], &[], &["--perfetto /tmp/lens-shared.out: is also --export-file's file"]),
    ];
    for (args, env, needles) in rows {
        let output = lens_probe(args, env);
        for needle in *needles {
            assert_one_line_error(&output, 2, needle);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_run_that_fails_at_start_leaves_an_earlier_timeline_as_it_was() {
    let dir = scratch("kept");
    let timeline_file = dir.join("earlier.perfetto-trace");
    std::fs::write(&timeline_file, b"an earlier run's timeline").unwrap();
    let output = lens_probe(
        &[
            "--perfetto",
            timeline_file.to_str().unwrap(),
            "--exec",
            "--",
            "/nonexistent/train",
        ],
        &[],
    );
    assert_ne!(output.status.code(), Some(0), "{}", stderr_text(&output));
    // Not truncated, not replaced by an empty trace, nothing left beside it.
    assert_eq!(
        std::fs::read(&timeline_file).unwrap(),
        b"an earlier run's timeline"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_config_files_timeline_table_alone_writes_the_timeline() {
    let test = "the_config_files_timeline_table_alone";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let _serial = serial();
    let dir = scratch("config");
    let (timeline_file, summary_file, config) = (
        dir.join("from-config.perfetto-trace"),
        dir.join("summary.json"),
        dir.join("lens.toml"),
    );
    std::fs::write(
        &config,
        format!(
            "[timeline]\nperfetto = \"{}\"\nmax_size = \"2MiB\"\n",
            timeline_file.display()
        ),
    )
    .unwrap();
    let output = lens_tests::lens_probe_command(LENS_PROBE)
        .args(["--span-groups", "per_step", "--config"])
        .arg(&config)
        .arg("--summary-json")
        .arg(&summary_file)
        .args(["--exec", "--"])
        .arg(lens_tests::trainer())
        .arg("2")
        .stdout(Stdio::null())
        .output()
        .unwrap();
    let stderr = stderr_text(&output);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let timeline = read_timeline(&timeline_file);
    assert_whole(&timeline);
    assert!(
        timeline.slices.iter().any(|s| s.name == "train.job"),
        "{:?}",
        timeline.slices
    );
    let report = &summary(&summary_file)["timeline"];
    assert_eq!(
        report["slices"].as_u64(),
        Some(timeline.slices.len() as u64)
    );
    assert_eq!(report["max_bytes"].as_u64(), Some(2 << 20), "{report}");
    assert!(
        stderr.contains(&format!(
            "lens-probe: timeline {}: ",
            timeline_file.display()
        )),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
