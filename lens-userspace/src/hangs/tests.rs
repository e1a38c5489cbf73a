//! Hang detection on synthetic collective streams: which ranks a hang names, when.
use std::time::Duration;

use super::*;

const S: u64 = 1_000_000_000;
const COMM: u64 = 0xc0ffee;

fn watcher() -> HangWatcher {
    let mut watcher = HangWatcher::new(Some(Duration::from_secs(3)));
    watcher.comm_init(100, 0xa0, COMM, 0);
    watcher.comm_init(101, 0xa1, COMM, 1);
    watcher
}

fn all_reduce(pid: u32, handle: u64, start_ns: u64) -> InflightCall {
    InflightCall {
        pid,
        tid: pid,
        probe: ProbeId::NcclAllReduce,
        start_ns,
        handle,
        bytes: Some(16_384),
    }
}

/// Both ranks return `n` all-reduces, the last entered at `at_ns`.
fn run_steps(watcher: &mut HangWatcher, n: u64, at_ns: u64) {
    for _ in 0..n {
        watcher.nccl_returned(100, 0xa0, CollectiveOp::AllReduce, at_ns);
        watcher.nccl_returned(101, 0xa1, CollectiveOp::AllReduce, at_ns);
    }
}

fn found(changes: &[HangChange]) -> Vec<&Hang> {
    changes
        .iter()
        .filter_map(|c| match c {
            HangChange::Found(hang) => Some(hang),
            HangChange::Resolved(_) => None,
        })
        .collect()
}

#[test]
fn a_rank_that_never_enters_is_missing_once_the_timeout_passed() {
    let mut watcher = watcher();
    run_steps(&mut watcher, 4, S);
    let waiting = [all_reduce(100, 0xa0, 10 * S)];
    assert!(watcher.check(12 * S, &waiting).is_empty(), "2 s < 3 s");
    let changes = watcher.check(13 * S, &waiting);
    let hangs = found(&changes);
    assert_eq!(hangs.len(), 1);
    let hang = hangs[0];
    assert_eq!(hang.kind, HangKind::RanksMissing);
    assert_eq!((hang.comm, hang.seq), (COMM, 4));
    assert_eq!(hang.op, Some(CollectiveOp::AllReduce));
    assert_eq!(hang.bytes, Some(16_384));
    assert_eq!(hang.since_ns, 10 * S);
    assert_eq!(hang.arrived.len(), 1);
    assert_eq!(hang.arrived[0].rank, 0);
    assert_eq!(hang.arrived[0].waiting_in, Some(waiting[0].clone()));
    assert_eq!(hang.missing.len(), 1);
    assert_eq!((hang.missing[0].rank, hang.missing[0].entered), (1, 4));
    // Reported once while it lasts.
    assert!(watcher.check(14 * S, &waiting).is_empty());
    assert_eq!(watcher.found(), 1);
}

#[test]
fn a_hang_resolves_when_every_rank_went_on() {
    let mut watcher = watcher();
    run_steps(&mut watcher, 4, S);
    let waiting = [all_reduce(100, 0xa0, 10 * S)];
    assert_eq!(found(&watcher.check(14 * S, &waiting)).len(), 1);
    // Rank 1 arrives; both return.
    watcher.nccl_returned(100, 0xa0, CollectiveOp::AllReduce, 10 * S);
    watcher.nccl_returned(101, 0xa1, CollectiveOp::AllReduce, 70 * S);
    let changes = watcher.check(71 * S, &[]);
    let [HangChange::Resolved(resolved)] = changes.as_slice() else {
        panic!("{changes:?}");
    };
    assert!(resolved.every_rank_went_on);
    assert_eq!(resolved.hang.seq, 4);
    assert_eq!(resolved.at_ns, 71 * S);
}

#[test]
fn every_rank_in_a_collective_that_does_not_finish_is_not_completed() {
    let mut watcher = watcher();
    run_steps(&mut watcher, 2, S);
    let waiting = [
        all_reduce(100, 0xa0, 10 * S),
        all_reduce(101, 0xa1, 10 * S + 5),
    ];
    let changes = watcher.check(14 * S, &waiting);
    let hangs = found(&changes);
    assert_eq!(hangs.len(), 1, "{changes:?}");
    assert_eq!(hangs[0].kind, HangKind::NotCompleted);
    assert_eq!(hangs[0].seq, 2);
    assert!(hangs[0].missing.is_empty());
    assert_eq!(hangs[0].arrived.len(), 2);
}

#[test]
fn a_wait_after_a_returned_collective_that_never_completes_is_not_completed() {
    let mut watcher = watcher();
    run_steps(&mut watcher, 3, 10 * S);
    let sync = InflightCall {
        pid: 101,
        tid: 101,
        probe: ProbeId::CudaStreamSynchronize,
        start_ns: 10 * S + 1,
        handle: 0,
        bytes: None,
    };
    let changes = watcher.check(20 * S, std::slice::from_ref(&sync));
    let hangs = found(&changes);
    assert_eq!(hangs.len(), 1, "{changes:?}");
    assert_eq!(hangs[0].kind, HangKind::NotCompleted);
    assert_eq!(hangs[0].seq, 2);
    assert_eq!(hangs[0].arrived[1].waiting_in, Some(sync));
}

#[test]
fn ranks_a_step_apart_within_the_timeout_are_not_a_hang() {
    let mut watcher = watcher();
    for step in 0..100 {
        watcher.nccl_returned(100, 0xa0, CollectiveOp::AllReduce, step * S);
        let inflight = [all_reduce(100, 0xa0, step * S + 1)];
        assert!(watcher.check(step * S + 2 * S, &inflight).is_empty());
        watcher.nccl_returned(101, 0xa1, CollectiveOp::AllReduce, step * S);
    }
    assert!(watcher.check(1_000 * S, &[]).is_empty(), "idle, all level");
}

#[test]
fn a_process_that_ends_ends_its_hangs() {
    let mut watcher = watcher();
    run_steps(&mut watcher, 1, S);
    let waiting = [all_reduce(100, 0xa0, 10 * S)];
    assert_eq!(found(&watcher.check(14 * S, &waiting)).len(), 1);
    let changes = watcher.process_ended(101, 15 * S);
    let [HangChange::Resolved(resolved)] = changes.as_slice() else {
        panic!("{changes:?}");
    };
    assert!(!resolved.every_rank_went_on);
    // Alone on the communicator now, rank 0 still waits: not completed, reported anew.
    let changes = watcher.check(16 * S, &waiting);
    assert_eq!(found(&changes)[0].kind, HangKind::NotCompleted);
}

fn gloo_process(pid: u32, rank: i64) -> ProcessInfo {
    ProcessInfo {
        pid,
        name: "python3".into(),
        command_line: vec![],
        traced_from_start: true,
        rank: Some(crate::sys::target::RankInfo {
            rank,
            world_size: Some(2),
            local_rank: Some(rank),
        }),
        view: std::sync::Arc::new(crate::sys::target::TargetView {
            environment: vec![
                ("MASTER_ADDR".into(), "127.0.0.1".into()),
                ("MASTER_PORT".into(), "29500".into()),
            ],
            ..Default::default()
        }),
    }
}

#[test]
fn gloo_groups_of_one_job_get_one_id_per_group_and_numbers_from_0() {
    let mut watcher = HangWatcher::new(Some(Duration::from_secs(3)));
    watcher.process_started(&gloo_process(200, 0), true);
    watcher.process_started(&gloo_process(201, 1), true);
    // Rank 0's group objects live at other addresses than rank 1's.
    let a0 = watcher
        .gloo_returned(200, 0x1000, CollectiveOp::Broadcast, S)
        .unwrap();
    let b0 = watcher
        .gloo_returned(200, 0x2000, CollectiveOp::AllReduce, S)
        .unwrap();
    let a1 = watcher
        .gloo_returned(201, 0x7000, CollectiveOp::Broadcast, S)
        .unwrap();
    let a1_next = watcher
        .gloo_returned(201, 0x7000, CollectiveOp::AllReduce, S)
        .unwrap();
    assert_eq!(a0.id, a1.id, "first-used groups agree across ranks");
    assert_ne!(a0.id, b0.id);
    assert_eq!((a0.rank, a1.rank), (0, 1));
    assert_eq!((a0.seq, a1.seq, a1_next.seq), (0, 0, 1));
    // Rank 0 waits in the second all-reduce... of group a (rank 1 did it already):
    // not hung; rank 1 ahead by one on group a: rank 0 missing once 3 s passed.
    let changes = watcher.check(10 * S, &[]);
    let hangs = found(&changes);
    assert_eq!(hangs.len(), 1, "{changes:?}");
    assert_eq!(hangs[0].backend, Backend::Gloo);
    assert_eq!(hangs[0].missing[0].rank, 0);
}

#[test]
fn processes_without_a_job_or_attached_late_get_no_gloo_ids() {
    let mut watcher = HangWatcher::new(Some(Duration::from_secs(3)));
    let mut lone = gloo_process(300, 0);
    std::sync::Arc::make_mut(&mut lone.view).environment.clear();
    watcher.process_started(&lone, true);
    watcher.process_started(&gloo_process(301, 1), false);
    assert_eq!(
        watcher.gloo_returned(300, 0x1000, CollectiveOp::AllReduce, S),
        None
    );
    assert_eq!(
        watcher.gloo_returned(301, 0x1000, CollectiveOp::AllReduce, S),
        None
    );
}

#[test]
fn ranks_that_went_on_and_ended_before_the_next_look_resolve_as_went_on() {
    let mut watcher = watcher();
    run_steps(&mut watcher, 4, S);
    let waiting = [all_reduce(100, 0xa0, 10 * S)];
    assert_eq!(found(&watcher.check(14 * S, &waiting)).len(), 1);
    run_steps(&mut watcher, 4, 15 * S);
    let changes = watcher.process_ended(101, 16 * S);
    let [HangChange::Resolved(resolved)] = changes.as_slice() else {
        panic!("{changes:?}");
    };
    assert!(resolved.every_rank_went_on);
}

#[test]
fn names_a_target_wrote_cannot_forge_lines_or_drive_the_terminal() {
    use crate::hangs::location::{NativeFrame, PyFrame};
    let python = PyFrame {
        function: "step\nlens-probe: hang resolved: all well".into(),
        file: "\u{1b}]0;owned\u{7}train.py".into(),
        line: Some(3),
    };
    let native = NativeFrame {
        function: Some("ncclAllReduce\r\u{1b}[2K".into()),
        file: "/lib/\u{9b}libnccl.so.2".into(),
    };
    for shown in [python.to_string(), native.to_string()] {
        assert!(!shown.chars().any(char::is_control), "{shown:?}");
    }
    assert_eq!(
        python.to_string(),
        "step\\nlens-probe: hang resolved: all well (\\u{1b}]0;owned\\u{7}train.py:3)"
    );
}
