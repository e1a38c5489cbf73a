//! The real libcudart and libnccl from the PyPI wheels, dlopen'ed late by a C program
//! (no GPU: the calls fail fast, the probes must still see them with the right arguments).
use std::{collections::BTreeMap, time::Duration};

use lens_common::ProbeId;
use lens_probe::{
    events::{CollectiveOp, ProbeEvent, SyncKind},
    nccl::{DataType, RedOp},
    probes::attach::ProbeOutcome,
    session::{Session, TraceOptions},
    sink::EventLog,
    sys::{library::LibraryKind, target::ExitStatus},
};

#[test]
fn real_cudart_and_nccl_every_symbol_attaches_and_calls_are_seen() {
    if !lens_tests::require_bpf("real_cudart_and_nccl") {
        return;
    }
    let Some(libs) = lens_tests::nvidia_libs("real_cudart_and_nccl") else {
        return;
    };
    // CUDA 13's runtime and the NCCL beside it, from the PyTorch venv's wheels.
    let Some(venv) = lens_tests::torch_venv("real_cudart_13_and_nccl") else {
        return;
    };
    let site = std::fs::read_dir(venv.dir.join("lib"))
        .unwrap()
        .map(|entry| entry.unwrap().path().join("site-packages/nvidia"))
        .find(|path| path.is_dir())
        .expect("the venv's nvidia wheels");
    // SAFETY: this test binary has this one test, so no other thread reads the environment.
    // NCCL must not look for network interfaces other than loopback here.
    unsafe { std::env::set_var("NCCL_SOCKET_IFNAME", "lo") };
    check(&libs.cudart, &libs.nccl);
    check(
        &site.join("cu13/lib/libcudart.so.13"),
        &site.join("nccl/lib/libnccl.so.2"),
    );
}

/// Every probe of `cudart` and `nccl` attached, each call seen once with its arguments.
fn check(cudart: &std::path::Path, nccl: &std::path::Path) {
    let mut session = Session::new(TraceOptions {
        span_groups: "all".parse().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    session
        .exec(&[
            lens_tests::real_libs_caller().into_os_string(),
            cudart.as_os_str().to_owned(),
            nccl.as_os_str().to_owned(),
        ])
        .unwrap();
    let mut log = EventLog::default();
    let report = session
        .run_blocking(&mut log, Some(Duration::from_secs(120)))
        .unwrap();
    assert_eq!(report.child_exit, Some(ExitStatus::Exited(0)));

    // Both libraries were found although loaded late, and every listed symbol attached.
    for kind in [LibraryKind::CudaRuntime, LibraryKind::Nccl] {
        let attachment = session
            .attacher()
            .attachments()
            .iter()
            .find(|a| a.library.kind == kind)
            .unwrap_or_else(|| panic!("{kind:?} was not attached"));
        let failed: Vec<_> = attachment
            .outcomes
            .iter()
            .filter(|o| matches!(o, ProbeOutcome::Failed { .. }))
            .collect();
        assert!(failed.is_empty(), "{kind:?}: {failed:?}");
    }
    // Every probe of these libraries (the torch ones are for the torch tests).
    let probes: Vec<ProbeId> = lens_probe::probes::catalog::CATALOG
        .iter()
        .filter(|spec| {
            matches!(
                spec.library,
                LibraryKind::CudaRuntime | LibraryKind::Nccl | LibraryKind::DynamicLoader
            )
        })
        .map(|spec| spec.id)
        .collect();
    let attached = session.attacher().attached_by_probe();
    for &probe in &probes {
        assert!(attached.contains_key(&probe), "{probe:?} not attached");
    }

    // Each call made once is counted once (aliases such as pncclX do not double-fire).
    // (`__cudaRegisterFunction` is attached, not called: it needs a module's fat binary.)
    let calls = &log.ended[0].calls;
    let expected: BTreeMap<ProbeId, u64> = probes
        .into_iter()
        .filter(|p| !matches!(p, ProbeId::DlDebugState | ProbeId::CudaRegisterFunction))
        .map(|p| (p, 1))
        .collect();
    assert_eq!(calls, &expected);

    let mut collectives = Vec::new();
    let mut syncs = Vec::new();
    let mut memory = Vec::new();
    let mut graphs = Vec::new();
    for event in &log.events {
        match event {
            ProbeEvent::Collective {
                op,
                count,
                datatype,
                redop,
                peer,
                comm,
                result,
                ..
            } => {
                assert_eq!(*comm, 0);
                // ncclInvalidArgument: NULL communicator.
                assert_eq!(*result, 4, "{op:?}");
                collectives.push((*op, *count, datatype.unwrap(), *redop, *peer));
            }
            ProbeEvent::SyncWait {
                kind,
                handle,
                result,
                ..
            } => {
                // cudaErrorInsufficientDriver: no GPU here.
                assert_eq!(*result, 35);
                syncs.push((*kind, *handle));
            }
            ProbeEvent::CommInit {
                rank,
                nranks,
                result,
                ..
            } => {
                assert_eq!((*rank, *nranks), (0, 2));
                assert_ne!(*result, 0);
            }
            ProbeEvent::ApiCall {
                probe,
                args,
                result,
                ..
            } if lens_probe::calls::GraphOp::from_probe(*probe).is_some() => {
                // No GPU: the capture never began, and nothing was instantiated.
                assert_eq!(*result, 35, "{probe:?}");
                graphs.push((*probe, args[0]));
            }
            ProbeEvent::ApiCall {
                probe,
                args,
                result,
                memory: change,
                ..
            } => {
                // cudaErrorInsufficientDriver, and nothing taken.
                assert_eq!(*result, 35, "{probe:?}");
                assert_eq!(change.as_ref().map(|c| c.held), Some(0));
                // An allocation: (out-pointer set, size); a free: its pointer, and the
                // stream of the async one.
                let (first, second) = match probe {
                    ProbeId::CudaFree => (args[0], 0),
                    ProbeId::CudaFreeAsync => (args[0], args[1]),
                    _ => (u64::from(args[0] != 0), args[1]),
                };
                memory.push((*probe, first, second));
            }
            _ => {}
        }
    }
    assert_eq!(
        collectives,
        [
            (
                CollectiveOp::AllReduce,
                1000,
                DataType::Float32,
                Some(RedOp::Sum),
                None
            ),
            (
                CollectiveOp::Broadcast,
                2000,
                DataType::Bfloat16,
                None,
                Some(1)
            ),
            (
                CollectiveOp::Reduce,
                300,
                DataType::Float16,
                Some(RedOp::Max),
                Some(2)
            ),
            (CollectiveOp::AllGather, 400, DataType::Int8, None, None),
            (
                CollectiveOp::ReduceScatter,
                500,
                DataType::Float64,
                Some(RedOp::Min),
                None
            ),
            (CollectiveOp::Send, 600, DataType::Int32, None, Some(3)),
            (CollectiveOp::Recv, 700, DataType::Int64, None, Some(4)),
            (
                CollectiveOp::AllToAll,
                800,
                DataType::Float8e4m3,
                None,
                None
            ),
        ]
    );
    // Each memory call's arguments where `calls::MemoryOp` reads them: an allocation's
    // out-pointer (an address on the caller's stack) first and size second; a free's
    // pointer first (and the async one's stream second).
    assert_eq!(
        memory,
        [
            (ProbeId::CudaMalloc, 1, 4096),
            (ProbeId::CudaMallocAsync, 1, 8192),
            (ProbeId::CudaMallocManaged, 1, 16384),
            (ProbeId::CudaFree, 0x7000, 0),
            (ProbeId::CudaFreeAsync, 0x7000, 0x42),
        ],
        "{}",
        cudart.display()
    );
    // A capture's stream is its first argument; an instantiation's first is the
    // out-pointer (an address on the caller's stack); a graph launch's the graph.
    // The graph launch first (its executable graph is its first argument).
    assert_eq!(graphs.len(), 5, "{graphs:?}");
    assert_eq!(graphs[0], (ProbeId::CudaGraphLaunch, 0x44));
    assert_eq!(graphs[1], (ProbeId::CudaStreamBeginCapture, 0x45));
    assert_eq!(graphs[2], (ProbeId::CudaStreamEndCapture, 0x45));
    assert_eq!(graphs[3].0, ProbeId::CudaGraphInstantiate);
    assert_ne!(graphs[3].1, 0);
    assert_eq!(graphs[4].0, ProbeId::CudaGraphInstantiateWithFlags);
    syncs.sort();
    assert_eq!(
        syncs,
        [
            (SyncKind::Stream, 0x42),
            (SyncKind::Event, 0x43),
            (SyncKind::Device, 0)
        ]
    );
}
