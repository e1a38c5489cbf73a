//! The phase rules on synthetic event streams: exact trees and boundaries.
use super::{AttrValue, SpanBuilder, SpanLog, SpanStatus, names};
use crate::{
    events::{CallTiming, CollectiveOp, PhaseSignal, ProbeEvent, PythonCaller, TorchScope},
    gpu_kernels::KernelLaunches,
    nccl::{DataType, RedOp},
    semconv,
    settings::groups::SpanGroups,
    sink::{EventSink, ProcessEnd},
    sys::target::{ExitStatus, ProcessInfo},
};

const PID: u32 = 100;
const FETCH: &str = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__";

struct Run {
    builder: SpanBuilder<SpanLog>,
    now: u64,
    /// The process's kernel launches so far, as the kernel stamps them on phase marks.
    launches: u64,
    /// Phase marks so far: the epoch the next one opens, as the kernel counts them.
    epoch: u64,
}

impl Run {
    fn new(groups: &str, from_start: bool) -> Run {
        let mut builder =
            SpanBuilder::new(groups.parse::<SpanGroups>().unwrap(), SpanLog::default());
        builder.start_process(
            &ProcessInfo {
                pid: PID,
                name: "python".into(),
                command_line: vec!["python".into(), "train.py".into()],
                traced_from_start: from_start,
                rank: None,
                view: Default::default(),
            },
            0,
        );
        Run {
            builder,
            now: 0,
            launches: 0,
            epoch: 0,
        }
    }

    /// Advances the clock by `ms` and sends `signal` then.
    fn at(&mut self, ms: u64, signal: PhaseSignal) -> &mut Self {
        self.now += ms * 1_000_000;
        self.epoch += 1;
        self.builder.on_event(&ProbeEvent::Phase {
            tgid: PID,
            tid: PID,
            at_ns: self.now,
            launches: self.launches,
            epoch: self.epoch,
            signal,
        });
        self
    }

    /// `launches` of kernel `name` now, as the session reads them from the kernel (it
    /// reads them before the marks that follow).
    fn kernel(&mut self, name: &str, launches: u64) -> &mut Self {
        self.launches += launches;
        self.builder.on_kernel_launches(
            PID,
            &[KernelLaunches {
                epoch: self.epoch,
                name: name.into(),
                launches,
            }],
        );
        self
    }

    fn launch(&mut self, kernels: u64) -> &mut Self {
        self.launches += kernels;
        self
    }

    fn scope(&mut self, ms: u64, name: &str, length_ms: u64) -> &mut Self {
        let signal = PhaseSignal::ScopeEnter {
            scope: TorchScope::from_name(name),
            name: name.into(),
        };
        self.at(ms, signal).at(length_ms, PhaseSignal::ScopeExit)
    }

    fn backward(&mut self, ms: u64, length_ms: u64) -> &mut Self {
        self.at(ms, PhaseSignal::BackwardStart)
            .at(length_ms, PhaseSignal::BackwardEnd)
    }

    fn grad(&mut self, ms: u64, enabled: bool) -> &mut Self {
        self.at(ms, PhaseSignal::GradMode { enabled })
    }

    /// One training step as torch runs it: per microbatch a fetch, a forward (not seen),
    /// a backward; then `Optimizer.step` (with its internal no_grad) and `zero_grad`.
    fn step(&mut self, accum: u32) -> &mut Self {
        for _ in 0..accum {
            self.scope(1, FETCH, 1).backward(2, 3);
        }
        self.at(1, scope_enter("Optimizer.step#SGD.step"))
            .grad(0, false)
            .grad(1, true)
            .at(0, PhaseSignal::ScopeExit)
            .scope(0, "Optimizer.zero_grad#SGD.zero_grad", 1)
    }

    fn eval(&mut self, batches: u32) -> &mut Self {
        self.grad(1, false);
        for _ in 0..=batches {
            self.scope(1, FETCH, 1);
        }
        self.grad(1, true)
    }

    fn checkpoint(&mut self) -> &mut Self {
        self.at(1, PhaseSignal::CheckpointWriteStart)
            .at(5, PhaseSignal::CheckpointWriteEnd)
    }

    fn allreduce(&mut self, start_ms_ago: u64) -> &mut Self {
        let timing = CallTiming {
            tgid: PID,
            tid: PID,
            start_ns: self.now - start_ms_ago * 1_000_000,
            end_ns: self.now,
        };
        self.builder.on_event(&ProbeEvent::Collective {
            timing,
            op: CollectiveOp::AllReduce,
            count: 256,
            datatype: Some(DataType::Float32),
            raw_datatype: 7,
            redop: Some(RedOp::Sum),
            peer: None,
            comm: 0xC0FFEE00,
            stream: 0,
            result: 0,
            python_caller: PythonCaller::None,
        });
        self
    }

    fn end(mut self, ms: u64, exit: Option<ExitStatus>) -> SpanLog {
        self.now += ms * 1_000_000;
        self.builder.end_process(PID, exit, self.now);
        self.builder.into_exporter()
    }
}

fn scope_enter(name: &str) -> PhaseSignal {
    PhaseSignal::ScopeEnter {
        scope: TorchScope::from_name(name),
        name: name.into(),
    }
}

const KEYS: &[&str] = &[
    semconv::DL_ITERATION,
    semconv::DL_MICROBATCH_COUNT,
    semconv::NEMO_SPAN_TRUNCATED,
];

fn ms(ns: u64) -> u64 {
    ns / 1_000_000
}

#[test]
fn a_training_run_from_start_gives_the_whole_tree() {
    let mut run = Run::new("per_step", true);
    run.grad(1, false).grad(1, true); // torch's import toggles grad mode: not evaluation
    run.at(10, PhaseSignal::CheckpointReadStart { own_file: false })
        .at(4, PhaseSignal::CheckpointReadEnd);
    run.step(2).step(2).eval(2).checkpoint().step(1);
    let log = run.end(3, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.outline(KEYS),
        "train.job
  train.model_init
  train.load_checkpoint
  train.step dl.iteration=0
    train.forward_backward dl.microbatch_count=2
    train.optimizer
  train.step dl.iteration=1
    train.forward_backward dl.microbatch_count=2
    train.optimizer
  train.evaluate
  train.checkpoint
  train.step dl.iteration=2
    train.forward_backward dl.microbatch_count=1
    train.optimizer
"
    );
    // Boundaries: model_init ends where the checkpoint load starts (12 ms); step 0 starts
    // at its first fetch (17) and ends when zero_grad returns (33); forward_backward ends
    // with the last backward (30); the optimizer starts with Optimizer.step (31).
    let span = |name: &str, n: usize| log.named(name).nth(n).unwrap().clone();
    assert_eq!(ms(span(names::MODEL_INIT, 0).end_ns), 12);
    let step0 = span(names::STEP, 0);
    let fb0 = span(names::FORWARD_BACKWARD, 0);
    let opt0 = span(names::OPTIMIZER, 0);
    assert_eq!((ms(step0.start_ns), ms(step0.end_ns)), (17, 33));
    assert_eq!((ms(fb0.start_ns), ms(fb0.end_ns)), (17, 30));
    assert_eq!((ms(opt0.start_ns), ms(opt0.end_ns)), (31, 33));
    assert_eq!(fb0.events.len(), 2);
    assert_eq!(
        fb0.events[1].attributes[0],
        (semconv::DL_MICROBATCH_ID, 1i64.into())
    );
    let job = span(names::JOB, 0);
    assert_eq!(job.status, SpanStatus::Unset);
    assert!(log.spans.iter().all(|s| !s.truncated()));
    // Children lie inside their parents.
    assert!(log.misnested().is_empty());
    // Every span carries its group.
    assert_eq!(step0.attr(semconv::NEMO_SPAN_GROUP), Some(&"step".into()));
}

#[test]
fn default_groups_export_only_job_evaluate_and_checkpoint() {
    let mut run = Run::new("default", true);
    run.step(2).eval(1).checkpoint().step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.outline(KEYS),
        "train.job\n  train.evaluate\n  train.checkpoint\n"
    );
}

#[test]
fn calls_inside_a_disabled_phase_hang_on_the_nearest_enabled_one() {
    let mut run = Run::new("job,step", true);
    run.scope(1, FETCH, 1).at(1, PhaseSignal::BackwardStart);
    run.allreduce(1);
    run.at(1, PhaseSignal::BackwardEnd)
        .scope(1, "Optimizer.step#SGD.step", 1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.outline(&[semconv::DL_COLLECTIVE_BYTES]),
        "train.job\n  train.step\n    nccl.all_reduce dl.collective.bytes=1024\n"
    );
    let call = log.named("nccl.all_reduce").next().unwrap();
    assert_eq!(call.attr(semconv::NEMO_SPAN_GROUP), Some(&"step".into()));
}

#[test]
fn a_collective_during_backward_is_a_child_of_forward_backward() {
    let mut run = Run::new("per_step", true);
    run.scope(1, FETCH, 1).at(1, PhaseSignal::BackwardStart);
    run.allreduce(1);
    run.at(1, PhaseSignal::BackwardEnd)
        .scope(1, "Optimizer.step#SGD.step", 1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert!(
        log.outline(&[])
            .contains("    train.forward_backward\n      nccl.all_reduce\n"),
        "{}",
        log.outline(&[])
    );
}

/// A pipeline stage: a send between two microbatches' backward passes is the step's
/// forward-backward work; the last one, after the last backward and before the
/// update, hangs under `train.step`, beside them (issue 38, item 5).
#[test]
fn a_send_after_the_last_backward_is_the_steps_not_forward_backwards() {
    let mut run = Run::new("per_step", true);
    run.scope(1, FETCH, 1).backward(2, 3).scope(1, FETCH, 1);
    run.now += 1_000_000;
    run.allreduce(1);
    run.backward(1, 3);
    run.now += 2_000_000;
    run.allreduce(1);
    run.at(1, scope_enter("Optimizer.step#SGD.step"))
        .grad(0, false)
        .grad(1, true)
        .at(0, PhaseSignal::ScopeExit)
        .scope(0, "Optimizer.zero_grad#SGD.zero_grad", 1)
        .step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert!(
        log.outline(&[]).starts_with(
            "train.job\n  train.model_init\n  train.step\n    train.forward_backward\n      \
             nccl.all_reduce\n    nccl.all_reduce\n    train.optimizer\n"
        ),
        "{}",
        log.outline(&[])
    );
    assert!(log.misnested().is_empty(), "{:#?}", log.misnested());
}

#[test]
fn no_grad_without_batches_is_not_evaluation() {
    let mut run = Run::new("per_step", true);
    run.step(1).grad(1, false).grad(2, true).step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(log.named(names::EVALUATE).count(), 0);
    assert_eq!(log.named(names::STEP).count(), 2);
}

#[test]
fn attaching_mid_step_reports_steps_only_from_the_next_boundary() {
    let mut run = Run::new("per_step", false);
    // Mid-way through a step: the end of a backward, then the optimizer.
    run.at(1, PhaseSignal::BackwardEnd)
        .scope(1, "Optimizer.step#SGD.step", 1)
        .scope(0, "Optimizer.zero_grad#SGD.zero_grad", 1);
    run.step(2).step(2);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.outline(KEYS),
        "train.job
  train.step dl.iteration=0
    train.forward_backward dl.microbatch_count=2
    train.optimizer
  train.step dl.iteration=1
    train.forward_backward dl.microbatch_count=2
    train.optimizer
"
    );
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(job.attr(semconv::NEMO_ATTACHED_MID_RUN), Some(&true.into()));
}

#[test]
fn a_killed_job_ends_open_spans_truncated_and_the_job_in_error() {
    let mut run = Run::new("per_step", true);
    run.step(1).scope(1, FETCH, 1).backward(1, 1);
    let log = run.end(2, Some(ExitStatus::Signaled(9)));
    assert_eq!(
        log.outline(KEYS),
        "train.job
  train.model_init
  train.step dl.iteration=0
    train.forward_backward dl.microbatch_count=1
    train.optimizer
  train.step dl.iteration=1 nemo.span.truncated=true
    train.forward_backward dl.microbatch_count=1 nemo.span.truncated=true
"
    );
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(job.status, SpanStatus::Error("killed by signal 9".into()));
    // Truncated spans end at the process's end, children before parents.
    let order: Vec<&str> = log.spans.iter().map(|s| s.name).collect();
    assert_eq!(
        &order[order.len() - 3..],
        [names::FORWARD_BACKWARD, names::STEP, names::JOB]
    );
}

#[test]
fn back_to_back_checkpoint_files_are_one_checkpoint() {
    let mut run = Run::new("default", true);
    run.step(1).checkpoint().checkpoint().step(1).checkpoint();
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let files: Vec<i64> = log
        .named(names::CHECKPOINT)
        .map(|s| s.int_attr(semconv::NEMO_CHECKPOINT_FILES).unwrap())
        .collect();
    assert_eq!(files, [2, 1]);
}

#[test]
fn the_process_end_sink_path_closes_the_job() {
    let mut run = Run::new("default", true);
    run.step(1);
    let mut builder = run.builder;
    builder.on_process_end(&ProcessEnd {
        pid: PID,
        calls: Default::default(),
        exit: None,
        ..ProcessEnd::default()
    });
    let log = builder.into_exporter();
    let job = log.named(names::JOB).next().unwrap();
    assert!(job.truncated(), "tracing stopped while the job ran on");
}

#[test]
fn a_process_that_never_trains_gives_no_spans() {
    // A launcher: imports torch (grad mode toggles), waits, exits.
    let mut run = Run::new("per_step", true);
    run.grad(1, false).grad(1, true);
    let log = run.end(100, Some(ExitStatus::Exited(0)));
    assert!(log.spans.is_empty(), "{}", log.outline(&[]));
}

#[test]
fn exec_before_training_starts_the_job_over_as_the_new_program() {
    let mut run = Run::new("per_step", true);
    run.grad(5, false).grad(1, true);
    let exec_info = ProcessInfo {
        pid: PID,
        name: "python3".into(),
        command_line: vec!["python3".into(), "train.py".into()],
        traced_from_start: true,
        rank: Some(crate::sys::target::RankInfo {
            rank: 1,
            world_size: Some(2),
            local_rank: Some(1),
        }),
        view: Default::default(),
    };
    run.now += 10_000_000;
    run.builder.exec_process(&exec_info, run.now);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(ms(job.start_ns), 16, "the job starts at the exec");
    assert_eq!(job.int_attr(semconv::DL_RANK), Some(1));
    assert_eq!(job.int_attr(semconv::DL_WORLD_SIZE), Some(2));
    assert_eq!(job.int_attr(semconv::DL_LOCAL_RANK), Some(1));
    assert_eq!(log.named(names::STEP).count(), 1);
}

#[test]
fn phase_spans_count_the_launches_made_inside_them() {
    let mut run = Run::new("per_step", true);
    run.builder.on_launch_counting(PID, true, 0, false);
    for _ in 0..2 {
        run.scope(1, FETCH, 1)
            .launch(10)
            .at(2, PhaseSignal::BackwardStart)
            .launch(5)
            .at(3, PhaseSignal::BackwardEnd)
            .at(1, scope_enter("Optimizer.step#SGD.step"))
            .launch(4)
            .grad(0, false)
            .grad(1, true)
            .at(0, PhaseSignal::ScopeExit)
            .scope(0, "Optimizer.zero_grad#SGD.zero_grad", 1);
    }
    let log = run.end(3, Some(ExitStatus::Exited(0)));
    let counts = |name: &str| -> Vec<Option<String>> {
        log.named(name)
            .map(|s| s.attr(semconv::CUDA_LAUNCH_COUNT).map(|v| v.to_string()))
            .collect()
    };
    let some = |n: &str| Some(n.to_string());
    assert_eq!(counts(names::FORWARD_BACKWARD), [some("15"), some("15")]);
    assert_eq!(counts(names::OPTIMIZER), [some("4"), some("4")]);
    assert_eq!(counts(names::STEP), [some("19"), some("19")]);
    assert_eq!(counts(names::JOB), [some("38")]);
    assert!(
        log.spans
            .iter()
            .all(|s| s.attr(semconv::CUDA_LAUNCH_SAMPLED).is_none())
    );
}

#[test]
fn each_step_carries_its_ten_most_launched_kernels_as_events() {
    let mut run = Run::new("per_step", true);
    run.builder.on_launch_counting(PID, true, 0, false);
    // Launched before the first step begins: in no step.
    run.kernel("init", 50);
    for step in 0..2u64 {
        run.scope(1, FETCH, 1);
        // 12 kernels in the forward, kernel k launched k + 1 (+ step) times: only the ten
        // most launched become events.
        for k in 0..12u64 {
            run.kernel(&format!("k{k:02}"), k + 1 + step);
        }
        run.at(2, PhaseSignal::BackwardStart)
            .kernel("k00", 100)
            .at(3, PhaseSignal::BackwardEnd)
            .at(1, scope_enter("Optimizer.step#SGD.step"))
            .kernel("adam", 12)
            .at(0, PhaseSignal::ScopeExit)
            .scope(0, "Optimizer.zero_grad#SGD.zero_grad", 1);
    }
    let log = run.end(3, Some(ExitStatus::Exited(0)));
    let steps: Vec<_> = log.named(names::STEP).collect();
    assert_eq!(steps.len(), 2);
    for (step, span) in steps.iter().enumerate() {
        let step = step as i64;
        let top: Vec<(String, i64)> = span
            .events
            .iter()
            .map(|e| {
                assert_eq!(e.name, names::KERNEL_TOP_EVENT);
                assert_eq!(e.at_ns, span.end_ns);
                let name = e.attributes[0].1.to_string();
                let AttrValue::Int(launches) = e.attributes[1].1 else {
                    panic!("{e:?}");
                };
                (name, launches)
            })
            .collect();
        // Every kernel of the step (k00: 1 + step in the forward and 100 in the
        // backward), most launched first, ties by name, the first ten.
        let mut expected: Vec<(String, i64)> = (1..12)
            .map(|k| (format!("k{k:02}"), k + 1 + step))
            .collect();
        expected.push(("k00".to_string(), 101 + step));
        expected.push(("adam".to_string(), 12));
        expected.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        expected.truncate(10);
        assert_eq!(top, expected, "step {step}");
        assert!(!top.iter().any(|(name, _)| name == "init"));
    }
}

#[test]
fn launches_are_counted_only_for_spans_inside_a_sampled_window() {
    let mut run = Run::new("per_step", true);
    // The budget takes the probes out during the first step and puts them back for the
    // second.
    run.step(1);
    let first_step_end = run.now;
    run.builder
        .on_launch_counting(PID, false, first_step_end / 2, true);
    run.builder
        .on_launch_counting(PID, true, first_step_end + 1, true);
    run.launch(0).scope(1, FETCH, 1).launch(7).backward(2, 3);
    run.at(1, scope_enter("Optimizer.step#SGD.step"))
        .at(0, PhaseSignal::ScopeExit)
        .scope(0, "Optimizer.zero_grad#SGD.zero_grad", 1);
    let log = run.end(3, Some(ExitStatus::Exited(0)));
    let steps: Vec<_> = log.named(names::STEP).collect();
    assert_eq!(steps[0].attr(semconv::CUDA_LAUNCH_COUNT), None);
    assert_eq!(
        steps[1]
            .attr(semconv::CUDA_LAUNCH_COUNT)
            .map(|v| v.to_string()),
        Some("7".to_string())
    );
    assert_eq!(
        steps[1]
            .attr(semconv::CUDA_LAUNCH_SAMPLED)
            .map(|v| v.to_string()),
        Some("true".to_string())
    );
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(
        job.attr(semconv::CUDA_LAUNCH_COUNT),
        None,
        "job spans the pause"
    );
}

#[test]
fn a_call_after_the_optimizer_returned_is_between_steps() {
    let mut run = Run::new("per_step", true);
    // A step, then a barrier-like collective before the next step's signals.
    run.step(1).at(1, PhaseSignal::GradMode { enabled: true });
    run.now += 1_000_000;
    run.allreduce(0);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let job = log.named(names::JOB).next().unwrap();
    let call = log.named("nccl.all_reduce").next().unwrap();
    assert_eq!(call.parent, Some(job.id), "{}", log.outline(&[]));
    assert!(log.misnested().is_empty(), "{:#?}", log.misnested());
}

#[test]
fn a_call_named_by_its_python_caller_carries_the_function_and_file() {
    let mut run = Run::new("per_step", true);
    run.step(1);
    let at = run.now + 1_000_000;
    let sync = |start_ns: u64, python_caller| ProbeEvent::SyncWait {
        timing: CallTiming {
            tgid: PID,
            tid: PID,
            start_ns,
            end_ns: start_ns + 500,
        },
        kind: crate::events::SyncKind::Device,
        handle: 0,
        result: 0,
        python_caller,
    };
    let named = PythonCaller::Named {
        function: "Trainer.reduce_gradients".into(),
        file: "/src/trainer.py".into(),
    };
    run.builder.on_event(&sync(at, named));
    // A code object the session could not name gives no attributes.
    run.builder
        .on_event(&sync(at + 2_000_000, PythonCaller::Code(0x7f00)));
    let log = run.end(5, Some(ExitStatus::Exited(0)));
    let syncs: Vec<_> = log.named("cuda.device_synchronize").collect();
    assert_eq!(syncs.len(), 2);
    assert_eq!(
        syncs[0].attr(semconv::CODE_FUNCTION),
        Some(&AttrValue::from("Trainer.reduce_gradients"))
    );
    assert_eq!(
        syncs[0].attr(semconv::CODE_FILEPATH),
        Some(&AttrValue::from("/src/trainer.py"))
    );
    assert_eq!(syncs[1].attr(semconv::CODE_FUNCTION), None);
}

/// transformers' `evaluation_loop`: each batch is fetched with grad mode on, then run
/// under its own `no_grad`.
fn eval_per_batch_no_grad(run: &mut Run, batches: u32) {
    for _ in 0..batches {
        run.scope(1, FETCH, 1).grad(0, false).grad(3, true);
    }
}

/// Lightning's `validate(ckpt_path=...)` after `fit`: the fit's last validation, a save,
/// the load (whose `load_state_dict` copies under `no_grad`), then the validation. The
/// second evaluation begins at its own batches, after the load, not at the first one's.
#[test]
fn an_evaluation_after_a_load_begins_after_it() {
    let mut run = Run::new("per_step", true);
    run.step(2).eval(2).checkpoint();
    run.at(1, PhaseSignal::CheckpointReadStart { own_file: false })
        .at(2, PhaseSignal::CheckpointReadEnd)
        .grad(0, false)
        .grad(1, true);
    let load_end = run.now;
    run.eval(2);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let evaluations: Vec<_> = log.named(names::EVALUATE).collect();
    assert_eq!(evaluations.len(), 2, "{}", log.outline(KEYS));
    assert!(evaluations[1].start_ns > load_end, "{:?}", evaluations[1]);
    assert!(log.misnested().is_empty(), "{}", log.outline(KEYS));
}

#[test]
fn an_evaluation_fetching_outside_its_no_grad_blocks_is_one_evaluate() {
    let mut run = Run::new("per_step", true);
    run.step(2);
    let eval_start = run.now + 1_000_000;
    eval_per_batch_no_grad(&mut run, 3);
    let eval_end = run.now;
    run.step(1);
    eval_per_batch_no_grad(&mut run, 2);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.outline(KEYS),
        "train.job
  train.model_init
  train.step dl.iteration=0
    train.forward_backward dl.microbatch_count=2
    train.optimizer
  train.evaluate
  train.step dl.iteration=1
    train.forward_backward dl.microbatch_count=1
    train.optimizer
  train.evaluate
  train.step dl.iteration=2
    train.forward_backward dl.microbatch_count=1
    train.optimizer
"
    );
    let evaluate = log.named(names::EVALUATE).next().unwrap();
    // From the first batch's fetch to the end of the last batch's no_grad block; the
    // next step starts at its own fetch, after it.
    assert_eq!((evaluate.start_ns, evaluate.end_ns), (eval_start, eval_end));
    let step1 = log.named(names::STEP).nth(1).unwrap();
    assert_eq!(step1.start_ns, eval_end + 1_000_000);
    assert!(log.misnested().is_empty());
}

#[test]
fn grad_mode_toggled_inside_an_evaluation_does_not_split_it() {
    let mut run = Run::new("per_step", true);
    run.step(1);
    // A recompile inside the loop switches grad mode on and off again.
    run.grad(1, false)
        .scope(1, FETCH, 1)
        .grad(1, true)
        .grad(1, false);
    run.scope(1, FETCH, 1).scope(1, FETCH, 1).grad(1, true);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.named(names::EVALUATE).count(),
        1,
        "{}",
        log.outline(&[])
    );
    assert_eq!(log.named(names::STEP).count(), 2);
}

#[test]
fn a_no_grad_block_after_the_fetch_of_a_step_is_not_evaluation() {
    // Distillation: the teacher's forward under no_grad, then the student's backward.
    let mut run = Run::new("per_step", true);
    for _ in 0..3 {
        run.scope(1, FETCH, 1)
            .grad(1, false)
            .grad(2, true)
            .backward(1, 3);
        run.scope(1, "Optimizer.step#SGD.step", 1);
    }
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.named(names::EVALUATE).count(),
        0,
        "{}",
        log.outline(&[])
    );
    assert_eq!(log.named(names::STEP).count(), 3);
}

/// Lightning's automatic optimization: `optimizer.step(closure)`, whose closure runs the
/// forward, the `zero_grad` of a step's first microbatch and the backward inside the
/// `Optimizer.step` scope; earlier microbatches of an accumulation run the closure
/// outside it.
fn closure_step(run: &mut Run, accum: u32) {
    for micro in 0..accum {
        run.scope(1, FETCH, 1);
        let last = micro + 1 == accum;
        if last {
            run.at(1, scope_enter("Optimizer.step#SGD.step"))
                .grad(0, false)
                .grad(0, true); // torch.enable_grad() around the closure
        }
        if micro == 0 {
            run.scope(1, "Optimizer.zero_grad#SGD.zero_grad", 1);
        }
        run.backward(1, 3);
        if last {
            run.grad(0, false)
                .grad(2, true)
                .at(0, PhaseSignal::ScopeExit);
        }
    }
}

#[test]
fn a_closure_optimizer_runs_the_last_microbatch_inside_its_step() {
    let mut run = Run::new("per_step", true);
    closure_step(&mut run, 2);
    closure_step(&mut run, 2);
    closure_step(&mut run, 1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.outline(KEYS),
        "train.job
  train.model_init
  train.step dl.iteration=0
    train.forward_backward dl.microbatch_count=2
    train.optimizer
  train.step dl.iteration=1
    train.forward_backward dl.microbatch_count=2
    train.optimizer
  train.step dl.iteration=2
    train.forward_backward dl.microbatch_count=1
    train.optimizer
"
    );
    let steps: Vec<_> = log.named(names::STEP).cloned().collect();
    let optimizers: Vec<_> = log.named(names::OPTIMIZER).cloned().collect();
    let fbs: Vec<_> = log.named(names::FORWARD_BACKWARD).cloned().collect();
    for i in 0..3 {
        // The update starts where the closure's backward ended and the step ends with it.
        assert_eq!(optimizers[i].start_ns, fbs[i].end_ns);
        assert_eq!(optimizers[i].end_ns, steps[i].end_ns);
        assert_eq!(ms(optimizers[i].end_ns - optimizers[i].start_ns), 2);
    }
    // The next step's zero_grad (inside its closure, after its fetch) does not stretch
    // the step before it.
    assert!(steps[0].end_ns < steps[1].start_ns);
    assert!(log.misnested().is_empty());
}

#[test]
fn calls_of_a_forward_pass_before_its_backward_belong_to_forward_backward() {
    let mut run = Run::new("per_step", true);
    run.step(1);
    // FSDP2's all-gathers in the forward pass come before the backward opens the step.
    run.scope(1, FETCH, 1);
    run.now += 2_000_000;
    run.allreduce(1);
    run.backward(1, 3).scope(1, "Optimizer.step#SGD.step", 1);
    // And one after the optimizer returned: between steps, on the job.
    run.now += 2_000_000;
    run.allreduce(1);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let outline = log.outline(&[]);
    assert!(
        outline.contains(
            "  train.step\n    train.forward_backward\n      nccl.all_reduce\n    train.optimizer\n"
        ),
        "{outline}"
    );
    assert!(
        outline.contains("    train.optimizer\n  nccl.all_reduce\n"),
        "{outline}"
    );
    assert!(log.misnested().is_empty());
}

#[test]
fn graph_capture_calling_autograd_grad_is_not_a_backward_pass() {
    let mut run = Run::new("per_step", true);
    // AOTAutograd traces the joint graph during the first forward: torch.autograd.grad.
    run.scope(1, FETCH, 1)
        .at(1, PhaseSignal::GradientStart)
        .at(2, PhaseSignal::BackwardEnd);
    run.backward(1, 3).scope(1, "Optimizer.step#SGD.step", 1);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.outline(KEYS),
        "train.job
  train.model_init
  train.step dl.iteration=0
    train.forward_backward dl.microbatch_count=1
    train.optimizer
  train.step dl.iteration=1
    train.forward_backward dl.microbatch_count=1
    train.optimizer
"
    );
}

#[test]
fn without_the_step_probes_an_evaluation_starts_where_grad_mode_goes_off() {
    // `default` groups: no backward probes, so no step consumes the training fetches.
    let mut run = Run::new("default", true);
    for _ in 0..2 {
        run.scope(1, FETCH, 1)
            .at(5, scope_enter("Optimizer.step#SGD.step"))
            .grad(0, false)
            .grad(1, true)
            .at(0, PhaseSignal::ScopeExit)
            .scope(0, "Optimizer.zero_grad#SGD.zero_grad", 1);
    }
    let eval_start = run.now + 1_000_000;
    run.eval(2);
    run.scope(1, FETCH, 1)
        .at(5, scope_enter("Optimizer.step#SGD.step"));
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(log.outline(KEYS), "train.job\n  train.evaluate\n");
    let evaluate = log.named(names::EVALUATE).next().unwrap();
    assert_eq!(evaluate.start_ns, eval_start);
}

#[test]
fn a_compiled_optimizer_step_ends_at_the_zero_grad_after_it() {
    // `torch.compile(opt.step)` runs no `Optimizer.step` scope; `zero_grad` still comes.
    let mut run = Run::new("per_step", true);
    for _ in 0..3 {
        run.scope(1, FETCH, 1)
            .backward(2, 3)
            .scope(4, "Optimizer.zero_grad#AdamW.zero_grad", 1);
    }
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.outline(KEYS),
        "train.job
  train.model_init
  train.step dl.iteration=0
    train.forward_backward dl.microbatch_count=1
    train.optimizer
  train.step dl.iteration=1
    train.forward_backward dl.microbatch_count=1
    train.optimizer
  train.step dl.iteration=2
    train.forward_backward dl.microbatch_count=1
    train.optimizer
"
    );
    let optimizer = log.named(names::OPTIMIZER).next().unwrap();
    // From the end of the backward to the end of zero_grad.
    assert_eq!(ms(optimizer.end_ns - optimizer.start_ns), 5);
    assert!(log.spans.iter().all(|s| !s.truncated()));
}

#[test]
fn a_collective_reducing_an_evaluation_s_metrics_is_the_evaluation_s() {
    let mut run = Run::new("per_step", true);
    run.step(1).eval(2);
    run.now += 2_000_000;
    run.allreduce(1);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let outline = log.outline(&[]);
    assert!(
        outline.contains("  train.evaluate\n    nccl.all_reduce\n"),
        "{outline}"
    );
    assert!(log.misnested().is_empty(), "{outline}");
}

#[test]
fn without_fetches_a_step_starts_at_its_wrapped_model_s_forward() {
    let mut run = Run::new("per_step", true);
    for _ in 0..2 {
        // FSDP2's root pre-forward, then its all-gathers, then the backward.
        run.scope(2, "FSDP::root_pre_forward", 1);
        run.now += 2_000_000;
        run.allreduce(1);
        run.backward(1, 3).scope(1, "Optimizer.step#SGD.step", 1);
    }
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let outline = log.outline(&[]);
    assert_eq!(
        outline
            .matches("    train.forward_backward\n      nccl.all_reduce\n")
            .count(),
        2,
        "{outline}"
    );
    assert!(log.misnested().is_empty(), "{outline}");
}

#[test]
fn a_load_whose_files_are_read_around_load_state_dict_is_one_load() {
    let mut run = Run::new("per_step", true);
    run.at(1, PhaseSignal::CheckpointReadStart { own_file: false })
        .at(2, PhaseSignal::CheckpointReadEnd)
        .grad(0, false) // model.load_state_dict copies under no_grad
        .grad(1, true)
        .at(1, PhaseSignal::CheckpointReadStart { own_file: false })
        .at(2, PhaseSignal::CheckpointReadEnd);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(
        log.outline(&[semconv::NEMO_CHECKPOINT_FILES]),
        "train.job
  train.model_init
  train.load_checkpoint nemo.checkpoint.files=2
  train.step
    train.forward_backward
    train.optimizer
"
    );
}

#[test]
fn a_recompile_after_an_evaluation_does_not_stretch_it_into_the_next_step() {
    let mut run = Run::new("per_step", true);
    run.step(1).eval(2);
    let eval_end = run.now;
    // The next step's forward recompiles (the grad mode changed): AOTAutograd toggles
    // grad mode before the backward.
    run.scope(1, FETCH, 1);
    let step_start = run.now - 1_000_000;
    run.grad(1, false)
        .grad(1, true)
        .grad(1, false)
        .grad(1, true);
    run.backward(1, 3).scope(1, "Optimizer.step#SGD.step", 1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let evaluate = log.named(names::EVALUATE).next().unwrap();
    assert_eq!(evaluate.end_ns, eval_end);
    let step = log.named(names::STEP).nth(1).unwrap();
    assert_eq!(step.start_ns, step_start, "{}", log.outline(&[]));
}

/// The index of the built-in framework rule naming `module:qualname`.
/// The background thread an `async_save` writes on.
const WRITER: u32 = PID + 7;

/// DCP's `async_save` and the `save` it runs on a background thread.
fn dcp_async_save_rules(rules: &crate::settings::probe_rules::ProbeRules) -> (u32, u32) {
    (
        framework_rule(
            rules,
            "torch.distributed.checkpoint.state_dict_saver:async_save",
        ),
        framework_rule(rules, "torch.distributed.checkpoint.state_dict_saver:save"),
    )
}

fn framework_rule(rules: &crate::settings::probe_rules::ProbeRules, name: &str) -> u32 {
    rules
        .python
        .iter()
        .find(|r| r.framework && format!("{}:{}", r.module, r.qualname) == name)
        .unwrap_or_else(|| panic!("no built-in rule {name}"))
        .index
}

impl Run {
    fn with_framework_rules(
        groups: &str,
    ) -> (
        Run,
        std::sync::Arc<crate::settings::probe_rules::ProbeRules>,
    ) {
        let rules = std::sync::Arc::new(
            crate::settings::probe_rules::ProbeRules::load(
                None,
                crate::settings::probe_rules::Profile::default(),
            )
            .unwrap(),
        );
        let mut run = Run::new(groups, true);
        run.builder = std::mem::replace(
            &mut run.builder,
            SpanBuilder::new(SpanGroups::default(), SpanLog::default()),
        )
        .with_rules(rules.clone());
        (run, rules)
    }

    /// A sampled framework call of thread `tid` entered (`at_return` false) or
    /// returned, `ms` from now.
    fn framework(&mut self, ms: u64, tid: u32, rule: u32, at_return: bool) -> &mut Self {
        self.framework_since(ms, tid, rule, at_return, None)
    }

    /// As `framework`, the thread's sample before having been taken at `since_ns`.
    fn framework_since(
        &mut self,
        ms: u64,
        tid: u32,
        rule: u32,
        at_return: bool,
        since_ns: Option<u64>,
    ) -> &mut Self {
        self.now += ms * 1_000_000;
        self.builder.on_event(&ProbeEvent::RuleCall {
            tgid: PID,
            tid,
            at_ns: self.now,
            launches: self.launches,
            epoch: self.epoch,
            rule,
            at_return,
            args: [0; lens_common::RULE_ARGS],
            text: None,
            ret: 0,
            since_ns,
        });
        self
    }

    fn on_thread(&mut self, ms: u64, tid: u32, signal: PhaseSignal) -> &mut Self {
        self.now += ms * 1_000_000;
        self.epoch += 1;
        self.builder.on_event(&ProbeEvent::Phase {
            tgid: PID,
            tid,
            at_ns: self.now,
            launches: self.launches,
            epoch: self.epoch,
            signal,
        });
        self
    }
}

/// Lightning's `validate(ckpt_path=...)`: the load's return is sampled 1 ms late, after
/// the validation switched grad mode off; the evaluation begins where the load ended,
/// not inside it (the fit-end test saw them overlap under load).
#[test]
fn an_evaluation_does_not_begin_inside_a_load_whose_end_was_sampled_late() {
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let restore = framework_rule(
        &rules,
        "lightning.pytorch.trainer.connectors.checkpoint_connector:_CheckpointConnector._restore_modules_and_callbacks",
    );
    run.step(1);
    run.framework(2, PID, restore, false)
        .at(1, PhaseSignal::CheckpointReadStart { own_file: false })
        .at(2, PhaseSignal::CheckpointReadEnd)
        .grad(0, false)
        .grad(1, true);
    // The validation's inference mode, then the sample without the load.
    run.grad(1, false).framework(1, PID, restore, true);
    let load_return = run.now;
    run.scope(1, FETCH, 1).scope(1, FETCH, 1).grad(1, true);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let loads: Vec<_> = log.named(names::LOAD_CHECKPOINT).collect();
    let evaluations: Vec<_> = log.named(names::EVALUATE).collect();
    assert_eq!(
        (loads.len(), evaluations.len()),
        (1, 1),
        "{}",
        log.outline(KEYS)
    );
    assert_eq!(loads[0].end_ns, load_return, "{:?}", loads[0]);
    assert!(
        evaluations[0].start_ns >= loads[0].end_ns,
        "{:?} begins inside {:?}",
        evaluations[0],
        loads[0]
    );
    assert!(log.misnested().is_empty(), "{}", log.outline(KEYS));
}

/// Lightning's `fit` calls its restore without a checkpoint, which returns at once: a
/// sample that lands in it shows a load call that reads nothing, which is no load. A
/// load call as short that opens a reader is one; one that lasts, with nothing seen
/// (remote storage), is one too.
#[test]
fn a_framework_load_call_that_loads_nothing_is_no_span() {
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let restore = framework_rule(
        &rules,
        "lightning.pytorch.trainer.connectors.checkpoint_connector:_CheckpointConnector._restore_modules_and_callbacks",
    );
    // fit(): the restore sampled once, then training.
    run.framework(1, PID, restore, false)
        .framework(1, PID, restore, true);
    run.step(1).step(1);
    // validate(ckpt_path=...): a reader in as short a call.
    run.framework(1, PID, restore, false)
        .at(0, PhaseSignal::CheckpointReadStart { own_file: false })
        .at(1, PhaseSignal::CheckpointReadEnd)
        .framework(1, PID, restore, true);
    run.step(1);
    // A load from remote storage: nothing seen in 20 ms.
    run.framework(1, PID, restore, false)
        .framework(20, PID, restore, true);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let loads: Vec<_> = log.named(names::LOAD_CHECKPOINT).collect();
    assert_eq!(loads.len(), 2, "{}", log.outline(KEYS));
    assert_eq!(loads[0].int_attr(semconv::NEMO_CHECKPOINT_FILES), Some(1));
    assert_eq!(loads[1].int_attr(semconv::NEMO_CHECKPOINT_FILES), Some(0));
    assert!(loads[1].duration_ns() >= 20_000_000, "{:?}", loads[1]);
    // No load before the first step: model_init, then the steps.
    let first_step = log.named(names::STEP).next().unwrap();
    assert!(
        loads[0].start_ns > first_step.end_ns,
        "{}",
        log.outline(KEYS)
    );
    assert_eq!(log.named(names::STEP).count(), 4, "{}", log.outline(KEYS));
    assert!(log.misnested().is_empty(), "{}", log.outline(KEYS));
}

/// Fabric writes through fsspec: `mkstemp` creates the temporary file, closes it, and
/// `open(name, "wb")` creates it again; two saves of one file each, and a second file.
#[test]
fn a_file_created_twice_in_a_save_is_one_file() {
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let save = framework_rule(&rules, "lightning.fabric.fabric:Fabric.save");
    run.step(1);
    run.framework(5, PID, save, false)
        .at(1, PhaseSignal::CheckpointWriteStart)
        .at(1, PhaseSignal::CheckpointWriteEnd)
        .at(1, PhaseSignal::FileCreated { path: 0xabc })
        .at(1, PhaseSignal::FileCreated { path: 0xabc })
        .at(1, PhaseSignal::FileCreated { path: 0xdef })
        .framework(1, PID, save, true);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let checkpoints: Vec<_> = log.named(names::CHECKPOINT).collect();
    assert_eq!(checkpoints.len(), 1, "{}", log.outline(&[]));
    assert_eq!(
        checkpoints[0].int_attr(semconv::NEMO_CHECKPOINT_FILES),
        Some(2)
    );
}

#[test]
fn a_framework_save_is_one_checkpoint_from_its_first_sample_to_its_return() {
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let save = framework_rule(&rules, "transformers.trainer:Trainer._save_checkpoint");
    run.step(1);
    let step_end = run.now;
    // Sampled 5 ms after the step ended: it began within the interval before.
    run.framework(5, PID, save, false);
    let save_start = run.now - 1_000_000;
    run.at(20, PhaseSignal::FileCreated { path: 0 }) // config.json, by Python
        .at(30, PhaseSignal::CheckpointWriteStart)
        .at(0, PhaseSignal::FileCreated { path: 0 })
        .at(10, PhaseSignal::CheckpointWriteEnd)
        .at(2, PhaseSignal::FileCreated { path: 0 }) // trainer_state.json
        .framework(1, PID, save, true);
    let save_end = run.now;
    // A log created after the save returned is not its file, nor a checkpoint.
    run.at(3, PhaseSignal::FileCreated { path: 0 });
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let checkpoints: Vec<_> = log.named(names::CHECKPOINT).collect();
    assert_eq!(checkpoints.len(), 1, "{}", log.outline(&[]));
    let checkpoint = checkpoints[0];
    assert!(save_start > step_end);
    assert_eq!(
        (checkpoint.start_ns, checkpoint.end_ns),
        (save_start, save_end)
    );
    assert_eq!(checkpoint.int_attr(semconv::NEMO_CHECKPOINT_FILES), Some(3));
    assert!(log.misnested().is_empty(), "{}", log.outline(&[]));
}

#[test]
fn a_framework_load_counts_the_files_it_opens_not_its_stream_reads() {
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let load = framework_rule(
        &rules,
        "torch.distributed.checkpoint.state_dict_loader:load",
    );
    run.framework(5, PID, load, false);
    // DCP's reader: each file opened once, its items `torch.load`ed from streams.
    run.at(1, PhaseSignal::FileRead { path: 0 });
    for _ in 0..2 {
        run.at(1, PhaseSignal::FileRead { path: 0 });
        for _ in 0..5 {
            run.at(1, PhaseSignal::CheckpointReadStart { own_file: false })
                .at(1, PhaseSignal::CheckpointReadEnd);
        }
    }
    run.framework(1, PID, load, true);
    // A file read after the load returned (the job's data) is not the load's.
    run.at(3, PhaseSignal::FileRead { path: 0 });
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let loads: Vec<_> = log.named(names::LOAD_CHECKPOINT).collect();
    assert_eq!(loads.len(), 1, "{}", log.outline(&[]));
    assert_eq!(loads[0].int_attr(semconv::NEMO_CHECKPOINT_FILES), Some(3));
}

#[test]
fn a_safetensors_load_counts_each_file_once_however_many_opens_are_seen() {
    // Two `load_file`s, each a `safe_open` that opens its file twice (its own mapping,
    // then torch's `UntypedStorage.from_file`). Opens are seen once the loader has
    // learnt of the load from a sample: from none of the four to all of them.
    for seen_from in 0..=4 {
        let (mut run, rules) = Run::with_framework_rules("per_step");
        let load_file = framework_rule(&rules, "safetensors.torch:load_file");
        run.at(5, PhaseSignal::CheckpointReadStart { own_file: true });
        for file in 0..2 {
            if file == 1 {
                run.at(0, PhaseSignal::GradMode { enabled: false })
                    .at(1, PhaseSignal::GradMode { enabled: true })
                    .at(1, PhaseSignal::CheckpointReadStart { own_file: true });
            }
            run.framework(0, PID, load_file, false);
            for open in 0..2 {
                if 2 * file + open >= 4 - seen_from {
                    run.at(0, PhaseSignal::FileRead { path: 0 });
                }
            }
            run.at(1, PhaseSignal::CheckpointReadEnd)
                .framework(1, PID, load_file, true);
        }
        run.step(1);
        let log = run.end(1, Some(ExitStatus::Exited(0)));
        let loads: Vec<_> = log.named(names::LOAD_CHECKPOINT).collect();
        assert_eq!(loads.len(), 1, "{}", log.outline(&[]));
        assert_eq!(
            loads[0].int_attr(semconv::NEMO_CHECKPOINT_FILES),
            Some(2),
            "{seen_from} opens seen"
        );
    }
}

#[test]
fn a_dcp_load_starts_with_its_get_state_dict_though_it_steps_a_fresh_optimizer() {
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let prepare = framework_rule(
        &rules,
        "torch.distributed.checkpoint.state_dict:get_state_dict",
    );
    let load = framework_rule(
        &rules,
        "torch.distributed.checkpoint.state_dict_loader:load",
    );
    run.step(1).step(1);
    run.framework(3, PID, prepare, false);
    let start = run.now - 1_000_000;
    // `_init_optim_state`: a zero-lr step and zero_grad of the optimizer loaded into,
    // then the load reads `.metadata` before a sample shows `load` running.
    run.scope(1, "Optimizer.step#SGD.step", 1)
        .scope(0, "Optimizer.zero_grad#SGD.zero_grad", 1)
        .framework(1, PID, prepare, true)
        .at(0, PhaseSignal::FileRead { path: 0 })
        .framework(1, PID, load, false);
    for _ in 0..2 {
        run.at(1, PhaseSignal::FileRead { path: 0 })
            .at(0, PhaseSignal::CheckpointReadStart { own_file: false })
            .at(1, PhaseSignal::CheckpointReadEnd);
    }
    run.framework(1, PID, load, true);
    let end = run.now;
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let outline = log.outline(&[semconv::DL_ITERATION]);
    let loads: Vec<_> = log.named(names::LOAD_CHECKPOINT).collect();
    assert_eq!(loads.len(), 1, "{outline}");
    assert_eq!(
        (loads[0].start_ns, loads[0].end_ns),
        (start, end),
        "{outline}"
    );
    assert_eq!(loads[0].int_attr(semconv::NEMO_CHECKPOINT_FILES), Some(3));
    // The zero-lr step is no step of the loop.
    assert_eq!(log.named(names::STEP).count(), 3, "{outline}");
    assert_eq!(log.named(names::OPTIMIZER).count(), 3, "{outline}");
}

#[test]
fn a_framework_call_sampled_after_its_file_began_moves_the_span_back() {
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let save_model = framework_rule(&rules, "safetensors.torch:save_model");
    let save_file = framework_rule(&rules, "safetensors.torch:save_file");
    run.step(1);
    // safetensors' native write began before the sample that shows save_model arrived.
    run.at(2, PhaseSignal::CheckpointWriteStart)
        .at(0, PhaseSignal::FileCreated { path: 0 })
        .framework(1, PID, save_model, false);
    let start = run.now - 1_000_000;
    run.at(3, PhaseSignal::CheckpointWriteEnd)
        .framework(1, PID, save_model, true)
        // save_file right after: the same checkpoint.
        .framework(1, PID, save_file, false)
        .at(1, PhaseSignal::CheckpointWriteStart)
        .at(0, PhaseSignal::FileCreated { path: 0 })
        .at(2, PhaseSignal::CheckpointWriteEnd)
        .framework(1, PID, save_file, true);
    let end = run.now;
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let checkpoint = log.named(names::CHECKPOINT).next().unwrap();
    assert_eq!(log.named(names::CHECKPOINT).count(), 1);
    assert_eq!((checkpoint.start_ns, checkpoint.end_ns), (start, end));
    assert_eq!(checkpoint.int_attr(semconv::NEMO_CHECKPOINT_FILES), Some(2));
}

#[test]
fn a_framework_call_sampled_late_starts_after_the_threads_sample_before() {
    // The thread's samples came 1.6 ms apart (the two CPUs' clocks out of step): the
    // load began after the earlier one, which did not show it, 0.6 ms before its file
    // was opened; the sample showing it came 1 ms after the open.
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let load_file = framework_rule(&rules, "safetensors.torch:load_file");
    run.at(5, PhaseSignal::CheckpointReadStart { own_file: true });
    let since = run.now - 600_000;
    run.framework_since(1, PID, load_file, false, Some(since))
        .at(1, PhaseSignal::CheckpointReadEnd)
        .framework(1, PID, load_file, true);
    let end = run.now;
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let loads: Vec<_> = log.named(names::LOAD_CHECKPOINT).collect();
    assert_eq!(loads.len(), 1, "{}", log.outline(&[]));
    assert_eq!((loads[0].start_ns, loads[0].end_ns), (since, end));
}

#[test]
fn the_next_phase_ends_a_framework_call_whose_return_is_not_sampled_yet() {
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let save = framework_rule(
        &rules,
        "lightning.pytorch.trainer.trainer:Trainer.save_checkpoint",
    );
    run.step(1).framework(2, PID, save, false);
    run.checkpoint();
    // The next step's fetch comes before the sample showing the save gone.
    run.scope(1, FETCH, 1);
    let fetch = run.now - 1_000_000;
    run.framework(0, PID, save, true)
        .backward(1, 2)
        .scope(1, "Optimizer.step#SGD.step", 1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let checkpoint = log.named(names::CHECKPOINT).next().unwrap();
    assert_eq!(checkpoint.end_ns, fetch, "{}", log.outline(&[]));
    assert_eq!(log.named(names::STEP).count(), 2);
}

#[test]
fn an_async_save_waited_for_keeps_its_writers_files_and_ends_with_the_writer() {
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let (async_save, save) = dcp_async_save_rules(&rules);
    run.step(1).framework(2, PID, async_save, false);
    let start = run.now - 1_000_000;
    run.framework(3, WRITER, save, false)
        .on_thread(1, WRITER, PhaseSignal::FileCreated { path: 0 })
        .on_thread(5, WRITER, PhaseSignal::FileCreated { path: 0 })
        // A sample catches the returning frame mid-update: `save` seems to return and
        // begin again.
        .framework(1, WRITER, save, true)
        .framework(1, WRITER, save, false);
    let end = run.now + 1_000_000;
    // The caller sat blocked in `future.result()` until the writer returned: its next
    // forward pass, and the sample showing `async_save` gone, are handled before the
    // writer's last sample is.
    run.now = end + 300_000;
    run.scope(0, "DistributedDataParallel.forward", 1)
        .framework(0, PID, async_save, true);
    let resumed = run.now;
    run.now = end;
    run.framework(0, WRITER, save, true);
    run.now = resumed;
    run.backward(1, 2)
        .scope(1, "Optimizer.step#SGD.step", 1)
        .step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let outline = log.outline(&[]);
    let checkpoints: Vec<_> = log.named(names::CHECKPOINT).collect();
    assert_eq!(checkpoints.len(), 1, "{outline}");
    assert_eq!(
        (checkpoints[0].start_ns, checkpoints[0].end_ns),
        (start, end),
        "{outline}"
    );
    assert_eq!(
        checkpoints[0].int_attr(semconv::NEMO_CHECKPOINT_FILES),
        Some(2)
    );
    assert_eq!(log.named(names::STEP).count(), 3, "{outline}");
}

#[test]
fn a_dcp_async_save_is_one_span_until_its_background_writer_returns() {
    let (mut run, rules) = Run::with_framework_rules("per_step");
    let (async_save, save) = dcp_async_save_rules(&rules);
    run.step(1).framework(2, PID, async_save, false);
    let start = run.now - 1_000_000;
    run.framework(3, WRITER, save, false)
        .framework(2, PID, async_save, true)
        // Training goes on while the writer writes.
        .step(1)
        .on_thread(0, WRITER, PhaseSignal::FileCreated { path: 0 })
        .on_thread(5, WRITER, PhaseSignal::FileCreated { path: 0 })
        .framework(4, WRITER, save, true);
    let end = run.now;
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    let checkpoints: Vec<_> = log.named(names::CHECKPOINT).collect();
    assert_eq!(checkpoints.len(), 1, "{}", log.outline(&[]));
    assert_eq!(
        (checkpoints[0].start_ns, checkpoints[0].end_ns),
        (start, end)
    );
    assert_eq!(
        checkpoints[0].int_attr(semconv::NEMO_CHECKPOINT_FILES),
        Some(2)
    );
    assert_eq!(log.named(names::STEP).count(), 3);
}

/// A library call of the generic kind, `length_us` long, from now on.
fn api_call(
    run: &mut Run,
    probe: lens_common::ProbeId,
    length_us: u64,
    result: i64,
    memory: Option<crate::events::MemoryChange>,
) {
    run.now += length_us * 1_000;
    run.builder.on_event(&ProbeEvent::ApiCall {
        timing: CallTiming {
            tgid: PID,
            tid: PID,
            start_ns: run.now - length_us * 1_000,
            end_ns: run.now,
        },
        probe,
        args: [0; lens_common::record::API_ARGS],
        out: 0,
        result,
        memory,
    });
}

fn held(bytes: u64, peak: u64) -> Option<crate::events::MemoryChange> {
    Some(crate::events::MemoryChange {
        op: crate::calls::MemoryOp::Alloc,
        bytes: 0,
        held: bytes,
        peak,
        out_of_memory: None,
    })
}

#[test]
fn slow_graph_and_memory_calls_are_spans_and_each_step_carries_its_peak() {
    use lens_common::ProbeId;
    let mut run = Run::new("per_step", true);
    run.step(1);
    // During the second step: a fast capture (counted only), a 5 ms instantiation and a
    // 2 ms cudaFree (spans), allocations that take the process to 9 MiB and back.
    run.at(1, scope_enter(FETCH));
    api_call(&mut run, ProbeId::CudaStreamBeginCapture, 10, 0, None);
    api_call(&mut run, ProbeId::CudaGraphInstantiate, 5_000, 0, None);
    api_call(&mut run, ProbeId::CudaMalloc, 20, 0, held(9 << 20, 9 << 20));
    api_call(
        &mut run,
        ProbeId::CudaFree,
        2_000,
        0,
        held(3 << 20, 9 << 20),
    );
    run.at(1, PhaseSignal::ScopeExit).backward(2, 3);
    run.at(1, scope_enter("Optimizer.step#SGD.step"))
        .grad(0, false)
        .grad(1, true)
        .at(0, PhaseSignal::ScopeExit)
        .scope(0, "Optimizer.zero_grad#SGD.zero_grad", 1);
    run.step(1);
    let log = run.end(1, Some(ExitStatus::Exited(0)));
    assert_eq!(log.named("cuda.graph_instantiate").count(), 1);
    assert_eq!(log.named("cuda.free").count(), 1);
    assert_eq!(log.named("cuda.stream_begin_capture").count(), 0);
    assert_eq!(log.named("cuda.malloc").count(), 0);
    let peaks: Vec<_> = log
        .named(names::STEP)
        .map(|step| step.int_attr(semconv::DL_GPU_MEMORY_PEAK))
        .collect();
    // None before the first memory call; then the step's own: 9 MiB, then what was held.
    assert_eq!(peaks, [None, Some(9 << 20), Some(3 << 20)]);
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(job.int_attr(semconv::DL_GPU_MEMORY_PEAK), Some(9 << 20));
}
