//! Faults of the target, of lens-probe itself and overload (issue 7, items 1–3): each
//! fault and the behaviour observed, asserted. `docs/security.md` has the table.
use std::{
    collections::BTreeSet,
    process::{Command, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use lens_common::ProbeId;
use lens_probe::{
    events::{PhaseSignal, ProbeEvent},
    semconv,
    session::{KernelState, Session, TraceOptions},
    settings::groups::SpanGroups,
    sink::{EventLog, EventSink, ProcessEnd, SinkInput},
    spans::{SpanBuilder, SpanLog, SpanStatus, names},
    sys::target::{ExitStatus, ProcessInfo},
};
use lens_tests::torch_trainer_argv as torch_trainer;

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

/// The tests that count BPF programs or kill lens-probe run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
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

const NOTHING_LEFT: KernelState = KernelState {
    targets: 0,
    inflight: 0,
    kernel_counters: 0,
    runtime_ranges: 0,
};

#[test]
fn a_target_killed_mid_step_leaves_no_kernel_state() {
    if !lens_tests::require_bpf("a_target_killed_mid_step_leaves_no_kernel_state") {
        return;
    }
    // 1 s forward passes; killed 300 ms after the first backward pass ended (which opened
    // step 0), inside the second forward pass.
    let mut session = session("per_step");
    let pid = session
        .exec(&torch_trainer(
            &[
                ("TRAINER_FORWARD_MS", "1000"),
                ("TRAINER_INIT_MS", "0"),
                ("TRAINER_LAUNCHES", "2"),
            ],
            &["3", "2", "0", "0"],
        ))
        .unwrap();
    let mut builder = KillAfterFirstBackward {
        builder: SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default()),
        pid,
        killer: None,
    };
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(60)))
        .unwrap();
    builder
        .killer
        .take()
        .expect("a backward pass")
        .join()
        .unwrap();
    let builder = builder.builder;
    let log = builder.into_exporter();
    let step = log.named(names::STEP).next().expect("the open step");
    assert!(step.truncated(), "{step:?}");
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(job.status, SpanStatus::Error("killed by signal 9".into()));
    assert_eq!(session.kernel_state(), NOTHING_LEFT);
}

/// The span builder, and a SIGKILL for `pid` 300 ms after its first backward pass.
struct KillAfterFirstBackward {
    builder: SpanBuilder<SpanLog>,
    pid: u32,
    killer: Option<std::thread::JoinHandle<()>>,
}

impl KillAfterFirstBackward {
    fn process_start(&mut self, process: &ProcessInfo) {
        self.builder.on_process_start(process);
    }
    fn event(&mut self, event: &ProbeEvent) {
        self.builder.on_event(event);
        if let ProbeEvent::Phase {
            signal: PhaseSignal::BackwardEnd,
            ..
        } = event
            && self.killer.is_none()
        {
            let pid = self.pid;
            self.killer = Some(std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: plain kill(2) of the child the test started.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }));
        }
    }
    fn process_end(&mut self, end: &ProcessEnd) {
        self.builder.on_process_end(end);
    }
}

impl EventSink for KillAfterFirstBackward {
    fn on(&mut self, input: &SinkInput<'_>) {
        match *input {
            SinkInput::ProcessStart(process) => self.process_start(process),
            SinkInput::Event(event) => self.event(event),
            SinkInput::ProcessEnd(end) => self.process_end(end),
            _ => {}
        }
    }
}

#[test]
fn a_target_that_execs_another_trainer_gets_a_second_job() {
    if !lens_tests::require_bpf("a_target_that_execs_another_trainer") {
        return;
    }
    let trainer = lens_tests::torch_trainer();
    let (log, session) = {
        let mut session = session("per_step");
        session
            .exec(&torch_trainer(
                &[("TRAINER_EXEC", trainer.to_str().unwrap())],
                &["3", "1", "0", "0"],
            ))
            .unwrap();
        let mut builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
        session
            .run_blocking(&mut builder, Some(Duration::from_secs(60)))
            .unwrap();
        (builder.into_exporter(), session)
    };
    // Same pid, two programs: 3 steps, then (after the exec) 2, each job with its own
    // iterations; the first job ends at the exec, truncated (its program never returns).
    let jobs: Vec<_> = log.named(names::JOB).collect();
    assert_eq!(jobs.len(), 2, "{}", log.outline(&[semconv::DL_ITERATION]));
    assert!(jobs[0].truncated());
    assert!(!jobs[1].truncated());
    assert_eq!(jobs[1].int_attr(semconv::PROCESS_EXIT_CODE), Some(0));
    for (job, steps) in jobs.iter().zip([3, 2]) {
        let iterations: Vec<i64> = log
            .children(job)
            .iter()
            .filter(|s| s.name == names::STEP)
            .map(|s| s.int_attr(semconv::DL_ITERATION).unwrap())
            .collect();
        assert_eq!(iterations, (0..steps).collect::<Vec<i64>>());
    }
    assert_eq!(session.kernel_state(), NOTHING_LEFT);
}

#[test]
fn a_hundred_children_are_each_traced_and_forgotten() {
    if !lens_tests::require_bpf("a_hundred_children_are_each_traced") {
        return;
    }
    let script = format!(
        "for i in $(seq 100); do {} 1 >/dev/null & done; wait",
        lens_tests::trainer().display()
    );
    let mut session = session("per_step");
    session
        .exec(&["sh".into(), "-c".into(), script.into()])
        .unwrap();
    let mut log = EventLog::default();
    let report = session
        .run_blocking(&mut log, Some(Duration::from_secs(120)))
        .unwrap();
    let trainers: Vec<&ProcessEnd> = log
        .ended
        .iter()
        .filter(|end| end.calls.contains_key(&ProbeId::NcclAllReduce))
        .collect();
    assert_eq!(trainers.len(), 100);
    for end in &trainers {
        assert_eq!(end.exit, Some(ExitStatus::Exited(0)), "{end:?}");
        // One step: 10 kernel launches, one of each collective.
        assert_eq!(end.calls[&ProbeId::CudaLaunchKernel], 10, "{end:?}");
        assert_eq!(end.calls[&ProbeId::NcclAllReduce], 1, "{end:?}");
    }
    let pids: BTreeSet<u32> = trainers.iter().map(|e| e.pid).collect();
    assert_eq!(pids.len(), 100);
    assert_eq!(report.losses.kernel.values().sum::<u64>(), 0);
    assert_eq!(session.kernel_state(), NOTHING_LEFT);
}

/// The span builder, watched: the most per-thread phase states it held at any time.
struct Watched {
    builder: SpanBuilder<SpanLog>,
    pid: u32,
    most_thread_states: usize,
}

impl Watched {
    fn process_start(&mut self, process: &ProcessInfo) {
        self.builder.on_process_start(process);
    }
    fn process_exec(&mut self, process: &ProcessInfo) {
        self.builder.on_process_exec(process);
    }
    fn event(&mut self, event: &ProbeEvent) {
        self.builder.on_event(event);
        self.most_thread_states = self
            .most_thread_states
            .max(self.builder.thread_states(self.pid));
    }
    fn process_end(&mut self, end: &ProcessEnd) {
        self.builder.on_process_end(end);
    }
}

impl EventSink for Watched {
    fn on(&mut self, input: &SinkInput<'_>) {
        match *input {
            SinkInput::ProcessStart(process) => self.process_start(process),
            SinkInput::ProcessExec(process) => self.process_exec(process),
            SinkInput::Event(event) => self.event(event),
            SinkInput::ProcessEnd(end) => self.process_end(end),
            _ => {}
        }
    }
}

#[test]
fn threads_made_and_ended_every_step_leave_no_state_behind() {
    if !lens_tests::require_bpf("threads_made_and_ended_every_step") {
        return;
    }
    let steps = 50;
    let mut session = session("per_step");
    let pid = session
        .exec(&torch_trainer(
            &[
                ("TRAINER_STEP_THREAD", "1"),
                ("TRAINER_FORWARD_MS", "0"),
                ("LENS_FAKE_BACKWARD_MS", "0"),
            ],
            &[&steps.to_string(), "1", "0", "0"],
        ))
        .unwrap();
    let mut watched = Watched {
        builder: SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default()),
        pid,
        most_thread_states: 0,
    };
    session
        .run_blocking(&mut watched, Some(Duration::from_secs(60)))
        .unwrap();
    let log = watched.builder.into_exporter();
    assert_eq!(log.named(names::STEP).count(), steps);
    // Each helper's collective is a span; 50 helper threads came and went, the state
    // kept stayed at the loop thread (plus at most the helper of the moment).
    assert_eq!(log.named("nccl.all_reduce").count(), steps);
    assert!(
        watched.most_thread_states <= 2,
        "{} thread states",
        watched.most_thread_states
    );
    assert_eq!(session.kernel_state(), NOTHING_LEFT);
}

/// Program ids of the BPF programs `pid` holds (its `bpf-prog` descriptors).
fn programs_held_by(pid: u32) -> BTreeSet<u32> {
    let mut ids = BTreeSet::new();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return ids;
    };
    for fd in fds.flatten() {
        if let Ok(info) = std::fs::read_to_string(fd.path()) {
            ids.extend(
                info.lines()
                    .filter_map(|l| l.strip_prefix("prog_id:"))
                    .filter_map(|v| v.trim().parse::<u32>().ok()),
            );
        }
    }
    ids
}

/// Uprobe attachments `pid` holds: bpf links (uprobe_multi) and perf events.
fn attachments_held_by(pid: u32) -> usize {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    fds.flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter(|target| {
            let target = target.to_string_lossy();
            target == "anon_inode:bpf_link" || target == "anon_inode:[perf_event]"
        })
        .count()
}

fn loaded_program_ids() -> BTreeSet<u32> {
    aya::programs::loaded_programs()
        .filter_map(|p| p.ok())
        .map(|p| p.id())
        .collect()
}

fn state_of(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

#[test]
fn a_probe_killed_with_sigkill_leaves_the_target_running_and_no_probe_behind() {
    if !lens_tests::require_bpf("a_probe_killed_with_sigkill") {
        return;
    }
    let _serial = serial();
    // A trainer held at a gate file until lens-probe has been killed, so that neither a
    // slow start-up nor a quick trainer decides the outcome; it then runs 60 steps
    // through the libraries lens-probe had probed.
    let scratch = std::env::temp_dir().join(format!("lens-sigkill-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let gate = scratch.join("go");
    let _ = std::fs::remove_file(&gate);
    let trainer = Command::new(lens_tests::trainer())
        .arg("60")
        .env("TRAINER_START_GATE", &gate)
        .env("TRAINER_STEP_DELAY_MS", "10")
        .env("LENS_FAKE_SYNC_MS", "0")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let probe_log = scratch.join("probe.log");
    let mut probe = Command::new(LENS_PROBE)
        .args([
            "--span-groups",
            "per_step",
            "--pid",
            &trainer.id().to_string(),
        ])
        .stderr(std::fs::File::create(&probe_log).unwrap())
        .spawn()
        .unwrap();
    // Killed once it holds programs and attachments (start-up takes longer when the
    // machine is busy, so the deadline only catches a hang).
    let deadline = Instant::now() + Duration::from_secs(100);
    while programs_held_by(probe.id()).is_empty() || attachments_held_by(probe.id()) == 0 {
        if let Some(status) = probe.try_wait().unwrap() {
            panic!(
                "lens-probe exited ({status}) before attaching: {}",
                std::fs::read_to_string(&probe_log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "lens-probe never attached");
        std::thread::sleep(Duration::from_millis(50));
    }
    let held = programs_held_by(probe.id());
    probe.kill().unwrap();
    probe.wait().unwrap();
    // The kernel tears the uprobes down when the last descriptor closes.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !loaded_program_ids().is_disjoint(&held) {
        assert!(Instant::now() < deadline, "programs {held:?} still loaded");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::write(&gate, b"").unwrap();
    let output = trainer.wait_with_output().unwrap();
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "trainer: 60 steps done\n"
    );
    let _ = std::fs::remove_dir_all(&scratch);
}

#[test]
fn a_stopped_target_is_continued_when_the_probe_dies() {
    if !lens_tests::require_bpf("a_stopped_target_is_continued") {
        return;
    }
    let _serial = serial();
    // lens-probe stops a target at a library load until it has attached; should it die
    // meanwhile, its guardian continues the target. Simulated: the target is stopped by
    // hand, then lens-probe is killed.
    let mut probe = Command::new(LENS_PROBE)
        .args(["--span-groups", "per_step", "--exec", "--"])
        .arg(lens_tests::trainer())
        .arg("3")
        .env("TRAINER_START_DELAY_MS", "1500")
        .env("LENS_FAKE_SYNC_MS", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let probe_pid = probe.id();
    // The trainer: the child of lens-probe running the trainer's executable (the other
    // child, the guardian, runs lens-probe's).
    let trainer_exe = std::fs::canonicalize(lens_tests::trainer()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let trainer = loop {
        let found = std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let parent: u32 = stat[stat.rfind(')')? + 1..]
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
            (parent == probe_pid && exe == trainer_exe).then_some(pid)
        });
        if let Some(pid) = found {
            break pid;
        }
        assert!(Instant::now() < deadline, "no trainer under lens-probe");
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: plain signals to processes this test started.
    unsafe {
        libc::kill(trainer as i32, libc::SIGSTOP);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while state_of(trainer) != Some('T') {
        assert!(Instant::now() < deadline, "trainer never stopped");
        std::thread::sleep(Duration::from_millis(10));
    }
    probe.kill().unwrap();
    probe.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while state_of(trainer) == Some('T') {
        assert!(
            Instant::now() < deadline,
            "the trainer stays stopped after lens-probe died"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // It runs to the end (its stdout is ours through the pipe lens-probe passed on).
    let mut out = String::new();
    use std::io::Read;
    probe
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert_eq!(out, "trainer: 3 steps done\n");
}

#[test]
fn sigterm_flushes_and_exits_0_within_5_s() {
    if !lens_tests::require_bpf("sigterm_flushes_and_exits_0_within_5_s") {
        return;
    }
    let _serial = serial();
    // It stops lens-probe 1.5 s in: another run's teardown must not slow its attach.
    wait_for_teardown();
    let dir = std::env::temp_dir().join(format!("lens-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spans = dir.join("spans.jsonl");
    let mut trainer = Command::new(lens_tests::torch_trainer())
        .args(["200", "1", "0", "0"])
        .env("TRAINER_START_DELAY_MS", "300")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut probe = Command::new(LENS_PROBE)
        .args([
            "--span-groups",
            "per_step",
            "--exporter",
            "file",
            "--export-file",
        ])
        .arg(&spans)
        .args(["--pid", &trainer.id().to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Stopped a second after it says it traces (not at a fixed time from its start: a
    // loaded machine can still be attaching then), steps run since.
    let (lines, stderr) = std::sync::mpsc::channel::<String>();
    let reader = std::io::BufReader::new(probe.stderr.take().unwrap());
    let collect = std::thread::spawn(move || {
        let mut all = String::new();
        for line in std::io::BufRead::lines(reader).map_while(Result::ok) {
            all.push_str(&line);
            all.push('\n');
            let _ = lines.send(line);
        }
        all
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Ok(line) = stderr.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if line.contains("tracing 1 process") {
            break;
        }
    }
    std::thread::sleep(Duration::from_millis(1000));
    // SAFETY: plain kill(2) of our child.
    unsafe { libc::kill(probe.id() as i32, libc::SIGTERM) };
    let sent = Instant::now();
    let status = probe.wait().unwrap();
    let took = sent.elapsed();
    let said = collect.join().unwrap();
    assert_eq!(status.code(), Some(0), "{said}");
    assert!(took < Duration::from_secs(5), "{took:?}\n{said}");
    // Whole steps were seen and written before the exit.
    let exported = lens_tests::otlp_file_spans(&spans);
    assert!(
        exported.iter().any(|(_, span)| span["name"] == names::STEP),
        "{} spans",
        exported.len()
    );
    trainer.kill().unwrap();
    trainer.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_probe_restarted_while_the_job_runs_resumes_at_the_next_step() {
    if !lens_tests::require_bpf("a_probe_restarted_while_the_job_runs") {
        return;
    }
    let _serial = serial();
    // 1200 steps of ~25 ms (~30 s). The first lens-probe is killed after 1 s; the kernel
    // takes its uprobes out one by one (~0.1 s each, serialised with new attachments, and
    // slower on a loaded machine: a 400-step run was over before they were), so the
    // second one (loaded before) attaches once they are gone, and sees whole steps from
    // its first boundary on.
    let mut second = session("per_step");
    let mut trainer = Command::new(lens_tests::torch_trainer())
        .args(["1200", "1", "0", "0"])
        .env("TRAINER_FORWARD_MS", "20")
        .env("LENS_FAKE_BACKWARD_MS", "5")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = trainer.id();
    // Its libraries loaded (on a loaded machine that can take seconds), not a fixed wait.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .contains("libtorch_cpu.so")
    {
        assert!(
            Instant::now() < deadline,
            "trainer_torch never loaded libtorch_cpu"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut first = Command::new(LENS_PROBE)
        .args(["--span-groups", "per_step", "--pid", &pid.to_string()])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let held = programs_held_by(first.id());
    first.kill().unwrap();
    first.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !loaded_program_ids().is_disjoint(&held) {
        assert!(Instant::now() < deadline, "programs {held:?} still loaded");
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Err(error) = second.attach_pid(pid) {
        panic!(
            "{error}: {:?}\n{}",
            std::fs::read_to_string(format!("/proc/{pid}/stat")),
            std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default()
        );
    }
    let mut builder = SpanBuilder::new("per_step".parse().unwrap(), SpanLog::default());
    second
        .run_blocking(&mut builder, Some(Duration::from_secs(120)))
        .unwrap();
    assert!(trainer.wait().unwrap().success());
    let log = builder.into_exporter();
    let steps: Vec<_> = log.named(names::STEP).collect();
    assert!(steps.len() >= 10, "{} steps", steps.len());
    assert!(steps.iter().all(|s| !s.truncated()));
    let iterations: Vec<i64> = steps
        .iter()
        .map(|s| s.int_attr(semconv::DL_ITERATION).unwrap())
        .collect();
    assert_eq!(iterations, (0..steps.len() as i64).collect::<Vec<_>>());
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(
        job.attr(semconv::NEMO_ATTACHED_MID_RUN)
            .map(|v| v.to_string()),
        Some("true".into())
    );
}

#[test]
fn a_burst_beyond_the_ring_buffer_is_counted_as_lost_never_hidden() {
    if !lens_tests::require_bpf("a_burst_beyond_the_ring_buffer") {
        return;
    }
    let _serial = serial();
    // 300 000 all-reduce calls (one event each) while lens-probe's reader is stopped for
    // 2 s: the 4 MiB ring buffer holds ~23 000 events, the rest must be counted lost.
    let calls = 300_000u64;
    let dir = std::env::temp_dir().join(format!("lens-burst-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let summary = dir.join("summary.json");
    let probe = Command::new(LENS_PROBE)
        .args([
            "--span-groups",
            "per_step",
            "--exporter",
            "file",
            "--export-file",
        ])
        .arg(dir.join("spans.jsonl"))
        .arg("--summary-json")
        .arg(&summary)
        .args(["--exec", "--"])
        .arg(lens_tests::hammer())
        .args(["collective", &calls.to_string()])
        .env("HAMMER_START_DELAY_MS", "1500")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once the hammer was let go after its libraries were attached (it sleeps before its
    // loop), lens-probe is stopped until the hammer's whole loop is done: its events fill
    // the ring buffer meanwhile, however slowly a busy machine runs the loop. (A target is
    // never held at a library load while lens-probe is stopped.)
    let hammer_exe = std::fs::canonicalize(lens_tests::hammer()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let hammer = loop {
        let sleeping = std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            (std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == hammer_exe)
                && std::fs::read_to_string(format!("/proc/{pid}/maps"))
                    .is_ok_and(|maps| maps.contains("libnccl"))
                && state_of(pid) == Some('S'))
            .then_some(pid)
        });
        if let Some(pid) = sleeping {
            break pid;
        }
        assert!(
            Instant::now() < deadline,
            "the hammer never started its pause"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // SAFETY: plain signals to our child.
    unsafe { libc::kill(probe.id() as i32, libc::SIGSTOP) };
    // Its parent (lens-probe) is stopped: the hammer stays a zombie once its loop is done.
    let deadline = Instant::now() + Duration::from_secs(300);
    while !matches!(state_of(hammer), Some('Z') | None) {
        assert!(
            Instant::now() < deadline,
            "the hammer never finished its loop"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(probe.id() as i32, libc::SIGCONT) };
    let output = probe.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{err}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    let lost = json["losses"]["kernel"]["ring_buffer_full"]
        .as_u64()
        .unwrap();
    assert!(lost > 0, "{json}");
    // Every call counted in the kernel; every event either received or counted lost.
    let hammer = json["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["calls"]["ncclAllReduce"].as_u64().is_some())
        .unwrap_or_else(|| panic!("{json}"));
    assert_eq!(hammer["calls"]["ncclAllReduce"].as_u64(), Some(calls));
    let received = hammer["collectives"]["all_reduce"]["calls"]
        .as_u64()
        .unwrap();
    // The lost count is over all events: a few others (processes' exit reports) may have
    // met the full ring too.
    assert!(received + lost >= calls, "{hammer}");
    assert!(received + lost <= calls + 4, "{hammer}");
    // Said at exit in words too.
    assert!(err.contains("events lost (ring_buffer_full "), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits until no lens-probe process of this test binary's is left: the one that lets
/// an ended run's probes go (the kernel takes ~0.1 s per uprobe) would slow the next
/// test's attaching.
fn wait_for_teardown() {
    wait_for_no_lens_probe();
}

/// Waits for it at the end of a test, even one that fails.
struct TeardownAfter;

impl Drop for TeardownAfter {
    fn drop(&mut self) {
        wait_for_no_lens_probe();
    }
}

fn wait_for_no_lens_probe() {
    // By name: an exiting process lets its descriptors (the probes) go after its memory,
    // and with it the link behind /proc/PID/exe.
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let running = std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .is_ok_and(|comm| comm.trim() == "lens-probe")
        });
        if !running {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn sigint_during_a_long_attach_stops_within_seconds() {
    if !lens_tests::require_bpf("sigint_during_a_long_attach_stops_within_seconds") {
        return;
    }
    let Some(venv) = lens_tests::torch_venv("sigint_during_a_long_attach_stops_within_seconds")
    else {
        return;
    };
    let _serial = serial();
    // Another run's teardown (the kernel's removal of its probes) slows every attach.
    wait_for_teardown();
    let _teardown = TeardownAfter;
    // A rule matching 4096 functions of libtorch_cpu: ~8192 uprobes, minutes to attach as
    // perf links (what a kernel without uprobe_multi links gets; with them it is one link
    // per program, in about a second, too short a window to aim a signal at).
    let dir = std::env::temp_dir().join(format!("lens-long-attach-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("rules.toml");
    std::fs::write(
        &config,
        "[[probe]]\nlibrary = \"libtorch_cpu.so\"\nsymbol = \"_ZN*\"\ngroup = \"step\"\n\
         max_matches = 4096\nnoexcept = true\n",
    )
    .unwrap();
    let mut probe = Command::new(LENS_PROBE)
        .args([
            "-v",
            "--uprobe-links",
            "perf",
            "--span-groups",
            "per_step",
            "--config",
        ])
        .arg(&config)
        .args(["--exec", "--"])
        .arg(&venv.python)
        .args(["-c", "import torch, time; time.sleep(120)"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until it attaches to libtorch_cpu (the rule's library), then stop it.
    let stderr = probe.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("libtorch_cpu.so: attaching") {
                let _ = tx.send(None);
            }
            lines.push(line);
        }
        let _ = tx.send(Some(lines));
    });
    let attaching = rx.recv_timeout(Duration::from_secs(120));
    assert!(
        matches!(attaching, Ok(None)),
        "lens-probe never attached to libtorch_cpu: {attaching:?}"
    );
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: plain kill(2) of our child.
    unsafe { libc::kill(probe.id() as i32, libc::SIGINT) };
    let sent = Instant::now();
    let status = probe.wait().unwrap();
    let took = sent.elapsed();
    let lines = rx
        .recv_timeout(Duration::from_secs(10))
        .ok()
        .flatten()
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    // Attaching all of them takes minutes (169 s measured); stopping, a few seconds at
    // most even on a loaded machine (the kernel's removal of the probes that were in
    // happens after lens-probe is gone).
    assert!(
        took < Duration::from_secs(15),
        "SIGINT took {took:?} to stop lens-probe:\n{}",
        lines.join("\n")
    );
    // The command's own code goes through (python interrupted by the SIGINT passed on).
    assert!(
        matches!(status.code(), Some(1 | 130)),
        "{status:?}\n{}",
        lines.join("\n")
    );
    wait_for_teardown();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("stopping:") && l.contains("were not probed")),
        "no line saying what was not probed:\n{}",
        lines.join("\n")
    );
}

#[test]
fn a_target_held_at_a_library_load_goes_on_within_a_second_while_lens_probe_is_stopped() {
    if !lens_tests::require_bpf("a_target_held_at_a_library_load_goes_on") {
        return;
    }
    let _serial = serial();
    wait_for_teardown();
    let _teardown = TeardownAfter;
    // A single-threaded target (stopped at each library load until lens-probe attached)
    // that says it is ready, then loads a library when told to. lens-probe is SIGSTOPped
    // between the two: by the target's word, not after a guessed delay (`python3` may be
    // a pyenv shim whose dozen processes take seconds to start on a loaded machine).
    let script = "import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n\
                  import ctypes\nprint('loaded', flush=True)\n";
    let mut probe = Command::new(LENS_PROBE)
        .args([
            "--span-groups",
            "per_step",
            "--exec",
            "--",
            "python3",
            "-c",
            script,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = probe.stdin.take().unwrap();
    let stdout = probe.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send((line, Instant::now()));
        }
    });
    let ready = rx.recv_timeout(Duration::from_secs(120));
    // SAFETY: plain signals to our child.
    unsafe { libc::kill(probe.id() as i32, libc::SIGSTOP) };
    let stopped_at = Instant::now();
    use std::io::Write;
    let told = stdin.write_all(b"go\n").and_then(|()| stdin.flush());
    let loaded = rx.recv_timeout(Duration::from_secs(20));
    // SAFETY: as above.
    unsafe { libc::kill(probe.id() as i32, libc::SIGCONT) };
    let held = stopped_at.elapsed();
    drop(stdin);
    let output = probe.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        ready.map(|(line, _)| line).ok().as_deref(),
        Some("ready"),
        "the target never started:\n{stderr}"
    );
    told.unwrap();
    let (line, at) = loaded.unwrap_or_else(|_| {
        panic!("the target never went on while lens-probe was stopped:\n{stderr}")
    });
    assert_eq!(line, "loaded");
    // The guardian lets the load go ≤ 0.5 s after it (its check every 0.1 s), so long
    // before lens-probe was continued (20 s would be the old behaviour: as long as
    // lens-probe stays stopped). 6 s leaves a loaded machine room for the import itself.
    let waited = at.duration_since(stopped_at);
    assert!(
        waited < Duration::from_secs(6),
        "the target went on {waited:?} after it was told to load, lens-probe held {held:?}:\n{stderr}"
    );
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("attached late"),
        "the late attach is not reported:\n{stderr}"
    );
    // And counted in the exit summary.
    assert!(
        stderr.contains("library loads attached late"),
        "the late attaches are not counted at exit:\n{stderr}"
    );
    wait_for_teardown();
}
