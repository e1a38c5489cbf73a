//! Hang reports (`--hang-timeout`, docs/hangs.md) as a user sees them on the console and
//! in the exported spans, on fake-NCCL ranks whose collectives block until every rank
//! arrived (`LENS_FAKE_NCCL_RENDEZVOUS`) and on a real two-rank gloo PyTorch job.
//!
//! Nothing here waits on a timer for the job: a held-back rank waits for a gate file the
//! test creates once the report is read, so a loaded machine only makes it slower.
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use serde_json::Value;

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

/// Longer than any report takes on a loaded machine: a safety net, not a measurement.
const PATIENCE: Duration = Duration::from_secs(180);

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lens-hangs-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// lens-probe running with its stderr read line by line.
struct Traced {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Traced {
    fn start(args: &[&str], command: &[&str], env: &[(&str, &str)]) -> Traced {
        let mut child = Command::new(LENS_PROBE)
            .args(args)
            .arg("--exec")
            .arg("--")
            .args(command)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Traced {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The next stderr line that `wanted` accepts, and the lines before it.
    fn wait_for(&mut self, what: &str, wanted: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if wanted(&line) {
                        return line;
                    }
                }
                Err(_) => {
                    let _ = self.child.kill();
                    panic!("no {what} on stderr:\n{}", self.seen.join("\n"));
                }
            }
        }
    }

    /// The first hang report (header, one line per rank) that `wanted` accepts. Others
    /// may come first on a loaded machine (a rank attached seconds after the other
    /// waits that long at its first collective) and resolve.
    fn hang_report(
        &mut self,
        ranks: usize,
        wanted: impl Fn(&str, &[String]) -> bool,
    ) -> (String, Vec<String>) {
        loop {
            let header = self.wait_for("hang report", |l| {
                l.starts_with("lens-probe: hang: ") && !l.starts_with("lens-probe: hang:   ")
            });
            let lines: Vec<String> = (0..ranks)
                .map(|_| self.wait_for("rank line", |l| l.starts_with("lens-probe: hang:   ")))
                .collect();
            if wanted(&header, &lines) {
                return (header, lines);
            }
        }
    }

    fn finish(mut self) -> String {
        let status = self.child.wait().unwrap();
        for line in self.lines.iter() {
            self.seen.push(line);
        }
        let text = self.seen.join("\n");
        assert_eq!(status.code(), Some(0), "{text}");
        text
    }
}

fn touch(path: &Path) {
    std::fs::write(path, b"").unwrap();
}

fn string_attr(span: &Value, key: &str) -> Option<String> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|kv| kv["key"] == key)
        .and_then(|kv| kv["value"]["stringValue"].as_str())
        .map(str::to_string)
}

fn int_attr(span: &Value, key: &str) -> Option<i64> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|kv| kv["key"] == key)
        .and_then(|kv| match &kv["value"]["intValue"] {
            Value::String(text) => text.parse().ok(),
            value => value.as_i64(),
        })
}

fn named<'a>(spans: &'a [lens_tests::FileSpan], name: &str) -> Vec<&'a Value> {
    spans
        .iter()
        .map(|(_, span)| span)
        .filter(|span| span["name"] == name)
        .collect()
}

#[test]
fn a_rank_that_never_enters_a_collective_is_named_with_where_every_rank_is() {
    if !lens_tests::require_bpf("a_rank_that_never_enters_a_collective") {
        return;
    }
    let dir = scratch("missing");
    let rendezvous = dir.join("rendezvous");
    std::fs::create_dir(&rendezvous).unwrap();
    let gate = dir.join("gate");
    let spans_file = dir.join("spans.jsonl");
    let rank = lens_tests::collective_rank();
    // Rank 1 holds back before its fifth all-reduce (seq 4) until the gate exists.
    let script = format!(
        "\"$0\" 0 2 8 & COLLECTIVE_STALL_STEP=4 COLLECTIVE_STALL_GATE={} \"$0\" 1 2 8; wait $!",
        gate.display()
    );
    let mut traced = Traced::start(
        &[
            "--span-groups",
            "per_step",
            "--hang-timeout",
            "3s",
            "--exporter",
            "file",
            "--export-file",
            spans_file.to_str().unwrap(),
        ],
        &["sh", "-c", &script, rank.to_str().unwrap()],
        &[("LENS_FAKE_NCCL_RENDEZVOUS", rendezvous.to_str().unwrap())],
    );
    let (header, ranks) = traced.hang_report(2, |header, _| header.contains(", seq 4, "));
    touch(&gate);
    for needle in [
        "nccl all_reduce, communicator ",
        ", seq 4, 16.0 KiB: waiting ",
        "arrived: 0; missing: 1",
    ] {
        assert!(header.contains(needle), "{needle:?} not in {header}");
    }
    let rank0 = ranks.iter().find(|l| l.contains(" rank 0 (pid ")).unwrap();
    let rank1 = ranks.iter().find(|l| l.contains(" rank 1 (pid ")).unwrap();
    // Rank 0 waits inside the all-reduce (the fake's rendezvous polls with nanosleep).
    assert!(rank0.contains(": in ncclAllReduce for "), "{rank0}");
    assert!(rank0.contains("ncclAllReduce (libnccl.so.2)"), "{rank0}");
    // Rank 1 entered 4 and is held in the fixture's own function.
    assert!(
        rank1.contains("in no probed call, 4 collectives entered"),
        "{rank1}"
    );
    assert!(
        rank1.contains("stall_until_gate (collective_rank)"),
        "{rank1}"
    );
    let resolved = traced.wait_for("resolution", |l| {
        l.starts_with("lens-probe: hang resolved: ")
    });
    assert!(resolved.contains("seq 4"), "{resolved}");
    assert!(resolved.contains("every traced rank went on"), "{resolved}");
    let text = traced.finish();
    assert!(text.contains("lens-probe: hang: nccl"), "{text}");

    let spans = lens_tests::otlp_file_spans(&spans_file);
    let hangs: Vec<&Value> = named(&spans, "lens_probe.hang")
        .into_iter()
        .filter(|s| int_attr(s, "dl.collective.seq") == Some(4))
        .collect();
    assert_eq!(hangs.len(), 2, "one per traced rank");
    for hang in &hangs {
        assert_eq!(hang["status"]["code"], 2, "error status: {hang}");
        assert_eq!(
            string_attr(hang, "lens_probe.hang.kind").as_deref(),
            Some("ranks_missing")
        );
        assert_eq!(
            string_attr(hang, "lens_probe.hang.ranks_missing").as_deref(),
            Some("1")
        );
        assert_eq!(int_attr(hang, "dl.collective.seq"), Some(4));
        assert_eq!(int_attr(hang, "dl.collective.bytes"), Some(16_384));
    }
    // The all-reduce rank 0 waited in carries the finding; every all-reduce went out.
    let all_reduces = named(&spans, "nccl.all_reduce");
    assert_eq!(all_reduces.len(), 16);
    let marked: Vec<&&Value> = all_reduces
        .iter()
        .filter(|s| int_attr(s, "dl.collective.seq") == Some(4))
        .filter(|s| {
            s["events"]
                .as_array()
                .is_some_and(|events| events.iter().any(|e| e["name"] == "lens_probe.hang"))
        })
        .collect();
    assert_eq!(marked.len(), 1);
    assert_eq!(int_attr(marked[0], "dl.collective.seq"), Some(4));
    assert_eq!(int_attr(marked[0], "dl.rank"), Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_collective_every_rank_entered_that_never_finishes_is_not_completed() {
    if !lens_tests::require_bpf("a_collective_every_rank_entered") {
        return;
    }
    let dir = scratch("unfinished");
    let rendezvous = dir.join("rendezvous");
    std::fs::create_dir(&rendezvous).unwrap();
    // A third rank, never traced, that arrived at the first two collectives only.
    for seq in 0..2 {
        touch(&rendezvous.join(format!("{seq}.2")));
    }
    let rank = lens_tests::collective_rank();
    let mut traced = Traced::start(
        &["--span-groups", "per_step", "--hang-timeout", "3s"],
        &[
            "sh",
            "-c",
            "\"$0\" 0 3 4 & \"$0\" 1 3 4; wait $!",
            rank.to_str().unwrap(),
        ],
        &[("LENS_FAKE_NCCL_RENDEZVOUS", rendezvous.to_str().unwrap())],
    );
    let (header, ranks) = traced.hang_report(2, |header, _| header.contains(", seq 2, "));
    // The third rank arrives.
    for seq in 2..4 {
        touch(&rendezvous.join(format!("{seq}.2")));
    }
    assert!(header.contains(", seq 2, "), "{header}");
    assert!(
        header.contains("every traced rank (0, 1) entered it; not finished after "),
        "{header}"
    );
    for line in &ranks {
        assert!(line.contains(": in ncclAllReduce for "), "{line}");
    }
    let resolved = traced.wait_for("resolution", |l| {
        l.starts_with("lens-probe: hang resolved: ")
    });
    assert!(resolved.contains("seq 2"), "{resolved}");
    traced.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_gloo_rank_stalled_in_python_is_named_with_its_stack_and_the_span_reaches_the_collector() {
    let name = "a_gloo_rank_stalled_in_python";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let (Some(venv), Some(rotel)) = (lens_tests::torch_venv(name), lens_tests::rotel(name)) else {
        return;
    };
    let collector = lens_tests::RotelCollector::start(&rotel, "hangs");
    let dir = scratch("gloo");
    let gate = dir.join("gate");
    let torchrun = venv.dir.join("bin/torchrun");
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/torch/hang_train.py");
    let port = lens_tests::free_port().to_string();
    let endpoint = format!("http://127.0.0.1:{}", collector.http);
    let mut traced = Traced::start(
        &["--span-groups", "per_step", "--hang-timeout", "3s"],
        &[
            torchrun.to_str().unwrap(),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            script.to_str().unwrap(),
        ],
        &[
            ("LENS_HANG_GATE", gate.to_str().unwrap()),
            ("GLOO_SOCKET_IFNAME", "lo"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("NEMO_LENS_EXPORT_STRATEGY", "all_ranks"),
        ],
    );
    let (header, ranks) = traced.hang_report(2, |_, lines| {
        lines.iter().any(|l| l.contains("slow_data ("))
    });
    // The collector has the hang span while the job still hangs.
    collector.wait_within(
        PATIENCE,
        |text| text.contains("lens_probe.hang.kind"),
        "receive the hang span before the job ends",
    );
    touch(&gate);
    assert!(
        header.contains("gloo all_reduce, communicator "),
        "{header}"
    );
    assert!(header.contains("arrived: 0; missing: 1"), "{header}");
    let rank1 = ranks.iter().find(|l| l.contains(" rank 1 (pid ")).unwrap();
    let rank0 = ranks.iter().find(|l| l.contains(" rank 0 (pid ")).unwrap();
    // Rank 1: in its data loading, read from its memory (function, file, line).
    assert!(rank1.contains("in no probed call"), "{rank1}");
    // (Mostly in the sleep, line 27; a read can catch the `exists` call of line 26.)
    assert!(
        rank1.contains("slow_data (") && rank1.contains("hang_train.py:42) < <module> ("),
        "slow_data, called from main's line 42: {rank1}"
    );
    // Rank 0: waiting for the all-reduce's work in torch.distributed, called from main.
    assert!(rank0.contains("python: all_reduce ("), "{rank0}");
    assert!(rank0.contains("distributed_c10d.py:"), "{rank0}");
    assert!(rank0.contains("hang_train.py:47) < <module> ("), "{rank0}");
    let resolved = traced.wait_for("resolution", |l| {
        l.starts_with("lens-probe: hang resolved: gloo all_reduce")
    });
    assert!(resolved.contains("every traced rank went on"), "{resolved}");
    traced.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Python stack as a hang report reads it (no BPF: `/proc/PID/mem`), on every
/// interpreter the sampler knows: innermost first, with the line each frame is at
/// (3.10: the line its function's definition starts at).
#[test]
fn python_stacks_are_read_from_the_process_on_every_cpython() {
    let dir = scratch("stacks");
    let script = dir.join("held.py");
    let ready = dir.join("ready");
    std::fs::write(
        &script,
        "import os, sys, time\n\
         \n\
         class Loader:\n\
         \x20   def wait(self):\n\
         \x20       open(sys.argv[1], 'w').close()\n\
         \x20       while True:\n\
         \x20           time.sleep(0.01)\n\
         \n\
         def outer():\n\
         \x20   Loader().wait()\n\
         \n\
         outer()\n",
    )
    .unwrap();
    for (path, exact_lines) in [
        ("/root/.pyenv/versions/3.10.13/bin/python3.10", false),
        ("/root/.pyenv/versions/3.11.7/bin/python3.11", true),
        ("/root/.pyenv/versions/3.12.1/bin/python3.12", true),
        ("/root/.pyenv/versions/3.13.0/bin/python3.13", true),
        ("/usr/bin/python3.11", true),
    ] {
        if !Path::new(path).exists() {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{path} is missing on this CI machine"
            );
            eprintln!("skipped: no {path}");
            continue;
        }
        let _ = std::fs::remove_file(&ready);
        let mut child = Command::new(path).arg(&script).arg(&ready).spawn().unwrap();
        let deadline = Instant::now() + PATIENCE;
        while !ready.exists() {
            assert!(
                Instant::now() < deadline,
                "{path}: the script never started"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // Past the `open` call, in the loop's sleep (a read mid-call would show that line):
        // the thread waits in clock_nanosleep (230) or, on 3.10, pselect6 (270).
        let sleeping = || {
            std::fs::read_to_string(format!("/proc/{}/syscall", child.id()))
                .is_ok_and(|text| text.starts_with("230 ") || text.starts_with("270 "))
        };
        while !sleeping() {
            assert!(Instant::now() < deadline, "{path}: never slept");
            std::thread::sleep(Duration::from_millis(1));
        }
        let place = lens_probe::hangs::location::read(child.id(), child.id());
        let _ = child.kill();
        let _ = child.wait();
        let frames: Vec<(String, Option<u32>)> = place
            .python
            .iter()
            .map(|f| (f.function.clone(), f.line))
            .collect();
        let (wait, outer) = if exact_lines { (7, 10) } else { (4, 9) };
        assert_eq!(
            frames,
            vec![
                ("Loader.wait".to_string(), Some(wait)),
                ("outer".to_string(), Some(outer)),
                (
                    "<module>".to_string(),
                    Some(if exact_lines { 12 } else { 1 })
                ),
            ],
            "{path}"
        );
        assert!(
            place
                .python
                .iter()
                .all(|f| f.file == script.to_str().unwrap())
        );
        let native = place.native.expect("a native place").to_string();
        // In a system call; pyenv's builds keep their symbol tables, so the stack scan
        // names the interpreter's `time.sleep` too (Debian's binary is stripped).
        assert!(native.contains("; callers scanned)"), "{path}: {native}");
        if path.contains("pyenv") {
            assert!(native.contains("time_sleep ("), "{path}: {native}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_frame_whose_name_is_not_ascii_is_marked_not_dropped() {
    let path = "/usr/bin/python3.11";
    if !Path::new(path).exists() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{path} is missing on this CI machine"
        );
        return;
    }
    let dir = scratch("non-ascii");
    let script = dir.join("held.py");
    let ready = dir.join("ready");
    std::fs::write(
        &script,
        "import sys, time\n\
         \n\
         def größe():\n\
         \x20   open(sys.argv[1], 'w').close()\n\
         \x20   while True:\n\
         \x20       time.sleep(0.01)\n\
         \n\
         def outer():\n\
         \x20   größe()\n\
         \n\
         outer()\n",
    )
    .unwrap();
    let mut child = Command::new(path).arg(&script).arg(&ready).spawn().unwrap();
    let deadline = Instant::now() + PATIENCE;
    let sleeping = || {
        std::fs::read_to_string(format!("/proc/{}/syscall", child.id()))
            .is_ok_and(|text| text.starts_with("230 "))
    };
    while !ready.exists() || !sleeping() {
        assert!(Instant::now() < deadline, "the script never slept");
        std::thread::sleep(Duration::from_millis(1));
    }
    let place = lens_probe::hangs::location::read(child.id(), child.id());
    let _ = child.kill();
    let _ = child.wait();
    let functions: Vec<&str> = place.python.iter().map(|f| f.function.as_str()).collect();
    // Before: `größe` was left out, and `outer` seemed to call `time.sleep` itself.
    assert_eq!(
        functions,
        [
            "<name not read: not a compact ASCII string>",
            "outer",
            "<module>"
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
