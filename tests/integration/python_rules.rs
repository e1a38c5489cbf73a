//! Python rules through the real sampler: a pure-Python training loop
//! (tests/fixtures/python/train_loop.py) whose `train_step`, `evaluate` and
//! `save_checkpoint` functions a config names, run on every CPython 3.10–3.13 pyenv has
//! here and on Debian's python3.11; and the same loop with the steps and evaluations as
//! methods of a class (`train_lib:Trainer.train_step`: on 3.10, whose code objects have
//! no qualified name, the class comes from the source). The spans must come out with the
//! right counts, nesting, iterations and lengths (each end within a couple of sampling
//! intervals).
use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use lens_probe::{
    events::ProbeEvent,
    semconv,
    session::{Session, TraceOptions},
    settings::{groups::SpanGroups, probe_rules::ProbeRules},
    sink::EventLog,
    spans::{AttrValue, SpanBuilder, SpanLog, SpanRecord, names},
};

const STEPS: usize = 12;
const EVAL_EVERY: usize = 4;

const RULES: &str = r#"
[[probe]]
python = "train_lib:train_step"
group = "step"

[[probe]]
python = "train_lib:evaluate"
group = "evaluate"

[[probe]]
python = "train_lib:save_checkpoint"
group = "checkpoint"

[[probe]]
python = "not_a_module:train"
group = "step"
"#;

/// The same for `train_loop.py`'s `trainer` mode: methods by their qualified names. The
/// module function `train_step` is not called there, and must not match the method.
const METHOD_RULES: &str = r#"
[[probe]]
python = "train_lib:Trainer.train_step"
group = "step"

[[probe]]
python = "train_lib:Trainer.evaluate"
group = "evaluate"

[[probe]]
python = "train_lib:save_checkpoint"
group = "checkpoint"

[[probe]]
python = "train_lib:train_step"
group = "step"

[[probe]]
python = "not_a_module:train"
group = "step"
"#;

/// What the loop calls: module functions, or a `Trainer`'s methods.
#[derive(Clone, Copy, Debug)]
enum Calls {
    Functions,
    Methods,
}

impl Calls {
    fn rules(self) -> &'static str {
        match self {
            Calls::Functions => RULES,
            Calls::Methods => METHOD_RULES,
        }
    }

    /// `train_loop.py`'s arguments after STEPS EVAL_EVERY.
    fn mode(self) -> &'static [&'static str] {
        match self {
            Calls::Functions => &[],
            Calls::Methods => &["trainer"],
        }
    }

    /// `code.function` of a step's and an evaluation's spans.
    fn step_and_evaluation(self) -> (&'static str, &'static str) {
        match self {
            Calls::Functions => ("train_step", "evaluate"),
            Calls::Methods => ("Trainer.train_step", "Trainer.evaluate"),
        }
    }

    /// The rules never called.
    fn unmatched(self) -> &'static [&'static str] {
        match self {
            Calls::Functions => &["not_a_module:train"],
            Calls::Methods => &["train_lib:train_step", "not_a_module:train"],
        }
    }
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/python/train_loop.py")
        .canonicalize()
        .unwrap()
}

/// The interpreters to run on: pyenv's 3.10–3.13 and Debian's 3.11. Missing ones are a
/// failure under CI (the machine has them), a skip elsewhere.
fn interpreter(path: &str) -> Option<PathBuf> {
    let path = PathBuf::from(path);
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{} is missing on this CI machine",
        path.display()
    );
    eprintln!("skipped: no {}", path.display());
    None
}

/// One call as the fixture timed it, `CLOCK_MONOTONIC` ns.
#[derive(Debug)]
struct Truth {
    function: String,
    start: u64,
    end: u64,
    /// Wall time less the thread's CPU time, at the call's start and at the end of the
    /// next thing recorded (the next call, or the exit): between them, how long the
    /// thread did not run, the most that can have delayed the samples that bound this
    /// call.
    waited_at_start: u64,
    waited_after: u64,
}

/// Traces `python train_loop.py STEPS EVAL_EVERY [MODE]` with the rules; returns the
/// spans, the warnings about rules never called, and the calls as the fixture timed them.
fn trace(python: &Path, calls: Calls) -> (SpanLog, Vec<String>, Vec<Truth>, Vec<Entry>) {
    let truth_path = std::env::temp_dir().join(format!(
        "lens-python-truth-{}-{}-{calls:?}",
        std::process::id(),
        python.file_name().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&truth_path);
    let mut argv: Vec<OsString> = vec![
        "env".into(),
        format!("TRAIN_TRUTH={}", truth_path.display()).into(),
        python.as_os_str().to_owned(),
        script().into_os_string(),
        STEPS.to_string().into(),
        EVAL_EVERY.to_string().into(),
    ];
    argv.extend(calls.mode().iter().map(OsString::from));
    let (log, unmatched, entries) = run_traced_with_entries(calls.rules(), &argv);
    let truth = read_truth(&truth_path);
    (log, unmatched, truth, entries)
}

/// The calls `train_lib` wrote to `path` at exit, in start order (the file is removed).
fn read_truth(path: &Path) -> Vec<Truth> {
    let mut records: Vec<(String, [u64; 4])> = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            assert_eq!(fields.len(), 5, "{line}");
            let number = |i: usize| fields[i].parse::<u64>().unwrap();
            (
                fields[0].to_string(),
                [number(1), number(2), number(3), number(4)],
            )
        })
        .collect();
    records.sort_by_key(|(_, [start, ..])| *start);
    let truth = records
        .iter()
        .zip(records.iter().skip(1))
        .map(
            |((function, [start, end, waited, _]), (_, [.., waited_next]))| Truth {
                function: function.clone(),
                start: *start,
                end: *end,
                waited_at_start: *waited,
                waited_after: *waited_next,
            },
        )
        .collect();
    let _ = std::fs::remove_file(path);
    truth
}

/// Runs `argv` under lens-probe (`all`, every process traced from its start) with the
/// config `rules`; it must exit 0. Returns the spans and the warnings about Python rules
/// never called.
fn run_traced(rules: &str, argv: &[OsString]) -> (SpanLog, Vec<String>) {
    let (log, unmatched, _) = run_traced_with_entries(rules, argv);
    (log, unmatched)
}

/// A Python rule's call as the sampler first showed it: the rule's function, the sample's
/// time and the thread's tick before it, when the kernel gave it.
#[derive(Debug)]
struct Entry {
    function: String,
    at_ns: u64,
    since_ns: Option<u64>,
}

/// For test `test`, where BPF works: pyenv's CPython 3.13, and this file's lock held (its
/// tests trace one at a time).
fn python_3_13_alone(test: &str) -> Option<(PathBuf, std::sync::MutexGuard<'static, ()>)> {
    if !lens_tests::require_bpf(test) {
        return None;
    }
    let python = interpreter("/root/.pyenv/versions/3.13.0/bin/python3.13")?;
    Some((python, SERIAL.lock().unwrap_or_else(|e| e.into_inner())))
}

fn all_groups() -> SpanGroups {
    "all".parse().unwrap()
}

/// A session of every group with `rules`, nothing traced yet.
fn session_with(rules: &Arc<ProbeRules>) -> Session {
    let mut session = Session::new(TraceOptions {
        span_groups: all_groups(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    session.set_rules(rules.clone());
    session
}

/// `run_traced`, with the entries of the Python rules' calls.
fn run_traced_with_entries(rules: &str, argv: &[OsString]) -> (SpanLog, Vec<String>, Vec<Entry>) {
    let rules = Arc::new(ProbeRules::parse(rules).unwrap());
    let mut session = session_with(&rules);
    session.exec(argv).unwrap();
    let builder = SpanBuilder::new(all_groups(), SpanLog::default()).with_rules(rules.clone());
    let mut sinks = (builder, EventLog::default());
    let report = session
        .run_blocking(&mut sinks, Some(Duration::from_secs(60)))
        .unwrap();
    assert_eq!(
        report.child_exit,
        Some(lens_probe::sys::target::ExitStatus::Exited(0))
    );
    let (builder, events) = sinks;
    let entries = events
        .events
        .iter()
        .filter_map(|event| match event {
            ProbeEvent::RuleCall {
                rule,
                at_ns,
                since_ns,
                at_return: false,
                ..
            } => Some(Entry {
                function: rules.python_rule(*rule)?.qualname.to_string(),
                at_ns: *at_ns,
                since_ns: *since_ns,
            }),
            _ => None,
        })
        .collect();
    (
        builder.into_exporter(),
        session.unmatched_python_rules(),
        entries,
    )
}

/// The sampler's record of a call's first sample says when the thread's tick before it
/// was taken (the thread, which never sleeps here, ran from one to the other): the call
/// began after it, the bound a framework save's span starts from (docs/spans.md). Every
/// step's first sample has one, before the step's own start; at most one step may be
/// seen a sample late (an asynchronous sample can catch the frame chain mid-update).
fn assert_entries_bound_their_calls(function: &str, entries: &[Entry], truth: &[Truth]) {
    let mut late = Vec::new();
    for call in truth.iter().filter(|call| call.function == "train_step") {
        let entry = entries
            .iter()
            .find(|e| e.function == function && e.at_ns >= call.start.saturating_sub(1_000_000))
            .unwrap_or_else(|| panic!("no entry for the step at {}: {entries:?}", call.start));
        let since = entry
            .since_ns
            .unwrap_or_else(|| panic!("the step's first sample has no tick before: {entry:?}"));
        assert!(since < entry.at_ns, "{entry:?}");
        if since > call.start {
            late.push((call.start, entry));
        }
    }
    assert!(late.len() <= 1, "ticks after the steps' starts: {late:?}");
}

/// Each span's ends are within 3 ms of the call's (the sampler looks every 1 ms the
/// thread runs), or later by no more than the time the thread then did not run (waiting
/// for a CPU, or its vCPU taken by the hypervisor: a loaded machine delays samples,
/// never advances them).
fn assert_matches_truth(kind: &str, spans: &[&SpanRecord], truth: &[Truth]) {
    let calls: Vec<&Truth> = truth.iter().filter(|call| call.function == kind).collect();
    assert_eq!(spans.len(), calls.len(), "{kind}");
    for (span, call) in spans.iter().zip(calls) {
        let waited = call.waited_after.saturating_sub(call.waited_at_start);
        let within =
            |seen: u64, truth: u64| seen + 3_000_000 >= truth && seen <= truth + 3_000_000 + waited;
        let off_ms = |a: u64, b: u64| (a as f64 - b as f64) / 1e6;
        assert!(
            within(span.start_ns, call.start) && within(span.end_ns, call.end),
            "{kind}: span {}..{} vs call {}..{} ({:+.2} ms, {:+.2} ms off; the thread \
             did not run for {:.2} ms)",
            span.start_ns,
            span.end_ns,
            call.start,
            call.end,
            off_ms(span.start_ns, call.start),
            off_ms(span.end_ns, call.end),
            waited as f64 / 1e6
        );
    }
}

/// One at a time: a sampler sees threads that run, and five interpreters with their
/// sessions on two cores would make each wait.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn check(python: &str, calls: Calls) {
    let Some(python) = interpreter(python) else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (log, unmatched, truth, entries) = trace(&python, calls);
    let (step_function, evaluation_function) = calls.step_and_evaluation();
    assert_entries_bound_their_calls(step_function, &entries, &truth);
    let steps: Vec<_> = log.named(names::STEP).collect();
    assert_eq!(
        steps.len(),
        STEPS,
        "{}",
        log.outline(&[semconv::DL_ITERATION])
    );
    for (i, step) in steps.iter().enumerate() {
        assert_eq!(step.int_attr(semconv::DL_ITERATION), Some(i as i64));
        assert_eq!(
            step.attr(semconv::CODE_FUNCTION),
            Some(&AttrValue::from(step_function))
        );
        let Some(AttrValue::Str(file)) = step.attr(semconv::CODE_FILEPATH) else {
            panic!("no file: {step:?}");
        };
        assert!(file.ends_with("train_lib.py"), "{file}");
    }
    assert_matches_truth("train_step", &steps, &truth);
    // Steps follow each other, evaluations between them, not inside.
    let evaluations: Vec<_> = log.named(names::EVALUATE).collect();
    assert_eq!(evaluations.len(), STEPS / EVAL_EVERY);
    for evaluation in &evaluations {
        assert_eq!(
            evaluation.attr(semconv::CODE_FUNCTION),
            Some(&AttrValue::from(evaluation_function))
        );
        assert!(
            steps
                .iter()
                .all(|s| s.end_ns <= evaluation.start_ns || s.start_ns >= evaluation.end_ns),
            "an evaluation overlaps a step"
        );
    }
    assert_matches_truth("evaluate", &evaluations, &truth);
    let checkpoints: Vec<_> = log.named(names::CHECKPOINT).collect();
    assert_matches_truth("save_checkpoint", &checkpoints, &truth);
    assert_eq!(checkpoints.len(), 1);
    let job = log.named(names::JOB).next().unwrap();
    for span in steps.iter().chain(&evaluations) {
        assert_eq!(span.parent, Some(job.id), "{span:?}");
    }
    assert_eq!(unmatched.len(), calls.unmatched().len(), "{unmatched:?}");
    for (warning, rule) in unmatched.iter().zip(calls.unmatched()) {
        assert!(warning.contains(rule), "{unmatched:?}");
    }
}

#[test]
fn python_3_10_functions_become_spans() {
    if !lens_tests::require_bpf("python_3_10_functions_become_spans") {
        return;
    }
    check(
        "/root/.pyenv/versions/3.10.13/bin/python3.10",
        Calls::Functions,
    );
}

#[test]
fn python_3_11_functions_become_spans() {
    if !lens_tests::require_bpf("python_3_11_functions_become_spans") {
        return;
    }
    check(
        "/root/.pyenv/versions/3.11.7/bin/python3.11",
        Calls::Functions,
    );
}

#[test]
fn python_3_12_functions_become_spans() {
    if !lens_tests::require_bpf("python_3_12_functions_become_spans") {
        return;
    }
    check(
        "/root/.pyenv/versions/3.12.1/bin/python3.12",
        Calls::Functions,
    );
}

#[test]
fn python_3_13_functions_become_spans() {
    if !lens_tests::require_bpf("python_3_13_functions_become_spans") {
        return;
    }
    check(
        "/root/.pyenv/versions/3.13.0/bin/python3.13",
        Calls::Functions,
    );
}

#[test]
fn debian_python_3_11_functions_become_spans() {
    if !lens_tests::require_bpf("debian_python_3_11_functions_become_spans") {
        return;
    }
    check("/usr/bin/python3.11", Calls::Functions);
}

/// `module:Class.method` rules: 3.10 names methods from the module's source.
#[test]
fn python_3_10_methods_become_spans() {
    if !lens_tests::require_bpf("python_3_10_methods_become_spans") {
        return;
    }
    check(
        "/root/.pyenv/versions/3.10.13/bin/python3.10",
        Calls::Methods,
    );
}

#[test]
fn python_3_11_methods_become_spans() {
    if !lens_tests::require_bpf("python_3_11_methods_become_spans") {
        return;
    }
    check(
        "/root/.pyenv/versions/3.11.7/bin/python3.11",
        Calls::Methods,
    );
}

#[test]
fn python_3_12_methods_become_spans() {
    if !lens_tests::require_bpf("python_3_12_methods_become_spans") {
        return;
    }
    check(
        "/root/.pyenv/versions/3.12.1/bin/python3.12",
        Calls::Methods,
    );
}

#[test]
fn python_3_13_methods_become_spans() {
    if !lens_tests::require_bpf("python_3_13_methods_become_spans") {
        return;
    }
    check(
        "/root/.pyenv/versions/3.13.0/bin/python3.13",
        Calls::Methods,
    );
}

/// Collective and sync spans of a Python process name the Python function that made the
/// call (`code.function`, `code.filepath`).
/// A rule's call on a thread that exits right after it returns ends where it returned,
/// not at the thread's last sample: the call's last 50 ms are asleep (unsampled), and
/// the thread's exit, sent by the kernel, ends it (DCP's `async_save` writer returns,
/// sets its future and exits between two ticks: its span ended 1 ms early).
#[test]
fn a_call_on_a_thread_that_exits_ends_at_its_return() {
    let Some((python, _serial)) =
        python_3_13_alone("a_call_on_a_thread_that_exits_ends_at_its_return")
    else {
        return;
    };
    let truth_path = std::env::temp_dir().join(format!(
        "lens-python-truth-{}-thread-save",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&truth_path);
    let argv: Vec<OsString> = vec![
        "env".into(),
        format!("TRAIN_TRUTH={}", truth_path.display()).into(),
        python.into_os_string(),
        script().with_file_name("thread_save.py").into_os_string(),
    ];
    let (log, _) = run_traced(RULES, &argv);
    let truth = read_truth(&truth_path);
    let [call] = &truth[..] else {
        panic!("one save_checkpoint call, and the exit: {truth:?}");
    };
    let spans: Vec<_> = log.named(names::CHECKPOINT).collect();
    let [span] = &spans[..] else {
        panic!("{} checkpoint spans for one call", spans.len());
    };
    let off_ms = |seen: u64, truth: u64| (seen as f64 - truth as f64) / 1e6;
    // Not before the call's return (by more than the precision the other tests allow):
    // the thread's last sample came 50 ms before it.
    assert!(
        span.end_ns + 3_000_000 >= call.end,
        "the span ends {:+.2} ms from the call's return: at the thread's last sample, not \
         its exit",
        off_ms(span.end_ns, call.end)
    );
    assert!(
        span.start_ns + 3_000_000 >= call.start && span.start_ns < call.end,
        "the span starts {:+.2} ms from the call's start",
        off_ms(span.start_ns, call.start)
    );
}

#[test]
fn native_calls_name_the_python_function_that_made_them() {
    if !lens_tests::require_bpf("native_calls_name_the_python_function_that_made_them") {
        return;
    }
    let Some(python) = interpreter("/root/.pyenv/versions/3.11.7/bin/python3.11") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const CALLS: usize = 5;
    let script = script().with_file_name("native_calls.py");
    let argv: Vec<OsString> = vec![
        python.into_os_string(),
        script.clone().into_os_string(),
        lens_tests::fake_lib_dir().into_os_string(),
        CALLS.to_string().into(),
    ];
    let (log, _) = run_traced(
        "[[probe]]\npython = \"__main__:train_step\"\ngroup = \"step\"\n",
        &argv,
    );
    let file = AttrValue::from(script.to_string_lossy().into_owned());
    for (name, function) in [
        ("nccl.all_reduce", "reduce_gradients"),
        ("cuda.device_synchronize", "wait_for_gpu"),
    ] {
        let spans: Vec<_> = log.named(name).collect();
        assert_eq!(spans.len(), CALLS, "{name}");
        for span in spans {
            assert_eq!(
                span.attr(semconv::CODE_FUNCTION),
                Some(&AttrValue::from(function)),
                "{span:?}"
            );
            assert_eq!(span.attr(semconv::CODE_FILEPATH), Some(&file));
        }
    }
    assert_eq!(log.named(names::STEP).count(), CALLS);
}

/// A Python that maps a file named like a libpython, but not one (no ELF): lens-probe
/// says it cannot read it and why, never that a real library lacks `_PyRuntime`; once
/// the process is gone, it says nothing (a child that exec'd or exited is no broken
/// library).
#[test]
fn an_unreadable_interpreter_file_is_named_with_its_cause_and_a_gone_process_is_silent() {
    use std::io::{BufRead, Write};
    use std::process::{Command, Stdio};
    let Some(python) = interpreter("/usr/bin/python3.11") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("lens-fake-libpython-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("libpython3.11.so.1.0");
    std::fs::write(&fake, vec![0x5a_u8; 8192]).unwrap();
    let mut child = Command::new(&python)
        .args([
            "-c",
            "import mmap, sys\n\
             f = open(sys.argv[1], 'rb')\n\
             m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n\
             print('mapped', flush=True)\n\
             sys.stdin.read()\n",
        ])
        .arg(&fake)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "mapped");
    let pid = child.id();
    let error = lens_probe::python::find_runtime(pid)
        .unwrap_err()
        .to_string();
    assert!(error.contains("cannot read its symbols"), "{error}");
    assert!(!error.contains("no _PyRuntime symbol"), "{error}");
    // Let it go, and wait for it: then the same question has no answer, and no error.
    child.stdin.take().unwrap().write_all(b"").unwrap();
    child.wait().unwrap();
    assert_eq!(lens_probe::python::find_runtime(pid), Ok(None));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A running process attached by pid (`--pid`): the threads it started before lens-probe
/// came are sampled too. Each thread has its own sampling clock, opened for every thread
/// the process has at the attach (its later threads inherit one); a thread left without
/// one would never show its calls.
#[test]
fn every_thread_of_a_process_attached_by_pid_is_sampled() {
    let Some((python, _serial)) =
        python_3_13_alone("every_thread_of_a_process_attached_by_pid_is_sampled")
    else {
        return;
    };
    // By the script's module name, not `__main__`: a `__main__` rule matches only once
    // the main thread's sample has named the script, and a worker's unchanging stack,
    // sampled before that, is not sent again.
    const RULE: &str = "[[probe]]\npython = \"busy_loop:train_step\"\ngroup = \"step\"\n";
    let mut session = session_with(&Arc::new(ProbeRules::parse(RULE).unwrap()));
    // Three threads besides the main one, all in `train_step` for 12 s.
    let mut child = std::process::Command::new(&python)
        .arg(script().with_file_name("busy_loop.py"))
        .args(["12", "3"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut ready,
    )
    .unwrap();
    let ids: Vec<u32> = ready
        .split_whitespace()
        .skip(1)
        .map(|id| id.parse().unwrap())
        .collect();
    assert_eq!(ids.len(), 4, "busy_loop.py said {ready:?}");
    session.attach_pid(ids[0]).unwrap();
    let mut events = EventLog::default();
    session
        .run_blocking(&mut events, Some(Duration::from_secs(60)))
        .unwrap();
    assert!(child.wait().unwrap().success());
    for tid in &ids {
        let calls = events
            .events
            .iter()
            .filter(|event| {
                matches!(event, ProbeEvent::RuleCall { tid: t, at_return: false, .. } if t == tid)
            })
            .count();
        assert!(
            calls > 0,
            "thread {tid} of {ids:?}: no train_step call sampled (calls by thread: {:?})",
            ids.iter()
                .map(|t| events
                    .events
                    .iter()
                    .filter(|e| matches!(e, ProbeEvent::RuleCall { tid, .. } if tid == t))
                    .count())
                .collect::<Vec<_>>()
        );
    }
}

/// With only the built-in framework rules, a process is sampled every 10 ms of its
/// threads' running time until a framework's frame shows on a stack, then every 1 ms
/// (docs/python.md, "Whose clocks, and how fast"). Seen from the calls' entries: each
/// says when its thread's tick before was taken. The first save, in a plain loop, was
/// found by a 10 ms tick (at least 10 ms of wall time after the one before); the five
/// after it, while the process is followed, by 1 ms ones.
#[test]
fn a_process_is_sampled_closely_only_once_a_framework_runs() {
    let Some((python, _serial)) =
        python_3_13_alone("a_process_is_sampled_closely_only_once_a_framework_runs")
    else {
        return;
    };
    let rules = Arc::new(ProbeRules::load(None, Default::default()).unwrap());
    let mut session = session_with(&rules);
    session
        .exec(&[
            python.into_os_string(),
            script()
                .with_file_name("watch_then_follow.py")
                .into_os_string(),
            lens_tests::fake_lib_dir().into_os_string(),
        ])
        .unwrap();
    let mut events = EventLog::default();
    let report = session
        .run_blocking(&mut events, Some(Duration::from_secs(60)))
        .unwrap();
    assert_eq!(
        report.child_exit,
        Some(lens_probe::sys::target::ExitStatus::Exited(0))
    );
    // Each save's entry: how long before it its thread's tick before was.
    let gaps_ms: Vec<f64> = events
        .events
        .iter()
        .filter_map(|event| match event {
            ProbeEvent::RuleCall {
                rule,
                at_ns,
                since_ns: Some(since),
                at_return: false,
                ..
            } if rules.python_rule(*rule)?.qualname == "Accelerator.save_state" => {
                Some((at_ns - since) as f64 / 1e6)
            }
            _ => None,
        })
        .collect();
    eprintln!("each save's entry, ms after its thread's tick before: {gaps_ms:.2?}");
    assert_eq!(gaps_ms.len(), 6, "six saves, entries: {gaps_ms:?}");
    // A tick counts running time: 10 ms of it is at least 10 ms (the timer's slack aside).
    assert!(
        gaps_ms[0] >= 9.5,
        "the first save was found {:.2} ms after the tick before: the plain loop was \
         sampled faster than every 10 ms ({gaps_ms:?})",
        gaps_ms[0]
    );
    // Followed, a save is found 1 ms of running time after the tick before: less than 10
    // ms of wall time unless its thread waited for a CPU for the rest (a loaded machine
    // can make one or two so; never all five).
    let closest = gaps_ms[1..].iter().copied().fold(f64::INFINITY, f64::min);
    assert!(
        closest < 9.5,
        "every save after the first was found at least {closest:.2} ms after the tick \
         before: the process was not sampled every 1 ms ({gaps_ms:?})"
    );
}
