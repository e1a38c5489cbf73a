//! Collective completion and stragglers through real uprobes, on `collective_rank`
//! (tests/README.md): the fake NCCL completes each all-reduce a known time after it was
//! called (`LENS_FAKE_COLLECTIVE_US`) and writes that ground truth to a file; the rank
//! learns of the completion as PyTorch does (event queries, from its own thread or a
//! watchdog thread) or by synchronizing. The spans must end at that completion, and with
//! two ranks, the one that arrives late must be named with its lateness.
use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    sync::Mutex,
    time::Duration,
};

use lens_probe::{
    semconv,
    session::{Session, TraceOptions},
    settings::groups::SpanGroups,
    spans::{AttrValue, SpanBuilder, SpanLog, SpanRecord, monotonic_now_ns},
};

/// Each all-reduce completes this long after it was called.
const COLLECTIVE_US: u64 = 3_000;
const STEPS: usize = 20;

/// One at a time: the comparison with the ground truth is in µs, and the two cores are
/// better left to one traced job and lens-probe.
static SERIAL: Mutex<()> = Mutex::new(());

/// One collective as the fake NCCL reports it:
/// `<op> <pid> <seq> <entry> <completion> <inside>`. The probe's entry lies in
/// `[entry_ns, inside_ns]`: the caller's clock just before the call, and the library's
/// first thing inside it.
#[derive(Debug)]
struct Truth {
    pid: u32,
    seq: u64,
    entry_ns: u64,
    completion_ns: u64,
    inside_ns: u64,
}

fn truths(path: &Path) -> Vec<Truth> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            assert_eq!(fields.len(), 6, "{line}");
            assert_eq!(fields[0], "all_reduce");
            Truth {
                pid: fields[1].parse().unwrap(),
                seq: fields[2].parse().unwrap(),
                entry_ns: fields[3].parse().unwrap(),
                completion_ns: fields[4].parse().unwrap(),
                inside_ns: fields[5].parse().unwrap(),
            }
        })
        .collect()
}

/// What each rank's host code saw of each collective (`COLLECTIVE_OBSERVED`), by (pid,
/// step).
struct Observed {
    /// When it learnt of the completion: the return of the query that found it done, or
    /// of the sync.
    completion_ns: u64,
    /// Its clock just after the collective's call returned.
    returned_ns: u64,
}

fn observations(path: &Path) -> std::collections::HashMap<(u32, u64), Observed> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| {
            let fields: Vec<u64> = line.split(' ').map(|f| f.parse().unwrap()).collect();
            assert_eq!(fields.len(), 4, "{line}");
            let observed = Observed {
                completion_ns: fields[2],
                returned_ns: fields[3],
            };
            ((fields[0] as u32, fields[1]), observed)
        })
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lens-collectives-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let _ = std::fs::remove_file(&path);
    path
}

/// Runs `sh -c SCRIPT` under lens-probe (`per_step`, every process traced from its
/// start), with the fake NCCL's delay and ground truth file; returns the spans and the
/// straggler summary lines.
fn trace(script: &str, truth: &Path, observed: &Path) -> (SpanLog, String) {
    let mut session = Session::new(TraceOptions {
        span_groups: "per_step".parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    let argv: Vec<OsString> = vec![
        "env".into(),
        format!("LENS_FAKE_COLLECTIVE_US={COLLECTIVE_US}").into(),
        format!("LENS_FAKE_NCCL_TRUTH={}", truth.display()).into(),
        format!("COLLECTIVE_OBSERVED={}", observed.display()).into(),
        "sh".into(),
        "-c".into(),
        script.into(),
        // `$0` of the script.
        lens_tests::collective_rank().into_os_string(),
    ];
    session.exec(&argv).unwrap();
    let mut builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
    let report = session
        .run_blocking(&mut builder, Some(Duration::from_secs(60)))
        .unwrap();
    assert_eq!(
        report.child_exit,
        Some(lens_probe::sys::target::ExitStatus::Exited(0))
    );
    let stragglers = lens_probe::spans::stragglers::render(builder.stragglers());
    (builder.into_exporter(), stragglers)
}

fn all_reduces(log: &SpanLog, pid: u32) -> Vec<&SpanRecord> {
    let mut spans: Vec<&SpanRecord> = log
        .named("nccl.all_reduce")
        .filter(|s| s.pid == pid)
        .collect();
    spans.sort_by_key(|s| s.start_ns);
    spans
}

/// One rank, `STEPS` all-reduces, waiting for each as `mode` says: every span ends
/// within 1 ms of the ground truth, inferred from `source`, and its precision bound
/// holds the true completion. (The fixture's own wake-up can be late on a loaded
/// machine: then the host itself learnt of the completion late, and the span must end
/// no later than the host learnt it.)
fn completion_is_inferred(mode: &str, source: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let truth_path = scratch(&format!("truth-{mode}"));
    let observed_path = scratch(&format!("observed-{mode}"));
    let script = format!("COLLECTIVE_WAIT={mode} exec \"$0\" 0 1 {STEPS}");
    let (log, _) = trace(&script, &truth_path, &observed_path);
    let truth = truths(&truth_path);
    let observed = observations(&observed_path);
    assert_eq!(truth.len(), STEPS);
    let spans = all_reduces(&log, truth[0].pid);
    assert_eq!(spans.len(), STEPS, "{:#?}", log.spans);
    let mut errors_us = Vec::new();
    let mut late_wakeups = 0;
    for (span, truth) in spans.iter().zip(&truth) {
        assert_eq!(
            span.int_attr(semconv::DL_COLLECTIVE_SEQ),
            Some(truth.seq as i64)
        );
        assert_eq!(
            span.attr(semconv::DL_COLLECTIVE_END_SOURCE),
            Some(&AttrValue::from(source)),
            "seq {}",
            truth.seq
        );
        // The fixture reads the clock just before the call (lensFakeNcclArrive) and first
        // thing inside it: the probe's entry lies between, however long a loaded machine
        // kept the thread off the CPU around the call.
        assert!(
            truth.entry_ns <= span.start_ns && span.start_ns <= truth.inside_ns,
            "seq {}: entry {} ns, not in the fixture's [{}, {}] ns",
            truth.seq,
            span.start_ns,
            truth.entry_ns,
            truth.inside_ns
        );
        // The completion lies where the span says: in [end − precision, end].
        let precision = span
            .int_attr(semconv::DL_COLLECTIVE_END_PRECISION_NS)
            .unwrap() as u64;
        assert!(
            span.end_ns - precision <= truth.completion_ns && truth.completion_ns <= span.end_ns,
            "seq {}: completion {} not in [{} - {precision}, {}]",
            truth.seq,
            truth.completion_ns,
            span.end_ns,
            span.end_ns
        );
        let error_ns = span.end_ns - truth.completion_ns;
        errors_us.push(error_ns / 1_000);
        // What the host code saw: the end is the return of the call that told it, just
        // before the fixture read the clock.
        let seen = &observed[&(truth.pid, truth.seq)];
        let returned = seen.returned_ns;
        let seen = seen.completion_ns;
        assert!(
            span.end_ns <= seen && seen - span.end_ns < 1_000_000,
            "seq {}: span end {} vs the host's observation {seen}",
            truth.seq,
            span.end_ns
        );
        if seen - truth.completion_ns <= 1_000_000 {
            assert!(
                error_ns <= 1_000_000,
                "seq {}: the span ends {error_ns} ns after the completion",
                truth.seq
            );
        } else {
            late_wakeups += 1;
        }
        // The call returned after the library's clock inside it and before the caller's
        // just after it. (Not "shorter than the collective": on a loaded machine the
        // thread can be kept off the CPU inside the call for longer.)
        let enqueue = span
            .int_attr(semconv::DL_COLLECTIVE_ENQUEUE_DURATION_NS)
            .unwrap() as u64;
        let call_return = span.start_ns + enqueue;
        assert!(
            truth.inside_ns <= call_return && call_return <= returned,
            "seq {}: the call returned at {call_return} ns, not in the fixture's [{}, \
             {returned}] ns",
            truth.seq,
            truth.inside_ns
        );
    }
    eprintln!("{mode}: span end − true completion, µs: {errors_us:?}");
    // The check above applies to the waits the fixture itself returned from within 1 ms
    // of the completion; on a loaded machine many return later (its thread waits for a
    // CPU), which says nothing about lens-probe, whose end is still held to the host's
    // observation for every one. At least one must have been on time, or the check
    // above said nothing.
    assert!(
        late_wakeups < STEPS,
        "{mode}: the fixture itself learnt of {late_wakeups} of {STEPS} completions more \
         than 1 ms late: {errors_us:?} µs"
    );
    let _ = std::fs::remove_file(&truth_path);
    let _ = std::fs::remove_file(&observed_path);
}

#[test]
fn completion_from_event_queries_on_the_calling_thread() {
    if !lens_tests::require_bpf("completion_from_event_queries_on_the_calling_thread") {
        return;
    }
    completion_is_inferred("query", "event_query");
}

#[test]
fn completion_from_event_queries_on_a_watchdog_thread() {
    if !lens_tests::require_bpf("completion_from_event_queries_on_a_watchdog_thread") {
        return;
    }
    completion_is_inferred("watchdog", "event_query");
}

#[test]
fn completion_from_event_synchronize() {
    if !lens_tests::require_bpf("completion_from_event_synchronize") {
        return;
    }
    completion_is_inferred("event_sync", "event_synchronize");
}

#[test]
fn completion_from_stream_synchronize() {
    if !lens_tests::require_bpf("completion_from_stream_synchronize") {
        return;
    }
    completion_is_inferred("stream_sync", "stream_synchronize");
}

#[test]
fn a_late_rank_is_named_with_its_lateness() {
    if !lens_tests::require_bpf("a_late_rank_is_named_with_its_lateness") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const LATE_MS: u64 = 10;
    const PERIOD_MS: u64 = 40;
    let truth_path = scratch("truth-ranks");
    let observed_path = scratch("observed-ranks");
    // Both ranks on one schedule that starts once both are attached; rank 1 calls every
    // all-reduce LATE_MS after rank 0. A fixed epoch (3 s ahead) failed when attaches
    // queued behind another lens-probe's uprobe teardown (~0.1 s a probe): past the
    // epoch, a rank runs its calls back to back and ends before the other reaches them.
    // So each rank says when its main() runs (its libraries loaded, hence attached: the
    // loads are held until then) and waits at a gate; the test opens it with an epoch.
    let ready = scratch("ready-ranks");
    let _ = std::fs::remove_dir_all(&ready);
    std::fs::create_dir_all(&ready).unwrap();
    let gate = scratch("gate-ranks");
    let opener = open_gate_when_ready(&ready, ["ready.0", "ready.1"], &gate);
    let script = format!(
        "export COLLECTIVE_EPOCH_NS=gate COLLECTIVE_PERIOD_MS={PERIOD_MS} \
         COLLECTIVE_READY_DIR={} COLLECTIVE_START_GATE={}; \
         \"$0\" 0 2 {STEPS} & COLLECTIVE_LATE_MS={LATE_MS} \"$0\" 1 2 {STEPS}; wait $!",
        ready.display(),
        gate.display()
    );
    let (log, summary) = trace(&script, &truth_path, &observed_path);
    opener.join().unwrap();
    let _ = std::fs::remove_dir_all(&ready);
    let _ = std::fs::remove_file(&gate);
    let truth = truths(&truth_path);
    assert_eq!(truth.len(), 2 * STEPS);
    let mut pids: Vec<u32> = truth.iter().map(|t| t.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids.len(), 2);
    // The true skew of each collective, from the fixture's own entry times.
    let entry = |pid: u32, seq: u64| {
        let truth = truth.iter().find(|t| t.pid == pid && t.seq == seq).unwrap();
        (truth.entry_ns as i64, truth.inside_ns as i64)
    };
    let spans: Vec<Vec<&SpanRecord>> = pids.iter().map(|pid| all_reduces(&log, *pid)).collect();
    let late_pid = *pids
        .iter()
        .find(|pid| all_reduces(&log, **pid)[0].int_attr(semconv::DL_RANK) == Some(1))
        .unwrap();
    let early_pid = *pids.iter().find(|pid| **pid != late_pid).unwrap();
    let mut true_skews = Vec::new();
    let mut skew_errors = Vec::new();
    for rank_spans in &spans {
        assert_eq!(rank_spans.len(), STEPS);
        for (seq, span) in rank_spans.iter().enumerate() {
            let seq = seq as u64;
            assert_eq!(span.int_attr(semconv::DL_COLLECTIVE_SEQ), Some(seq as i64));
            assert_eq!(span.int_attr(semconv::DL_COLLECTIVE_LAST_RANK), Some(1));
            assert_eq!(
                span.int_attr(semconv::DL_COLLECTIVE_RANKS_COMPARED),
                Some(2)
            );
            let (late_before, late_inside) = entry(late_pid, seq);
            let (early_before, early_inside) = entry(early_pid, seq);
            let true_skew = late_before - early_before;
            let skew = span
                .int_attr(semconv::DL_COLLECTIVE_ARRIVAL_SKEW_NS)
                .unwrap();
            // Each rank's entry lies between its clock just before the call and its clock
            // first thing inside, so the measured skew lies between the extremes. (A
            // tolerance around the clocks before failed on a loaded machine: the early
            // rank was once preempted 2.5 ms between its clock and its call.)
            assert!(
                late_before - early_inside <= skew && skew <= late_inside - early_before,
                "seq {seq}: measured {skew} ns, not in [{}, {}] ns",
                late_before - early_inside,
                late_inside - early_before
            );
            true_skews.push(true_skew);
            skew_errors.push((skew - true_skew).abs());
            let wait = span.int_attr(semconv::DL_COLLECTIVE_WAIT_NS).unwrap();
            if span.pid == late_pid {
                assert_eq!(wait, 0);
            } else {
                assert_eq!(wait, skew);
            }
        }
    }
    // Typically the probe's latency apart (a preemption between the clock and the call
    // is the exception).
    skew_errors.sort_unstable();
    let median_error = skew_errors[skew_errors.len() / 2];
    assert!(median_error < 100_000, "skew errors {skew_errors:?} ns");
    // The fixture's own clocks say rank 1 arrived last at every collective, which the
    // summary below must report, and late by about what the schedule asked. Not to
    // ± 10 %: on a loaded machine a rank's wake-ups overshoot by several ms (a CI run saw
    // 10.0–17.5 ms, median 11.3, for 10 ms asked), which says nothing about lens-probe:
    // its measurement is held to the fixture's clocks above, exactly.
    true_skews.sort_unstable();
    let median = true_skews[true_skews.len() / 2];
    assert!(
        true_skews[0] > 0 && median >= (LATE_MS * 1_000_000 / 2) as i64,
        "the schedule did not make rank 1 late: true skews {true_skews:?} ns, \
         {LATE_MS} ms asked"
    );
    assert!(
        summary.contains(&format!(
            "stragglers: rank 1 arrived last in 100% of all_reduce ({STEPS} of {STEPS} matched"
        )),
        "{summary}"
    );
    let _ = std::fs::remove_file(&truth_path);
    let _ = std::fs::remove_file(&observed_path);
}

/// Opens `gate` (a file holding an epoch 0.5 s ahead, `CLOCK_MONOTONIC` ns) once both
/// `ready` files exist in `dir`: each rank makes its own when its `main()` runs, its
/// libraries loaded and so attached (the loads are held until then), so the ranks start
/// together however long each attach took on a loaded machine.
fn open_gate_when_ready(
    dir: &std::path::Path,
    ready: [&'static str; 2],
    gate: &std::path::Path,
) -> std::thread::JoinHandle<()> {
    let (dir, gate) = (dir.to_path_buf(), gate.to_path_buf());
    std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while !ready.iter().all(|name| dir.join(name).exists()) {
            assert!(
                std::time::Instant::now() < deadline,
                "the ranks never started"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let epoch = monotonic_now_ns() + 500_000_000;
        let staged = gate.with_extension("tmp");
        std::fs::write(&staged, epoch.to_string()).unwrap();
        std::fs::rename(&staged, &gate).unwrap();
    })
}

/// Two fake-PyTorch ranks (`trainer_torch`, DDP-like: an all-reduce inside each
/// backward) whose all-reduces block until both arrived (`LENS_FAKE_NCCL_RENDEZVOUS`);
/// rank 1 gets `slow` (its environment) and arrives late. Returns the all-reduce spans
/// and the straggler summary.
fn trace_slow_rank(name: &str, slow: (&str, &str)) -> (SpanLog, String) {
    let rendezvous = scratch(&format!("rendezvous-{name}"));
    std::fs::create_dir_all(&rendezvous).unwrap();
    let mut session = Session::new(TraceOptions {
        span_groups: "per_step".parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    let trainer = lens_tests::torch_trainer();
    // The first all-reduce would otherwise tell which rank was attached last, not which
    // is slow (rank 0, held 250 ms at its library loads on a loaded machine, was last).
    let ready = scratch(&format!("ready-{name}"));
    let _ = std::fs::remove_dir_all(&ready);
    std::fs::create_dir_all(&ready).unwrap();
    let gate = scratch(&format!("gate-{name}"));
    let _ = std::fs::remove_file(&gate);
    let opener = open_gate_when_ready(&ready, ["rank0", "rank1"], &gate);
    let script = format!(
        "export TRAINER_READY_DIR={} TRAINER_START_GATE={}; \
         TRAINER_RANK=0 \"$0\" 10 1 0 0 & TRAINER_RANK=1 {}={} \"$0\" 10 1 0 0; wait $!",
        ready.display(),
        gate.display(),
        slow.0,
        slow.1
    );
    let argv: Vec<OsString> = vec![
        "env".into(),
        "TRAINER_DISTRIBUTED=1".into(),
        "TRAINER_NRANKS=2".into(),
        "TRAINER_INIT_MS=0".into(),
        format!("LENS_FAKE_NCCL_RENDEZVOUS={}", rendezvous.display()).into(),
        "sh".into(),
        "-c".into(),
        script.into(),
        trainer.into_os_string(),
    ];
    session.exec(&argv).unwrap();
    let mut builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
    let report = session
        .run_blocking(&mut builder, Some(Duration::from_secs(120)))
        .unwrap();
    assert_eq!(
        report.child_exit,
        Some(lens_probe::sys::target::ExitStatus::Exited(0))
    );
    opener.join().unwrap();
    let _ = std::fs::remove_dir_all(&rendezvous);
    let _ = std::fs::remove_dir_all(&ready);
    let _ = std::fs::remove_file(&gate);
    let stragglers = lens_probe::spans::stragglers::render(builder.stragglers());
    (builder.into_exporter(), stragglers)
}

/// The straggler's cause: the phase in which rank 1's recent steps took longer than
/// rank 0's (whose wait inside the all-reduce is not counted against its phases).
fn cause_is_named(name: &str, slow: (&str, &str), cause: &str) {
    if !lens_tests::require_bpf(name) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (log, summary) = trace_slow_rank(name, slow);
    let all_reduces: Vec<&SpanRecord> = log.named("nccl.all_reduce").collect();
    assert_eq!(all_reduces.len(), 20, "10 steps, 2 ranks");
    let told: Vec<String> = all_reduces
        .iter()
        .filter_map(|s| match s.attr(semconv::DL_COLLECTIVE_STRAGGLER_CAUSE) {
            Some(AttrValue::Str(c)) => Some(c.to_string()),
            _ => None,
        })
        .collect();
    // From the second step on (a cause needs a whole step of each rank), both spans of
    // each all-reduce: the cause is the same for all.
    assert!(told.len() >= 14, "{told:?}");
    assert!(told.iter().all(|c| c == cause), "{told:?}");
    assert!(
        summary.contains("stragglers: rank 1 arrived last in 100% of all_reduce")
            && summary.contains(&format!("; cause: {cause} (100% of ")),
        "{summary}"
    );
}

#[test]
fn a_rank_slow_in_data_loading_is_late_for_data_loading() {
    cause_is_named(
        "a_rank_slow_in_data_loading",
        ("TRAINER_FETCH_MS", "30"),
        "data_loading",
    );
}

#[test]
fn a_rank_slow_in_compute_is_late_for_forward_backward() {
    cause_is_named(
        "a_rank_slow_in_compute",
        ("TRAINER_FORWARD_MS", "30"),
        "forward_backward",
    );
}
