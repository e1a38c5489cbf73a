//! Driver-level launches and kernel names through real uprobes, on the fake trainer with
//! `TRAINER_KERNELS=1` (tests/README.md): its runtime launches go through the fake
//! libcuda.so.1 (counted once, at the runtime), it also launches through the driver
//! directly (counted at the driver), and its kernel stubs carry C++ names that the steps'
//! `cuda.kernel.top` events show demangled, with exact counts.
use std::{ffi::OsString, time::Duration};

use lens_common::ProbeId;
use lens_probe::{
    semconv,
    session::{KernelState, Session, TraceOptions},
    settings::groups::SpanGroups,
    spans::{AttrValue, SpanBuilder, SpanLog, names},
    summary::Summary,
};

const STEPS: u64 = 3;
const MICROBATCHES: u64 = 2;

/// `trainer_torch 3 2 0 0` with named kernels, traced with `per_step` from its start.
fn trace_kernels() -> (SpanLog, Summary, KernelState) {
    trace_trainer("TRAINER_KERNELS=1")
}

/// The `cuda.kernel.top` events of a step: (name, launches), most launched first.
fn top_kernels(step: &lens_probe::spans::SpanRecord) -> Vec<(String, i64)> {
    step.events
        .iter()
        .filter(|e| e.name == names::KERNEL_TOP_EVENT)
        .map(|e| {
            assert_eq!(e.at_ns, step.end_ns);
            let attr = |key: &str| e.attributes.iter().find(|(k, _)| *k == key).cloned();
            let Some((_, AttrValue::Str(name))) = attr(semconv::CUDA_KERNEL_NAME) else {
                panic!("no name: {e:?}");
            };
            let Some((_, AttrValue::Int(launches))) = attr(semconv::CUDA_KERNEL_LAUNCHES) else {
                panic!("no launches: {e:?}");
            };
            (name, launches)
        })
        .collect()
}

/// A session tracing with `per_step`.
fn per_step_session() -> Session {
    Session::new(TraceOptions {
        span_groups: "per_step".parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap()
}

/// `trainer_torch 3 2 0 0` with `kernels` (its env switch), traced with `per_step` from
/// its start.
fn trace_trainer(kernels: &str) -> (SpanLog, Summary, KernelState) {
    let mut session = per_step_session();
    let argv: Vec<OsString> = vec![
        "env".into(),
        kernels.into(),
        "LENS_FAKE_BACKWARD_MS=1".into(),
        // Kernel stubs are named through the live process's maps: a run of a few ms can
        // end before its events are drained (every 50 ms), which leaves them unnamed.
        "TRAINER_EXIT_DELAY_MS=300".into(),
        lens_tests::torch_trainer().into_os_string(),
        STEPS.to_string().into(),
        MICROBATCHES.to_string().into(),
        "0".into(),
        "0".into(),
    ];
    session.exec(&argv).unwrap();
    let mut sink = (
        SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default()),
        Summary::default(),
    );
    session
        .run_blocking(&mut sink, Some(Duration::from_secs(60)))
        .unwrap();
    let state = session.kernel_state();
    (sink.0.into_exporter(), sink.1, state)
}

#[test]
fn each_launch_counts_once_with_runtime_and_driver_probes_attached() {
    if !lens_tests::require_bpf("each_launch_counts_once_with_runtime_and_driver_probes_attached") {
        return;
    }
    let (log, summary, state) = trace_kernels();
    let process = summary
        .processes
        .values()
        .find(|p| p.ended && p.calls.contains_key(&ProbeId::CudaLaunchKernel))
        .expect("the trainer's summary");
    let per_step = |n: u64| STEPS * n;
    // Through the runtime (each also reaches cuLaunchKernel/Ex, not counted there):
    // 3 gemm + 2 relu per microbatch, 1 adam per step; 1 softmax (ExC) per microbatch.
    assert_eq!(
        process.launches(),
        [
            (ProbeId::CudaLaunchKernel, per_step(MICROBATCHES * 5 + 1)),
            (ProbeId::CudaLaunchKernelExC, per_step(MICROBATCHES)),
        ]
        .into_iter()
        .collect()
    );
    // Straight to the driver, as cuBLAS would: 2 + 1 + 1 graph per microbatch.
    assert_eq!(
        process.driver_launches(),
        [
            (ProbeId::CuLaunchKernel, per_step(MICROBATCHES * 2)),
            (ProbeId::CuLaunchKernelEx, per_step(MICROBATCHES)),
            (ProbeId::CuGraphLaunch, per_step(MICROBATCHES)),
        ]
        .into_iter()
        .collect()
    );
    // The probe-cost estimate prices every hit the process paid for: each counted call
    // (and its return, where there is a return probe), and each runtime launch's second
    // hit, at the driver, which is not a call of its own.
    let cost = process.probe_cost.as_ref().expect("a probe cost");
    let runtime_made = per_step(MICROBATCHES * 5 + 1) + per_step(MICROBATCHES);
    let entries: u64 = process.calls.values().sum::<u64>() + runtime_made;
    let returns: u64 = process
        .calls
        .iter()
        .filter(|(probe, _)| lens_probe::probes::catalog::spec_of(**probe).exit.is_some())
        .map(|(_, calls)| calls)
        .sum();
    assert_eq!(
        cost.estimated_ns,
        entries * cost.entry_hit_ns + returns * cost.return_hit_ns,
        "{entries} entry hits ({runtime_made} made by the runtime), {returns} returns: {cost:?}"
    );
    // Every step counts its 10 launches per microbatch and the optimizer's one.
    let steps: Vec<_> = log.named(names::STEP).collect();
    assert_eq!(steps.len() as u64, STEPS);
    for step in &steps {
        assert_eq!(
            step.int_attr(semconv::CUDA_LAUNCH_COUNT),
            Some((MICROBATCHES * 10 + 1) as i64),
            "{step:?}"
        );
    }
    // Nothing of the ended process stays in the kernel.
    assert_eq!(
        state,
        KernelState {
            targets: 0,
            inflight: 0,
            kernel_counters: 0,
            runtime_ranges: 0,
        }
    );
}

#[test]
fn kernel_names_appear_demangled_on_each_step_with_exact_counts() {
    if !lens_tests::require_bpf("kernel_names_appear_demangled_on_each_step_with_exact_counts") {
        return;
    }
    let (log, _, _) = trace_kernels();
    let steps: Vec<_> = log.named(names::STEP).collect();
    assert_eq!(steps.len() as u64, STEPS);
    let mut handles = Vec::new();
    for step in steps {
        let top = top_kernels(step);
        // Driver handles are heap objects: named by value, the same in every step.
        let names: Vec<(&str, i64)> = top
            .iter()
            .map(|(name, launches)| {
                if name.starts_with("CUfunction 0x") {
                    handles.push(name.clone());
                    ("CUfunction", *launches)
                } else {
                    (name.as_str(), *launches)
                }
            })
            .collect();
        let mb = MICROBATCHES as i64;
        assert_eq!(
            names,
            [
                (
                    "void fakenn::gemm_kernel<float, 128>(float const*, float const*, float*, int)",
                    3 * mb
                ),
                ("CUfunction", 2 * mb),
                ("void fakenn::relu_kernel<float>(float*, long)", 2 * mb),
                ("CUfunction", mb),
                ("fakenn::softmax_kernel(float const*, float*, int, int)", mb),
                ("fakenn::adam_step_kernel(float*, float*, float*, float)", 1),
            ],
            "step {:?}",
            step.int_attr(semconv::DL_ITERATION)
        );
    }
    // Two handles (cuBLAS's gemm, cuDNN's conv), each named the same way in every step.
    handles.sort();
    handles.dedup();
    assert_eq!(handles.len(), 2, "{handles:?}");
}

#[test]
fn kernels_of_a_library_without_symbols_are_named_as_registered() {
    if !lens_tests::require_bpf("kernels_of_a_library_without_symbols_are_named_as_registered") {
        return;
    }
    // faketorch/libtorch_cuda.so has no symbol table (as PyTorch's wheel): its stubs are
    // named only through __cudaRegisterFunction, which its constructor calls.
    let library = lens_tests::fake_torch_dir().join("libtorch_cuda.so");
    let data = std::fs::read(&library).unwrap();
    let elf = object::File::parse(&*data).unwrap();
    assert!(
        object::Object::symbol_table(&elf).is_none(),
        "{} has a .symtab",
        library.display()
    );
    let (log, summary, _) = trace_trainer("TRAINER_REGISTERED_KERNELS=1");
    let process = summary
        .processes
        .values()
        .find(|p| p.calls.contains_key(&ProbeId::CudaRegisterFunction))
        .expect("a process registered kernels");
    assert_eq!(process.calls[&ProbeId::CudaRegisterFunction], 2);
    let steps: Vec<_> = log.named(names::STEP).collect();
    assert_eq!(steps.len() as u64, STEPS);
    let mb = MICROBATCHES as i64;
    for step in steps {
        assert_eq!(
            top_kernels(step),
            [
                (
                    "void fakenn::layer_norm_kernel<float>(float const*, float*, int)".to_string(),
                    3 * mb
                ),
                (
                    "fakenn::dropout_kernel(float*, float*, float)".to_string(),
                    mb
                ),
            ],
            "step {:?}",
            step.int_attr(semconv::DL_ITERATION)
        );
    }
}

#[test]
fn runtime_and_direct_driver_launches_interleaved_on_two_threads_count_once_each() {
    if !lens_tests::require_bpf("runtime_and_direct_driver_launches_interleaved_on_two_threads") {
        return;
    }
    // Each of `hammer mixed`'s two threads alternates a runtime launch (whose driver call
    // comes from libcudart: not counted again) and a launch straight to the driver (counted
    // there), at once: a thread's note of its runtime launch must neither be taken by the
    // other thread's direct launch nor outlive its own driver call.
    const PER_THREAD: u64 = 20_000;
    let process = hammer_summary("mixed", PER_THREAD, ProbeId::CudaLaunchKernel);
    assert_eq!(
        process.launches(),
        [(ProbeId::CudaLaunchKernel, 2 * PER_THREAD)]
            .into_iter()
            .collect()
    );
    assert_eq!(
        process.driver_launches(),
        [(ProbeId::CuLaunchKernel, 2 * PER_THREAD)]
            .into_iter()
            .collect()
    );
}

#[test]
fn launches_on_a_capturing_stream_count_as_captured_not_run() {
    if !lens_tests::require_bpf("launches_on_a_capturing_stream_count_as_captured") {
        return;
    }
    // `hammer capture`: while stream S captures a graph, N runtime launches on S, N on
    // another stream T, N `cudaLaunchKernelExC` whose config names S and N driver
    // launches on S; then the graph is instantiated and launched 3 times, and N more
    // launches go to S once the capture ended.
    const N: u64 = 500;
    let (process, log) = hammer_run("capture", N, ProbeId::CudaStreamBeginCapture);
    // Each graph launch is a span.
    assert_eq!(
        log.named("cuda.graph_launch").count(),
        3,
        "{}",
        log.outline(&[])
    );
    // Run: the launches on T and those on S after the capture, and the graph launches.
    assert_eq!(
        process.launches(),
        [
            (ProbeId::CudaLaunchKernel, 2 * N),
            (ProbeId::CudaGraphLaunch, 3)
        ]
        .into_iter()
        .collect()
    );
    assert!(
        process.driver_launches().is_empty(),
        "{:?}",
        process.driver_launches()
    );
    // Recorded into the graph, not run.
    assert_eq!(
        process.captured,
        [
            (ProbeId::CudaLaunchKernel, N),
            (ProbeId::CudaLaunchKernelExC, N),
            (ProbeId::CuLaunchKernel, N),
        ]
        .into_iter()
        .collect()
    );
    // One capture and one instantiation, each seen once: the driver calls the runtime
    // made for them are its own.
    for probe in [
        ProbeId::CudaStreamBeginCapture,
        ProbeId::CudaStreamEndCapture,
        ProbeId::CudaGraphInstantiate,
    ] {
        assert_eq!(process.calls.get(&probe), Some(&1), "{probe:?}");
    }
    for probe in [
        ProbeId::CuStreamBeginCapture,
        ProbeId::CuStreamEndCapture,
        ProbeId::CuGraphInstantiate,
    ] {
        assert_eq!(process.calls.get(&probe), None, "{probe:?}");
    }
}

/// `hammer KIND N` traced with `per_step`: the summary of the process that called `probe`.
fn hammer_summary(kind: &str, n: u64, probe: ProbeId) -> lens_probe::summary::ProcessSummary {
    hammer_run(kind, n, probe).0
}

/// `hammer KIND N` traced with `per_step`: the summary of the process that called
/// `probe`, and the spans.
fn hammer_run(
    kind: &str,
    n: u64,
    probe: ProbeId,
) -> (lens_probe::summary::ProcessSummary, SpanLog) {
    let mut session = per_step_session();
    let argv: Vec<OsString> = vec![
        lens_tests::hammer().into_os_string(),
        kind.into(),
        n.to_string().into(),
    ];
    session.exec(&argv).unwrap();
    let mut sinks = (
        SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default()),
        Summary::default(),
    );
    session
        .run_blocking(&mut sinks, Some(Duration::from_secs(120)))
        .unwrap();
    let (builder, mut summary) = sinks;
    let pid = summary
        .processes
        .iter()
        .find(|(_, p)| p.ended && p.calls.contains_key(&probe))
        .map(|(pid, _)| *pid)
        .expect("the hammer's summary");
    (
        summary.processes.remove(&pid).unwrap(),
        builder.into_exporter(),
    )
}
