use std::path::PathBuf;

use super::tracks::{self, Level};
use super::{replay::Replayed, *};
use crate::{
    export::resource::own_host_name, names, semconv, settings::groups::SpanGroup,
    spans::SpanStatus, sys::target::RankInfo,
};

const PID: u32 = 4242;
const WORKER: u32 = 4243;

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lens-timeline-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("run.perfetto-trace")
}

fn info(pid: u32, rank: i64) -> ProcessInfo {
    ProcessInfo {
        pid,
        name: "python".into(),
        command_line: vec!["python".into(), "train.py".into()],
        traced_from_start: true,
        rank: Some(RankInfo {
            rank,
            world_size: Some(2),
            local_rank: Some(rank),
        }),
        view: Default::default(),
    }
}

fn span(
    id: u64,
    parent: Option<u64>,
    name: &'static str,
    tid: u32,
    (start_ns, end_ns): (u64, u64),
) -> SpanRecord {
    SpanRecord {
        id: SpanId(id),
        parent: parent.map(SpanId),
        name,
        group: SpanGroup::Step,
        pid: PID,
        tid,
        start_ns,
        end_ns,
        attributes: vec![(semconv::NEMO_SPAN_GROUP, "step".into())],
        events: Vec::new(),
        status: SpanStatus::Unset,
    }
}

fn collective(id: u64, parent: u64, (start, end): (u64, u64), seq: i64, bytes: i64) -> SpanRecord {
    let mut s = span(id, Some(parent), "nccl.all_reduce", PID, (start, end));
    s.attributes.extend([
        (semconv::DL_COLLECTIVE_COMM_ID, "00000000000000aa".into()),
        (semconv::DL_COLLECTIVE_SEQ, seq.into()),
        (semconv::DL_COLLECTIVE_BYTES, bytes.into()),
        (semconv::DL_RANK, 0i64.into()),
    ]);
    s
}

/// Writes `spans` (in the order given, as the span builder hands them over) and reads
/// the file back.
fn written(name: &str, max_bytes: u64, spans: Vec<SpanRecord>) -> (Replayed, TimelineReport) {
    let path = temp_path(name);
    let settings = TimelineSettings {
        path: path.clone(),
        max_bytes,
    };
    let mut timeline = Timeline::create(&settings).unwrap();
    let report = timeline.report();
    timeline.process_started(&info(PID, 1), None, 0);
    for span in spans {
        timeline.export(span);
    }
    drop(timeline);
    let replayed = replay::replay(&std::fs::read(&path).unwrap());
    let report = report.lock().unwrap().clone();
    (replayed, report)
}

/// One step as the builder ends it: children first, phases touching, a parent and its
/// first child starting at one instant, a collective on a worker thread.
fn one_step() -> Vec<SpanRecord> {
    vec![
        collective(5, 3, (1_200, 1_400), 0, 4096),
        span(3, Some(2), names::FORWARD_BACKWARD, PID, (1_000, 2_000)),
        span(4, Some(2), names::OPTIMIZER, PID, (2_000, 2_500)),
        span(6, Some(2), "cuda.synchronize", WORKER, (2_100, 2_200)),
        span(2, Some(1), names::STEP, PID, (1_000, 3_000)),
        span(7, Some(1), names::STEP, PID, (3_000, 4_000)),
        span(1, None, names::JOB, PID, (0, 4_000)),
    ]
}

#[test]
fn every_span_is_one_balanced_slice_on_a_track_of_its_process() {
    let (replayed, report) = written("balanced", DEFAULT_MAX_BYTES, one_step());
    assert_eq!(replayed.problems, Vec::<String>::new());
    assert!(!replayed.truncated);
    assert_eq!(replayed.slices.len(), 7);
    assert_eq!(report.slices, 7);
    let process: Vec<u64> = replayed
        .tracks_named(&format!("rank 1 · {} · pid {PID}", own_host_name()))
        .collect();
    assert_eq!(process.len(), 1, "{:?}", replayed.tracks);
    for slice in &replayed.slices {
        assert_eq!(replayed.root_of(slice.track), process[0], "{}", slice.name);
        assert_eq!(
            slice.depth, 0,
            "{} shares its track with its parent",
            slice.name
        );
    }
    let job = replayed
        .slices
        .iter()
        .find(|s| s.name == names::JOB)
        .unwrap();
    assert_eq!(job.track, process[0]);
    assert_eq!(job.end_ns - job.start_ns, 4_000);
    let main = replayed
        .tracks_named(&format!("main thread {PID}"))
        .next()
        .unwrap();
    let steps: Vec<&Slice> = replayed
        .slices
        .iter()
        .filter(|s| s.name == names::STEP)
        .collect();
    assert!(
        steps.iter().all(|s| s.track == main),
        "steps on the thread's own track"
    );
    let parts = replayed
        .slices
        .iter()
        .filter(|s| s.name == names::FORWARD_BACKWARD || s.name == names::OPTIMIZER);
    for part in parts {
        let track = &replayed.tracks[&part.track];
        assert_eq!(track.name, Level::StepPart.track_name());
        assert_eq!(track.parent, Some(main));
    }
    let sync = replayed
        .slices
        .iter()
        .find(|s| s.name == "cuda.synchronize")
        .unwrap();
    let worker = replayed.tracks[&sync.track].parent.unwrap();
    assert!(replayed.tracks[&worker].name.ends_with(&WORKER.to_string()));
    assert_eq!(replayed.tracks[&worker].parent, Some(process[0]));
    assert_eq!(
        job.annotations
            .get(semconv::NEMO_SPAN_GROUP)
            .map(String::as_str),
        Some("step")
    );
    assert!(job.start_ns > 1_600_000_000_000_000_000, "wall-clock ns");
}

use replay::Slice;

#[test]
fn overlapping_calls_of_one_thread_go_on_lanes_of_their_own() {
    let spans = vec![
        collective(2, 1, (100, 400), 0, 8),
        collective(3, 1, (200, 300), 1, 8),
        collective(4, 1, (300, 500), 2, 8),
        // Arrives late, ending where an earlier-written one begins.
        collective(5, 1, (50, 100), 3, 8),
    ];
    let (replayed, report) = written("lanes", DEFAULT_MAX_BYTES, spans);
    assert_eq!(replayed.problems, Vec::<String>::new());
    assert_eq!(report.slices, 4);
    let lanes: std::collections::BTreeSet<&str> = replayed
        .slices
        .iter()
        .map(|s| replayed.tracks[&s.track].name.as_str())
        .collect();
    assert_eq!(lanes, ["calls", "calls 2"].into_iter().collect());
    let track_of = |length: u64| {
        let wall = |s: &&Slice| s.end_ns - s.start_ns;
        replayed
            .slices
            .iter()
            .filter(|s| wall(s) == length)
            .map(|s| s.track)
            .next()
            .unwrap()
    };
    // Lengths tell the four apart: 300, 100, 200, 50 ns.
    assert_ne!(track_of(300), track_of(100), "overlapping");
    assert_ne!(
        track_of(50),
        track_of(300),
        "ends where one written before begins"
    );
    assert_eq!(
        track_of(100),
        track_of(200),
        "the second begins where the first ends"
    );
}

#[test]
fn a_collective_carries_its_flow_and_its_bytes_count_for_its_step() {
    let (replayed, _) = written("flows", DEFAULT_MAX_BYTES, one_step());
    let all_reduce = replayed
        .slices
        .iter()
        .find(|s| s.name == "nccl.all_reduce")
        .unwrap();
    assert_eq!(
        all_reduce.flow_ids,
        vec![tracks::collective_flow("00000000000000aa", 0)]
    );
    let bytes = replayed
        .tracks_named("collective bytes per step")
        .next()
        .unwrap();
    let points: Vec<i64> = replayed
        .counters
        .iter()
        .filter(|c| c.track == bytes)
        .map(|c| c.value)
        .collect();
    assert_eq!(
        points,
        vec![4096, 0],
        "the first step's all-reduce, none in the second"
    );
}

#[test]
fn a_hang_report_and_a_straggler_verdict_are_instants_with_their_text() {
    let mut hang = span(2, Some(1), names::HANG, PID, (100, 900));
    hang.status = SpanStatus::Error("all_reduce #7 hung: rank 1 missing".into());
    hang.attributes.push((
        semconv::LENS_PROBE_HANG_PYTHON_STACK,
        "train.py:12 step\ntrain.py:40 main".into(),
    ));
    let mut late = collective(3, 1, (1_000, 1_100), 4, 8);
    late.attributes.extend([
        (semconv::DL_COLLECTIVE_LAST_RANK, 0i64.into()),
        (semconv::DL_COLLECTIVE_ARRIVAL_SKEW_NS, 2_500_000i64.into()),
        (semconv::DL_COLLECTIVE_STRAGGLER_CAUSE, "compute".into()),
    ]);
    let (replayed, _) = written("reports", DEFAULT_MAX_BYTES, vec![hang, late]);
    assert_eq!(replayed.problems, Vec::<String>::new());
    assert_eq!(replayed.slices.len(), 2);
    let names: Vec<&str> = replayed.instants.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "hang: all_reduce #7 hung: rank 1 missing",
            "straggler: rank 0 arrived last at nccl.all_reduce by 2.50 ms (compute)"
        ]
    );
    let reports = replayed.tracks_named("reports").next().unwrap();
    assert!(replayed.instants.iter().all(|i| i.track == reports));
    assert_eq!(
        replayed.instants[0]
            .annotations
            .get(semconv::LENS_PROBE_HANG_PYTHON_STACK)
            .map(String::as_str),
        Some("train.py:12 step\ntrain.py:40 main")
    );
}

#[test]
fn past_its_cap_the_file_stops_whole_and_says_how_many_spans_it_lacks() {
    let spans: Vec<SpanRecord> = (0..200)
        .map(|i| collective(10 + i, 1, (i * 100, i * 100 + 50), i as i64, 8))
        .collect();
    let (replayed, report) = written("cap", 4096, spans);
    assert_eq!(replayed.problems, Vec::<String>::new());
    assert!(!replayed.truncated);
    assert!(report.bytes <= 4096, "{report:?}");
    assert!(report.slices > 0 && report.spans_past_cap > 0);
    assert_eq!(report.slices + report.spans_past_cap, 200);
    assert_eq!(replayed.slices.len() as u64, report.slices);
    assert!(report.render().contains("reached its size cap"));
}

#[test]
fn two_writers_files_concatenated_open_as_one_trace() {
    let a = written("concat-a", DEFAULT_MAX_BYTES, one_step());
    let path_a = temp_path("concat-a2");
    let path_b = temp_path("concat-b2");
    for path in [&path_a, &path_b] {
        let settings = TimelineSettings {
            path: path.clone(),
            max_bytes: DEFAULT_MAX_BYTES,
        };
        let mut timeline = Timeline::create(&settings).unwrap();
        timeline.process_started(&info(PID, 0), None, 0);
        for span in one_step() {
            timeline.export(span);
        }
    }
    let mut both = std::fs::read(&path_a).unwrap();
    both.extend(std::fs::read(&path_b).unwrap());
    let replayed = replay::replay(&both);
    assert_eq!(replayed.problems, Vec::<String>::new());
    assert_eq!(replayed.slices.len(), 2 * a.0.slices.len());
    assert_eq!(replayed.sequences.len(), 2);
    let processes = replayed
        .tracks
        .values()
        .filter(|t| t.parent.is_none())
        .count();
    assert_eq!(processes, 2, "one pid, two writers: two processes");
}

#[test]
fn an_empty_run_leaves_an_empty_trace_in_place() {
    let (replayed, report) = written("empty", DEFAULT_MAX_BYTES, Vec::new());
    assert_eq!(replayed.slices.len(), 0);
    assert_eq!(report.slices, 0);
    assert!(report.path.exists());
}

#[test]
fn a_later_process_with_an_ended_ones_pid_gets_tracks_of_its_own() {
    // The pid reused (a node traced for days), or a traced process that execs another
    // trainer: each process is drawn under its own name, its rank and command line.
    let path = temp_path("pid-reused");
    let settings = TimelineSettings {
        path: path.clone(),
        max_bytes: DEFAULT_MAX_BYTES,
    };
    let mut timeline = Timeline::create(&settings).unwrap();
    timeline.process_started(&info(PID, 1), None, 0);
    timeline.export(span(1, None, names::JOB, PID, (0, 1_000)));
    timeline.process_ended(PID);
    timeline.process_started(&info(PID, 3), None, 0);
    timeline.export(span(2, Some(3), names::STEP, PID, (2_000, 2_500)));
    timeline.export(span(3, None, names::JOB, PID, (2_000, 3_000)));
    timeline.process_ended(PID);
    drop(timeline);
    let replayed = replay::replay(&std::fs::read(&path).unwrap());
    assert_eq!(replayed.problems, Vec::<String>::new());
    let host = own_host_name();
    for (rank, jobs) in [(1, 1), (3, 1)] {
        let tracks: Vec<u64> = replayed
            .tracks_named(&format!("rank {rank} · {host} · pid {PID}"))
            .collect();
        assert_eq!(tracks.len(), 1, "rank {rank}: {:#?}", replayed.tracks);
        let on_it = replayed
            .slices
            .iter()
            .filter(|s| s.name == names::JOB && s.track == tracks[0])
            .count();
        assert_eq!(on_it, jobs, "rank {rank}");
    }
    let step = replayed
        .slices
        .iter()
        .find(|s| s.name == names::STEP)
        .unwrap();
    let rank_3 = replayed
        .tracks_named(&format!("rank 3 · {host} · pid {PID}"))
        .next()
        .unwrap();
    assert_eq!(replayed.root_of(step.track), rank_3);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn an_out_of_memory_is_one_instant_on_the_reports_track() {
    use crate::spans::SpanEvent;
    let event = SpanEvent {
        name: names::OUT_OF_MEMORY_EVENT,
        at_ns: 400,
        attributes: vec![
            (semconv::DL_GPU_MEMORY_BYTES, (20i64 << 30).into()),
            (semconv::DL_GPU_MEMORY_HELD, (61i64 << 30).into()),
            (semconv::CODE_STACKTRACE, "forward (model.py:118)".into()),
        ],
    };
    // The failed allocation's span and the phase it ran in both carry the event: one
    // instant, from the allocation's.
    let mut phase = span(2, Some(1), names::FORWARD_BACKWARD, PID, (100, 900));
    phase.events.push(event.clone());
    let mut malloc = span(3, Some(2), "cuda.malloc", PID, (300, 400));
    malloc.attributes.extend([
        (semconv::DL_GPU_MEMORY_BYTES, (20i64 << 30).into()),
        (semconv::DL_GPU_MEMORY_HELD, (61i64 << 30).into()),
    ]);
    malloc.events.push(event);
    let (replayed, _) = written("oom", DEFAULT_MAX_BYTES, vec![malloc, phase]);
    assert_eq!(replayed.problems, Vec::<String>::new());
    let names: Vec<&str> = replayed.instants.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(
        names,
        vec![format!("out of GPU memory: {} bytes asked", 20u64 << 30)]
    );
    let reports = replayed.tracks_named("reports").next().unwrap();
    assert_eq!(replayed.instants[0].track, reports);
    assert_eq!(
        replayed.instants[0]
            .annotations
            .get(semconv::CODE_STACKTRACE)
            .map(String::as_str),
        Some("forward (model.py:118)")
    );
}
