//! Node-wide mode: lens-probe started before the training processes finds them as they
//! start (in other mount namespaces too), traces each from its start with its own
//! resources, leaves unmatched processes alone, and detaches when they are gone.
use std::{process::Command, time::Duration};

use lens_probe::{
    discovery::NodeFilter,
    export::strategy::ExportStrategy,
    semconv,
    session::{Session, TraceOptions},
    settings::groups::SpanGroups,
    spans::{SpanBuilder, SpanLog, names},
    sys::library::LibraryKind,
};

#[test]
fn node_mode_traces_processes_that_start_later_and_detaches_after_them() {
    if !lens_tests::require_bpf("node_mode_traces_processes_that_start_later") {
        return;
    }
    // How each candidate was judged, shown when the test fails (a rank once went
    // untraced in a fresh-clone run).
    let _ = env_logger::builder()
        .is_test(true)
        .filter_module("lens_probe::session", log::LevelFilter::Debug)
        .try_init();
    let marker = format!("run-{}", std::process::id());
    let mut session = Session::new(TraceOptions {
        span_groups: "per_step".parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    session.set_export_strategy(ExportStrategy::AllRanks);
    let running = session
        .watch_node(NodeFilter {
            environment: vec![("LENS_NODE_TEST".into(), marker.clone())],
            ..NodeFilter::default()
        })
        .unwrap();
    assert_eq!(running, 0);

    // Three trainers started at different times (one in a mount namespace of its own),
    // and one that does not match the filter.
    let trainer = lens_tests::torch_trainer();
    let launcher = {
        let marker = marker.clone();
        std::thread::spawn(move || {
            let start = |rank: u32, delay_ms: u64, unshare: bool, matched: bool| {
                std::thread::sleep(Duration::from_millis(delay_ms));
                let mut command = if unshare {
                    let mut c = Command::new("unshare");
                    c.args(["--mount", "--propagation", "private"])
                        .arg(&trainer);
                    c
                } else {
                    Command::new(&trainer)
                };
                command
                    .args(["2", "2", "0", "0"])
                    // Node mode finds a process when the loader handles its first
                    // library load and pauses it then: a rank that had ended before
                    // (0.7 s of model init, with another test's session busy on the
                    // 2 cores) went untraced.
                    .env("TRAINER_INIT_MS", "1500")
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", "3")
                    .stdout(std::process::Stdio::null());
                if matched {
                    command.env("LENS_NODE_TEST", &marker);
                }
                command.spawn().unwrap()
            };
            let children = vec![
                start(0, 300, false, true),
                start(9, 0, false, false),
                start(1, 700, true, true),
                start(2, 700, false, true),
            ];
            for mut child in children {
                assert!(child.wait().unwrap().success());
            }
        })
    };
    let mut builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(8)))
        .unwrap();
    launcher.join().unwrap();
    let log = builder.into_exporter();

    let mut ranks: Vec<i64> = log
        .named(names::JOB)
        .map(|job| job.int_attr(semconv::DL_RANK).unwrap())
        .collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2], "{}", log.outline(&[semconv::DL_RANK]));
    for job in log.named(names::JOB) {
        // Traced from their start: the whole run, model_init first, then both steps.
        let children: Vec<&str> = log.children(job).iter().map(|s| s.name).collect();
        assert_eq!(
            children,
            [names::MODEL_INIT, names::STEP, names::STEP],
            "rank {:?}",
            job.int_attr(semconv::DL_RANK)
        );
        assert_eq!(job.int_attr(semconv::DL_WORLD_SIZE), Some(3));
    }
    // Gone with them: no probe is left on their libraries, only the loaders' (which
    // find the next ones).
    let left: Vec<_> = session
        .attacher()
        .attachments()
        .iter()
        .filter(|a| a.library.kind != LibraryKind::DynamicLoader)
        .map(|a| a.library.shown_path.clone())
        .collect();
    assert!(left.is_empty(), "still attached: {left:?}");
}

#[test]
fn the_mapped_inode_is_probed_not_what_the_maps_path_names_here() {
    use lens_probe::{events::ProbeEvent, sink::EventLog};

    if !lens_tests::require_bpf("the_mapped_inode_is_probed") {
        return;
    }
    // In lens-probe's view, DIR holds decoys: a "libnccl.so.2" that is really a copy of
    // the fake libcudart (no NCCL symbols at all). The trainer runs in a mount namespace
    // where a tmpfs over DIR holds the real fake libraries: its maps show DIR/libnccl.so.2,
    // a path that names the decoy here.
    let dir = std::env::temp_dir().join(format!("lens-crafted-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fixtures = lens_tests::fake_lib_dir();
    std::fs::copy(fixtures.join("libcudart.so.12"), dir.join("libnccl.so.2")).unwrap();
    std::fs::copy(
        fixtures.join("libcudart.so.12"),
        dir.join("libcudart.so.12"),
    )
    .unwrap();
    let decoy = dir.join("libnccl.so.2");
    let decoy_symbols =
        lens_probe::sys::symbols::resolve_file_offsets(&decoy, &["ncclAllReduce"]).unwrap();
    assert!(
        decoy_symbols.is_empty(),
        "the decoy must have no NCCL symbol"
    );
    let script = format!(
        "mount -t tmpfs none {d} && cp {f}/libnccl.so.2 {f}/libcudart.so.12 {t} {d}/ && exec {d}/trainer 3",
        d = dir.display(),
        f = fixtures.display(),
        t = lens_tests::trainer().display(),
    );
    let mut session = Session::new(TraceOptions {
        span_groups: "per_step".parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    session
        .exec(&[
            "unshare".into(),
            "--mount".into(),
            "--propagation".into(),
            "private".into(),
            "sh".into(),
            "-c".into(),
            script.into(),
        ])
        .unwrap();
    let mut log = EventLog::default();
    session
        .run_blocking(&mut log, Some(Duration::from_secs(60)))
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);

    // Probed by path, the decoy would have been attached (and found without a single
    // NCCL symbol): no collective could have been seen. By the mapped inode
    // (/proc/PID/map_files), the real library's calls are.
    let all_reduces = log
        .events
        .iter()
        .filter(|e| matches!(e, ProbeEvent::Collective { .. }))
        .count();
    assert!(
        all_reduces >= 3,
        "the real library's calls were seen: {all_reduces}"
    );
}
