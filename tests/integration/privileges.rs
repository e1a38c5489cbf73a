//! Privilege (issue 7, item 5): the capabilities lens-probe needs, those it drops after
//! attaching, and what it reads from a target (an allow-list; secrets never exported).
//!
//! The runs without root go through util-linux's `setpriv`: another uid, and exactly the
//! capabilities named (inheritable and ambient, so that they survive the exec of
//! lens-probe). lens-probe and the fixtures are staged in a world-readable directory so
//! that those uids can run them. Switching uids needs root: these tests run where the BPF
//! tests run. That a library is read through `/proc/PID/map_files`, never through the path
//! lens-probe sees, is `the_mapped_inode_is_probed_not_what_the_maps_path_names_here` in
//! `node.rs`.
use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use lens_probe::sys::privileges::{
    CAP_BPF, CAP_DAC_READ_SEARCH, CAP_PERFMON, CAP_SYS_ADMIN, CAP_SYS_PTRACE, Capability,
    status_mask,
};

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");
/// The uid lens-probe runs as without root (`nobody`), and the uid of "another user"'s
/// training job. Neither needs an entry in /etc/passwd.
const PROBE_UID: u32 = 65534;
const OTHER_UID: u32 = 65531;

const EXACT: [Capability; 3] = [CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN];

/// `setpriv`'s spelling of a capability (`CAP_SYS_ADMIN` → `sys_admin`).
fn setpriv_name(cap: Capability) -> String {
    cap.name.trim_start_matches("CAP_").to_ascii_lowercase()
}

/// lens-probe and the fixtures, copied where any uid can read and run them: the build
/// tree may be under a private home. Fixtures find their libraries through RUNPATH
/// `$ORIGIN`, so the whole directory is copied.
struct Staged {
    lens_probe: PathBuf,
    fixtures: PathBuf,
    /// Writable by every uid (pid and export files).
    out: PathBuf,
}

fn staged() -> &'static Staged {
    static STAGED: OnceLock<Staged> = OnceLock::new();
    STAGED.get_or_init(|| {
        let root = std::env::temp_dir();
        // Leftovers of earlier runs whose process is gone.
        for entry in fs::read_dir(&root).unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("lens-privileges-")
                && !Path::new(&format!("/proc/{pid}")).exists()
            {
                let _ = fs::remove_dir_all(entry.path());
            }
        }
        let dir = root.join(format!("lens-privileges-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let lens_probe = dir.join("lens-probe");
        // The binary is large: a link where it can be (its own mode is 0755).
        if fs::hard_link(LENS_PROBE, &lens_probe).is_err() {
            fs::copy(LENS_PROBE, &lens_probe).unwrap();
        }
        let fixtures = dir.join("fixtures");
        let copied = Command::new("cp")
            .arg("-a")
            .arg(lens_tests::fixtures_dir())
            .arg(&fixtures)
            .status()
            .unwrap();
        assert!(copied.success());
        let readable = Command::new("chmod")
            .args(["-R", "a+rX"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(readable.success());
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        let out = dir.join("out");
        fs::create_dir(&out).unwrap();
        fs::set_permissions(&out, fs::Permissions::from_mode(0o1777)).unwrap();
        Staged {
            lens_probe,
            fixtures,
            out,
        }
    })
}

/// A command run as `uid` with exactly `caps` (none: an ordinary user).
fn as_user(uid: u32, caps: &[Capability], program: &Path) -> Command {
    let list: String = caps
        .iter()
        .map(|cap| format!(",+{}", setpriv_name(*cap)))
        .collect();
    let mut command = Command::new("setpriv");
    command
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .arg(format!("--inh-caps=-all{list}"))
        .arg(format!("--ambient-caps=-all{list}"))
        .arg(format!("--bounding-set=-all{list}"))
        .arg(program);
    command
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs lens-probe as `PROBE_UID` with `caps`, with a time limit.
fn probe_as_user(caps: &[Capability], args: &[&str]) -> Output {
    let mut command = as_user(PROBE_UID, caps, &staged().lens_probe);
    command.arg("--span-groups").arg("per_step").args(args);
    run_with_limit(command, Duration::from_secs(120))
}

fn run_with_limit(mut command: Command, limit: Duration) -> Output {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let watchdog = std::thread::spawn(move || {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // SAFETY: a signal to our own child, still running past its limit.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    });
    let output = child.wait_with_output().unwrap();
    let _ = watchdog.join();
    output
}

/// A fake training job of `uid`, waiting `start_delay_ms` before its first call, then
/// `steps` steps 100 ms apart.
fn trainer_as(uid: u32, start_delay_ms: u64, steps: u32) -> Child {
    let mut command = as_user(uid, &[], &staged().fixtures.join("trainer"));
    command
        .arg(steps.to_string())
        .env("TRAINER_START_DELAY_MS", start_delay_ms.to_string())
        .env("TRAINER_STEP_DELAY_MS", "100")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command.spawn().unwrap()
}

fn assert_traced(output: &Output) {
    let text = stderr(output);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(
        text.contains("launches: cudaLaunchKernel"),
        "no launches seen: {text}"
    );
    assert!(text.contains("all_reduce"), "no collectives seen: {text}");
    assert!(!text.contains("panicked"), "{text}");
}

/// Exit 1, one line naming `needle`, no panic.
fn assert_one_line_naming(output: &Output, needle: &str) {
    let text = stderr(output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert_eq!(text.lines().count(), 1, "not one line: {text:?}");
    assert!(text.starts_with("lens-probe: "), "{text}");
    assert!(text.contains(needle), "{needle:?} not in {text:?}");
}

#[test]
fn exactly_bpf_perfmon_and_sys_admin_trace_a_job_of_the_same_user() {
    if !lens_tests::require_bpf("exactly_bpf_perfmon_and_sys_admin_trace") {
        return;
    }
    let trainer = staged().fixtures.join("trainer");
    let trainer = trainer.to_str().unwrap();
    // --exec: the command runs as the same user, from its first instruction.
    let output = probe_as_user(&EXACT, &["--exec", "--", trainer, "3"]);
    assert_traced(&output);

    // --pid: a running job of the same user. Its first call waits long enough for the
    // attach, which queues behind the kernel's removal of other instances' uprobes
    // (~0.1 s each), so start on a quiet kernel.
    lens_tests::wait_for_lens_probe_teardown();
    let mut job = trainer_as(PROBE_UID, 4000, 20);
    let pid = job.id().to_string();
    let output = probe_as_user(&EXACT, &["--pid", &pid]);
    assert!(job.wait().unwrap().success());
    assert_traced(&output);
}

#[test]
fn without_one_of_the_three_it_says_which_in_one_line() {
    if !lens_tests::require_bpf("without_one_of_the_three_it_says_which") {
        return;
    }
    let trainer = staged().fixtures.join("trainer");
    for missing in EXACT {
        let caps: Vec<Capability> = EXACT.into_iter().filter(|c| *c != missing).collect();
        let output = probe_as_user(&caps, &["--exec", "--", trainer.to_str().unwrap(), "1"]);
        assert_one_line_naming(&output, &format!("missing {}:", missing.name));
        assert!(
            stderr(&output)
                .contains("needs root, or the capabilities CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN"),
            "{}",
            stderr(&output)
        );
    }
}

#[test]
fn another_users_job_needs_sys_ptrace_and_dac_read_search() {
    if !lens_tests::require_bpf("another_users_job_needs_sys_ptrace") {
        return;
    }
    // Refused up front, naming what is missing, rather than attached to nothing.
    let mut job = trainer_as(OTHER_UID, 60_000, 1);
    let pid = job.id().to_string();
    let output = probe_as_user(&EXACT, &["--pid", &pid]);
    assert_one_line_naming(&output, "missing CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH");
    let mut with_ptrace = EXACT.to_vec();
    with_ptrace.push(CAP_SYS_PTRACE);
    let output = probe_as_user(&with_ptrace, &["--pid", &pid]);
    assert_one_line_naming(&output, "missing CAP_DAC_READ_SEARCH");
    assert!(stderr(&output).contains(&format!("/proc/{pid}/")));
    let _ = job.kill();
    let _ = job.wait();

    // With both, it traces (on a quiet kernel, as above).
    lens_tests::wait_for_lens_probe_teardown();
    let mut job = trainer_as(OTHER_UID, 4000, 20);
    let pid = job.id().to_string();
    let mut all = with_ptrace;
    all.push(CAP_DAC_READ_SEARCH);
    let output = probe_as_user(&all, &["--pid", &pid]);
    assert!(job.wait().unwrap().success());
    assert_traced(&output);
}

/// Capability sets and flags of one thread, from its `status`.
#[derive(Debug)]
struct ThreadCaps {
    effective: u64,
    permitted: u64,
    inheritable: u64,
    bounding: u64,
    ambient: u64,
    no_new_privs: bool,
}

fn thread_caps(status: &str) -> ThreadCaps {
    ThreadCaps {
        effective: status_mask(status, "CapEff"),
        permitted: status_mask(status, "CapPrm"),
        inheritable: status_mask(status, "CapInh"),
        bounding: status_mask(status, "CapBnd"),
        ambient: status_mask(status, "CapAmb"),
        no_new_privs: status
            .lines()
            .any(|l| l.split_whitespace().eq(["NoNewPrivs:", "1"])),
    }
}

/// Every thread of `pid`, by tid.
fn threads_of(pid: u32) -> BTreeMap<u32, ThreadCaps> {
    let mut threads = BTreeMap::new();
    let Ok(entries) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return threads;
    };
    for entry in entries.flatten() {
        let tid: u32 = entry.file_name().to_str().unwrap().parse().unwrap();
        if let Ok(status) = fs::read_to_string(entry.path().join("status")) {
            threads.insert(tid, thread_caps(&status));
        }
    }
    threads
}

fn mask(caps: &[Capability]) -> u64 {
    caps.iter().map(|c| c.mask()).sum()
}

/// Runs lens-probe (as `uid` with `caps`, or as root) on `real_libs_caller`, which loads
/// the fake libraries 3 s after it starts, long after the attach: checks every thread's
/// capabilities once they dropped, and that the late libraries were still attached to.
fn check_drop(user: Option<(u32, &[Capability])>, kept: u64) {
    let staged = staged();
    let pid_file = staged
        .out
        .join(format!("pid-{}", user.map_or(0, |(uid, _)| uid)));
    let _ = fs::remove_file(&pid_file);
    let export_file = pid_file.with_extension("jsonl");
    let mut command = match user {
        Some((uid, caps)) => as_user(uid, caps, &staged.lens_probe),
        None => Command::new(&staged.lens_probe),
    };
    let lib = |name: &str| staged.fixtures.join(name);
    command
        .args(["--span-groups", "per_step", "--pid-file"])
        .arg(&pid_file)
        // The exporter runs threads of its own: they must drop too.
        .args(["--exporter", "file", "--export-file"])
        .arg(&export_file)
        .args(["--exec", "--"])
        .arg(lib("real_libs_caller"))
        .arg(lib("libcudart.so.12"))
        .arg(lib("libnccl.so.2"))
        .env("CALLER_START_DELAY_MS", "3000");
    let run = std::thread::spawn(move || run_with_limit(command, Duration::from_secs(120)));

    // Its pid, then the drop (all threads at most `kept`).
    let deadline = Instant::now() + Duration::from_secs(60);
    let pid: u32 = loop {
        if let Some(pid) = fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            break pid;
        }
        assert!(Instant::now() < deadline, "no pid file");
        std::thread::sleep(Duration::from_millis(20));
    };
    let threads = loop {
        let threads = threads_of(pid);
        let dropped = |t: &ThreadCaps| {
            t.permitted == kept && t.no_new_privs && t.inheritable == 0 && t.ambient == 0
        };
        if !threads.is_empty() && threads.values().all(dropped) {
            break threads;
        }
        assert!(
            Instant::now() < deadline,
            "capabilities not dropped: {threads:#x?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(threads.len() >= 2, "one thread only: {threads:?}");
    for (tid, caps) in &threads {
        assert_eq!(caps.effective, kept, "thread {tid}: {caps:#x?}");
        assert_eq!(caps.inheritable, 0, "thread {tid}: {caps:#x?}");
        assert_eq!(caps.ambient, 0, "thread {tid}: {caps:#x?}");
        if user.is_none() {
            // Root may clear its bounding set (CAP_SETPCAP).
            assert_eq!(caps.bounding, kept, "thread {tid}: {caps:#x?}");
        }
    }
    // The command it started keeps what it had: a root job stays root.
    let children: Vec<(u32, String)> =
        fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap()
            .split_whitespace()
            .filter_map(|c| c.parse::<u32>().ok())
            .filter_map(|c| Some((c, fs::read_to_string(format!("/proc/{c}/comm")).ok()?)))
            .collect();
    let caller = children
        .iter()
        .find(|(_, comm)| comm.starts_with("real_libs_call"))
        .map(|(c, _)| *c)
        .expect("the command is a child of lens-probe");
    // The guardian (which continues stopped targets if lens-probe dies) keeps CAP_KILL
    // at most.
    let guardian = children
        .iter()
        .find(|(_, comm)| comm.trim() == "lens-probe")
        .map(|(c, _)| *c)
        .expect("a guardian process");
    let guardian_caps =
        thread_caps(&fs::read_to_string(format!("/proc/{guardian}/status")).unwrap());
    let kill = lens_probe::sys::privileges::CAP_KILL.mask();
    assert_eq!(
        guardian_caps.permitted & !kill,
        0,
        "guardian: {guardian_caps:#x?}"
    );
    assert_eq!(guardian_caps.ambient | guardian_caps.inheritable, 0);
    assert!(guardian_caps.no_new_privs);
    let caller_caps = thread_caps(&fs::read_to_string(format!("/proc/{caller}/status")).unwrap());
    match user {
        None => assert_eq!(
            caller_caps.effective,
            status_mask(&fs::read_to_string("/proc/self/status").unwrap(), "CapEff"),
            "{caller_caps:#x?}"
        ),
        Some((_, caps)) => assert_eq!(caller_caps.effective, mask(caps), "{caller_caps:#x?}"),
    }

    let output = run.join().unwrap();
    let _ = fs::remove_file(&pid_file);
    let _ = fs::remove_file(&export_file);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(
        text.contains("launches: cudaLaunchKernel 1"),
        "the libraries loaded after the drop were not attached to: {text}"
    );
    assert!(!text.contains("cannot probe"), "{text}");
}

#[test]
fn after_attaching_every_thread_keeps_only_what_the_run_needs() {
    if !lens_tests::require_bpf("after_attaching_every_thread_keeps_only") {
        return;
    }
    // Root: everything but these five goes, the bounding set too.
    let kept = mask(&[
        CAP_BPF,
        CAP_PERFMON,
        CAP_SYS_ADMIN,
        CAP_SYS_PTRACE,
        CAP_DAC_READ_SEARCH,
    ]);
    check_drop(None, kept);
    // Exactly the three: they stay, the ambient and inheritable sets go.
    check_drop(Some((PROBE_UID, &EXACT)), mask(&EXACT));
}

#[test]
fn only_allow_listed_variables_are_read_and_secrets_are_never_exported() {
    if !lens_tests::require_bpf("only_allow_listed_variables_are_read") {
        return;
    }
    let export_file =
        std::env::temp_dir().join(format!("lens-privileges-env-{}.jsonl", std::process::id()));
    let output = run_with_limit(
        {
            let mut command = Command::new(LENS_PROBE);
            command
                .args([
                    "--span-groups",
                    "per_step",
                    "--export-strategy",
                    "all_ranks",
                ])
                .args(["--exporter", "file", "--export-file"])
                .arg(&export_file)
                .args(["--exec", "--"])
                .arg(lens_tests::trainer())
                .arg("2")
                .env("MY_API_TOKEN", "hunter2")
                .env("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI-hunter2")
                .env("OTEL_RESOURCE_ATTRIBUTES", "team=ml,db.password=hunter2")
                .env("FOO", "bar")
                .env("LENS_UNRELATED", "not-allow-listed-5b1c")
                .env("WANDB_PROJECT", "llm");
            command
        },
        Duration::from_secs(120),
    );
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(0), "{text}");
    let exported = fs::read_to_string(&export_file).unwrap();
    let spans = lens_tests::otlp_file_spans(&export_file);
    let _ = fs::remove_file(&export_file);
    assert!(!spans.is_empty(), "{text}");
    for needle in [
        "hunter2",
        "not-allow-listed-5b1c",
        "\"bar\"",
        "FOO",
        "password",
    ] {
        assert!(!exported.contains(needle), "{needle:?} was exported");
    }
    for (resource, _) in &spans {
        // The target's OTEL_RESOURCE_ATTRIBUTES, less the secret; an allow-listed variable.
        assert_eq!(resource["team"]["stringValue"], "ml", "{resource:?}");
        assert_eq!(resource["wandb.project"]["stringValue"], "llm");
        assert!(!resource.contains_key("db.password"), "{resource:?}");
    }
}
