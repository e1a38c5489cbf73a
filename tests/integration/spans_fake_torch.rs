//! Span trees from the fake libtorch trainer (tests/README.md has its exact call
//! sequence) through real uprobes: whole trees asserted, the group gate counted in
//! attached uprobes, attaching mid-run, a killed job.
use std::{
    ffi::OsString,
    sync::{RwLock, RwLockReadGuard, RwLockWriteGuard},
    time::Duration,
};

use lens_common::ProbeId;
use lens_probe::{
    semconv,
    session::{Session, TraceOptions},
    settings::groups::SpanGroups,
    spans::{SpanBuilder, SpanLog, SpanStatus, names},
};
use lens_tests::torch_trainer_argv as trainer;

/// The overhead-budget test runs alone. It once saw 1001 steps for 1000 (issue 16,
/// row 14), because another session of this process starting up followed this test's
/// trainer fork; `TARGET_CALIBRATION` fixed that (see `fake_libs.rs`). It stays alone
/// because its 1 % check rests on the per-hit cost measured at start-up, which other
/// sessions' trainers on the same cores would inflate. The other tests share the lock
/// and run side by side.
static ALONE: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    ALONE.read().unwrap_or_else(|e| e.into_inner())
}

fn alone() -> RwLockWriteGuard<'static, ()> {
    ALONE.write().unwrap_or_else(|e| e.into_inner())
}

fn session(spec: &str) -> Session {
    Session::new(TraceOptions {
        span_groups: spec.parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap()
}

fn trace(spec: &str, argv: &[OsString]) -> (SpanLog, Session) {
    let mut session = session(spec);
    session.exec(argv).unwrap();
    let mut builder = SpanBuilder::new(spec.parse().unwrap(), SpanLog::default());
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(60)))
        .unwrap();
    (builder.into_exporter(), session)
}

const KEYS: &[&str] = &[
    semconv::DL_ITERATION,
    semconv::DL_MICROBATCH_COUNT,
    semconv::NEMO_CHECKPOINT_FILES,
    semconv::NEMO_SPAN_TRUNCATED,
];

fn step(iteration: u32, microbatches: u32) -> String {
    format!(
        "  train.step dl.iteration={iteration}\n    train.forward_backward \
         dl.microbatch_count={microbatches}\n    train.optimizer\n"
    )
}

/// The tree of the trainer's `4 2 2 3` (4 steps of 2 microbatches, evaluation after
/// steps 2 and 4, a checkpoint after 3), after `load`, the load's line, if any.
fn four_steps(load: Option<&str>) -> String {
    [
        "train.job\n  train.model_init\n".to_string(),
        load.unwrap_or_default().to_string(),
        step(0, 2),
        step(1, 2),
        "  train.evaluate\n".into(),
        step(2, 2),
        "  train.checkpoint nemo.checkpoint.files=1\n".into(),
        step(3, 2),
        "  train.evaluate\n".into(),
    ]
    .concat()
}

#[test]
fn per_step_gives_the_exact_tree() {
    if !lens_tests::require_bpf("per_step_gives_the_exact_tree") {
        return;
    }
    let _guard = shared();
    // 4 steps of 2 microbatches, evaluation after steps 2 and 4, a checkpoint after 3,
    // a checkpoint loaded before training.
    let (log, _) = trace(
        "per_step",
        &trainer(&[("TRAINER_LOAD", "1")], &["4", "2", "2", "3"]),
    );
    assert_eq!(
        log.outline(KEYS),
        four_steps(Some("  train.load_checkpoint nemo.checkpoint.files=1\n"))
    );
    // In time: children inside parents, siblings one after another.
    assert!(log.misnested().is_empty(), "{:#?}", log.misnested());
    let steps: Vec<_> = log.named(names::STEP).collect();
    for pair in steps.windows(2) {
        assert!(pair[0].end_ns <= pair[1].start_ns);
    }
    // Each backward is a span event with its microbatch id; the fake backward sleeps 4 ms
    // and the forward before it 2 ms.
    for fb in log.named(names::FORWARD_BACKWARD) {
        let ids: Vec<_> = fb
            .events
            .iter()
            .map(|e| e.attributes[0].1.clone())
            .collect();
        assert_eq!(ids, [0i64.into(), 1i64.into()]);
        assert!(fb.duration_ns() >= 2 * (2 + 4) * 1_000_000, "{fb:?}");
    }
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(job.status, SpanStatus::Unset);
    assert_eq!(job.int_attr(semconv::PROCESS_EXIT_CODE), Some(0));
}

#[test]
fn default_groups_give_job_evaluate_checkpoint_and_attach_no_step_probes() {
    if !lens_tests::require_bpf("default_groups_give_job_evaluate_checkpoint") {
        return;
    }
    let _guard = shared();
    let argv = trainer(&[("TRAINER_DISTRIBUTED", "1")], &["4", "2", "2", "3"]);
    let (log, session) = trace("default", &argv);
    assert_eq!(
        log.outline(KEYS),
        "train.job\n  nccl.comm_init\n  train.evaluate\n  train.checkpoint \
         nemo.checkpoint.files=1\n  train.evaluate\n"
    );
    // The gate is attachment: none of the per-step probes is in the kernel.
    let attached = session.attacher().attached_by_probe();
    for probe in [
        ProbeId::TorchBackward,
        ProbeId::GlooAllReduce,
        ProbeId::NcclAllReduce,
        ProbeId::CheckpointReaderOpen,
    ] {
        assert!(
            !attached.contains_key(&probe),
            "{probe:?} attached: {attached:?}"
        );
    }
    // Grad mode where Python sets it: libtorch_python's binding, not libc10's
    // `set_enabled`, whose calls include autograd's C++ guards.
    assert!(
        !attached.contains_key(&ProbeId::TorchGradMode),
        "libc10's grad mode attached beside the binding: {attached:?}"
    );
    for probe in [
        ProbeId::TorchScopeEnter,
        ProbeId::TorchScopeExit,
        ProbeId::TorchSetGradEnabled,
        ProbeId::CheckpointWriterOpen,
        ProbeId::CheckpointWriterClose,
        ProbeId::NcclCommInitRank,
    ] {
        assert!(
            attached.contains_key(&probe),
            "{probe:?} missing: {attached:?}"
        );
    }
}

/// Activation checkpointing toggles grad mode in every forward pass: the kernel counts
/// each call but sends only what the phase rules can tell apart (`lens-ebpf/src/
/// grad_mode.rs`), and the tree is the one without recompute. Grad mode is read where
/// Python sets it (`torch._C._set_grad_enabled`): autograd's C++ guards, which call
/// libc10 directly, cost no trap at all.
#[test]
fn recompute_grad_toggles_are_counted_in_the_kernel_and_the_tree_is_unchanged() {
    let name = "recompute_grad_toggles_are_counted_in_the_kernel";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let _guard = shared();
    let (calls, sent) = trace_recompute(&[]);
    // Python's calls counted: import torch's 4, per microbatch 2 a layer, per optimizer
    // step 2, per evaluation 2; the C++ guard in each layer is not probed.
    assert_eq!(
        calls.get(&ProbeId::TorchSetGradEnabled),
        Some(&(4 + 4 * 2 * 2 * RECOMPUTE + 4 * 2 + 2 * 2))
    );
    assert_eq!(calls.get(&ProbeId::TorchGradMode), None);
    // Sent: of import torch's toggles the first and the last; of each forward pass's,
    // the first and the last; each optimizer step's and evaluation's two, as they were.
    assert_eq!(sent, RECOMPUTE_SENT);
}

/// A libtorch_python built for a free-threaded CPython lays its tuples out otherwise:
/// its binding is left alone, and libc10's `set_enabled` is probed instead, every call
/// counted (the binding's and the C++ guards'), the same changes sent, the same tree.
#[test]
fn a_free_threaded_libtorch_python_leaves_grad_mode_to_libc10() {
    let name = "a_free_threaded_libtorch_python_leaves_grad_mode_to_libc10";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let _guard = shared();
    let free_threaded = lens_tests::fixtures_dir().join("faketorch-free-threaded");
    let (calls, sent) = trace_recompute(&[("LD_LIBRARY_PATH", free_threaded.to_str().unwrap())]);
    assert_eq!(calls.get(&ProbeId::TorchSetGradEnabled), None);
    assert_eq!(
        calls.get(&ProbeId::TorchGradMode),
        Some(&(4 + 4 * 2 * 3 * RECOMPUTE + 4 * 2 + 2 * 2))
    );
    assert_eq!(sent, RECOMPUTE_SENT);
}

const RECOMPUTE: u64 = 20;
/// The grad-mode changes sent for [`trace_recompute`]'s run (see the first test).
const RECOMPUTE_SENT: usize = 2 + 4 * 2 * 2 + 4 * 2 + 2 * 2;

/// Traces the trainer's `4 2 2 3` with `RECOMPUTE` checkpointed layers under `per_step`,
/// asserts its tree is [`four_steps`], and returns its calls by probe and how many
/// grad-mode changes were sent.
fn trace_recompute(env: &[(&str, &str)]) -> (std::collections::BTreeMap<ProbeId, u64>, usize) {
    let recompute = RECOMPUTE.to_string();
    let mut vars = vec![("TRAINER_RECOMPUTE", recompute.as_str())];
    vars.extend_from_slice(env);
    let argv = trainer(&vars, &["4", "2", "2", "3"]);
    let mut session = session("per_step");
    session.exec(&argv).unwrap();
    let builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
    let mut sinks = (builder, lens_probe::sink::EventLog::default());
    session
        .run_blocking(&mut sinks, Some(Duration::from_secs(60)))
        .unwrap();
    let (builder, events) = sinks;
    assert_eq!(builder.into_exporter().outline(KEYS), four_steps(None));
    let sent = events
        .events
        .iter()
        .filter(|event| {
            matches!(
                event,
                lens_probe::events::ProbeEvent::Phase {
                    signal: lens_probe::events::PhaseSignal::GradMode { .. },
                    ..
                }
            )
        })
        .count();
    (events.ended[0].calls.clone(), sent)
}

#[test]
fn uprobes_attached_grow_with_the_preset() {
    if !lens_tests::require_bpf("uprobes_attached_grow_with_the_preset") {
        return;
    }
    let _guard = shared();
    let count = |spec: &str| {
        let (_, session) = trace(spec, &trainer(&[], &["1", "1", "0", "0"]));
        session.attacher().uprobe_count()
    };
    let (default, per_step) = (count("default"), count("per_step"));
    // default: ld.so, ncclCommInitRank (entry+return), scope enter/exit, writer open,
    // writer close (return), grad mode (`_set_grad_enabled`), and from the fake
    // libtorch_python the inference-mode guard's PLT stub and `_log_api_usage_once`
    // (entries), and from the fake libcudart the 5 memory calls (entry+return; the fake
    // driver is not loaded).
    assert_eq!(default, 1 + 2 + 2 + 1 + 2 + 2 + 5 * 2);
    // per_step adds backward (Engine::execute's entry, THPEngine_run_backward's return),
    // reader open/close, 8 gloo calls (entry only: they throw), from the fake libnccl the
    // 8 collectives (entry+return; ncclAlltoAll the eighth) and group start/end, and from
    // the fake libcudart the 3 launches (entry; the graph launch's return too), 3 syncs
    // (entry+return), the 2 event
    // records (entry), the event query (entry+return), kernel registration (entry) and
    // the 4 graph calls (entry+return: capture begin and end, two instantiations), and
    // from the fake libc10 the caching allocator's report (entry).
    assert_eq!(
        per_step,
        default + 2 + 2 + 8 + 8 * 2 + 2 + 3 + 1 + 3 * 2 + 2 + 2 + 1 + 4 * 2 + 1
    );
}

#[test]
fn collectives_during_backward_are_children_of_forward_backward() {
    if !lens_tests::require_bpf("collectives_during_backward") {
        return;
    }
    let _guard = shared();
    let (log, _) = trace(
        "per_step",
        &trainer(&[("TRAINER_DISTRIBUTED", "1")], &["2", "2", "0", "0"]),
    );
    let calls = "      gloo.all_reduce\n      nccl.all_reduce dl.rank=1 dl.world_size=4\n";
    let step = |i: u32| {
        format!("  train.step\n    train.forward_backward\n{calls}{calls}    train.optimizer\n",)
            .replace("train.step", &format!("train.step dl.iteration={i}"))
    };
    assert_eq!(
        log.outline(&[
            semconv::DL_ITERATION,
            semconv::DL_RANK,
            semconv::DL_WORLD_SIZE
        ]),
        format!(
            "train.job\n  train.model_init\n    nccl.comm_init dl.rank=1 dl.world_size=4\n{}{}",
            step(0),
            step(1)
        )
    );
    let allreduce = log.named("nccl.all_reduce").next().unwrap();
    assert_eq!(allreduce.int_attr(semconv::DL_COLLECTIVE_BYTES), Some(4096));
    assert_eq!(
        allreduce.attr(semconv::NEMO_SPAN_GROUP),
        Some(&"forward_backward".into())
    );
}

#[test]
fn attaching_mid_run_reports_whole_steps_only() {
    if !lens_tests::require_bpf("attaching_mid_run_reports_whole_steps_only") {
        return;
    }
    let _guard = shared();
    // ~60 ms steps; attach after ~5 of them (the probes loaded beforehand). 150 steps:
    // the attach may queue seconds behind the kernel's removal of other tests' uprobes.
    const STEPS: usize = 150;
    let mut session = session("per_step");
    let mut child = std::process::Command::new(lens_tests::torch_trainer())
        .args([&STEPS.to_string(), "2", "0", "0"])
        .env("TRAINER_FORWARD_MS", "25")
        .env("TRAINER_INIT_MS", "0")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The loader has mapped the libraries (a loaded machine can take a while), then ~5
    // steps run.
    let maps = format!("/proc/{}/maps", child.id());
    for _ in 0..1000 {
        if std::fs::read_to_string(&maps).is_ok_and(|m| m.contains("libtorch_cpu.so")) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(330));
    session.attach_pid(child.id()).unwrap();
    let mut builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(60)))
        .unwrap();
    assert!(child.wait().unwrap().success());
    let log = builder.into_exporter();
    let steps: Vec<_> = log.named(names::STEP).collect();
    assert!(
        (15..STEPS).contains(&steps.len()),
        "{} steps seen",
        steps.len()
    );
    for (i, step) in steps.iter().enumerate() {
        assert_eq!(step.int_attr(semconv::DL_ITERATION), Some(i as i64));
        assert!(!step.truncated());
        let children = log.children(step);
        let names: Vec<_> = children.iter().map(|s| s.name).collect();
        assert_eq!(names, [names::FORWARD_BACKWARD, names::OPTIMIZER]);
        assert_eq!(
            children[0].int_attr(semconv::DL_MICROBATCH_COUNT),
            Some(2),
            "step {i} is not whole"
        );
    }
    assert_eq!(log.named(names::MODEL_INIT).count(), 0);
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(job.attr(semconv::NEMO_ATTACHED_MID_RUN), Some(&true.into()));
}

#[test]
fn a_killed_job_has_an_error_status_and_truncated_open_spans() {
    if !lens_tests::require_bpf("a_killed_job_has_an_error_status") {
        return;
    }
    let _guard = shared();
    // 2 s forward passes, timed from the trainer's start gate (after its model init, so
    // however slow the start on a loaded machine): the first backward (which opens step
    // 0) at ~2 s, the second at ~4 s; killed at 3 s, inside the second forward, with a
    // second of margin each way.
    let dir = std::env::temp_dir().join(format!("lens-killed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let gate = dir.join("go");
    let mut session = session("per_step");
    let pid = session
        .exec(&trainer(
            &[
                ("TRAINER_FORWARD_MS", "2000"),
                ("TRAINER_INIT_MS", "0"),
                ("TRAINER_READY_DIR", dir.to_str().unwrap()),
                ("TRAINER_START_GATE", gate.to_str().unwrap()),
            ],
            &["3", "2", "0", "0"],
        ))
        .unwrap();
    let ready_dir = dir.clone();
    let killer = std::thread::spawn(move || {
        let ready = |d: &std::path::Path| {
            std::fs::read_dir(d).is_ok_and(|mut entries| {
                entries
                    .any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("rank")))
            })
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !ready(&ready_dir) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::write(&gate, "").unwrap();
        std::thread::sleep(Duration::from_millis(3000));
        // SAFETY: plain kill(2) of the child we started.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    });
    let mut builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(60)))
        .unwrap();
    killer.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let log = builder.into_exporter();
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(job.status, SpanStatus::Error("killed by signal 9".into()));
    assert_eq!(
        log.outline(KEYS),
        "train.job\n  train.model_init\n  train.step dl.iteration=0 nemo.span.truncated=true\n    \
         train.forward_backward dl.microbatch_count=1 nemo.span.truncated=true\n"
    );
}

#[test]
fn phase_spans_carry_the_launches_counted_in_the_kernel() {
    if !lens_tests::require_bpf("phase_spans_carry_the_launches_counted_in_the_kernel") {
        return;
    }
    let _guard = shared();
    // 3 kernel launches in each forward pass and in each optimizer step, 2 microbatches;
    // evaluation (no launches) after steps 2 and 4.
    let (log, _) = trace(
        "per_step",
        &trainer(&[("TRAINER_LAUNCHES", "3")], &["4", "2", "2", "0"]),
    );
    let keys = &[semconv::DL_ITERATION, semconv::CUDA_LAUNCH_COUNT];
    let step = |i: u32| {
        format!(
            "  train.step dl.iteration={i} cuda.launch.count=9\n    train.forward_backward \
             cuda.launch.count=6\n    train.optimizer cuda.launch.count=3\n"
        )
    };
    let evaluate = "  train.evaluate cuda.launch.count=0\n".to_string();
    let expected = [
        "train.job cuda.launch.count=36\n  train.model_init cuda.launch.count=0\n".to_string(),
        step(0),
        step(1),
        evaluate.clone(),
        step(2),
        step(3),
        evaluate,
    ]
    .concat();
    assert_eq!(log.outline(keys), expected);
    assert!(
        log.spans
            .iter()
            .all(|s| s.attr(semconv::CUDA_LAUNCH_SAMPLED).is_none()),
        "no budget, nothing sampled"
    );
}

#[test]
fn an_overhead_budget_samples_the_launch_probes_and_stays_under_it() {
    if !lens_tests::require_bpf("an_overhead_budget_samples_the_launch_probes") {
        return;
    }
    let _guard = alone();
    // 100 launches of 2 µs in each forward and optimizer step, ~8 ms steps: with the launch
    // probes in all the time they would cost a few % of the time; the budget is 1%.
    let mut session = Session::new(TraceOptions {
        span_groups: "per_step".parse().unwrap(),
        kernel_logs: false,
        overhead_budget: Some("1%".parse().unwrap()),
        uprobe_links: Default::default(),
    })
    .unwrap();
    let steps = 1000;
    session
        .exec(&trainer(
            &[
                ("TRAINER_LAUNCHES", "100"),
                ("LENS_FAKE_LAUNCH_NS", "2000"),
                ("TRAINER_INIT_MS", "0"),
            ],
            &[&steps.to_string(), "1", "0", "0"],
        ))
        .unwrap();
    let mut builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
    let report = session
        .run_blocking(&mut builder, Some(Duration::from_secs(120)))
        .unwrap();
    let budget = report.budget.expect("a budget report");
    let log = builder.into_exporter();
    let steps_seen: Vec<_> = log.named(names::STEP).collect();
    if steps_seen.len() != steps {
        // Issue 16 #14 (1001 steps for 1000, seen in 3 of ~30 runs): the steps that are
        // not like the others, to find which signal split one.
        let median = {
            let mut d: Vec<u64> = steps_seen.iter().map(|s| s.duration_ns()).collect();
            d.sort_unstable();
            d.get(d.len() / 2).copied().unwrap_or(0)
        };
        let odd: Vec<String> = steps_seen
            .iter()
            .enumerate()
            .filter(|(i, s)| {
                *i < 2
                    || *i + 2 >= steps_seen.len()
                    || s.duration_ns() < median / 2
                    || s.duration_ns() > median * 2
            })
            .map(|(i, s)| {
                let children: Vec<String> = log
                    .children(s)
                    .iter()
                    .map(|c| format!("{} {:?}", c.name, c.attributes))
                    .collect();
                format!(
                    "#{i} pid {} tid {} start {} {:.2} ms {:?} children {children:?}",
                    s.pid,
                    s.tid,
                    s.start_ns,
                    s.duration_ns() as f64 / 1e6,
                    s.attributes
                )
            })
            .collect();
        panic!(
            "{} steps for {steps} (median {:.2} ms); odd ones:\n{}",
            steps_seen.len(),
            median as f64 / 1e6,
            odd.join("\n")
        );
    }
    let counted: Vec<_> = steps_seen
        .iter()
        .filter(|s| s.attr(semconv::CUDA_LAUNCH_COUNT).is_some())
        .collect();
    let summary = format!("{budget:?}; {} of {steps} steps counted", counted.len());
    assert!(budget.estimated_percent <= 1.0, "{summary}");
    assert!(budget.per_hit_ns > 0.0, "{summary}");
    assert!(budget.sampled_percent < 90.0, "{summary}");
    assert!(budget.windows >= 1, "{summary}");
    assert!(!counted.is_empty(), "{summary}");
    assert!(counted.len() < steps * 9 / 10, "{summary}");
    for step in counted {
        // Exact where counted: the step lay inside a window.
        assert_eq!(
            step.attr(semconv::CUDA_LAUNCH_COUNT).map(|v| v.to_string()),
            Some("200".to_string()),
            "{summary}"
        );
        assert_eq!(
            step.attr(semconv::CUDA_LAUNCH_SAMPLED)
                .map(|v| v.to_string()),
            Some("true".to_string())
        );
    }
}
