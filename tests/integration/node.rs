//! Node-wide mode: lens-probe started before the training processes finds them as they
//! start (in other mount namespaces too), traces each from its start with its own
//! resources, leaves unmatched processes alone, and detaches when they are gone.
use std::{process::Command, time::Duration};

use lens_probe::{
    discovery::NodeFilter,
    export::strategy::ExportStrategy,
    groups::SpanGroups,
    probes::library::LibraryKind,
    semconv,
    session::{Session, TraceOptions},
    spans::{SpanBuilder, SpanLog, names},
};

#[test]
fn node_mode_traces_processes_that_start_later_and_detaches_after_them() {
    if !lens_tests::require_bpf("node_mode_traces_processes_that_start_later") {
        return;
    }
    let marker = format!("run-{}", std::process::id());
    let mut session = Session::new(TraceOptions {
        span_groups: "per_step".parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
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
                    .env("TRAINER_INIT_MS", "700")
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
        .run_blocking(&mut builder, Some(Duration::from_secs(6)))
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
