//! The fake libcudart/libnccl and the trainer that calls them in a known pattern: exact
//! counts, arguments and durations through real uprobes (see tests/README.md).
use std::{collections::BTreeMap, time::Duration};

use lens_common::{NCCL_UNIQUE_ID_WORDS, ProbeId, comm_id_hash};
use lens_probe::{
    events::{CollectiveOp, ProbeEvent, PythonCaller, SyncKind},
    nccl::{DataType, RedOp},
    session::{RunReport, Session, StopReason, TraceOptions},
    settings::groups::SpanGroups,
    sink::EventLog,
    sys::target::ExitStatus,
};

const STEPS: u64 = 3;
/// The fake cudaStreamSynchronize sleeps this long; event sync half, device sync a quarter.
const SYNC_MS: u64 = 20;

fn options(spec: &str) -> TraceOptions {
    TraceOptions {
        span_groups: spec.parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    }
}

fn run(session: &mut Session) -> (EventLog, RunReport) {
    let mut log = EventLog::default();
    let report = session
        .run_blocking(&mut log, Some(Duration::from_secs(60)))
        .unwrap();
    (log, report)
}

fn trainer_args() -> Vec<std::ffi::OsString> {
    vec![
        lens_tests::trainer().into_os_string(),
        STEPS.to_string().into(),
    ]
}

/// The trainer started through env(1) (one more exec in the same pid) with a sync log:
/// the fake libcudart writes there how long each sync call really slept.
fn trainer_args_with_sync_log(log: &std::path::Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec![
        "env".into(),
        format!("LENS_FAKE_SYNC_LOG={}", log.display()).into(),
        format!("LENS_FAKE_SYNC_MS={SYNC_MS}").into(),
    ];
    args.extend(trainer_args());
    args
}

/// Durations from the sync log, per key in call order: `stream` is what the library
/// slept, `stream-call` the caller's clock around the call (likewise event, device).
fn slept_ns(log: &std::path::Path) -> BTreeMap<String, Vec<u64>> {
    let mut slept: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for line in std::fs::read_to_string(log).unwrap().lines() {
        let (kind, ns) = line.split_once(' ').unwrap();
        slept
            .entry(kind.to_string())
            .or_default()
            .push(ns.parse().unwrap());
    }
    slept
}

/// The communicator id the trainer passes: byte i = i.
fn trainer_comm_id_hash() -> u64 {
    let bytes: Vec<u8> = (0..128u8).collect();
    let mut words = [0u64; NCCL_UNIQUE_ID_WORDS];
    for (word, &chunk) in words.iter_mut().zip(bytes.as_chunks::<8>().0) {
        *word = u64::from_le_bytes(chunk);
    }
    comm_id_hash(&words)
}

/// (op, count, dtype, redop, root/peer) of one collective.
type CollectiveArgs = (CollectiveOp, u64, DataType, Option<RedOp>, Option<i32>);

fn expected_collectives_of_step(step: u64) -> Vec<CollectiveArgs> {
    vec![
        (
            CollectiveOp::AllReduce,
            1024 * (step + 1),
            DataType::Float32,
            Some(RedOp::Sum),
            None,
        ),
        (
            CollectiveOp::Broadcast,
            4096,
            DataType::Bfloat16,
            None,
            Some(2),
        ),
        (
            CollectiveOp::Reduce,
            256,
            DataType::Float16,
            Some(RedOp::Max),
            Some(3),
        ),
        (CollectiveOp::AllGather, 512, DataType::Int32, None, None),
        (
            CollectiveOp::ReduceScatter,
            128,
            DataType::Float64,
            Some(RedOp::Avg),
            None,
        ),
        (CollectiveOp::Send, 64, DataType::Uint8, None, Some(0)),
        (CollectiveOp::Recv, 64, DataType::Uint8, None, Some(2)),
    ]
}

#[test]
fn exec_trainer_every_call_counted_with_exact_arguments() {
    if !lens_tests::require_bpf("exec_trainer_every_call_counted_with_exact_arguments") {
        return;
    }
    let sync_log = std::env::temp_dir().join(format!("lens-sync-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&sync_log);
    let mut session = Session::new(options("per_step")).unwrap();
    let pid = session
        .exec(&trainer_args_with_sync_log(&sync_log))
        .unwrap();
    let (log, report) = run(&mut session);
    let slept = slept_ns(&sync_log);
    let _ = std::fs::remove_file(&sync_log);

    assert_eq!(report.stop, StopReason::TargetsExited);
    assert_eq!(report.child_exit, Some(ExitStatus::Exited(0)));
    assert_eq!(report.losses.total(), 0, "{:?}", report.losses);

    // Every probed call, counted in the kernel, exactly.
    assert_eq!(log.ended.len(), 1);
    let calls = &log.ended[0].calls;
    let expected: BTreeMap<ProbeId, u64> = [
        (ProbeId::CudaLaunchKernel, 10 * STEPS),
        (ProbeId::CudaLaunchKernelExC, STEPS),
        (ProbeId::CudaGraphLaunch, STEPS),
        (ProbeId::CudaStreamSynchronize, STEPS),
        (ProbeId::CudaDeviceSynchronize, STEPS),
        (ProbeId::CudaEventSynchronize, STEPS),
        (ProbeId::NcclAllReduce, STEPS),
        (ProbeId::NcclBroadcast, STEPS),
        (ProbeId::NcclReduce, STEPS),
        (ProbeId::NcclAllGather, STEPS),
        (ProbeId::NcclReduceScatter, STEPS),
        (ProbeId::NcclSend, STEPS),
        (ProbeId::NcclRecv, STEPS),
        (ProbeId::NcclGroupStart, STEPS),
        (ProbeId::NcclGroupEnd, STEPS),
        (ProbeId::NcclCommInitRank, 1),
    ]
    .into();
    assert_eq!(calls, &expected);

    // The communicator: handle written by the call, rank/size, id hash as every rank sees it.
    let inits: Vec<_> = log
        .events
        .iter()
        .filter(|e| matches!(e, ProbeEvent::CommInit { .. }))
        .collect();
    assert_eq!(inits.len(), 1);
    match inits[0] {
        ProbeEvent::CommInit {
            timing,
            comm,
            rank,
            nranks,
            comm_id_hash,
            result,
        } => {
            assert_eq!(timing.tgid, pid);
            assert_eq!(*comm, 0xC0FFEE00);
            assert_eq!((*rank, *nranks), (1, 4));
            assert_eq!(*comm_id_hash, trainer_comm_id_hash());
            assert_eq!(*result, 0);
        }
        _ => unreachable!(),
    }

    // Every collective, in call order, with its exact arguments.
    let collectives: Vec<CollectiveArgs> = log
        .events
        .iter()
        .filter_map(|e| match e {
            ProbeEvent::Collective {
                op,
                count,
                datatype,
                redop,
                peer,
                comm,
                stream,
                result,
                timing,
                ..
            } => {
                assert_eq!(*comm, 0xC0FFEE00);
                assert_eq!(*stream, 0x5000);
                assert_eq!(*result, 0);
                assert_eq!(timing.tgid, pid);
                assert!(timing.end_ns >= timing.start_ns);
                Some((*op, *count, datatype.unwrap(), *redop, *peer))
            }
            _ => None,
        })
        .collect();
    let expected: Vec<CollectiveArgs> = (0..STEPS).flat_map(expected_collectives_of_step).collect();
    assert_eq!(collectives, expected);
    let all_reduce_bytes: Vec<u64> = log
        .events
        .iter()
        .filter(|e| {
            matches!(
                e,
                ProbeEvent::Collective {
                    op: CollectiveOp::AllReduce,
                    ..
                }
            )
        })
        .filter_map(ProbeEvent::bytes)
        .collect();
    assert_eq!(all_reduce_bytes, [4096, 8192, 12288]);

    // Group brackets: start then end, once per step.
    let groups: Vec<bool> = log
        .events
        .iter()
        .filter_map(|e| match e {
            ProbeEvent::Group { open, .. } => Some(*open),
            _ => None,
        })
        .collect();
    assert_eq!(groups, [true, false].repeat(STEPS as usize));

    // Sync waits: never shorter than the library really slept, never longer than the
    // caller's own clock around the call. Both bounds hold on any load; the nominal sleep
    // is a floor the library's nanosleep guarantees.
    for (kind, name, handle, sleep_ms) in [
        (SyncKind::Stream, "stream", 0x5000, SYNC_MS),
        (SyncKind::Event, "event", 0x7000, SYNC_MS / 2),
        (SyncKind::Device, "device", 0, SYNC_MS / 4),
    ] {
        let waits: Vec<u64> = log
            .events
            .iter()
            .filter_map(|e| match e {
                ProbeEvent::SyncWait {
                    timing,
                    kind: k,
                    handle: h,
                    result,
                    python_caller,
                } if *k == kind => {
                    assert_eq!(*h, handle, "{kind:?}");
                    assert_eq!(*result, 0);
                    assert_eq!(*python_caller, PythonCaller::None, "not a Python process");
                    Some(timing.duration_ns())
                }
                _ => None,
            })
            .collect();
        assert_eq!(waits.len() as u64, STEPS, "{kind:?}");
        let slept_in_library = &slept[name];
        let caller_bracket = &slept[&format!("{name}-call")];
        assert_eq!(slept_in_library.len(), waits.len(), "{kind:?}");
        assert_eq!(caller_bracket.len(), waits.len(), "{kind:?}");
        for ((wait, inner), outer) in waits.iter().zip(slept_in_library).zip(caller_bracket) {
            assert!(
                inner <= wait && wait <= outer,
                "{kind:?}: measured {wait} ns, the library slept {inner} ns, \
                 the caller saw {outer} ns"
            );
            assert!(*wait >= sleep_ms * 1_000_000, "{kind:?}: {wait} ns");
        }
    }
}

#[test]
fn default_groups_leave_per_call_probes_unattached() {
    if !lens_tests::require_bpf("default_groups_leave_per_call_probes_unattached") {
        return;
    }
    let mut session = Session::new(options("default")).unwrap();
    session.exec(&trainer_args()).unwrap();
    let (log, report) = run(&mut session);
    assert_eq!(report.child_exit, Some(ExitStatus::Exited(0)));

    // Only the infrastructure probes went in (the loader hook and communicator init),
    // and the GPU memory calls' (the job span's peak; the trainer makes none).
    let (memory, attached): (Vec<ProbeId>, Vec<ProbeId>) = session
        .attacher()
        .attached_by_probe()
        .into_keys()
        .partition(|&probe| lens_probe::calls::MemoryOp::from_probe(probe).is_some());
    assert_eq!(attached, [ProbeId::NcclCommInitRank, ProbeId::DlDebugState]);
    assert!(memory.contains(&ProbeId::CudaMalloc), "{memory:?}");
    // ...and nothing else fired.
    assert!(
        log.events
            .iter()
            .all(|e| matches!(e, ProbeEvent::CommInit { .. })),
        "{:?}",
        log.events
    );
    let calls: Vec<ProbeId> = log.ended[0].calls.keys().copied().collect();
    assert_eq!(calls, [ProbeId::NcclCommInitRank]);
}

#[test]
fn attach_by_pid_counts_the_calls_made_after_attach() {
    if !lens_tests::require_bpf("attach_by_pid_counts_the_calls_made_after_attach") {
        return;
    }
    // The trainer makes its first call only once the test opens its gate, after the
    // attach returned, so every call comes after the attach whatever the attach took
    // (it queues behind the kernel's removal of other sessions' uprobes, ~0.1 s each).
    let gate = std::env::temp_dir().join(format!("lens-fake-libs-gate-{}", std::process::id()));
    let _ = std::fs::remove_file(&gate);
    let mut session = Session::new(options("per_step")).unwrap();
    let mut child = std::process::Command::new(lens_tests::trainer())
        .arg("2")
        .env("TRAINER_START_GATE", &gate)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the dynamic loader has mapped the fake libraries.
    let maps = format!("/proc/{}/maps", child.id());
    for _ in 0..200 {
        if std::fs::read_to_string(&maps).is_ok_and(|m| m.contains("libnccl.so.2")) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    session.attach_pid(child.id()).unwrap();
    std::fs::write(&gate, b"").unwrap();
    let (log, report) = run(&mut session);
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_file(&gate);

    assert_eq!(report.stop, StopReason::TargetsExited);
    // Not lens-probe's child: the kernel's exit tracepoint told how it ended.
    assert_eq!(
        log.ended[0].exit,
        Some(ExitStatus::Exited(0)),
        "{:?}",
        log.ended
    );
    let calls = &log.ended[0].calls;
    assert_eq!(
        calls.get(&ProbeId::CudaLaunchKernel),
        Some(&20),
        "{calls:?} {:?}",
        session.attacher().attached_by_probe()
    );
    assert_eq!(calls.get(&ProbeId::NcclAllReduce), Some(&2));
    assert_eq!(calls.get(&ProbeId::NcclCommInitRank), Some(&1));
    let collectives = log
        .events
        .iter()
        .filter(|e| matches!(e, ProbeEvent::Collective { .. }))
        .count();
    assert_eq!(collectives, 14);
}

#[test]
fn a_library_without_the_symbols_gets_one_report_per_probe_and_nothing_breaks() {
    use lens_probe::bpf::BpfObject;
    use lens_probe::probes::attach::{Attacher, ProbeOutcome};
    use lens_probe::sys::library::{FileId, LibraryKind, MappedLibrary};
    if !lens_tests::require_bpf("a_library_without_the_symbols_gets_one_report_per_probe") {
        return;
    }
    let mut ebpf = BpfObject::load(false, Default::default()).unwrap().programs;
    let mut attacher = Attacher::default();
    // A file taken for libnccl that defines none of NCCL's API (the fake libcudart), then
    // the real fake libnccl: the first yields one failure per probe, the second attaches.
    let impostor = MappedLibrary {
        kind: LibraryKind::Nccl,
        file: FileId { dev: 0, ino: 1 },
        shown_path: "/opt/impostor/libnccl.so.2".into(),
        open_path: lens_tests::fake_lib_dir().join("libcudart.so.12"),
    };
    let all = "all".parse().unwrap();
    // Probes for this process alone (no process maps these files here).
    let me = std::process::id();
    let outcomes = attacher
        .attach_library(&mut ebpf, me, &impostor, &all)
        .unwrap()
        .outcomes
        .clone();
    // One report per NCCL probe, but none for ncclAlltoAll: newer than many NCCL releases,
    // its absence is no fault.
    assert_eq!(
        outcomes.len(),
        10,
        "one report per NCCL probe: {outcomes:?}"
    );
    assert!(
        !outcomes
            .iter()
            .any(|o| format!("{o:?}").contains("ncclAlltoAll")),
        "{outcomes:?}"
    );
    for outcome in &outcomes {
        match outcome {
            ProbeOutcome::Failed { reason, .. } => {
                assert_eq!(reason, "libnccl defines no such symbol")
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // Asking again for the same file does nothing (reported once).
    assert!(
        attacher
            .attach_library(&mut ebpf, me, &impostor, &all)
            .is_none()
    );

    let nccl = MappedLibrary {
        kind: LibraryKind::Nccl,
        file: FileId { dev: 0, ino: 2 },
        shown_path: "libnccl.so.2".into(),
        open_path: lens_tests::fake_lib_dir().join("libnccl.so.2"),
    };
    let attached = attacher.attach_library(&mut ebpf, me, &nccl, &all).unwrap();
    assert!(
        attached
            .outcomes
            .iter()
            .all(|o| matches!(o, ProbeOutcome::Attached { .. })),
        "{:?}",
        attached.outcomes
    );
    // 11 functions; the 9 that need a duration also get a return probe.
    assert_eq!(attached.outcomes.len(), 20);
}

/// A session measures at start-up what a probe hit costs, with its own process briefly
/// traced: processes that other threads of that process start meanwhile (a library user
/// running jobs, or other tests) are not followed into tracing.
#[test]
fn processes_started_beside_a_starting_session_are_not_traced() {
    if !lens_tests::require_bpf("processes_started_beside_a_starting_session_are_not_traced") {
        return;
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spawner = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut spawned = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::process::Command::new("true").status();
                spawned += 1;
            }
            spawned
        })
    };
    for _ in 0..3 {
        let session = Session::new(options("per_step")).unwrap();
        assert_eq!(session.kernel_state().targets, 0);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(spawner.join().unwrap() > 0);
}
