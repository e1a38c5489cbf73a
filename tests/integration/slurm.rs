//! A real SLURM on this machine: Debian's slurm-wlm (munged, slurmctld, slurmd) started by
//! the test as a one-node cluster (`tests/slurm/slurm.conf.in`), with lens-probe's node
//! prolog and epilog (`observability/slurm/`) as its `Prolog=`/`Epilog=`. A batch job of
//! two tasks runs the fake PyTorch trainer; the prolog must have started one lens-probe for
//! the job on the node, whose spans carry the job's SLURM attributes and each task's rank,
//! and the epilog must have flushed and stopped it, leaving nothing of the job running.
//!
//! Needs root, BPF and `slurm-wlm` (`cargo xtask setup` installs it). Without them, or
//! when the cluster does not come up, the test prints `SKIP` and passes, except under
//! `CI=true`, where it fails (the rule of `lens_tests::require_bpf`).
use std::{
    collections::BTreeMap,
    fs,
    net::TcpListener,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use lens_tests::{FileSpan, otlp_file_spans};
use serde_json::Value;

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

const TEST: &str = "a_real_slurm_job_is_traced_by_the_prolog_and_stopped_by_the_epilog";

/// The cluster, partition and job names of `slurm.conf.in` and the job.
const CLUSTER: &str = "lenstest";
const PARTITION: &str = "lens";
const JOB_NAME: &str = "lens-slurm-test";

/// Steps each task of the job runs.
const STEPS: usize = 3;

/// What the test runs, from slurm-wlm and munge.
const PROGRAMS: [&str; 9] = [
    "munged",
    "mungekey",
    "munge",
    "slurmctld",
    "slurmd",
    "sbatch",
    "scontrol",
    "sinfo",
    "srun",
];

/// Generous: a loaded 2-core machine may start daemons and schedule slowly.
const CLUSTER_UP: Duration = Duration::from_secs(90);
const JOB_DEADLINE: Duration = Duration::from_secs(180);
const TEARDOWN: Duration = Duration::from_secs(60);

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative)
}

/// The skip rule of `lens_tests`: `SKIP <test>: <reason>` locally, a failure under CI.
fn skip(reason: &str) {
    lens_tests::skip(TEST, "SLURM", reason);
}

/// `name` on PATH or in the sbin directories (where Debian puts the daemons).
fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// This machine's name up to the first dot, as `hostname -s` (and slurmd) give it.
fn short_hostname() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length, which is passed.
    let rc = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) };
    assert_eq!(rc, 0, "gethostname: {}", std::io::Error::last_os_error());
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    let name = String::from_utf8_lossy(&buffer[..end]).into_owned();
    name.split('.').next().unwrap_or_default().to_string()
}

/// Two TCP ports free on this machine now (the kernel's pick), for slurmctld and slurmd.
fn free_ports() -> (u16, u16) {
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

// ---- processes

fn pids() -> Vec<u32> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .collect()
}

/// The state letter of /proc/PID/stat (`Z`: exited, unreaped), None when gone.
fn process_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

fn running(pid: u32) -> bool {
    process_state(pid).is_some_and(|s| s != 'Z')
}

/// The command line, arguments separated (and ended) by spaces.
fn cmdline(pid: u32) -> String {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| {
            c.split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| format!("{} ", String::from_utf8_lossy(a)))
                .collect()
        })
        .unwrap_or_default()
}

/// The parent's pid (`PPid:` of /proc/PID/status).
fn parent(pid: u32) -> Option<u32> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))?
        .trim()
        .parse()
        .ok()
}

fn comm(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_default()
}

/// Whether the process's environment has exactly `entry` (`KEY=VALUE`).
fn environ_has(pid: u32, entry: &str) -> bool {
    fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|e| e.split(|&b| b == 0).any(|v| v == entry.as_bytes()))
}

/// The running processes of SLURM job `job` on this node: its slurmstepds, whatever
/// inherited its `SLURM_JOB_ID` (the batch script, srun, the tasks), and a lens-probe
/// started for it. As `pid comm: command line`.
fn job_processes(job: &str) -> Vec<String> {
    let env_entry = format!("SLURM_JOB_ID={job}");
    let stepd = format!("slurmstepd: [{job}.");
    pids()
        .into_iter()
        .filter(|&pid| pid != std::process::id() && running(pid))
        .filter(|&pid| {
            let line = cmdline(pid);
            line.starts_with(&stepd)
                || environ_has(pid, &env_entry)
                || (comm(pid) == "lens-probe" && line.contains(&format!("{env_entry} ")))
        })
        .map(|pid| format!("{pid} {}: {}", comm(pid), cmdline(pid)))
        .collect()
}

/// SIGTERM, then SIGKILL if it is still there after `grace`; reaps it.
fn stop_child(child: &mut Child, grace: Duration) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    // SAFETY: kill(2) of a child this test started and has not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let start = Instant::now();
    while start.elapsed() < grace {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn wait_for(
    what: &str,
    timeout: Duration,
    diagnostics: impl Fn() -> String,
    mut done: impl FnMut() -> bool,
) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}\n{}",
            diagnostics()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A new cgroup in the cgroup v2 hierarchy (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified`
/// on a hybrid host), when this process may create one.
fn new_cgroup(name: &str) -> Option<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let root = mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mount_point = left.split_whitespace().nth(4)?;
        (right.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount_point))
    })?;
    let cgroup = root.join(name);
    fs::create_dir(&cgroup).ok()?;
    if cgroup.join("cgroup.procs").exists() {
        Some(cgroup)
    } else {
        let _ = fs::remove_dir(&cgroup);
        None
    }
}

/// The processes of a cgroup (`cgroup.procs`), exiting ones included.
fn cgroup_procs(cgroup: &Path) -> Vec<u32> {
    fs::read_to_string(cgroup.join("cgroup.procs"))
        .map(|procs| {
            procs
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

// ---- the cluster

/// A one-node SLURM cluster in a scratch directory: munged, slurmctld and slurmd run as
/// this test's children. Dropping it stops them and kills whatever of theirs is left
/// (slurmstepd, job processes, a lens-probe started by the prolog), so nothing outlives
/// the test, passed or failed. The directory is removed, or kept (and named) on failure.
struct Cluster {
    dir: PathBuf,
    host: String,
    /// `SLURM_CONF=<dir>/slurm.conf`: every process of this cluster has it in its
    /// environment (the daemons, slurmstepd, the prolog and epilog, the job's processes).
    conf_entry: String,
    munged: Option<Child>,
    slurmctld: Option<Child>,
    slurmd: Option<Child>,
    /// slurmd's own cgroup (v2), where everything it starts stays, exiting or not; None
    /// where none can be made (the end check then sees only the named processes).
    cgroup: Option<PathBuf>,
}

impl Cluster {
    /// Starts the cluster and waits for the node to be idle. Err: why it did not come up.
    fn start(dir: PathBuf) -> Result<Cluster, String> {
        let host = short_hostname();
        if host.is_empty() {
            return Err("this machine has no host name".into());
        }
        let conf = dir.join("slurm.conf");
        let mut cluster = Cluster {
            conf_entry: format!("SLURM_CONF={}", conf.display()),
            dir,
            host,
            munged: None,
            slurmctld: None,
            slurmd: None,
            cgroup: None,
        };
        cluster.write_files()?;
        cluster.start_munged()?;
        // Standard output and error of a daemon (what it says before its log file is open).
        let log = |name: &str| -> Result<(Stdio, Stdio), String> {
            let file = fs::File::create(cluster.dir.join("log").join(name))
                .map_err(|e| format!("cannot create {name}: {e}"))?;
            let copy = file.try_clone().map_err(|e| format!("{name}: {e}"))?;
            Ok((Stdio::from(file), Stdio::from(copy)))
        };
        let (stdout, stderr) = log("slurmctld.out")?;
        let slurmctld = cluster
            .command("slurmctld")
            .args(["-D", "-i"])
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("cannot start slurmctld: {e}"))?;
        cluster.slurmctld = Some(slurmctld);
        // slurmd enters its cgroup before it starts (sh moves itself there, then execs).
        let name = cluster
            .dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        cluster.cgroup = new_cgroup(&name);
        let procs = match &cluster.cgroup {
            Some(cgroup) => cgroup.join("cgroup.procs").display().to_string(),
            None => "/dev/null".to_string(),
        };
        let slurmd_path = find_program("slurmd").ok_or("no slurmd")?;
        let (stdout, stderr) = log("slurmd.out")?;
        let slurmd = cluster
            .command("sh")
            .args(["-c", "echo $$ > \"$0\" && exec \"$@\"", &procs])
            .arg(slurmd_path)
            .args(["-D", "-N", &cluster.host])
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("cannot start slurmd: {e}"))?;
        cluster.slurmd = Some(slurmd);

        // The controller answers, and the node has registered and is idle.
        let start = Instant::now();
        loop {
            let exited = [
                ("slurmctld", &mut cluster.slurmctld),
                ("slurmd", &mut cluster.slurmd),
            ]
            .into_iter()
            .find_map(|(name, child)| match child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(format!("{name} exited ({status})")),
                _ => None,
            });
            if let Some(exited) = exited {
                return Err(format!("{exited}\n{}", cluster.logs()));
            }
            let state = cluster
                .run("sinfo", &["-h", "-n", &cluster.host, "-o", "%t"])
                .unwrap_or_default();
            if state.trim() == "idle" {
                return Ok(cluster);
            }
            if start.elapsed() > CLUSTER_UP {
                return Err(format!(
                    "node {} not idle after {CLUSTER_UP:?} (sinfo: {:?})\n{}",
                    cluster.host,
                    state.trim(),
                    cluster.logs()
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// slurm.conf, the prolog/epilog wrappers and lens-probe's env file, from the
    /// templates of tests/slurm/.
    fn write_files(&self) -> Result<(), String> {
        let dir = self.dir.display().to_string();
        if dir.contains(['\'', ' ', '@']) || dir.len() > 80 {
            return Err(format!(
                "the scratch directory {dir} does not fit a munge socket path"
            ));
        }
        for sub in ["munge", "state", "spool", "log"] {
            fs::create_dir_all(self.dir.join(sub)).map_err(|e| format!("{dir}/{sub}: {e}"))?;
        }
        let template = |name: &str| {
            fs::read_to_string(repo_path("tests/slurm").join(name))
                .unwrap_or_else(|e| panic!("tests/slurm/{name}: {e}"))
        };
        let (slurmctld_port, slurmd_port) = free_ports();
        // Job ids of their own: another run's lens-probe never matches this run's jobs.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let first_job_id = 1_000_000 + (std::process::id() % 20_000) * 1000 + nanos % 1000;
        let substitute = |text: String, pairs: &[(&str, &str)]| -> String {
            let text = pairs.iter().fold(text, |text, (key, value)| {
                text.replace(&format!("@{key}@"), value)
            });
            assert!(!text.contains('@'), "a placeholder is left:\n{text}");
            text
        };
        let common = [("DIR", dir.as_str()), ("LENS_PROBE_BIN", LENS_PROBE)];
        let write = |name: &str, text: String, mode: u32| -> Result<(), String> {
            let path = self.dir.join(name);
            fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
            fs::set_permissions(&path, fs::Permissions::from_mode(mode))
                .map_err(|e| format!("{}: {e}", path.display()))
        };
        write(
            "slurm.conf",
            substitute(
                template("slurm.conf.in"),
                &[
                    ("DIR", &dir),
                    ("HOST", &self.host),
                    ("SLURMCTLD_PORT", &slurmctld_port.to_string()),
                    ("SLURMD_PORT", &slurmd_port.to_string()),
                    ("FIRST_JOB_ID", &first_job_id.to_string()),
                    ("PARTITION", PARTITION),
                ],
            ),
            0o644,
        )?;
        for (wrapper, script) in [
            ("prolog.sh", "lens-probe-prolog.sh"),
            ("epilog.sh", "lens-probe-epilog.sh"),
        ] {
            let script = repo_path("observability/slurm").join(script);
            let script = script
                .canonicalize()
                .map_err(|e| format!("{}: {e}", script.display()))?;
            let script = script.display().to_string();
            let mut pairs = common.to_vec();
            pairs.push(("SCRIPT", &script));
            write(
                wrapper,
                substitute(template("lens-probe-script.sh.in"), &pairs),
                0o755,
            )?;
        }
        write(
            "lens-probe.env",
            substitute(template("lens-probe.env.in"), &common),
            0o644,
        )
    }

    /// munged with a key of its own and its socket in the scratch directory (`-f`: the
    /// scratch directory may be under a world-writable /tmp).
    fn start_munged(&mut self) -> Result<(), String> {
        let munge = self.dir.join("munge");
        fs::set_permissions(&munge, fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("{}: {e}", munge.display()))?;
        let key = munge.join("munge.key");
        let out = self
            .command("mungekey")
            .args(["-c", "-k"])
            .arg(&key)
            .output()
            .map_err(|e| format!("cannot run mungekey: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mungekey failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let socket = munge.join("munge.socket");
        let child = self
            .command("munged")
            .args(["-F", "-f"])
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!(
                "--log-file={}",
                self.dir.join("log/munged.log").display()
            ))
            .arg(format!("--pid-file={}", munge.join("munged.pid").display()))
            .arg(format!(
                "--seed-file={}",
                munge.join("munged.seed").display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start munged: {e}"))?;
        self.munged = Some(child);
        // Up when it encodes a credential.
        let start = Instant::now();
        loop {
            if let Some(Ok(Some(status))) = self.munged.as_mut().map(Child::try_wait) {
                return Err(format!(
                    "munged exited ({status}):\n{}",
                    tail(&self.dir.join("log/munged.log"), 20)
                ));
            }
            let encoded = self
                .command("munge")
                .arg("-n")
                .arg(format!("--socket={}", socket.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if encoded {
                return Ok(());
            }
            if start.elapsed() > CLUSTER_UP {
                return Err(format!(
                    "munged not answering after {CLUSTER_UP:?}:\n{}",
                    tail(&self.dir.join("log/munged.log"), 20)
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A SLURM or munge program with a clean environment: PATH, HOME and this cluster's
    /// SLURM_CONF (nothing of this process's SLURM_*, rank or lens-probe settings).
    fn command(&self, program: &str) -> Command {
        let path = find_program(program).unwrap_or_else(|| PathBuf::from(program));
        let mut command = Command::new(path);
        command
            .env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .env("HOME", "/root")
            .env("LANG", "C")
            .env("SLURM_CONF", self.dir.join("slurm.conf"))
            .current_dir(&self.dir)
            .stdin(Stdio::null());
        command
    }

    /// A client command's standard output, when it succeeded.
    fn run(&self, program: &str, args: &[&str]) -> Result<String, String> {
        let out = self
            .command(program)
            .args(args)
            .output()
            .map_err(|e| format!("cannot run {program}: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "{program} {args:?}: {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// `scontrol -o show job`: KEY=VALUE fields of the job.
    fn job(&self, job: &str) -> BTreeMap<String, String> {
        self.run("scontrol", &["-o", "show", "job", job])
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|field| field.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// The processes in slurmd's cgroup (slurmd included); none without one.
    fn cgroup_pids(&self) -> Vec<u32> {
        self.cgroup.as_deref().map(cgroup_procs).unwrap_or_default()
    }

    /// The last lines of the daemons' logs, for failure messages.
    fn logs(&self) -> String {
        let mut text = String::new();
        for name in [
            "slurmctld.log",
            "slurmd.log",
            "slurmctld.out",
            "slurmd.out",
            "munged.log",
        ] {
            text += &format!(
                "--- {name}\n{}\n",
                tail(&self.dir.join("log").join(name), 25)
            );
        }
        text
    }

    /// The processes this cluster started that are still running (itself excluded):
    /// those with its SLURM_CONF in their environment.
    fn leftovers(&self) -> Vec<u32> {
        let daemons: Vec<u32> = [&self.munged, &self.slurmctld, &self.slurmd]
            .into_iter()
            .flatten()
            .map(Child::id)
            .collect();
        pids()
            .into_iter()
            .filter(|pid| *pid != std::process::id() && !daemons.contains(pid))
            .filter(|&pid| running(pid) && environ_has(pid, &self.conf_entry))
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in [&mut self.slurmctld, &mut self.slurmd]
            .into_iter()
            .flatten()
        {
            stop_child(child, Duration::from_secs(20));
        }
        // What slurmd started and left (slurmstepd, tasks, lens-probe), killed at once
        // (cgroup.kill), then gone once they have exited.
        if let Some(cgroup) = self.cgroup.take() {
            let _ = fs::write(cgroup.join("cgroup.kill"), "1");
            let start = Instant::now();
            while fs::remove_dir(&cgroup).is_err() && start.elapsed() < TEARDOWN {
                for pid in cgroup_procs(&cgroup) {
                    // SAFETY: kill(2) of a process in this test's own cgroup.
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        // Anything else with this cluster's SLURM_CONF (slurmctld's slurmscriptd).
        let start = Instant::now();
        loop {
            let left = self.leftovers();
            if left.is_empty() || start.elapsed() > TEARDOWN {
                break;
            }
            for pid in left {
                // SAFETY: kill(2) of a process of this test's cluster (its SLURM_CONF).
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(munged) = &mut self.munged {
            stop_child(munged, Duration::from_secs(10));
        }
        if std::thread::panicking() {
            eprintln!(
                "{TEST}: the cluster's files are kept in {}",
                self.dir.display()
            );
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

// ---- the spans

fn attribute(resource: &BTreeMap<String, Value>, key: &str) -> Option<String> {
    let value = resource.get(key)?;
    value["stringValue"]
        .as_str()
        .or_else(|| value["intValue"].as_str())
        .map(str::to_string)
}

/// `task pid=P job=J step=S procid=R ntasks=N` lines the job's tasks printed: procid →
/// their fields.
fn tasks(job_output: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    job_output
        .lines()
        .filter_map(|line| line.strip_prefix("task "))
        .map(|fields| {
            let fields: BTreeMap<String, String> = fields
                .split_whitespace()
                .filter_map(|f| f.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            (fields["procid"].clone(), fields)
        })
        .collect()
}

#[test]
fn a_real_slurm_job_is_traced_by_the_prolog_and_stopped_by_the_epilog() {
    if !lens_tests::require_bpf(TEST) {
        return;
    }
    let missing: Vec<&str> = PROGRAMS
        .into_iter()
        .filter(|p| find_program(p).is_none())
        .collect();
    if !missing.is_empty() {
        skip(&format!(
            "{} not installed: run `cargo xtask setup` (Debian's slurm-wlm and munge)",
            missing.join(", ")
        ));
        return;
    }
    // On a quiet kernel: another tracer's uprobe teardown holds up new attachments (see
    // lens_tests::wait_for_lens_probe_teardown).
    lens_tests::wait_for_lens_probe_teardown();
    let started = Instant::now();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let dir = std::env::temp_dir().join(format!("lens-slurm-{}-{nanos}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let cluster = match Cluster::start(dir.clone()) {
        Ok(cluster) => cluster,
        Err(reason) => {
            let _ = fs::remove_dir_all(&dir);
            skip(&format!(
                "the one-node SLURM cluster did not come up: {reason}"
            ));
            return;
        }
    };
    let cluster_up = started.elapsed();

    // The batch job: two tasks of the fake trainer, once the test opens the gate.
    let gate = dir.join("gate");
    let output = cluster
        .command("sbatch")
        .args(["--parsable", "-N1", "-n2", "-J", JOB_NAME])
        .arg(format!("--output={}/job-%j.out", dir.display()))
        .arg(repo_path("tests/slurm/job.sh"))
        .arg(&gate)
        .arg(lens_tests::torch_trainer())
        .args([STEPS.to_string().as_str(), "1", "0", "0"])
        .env("TRAINER_INIT_MS", "700")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "sbatch: {}\n{}",
        lens_tests::stderr_text(&output),
        cluster.logs()
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let job = stdout.trim().split(';').next().unwrap().to_string();
    assert!(job.parse::<u64>().is_ok(), "sbatch printed {stdout:?}");

    let pid_file = dir.join("run").join(format!("{job}.pid"));
    let log_file = dir.join("lens-probe-log").join(format!("{job}.log"));
    let job_output = dir.join(format!("job-{job}.out"));
    let export_file = dir.join(format!("spans-{job}.jsonl"));
    let diagnostics = || {
        format!(
            "scontrol show job: {:?}\n--- lens-probe log\n{}\n--- job output\n{}\n{}",
            cluster.job(&job),
            tail(&log_file, 40),
            tail(&job_output, 20),
            cluster.logs()
        )
    };

    // Allocation: slurmd ran the prolog (PrologFlags=Alloc), which started lens-probe.
    wait_for("the prolog's pid file", JOB_DEADLINE, diagnostics, || {
        fs::read_to_string(&pid_file).is_ok_and(|t| !t.trim().is_empty())
    });
    let pid: u32 = fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    wait_for(
        "lens-probe to watch the node",
        JOB_DEADLINE,
        diagnostics,
        || fs::read_to_string(&log_file).is_ok_and(|l| l.contains("watching for new ones")),
    );
    assert!(
        running(pid),
        "lens-probe {pid} is not running\n{}",
        diagnostics()
    );
    let args = cmdline(pid);
    assert!(
        args.contains(&format!(
            "--node --match-env SLURM_JOB_ID={job} --pid-file "
        )),
        "{args}"
    );
    // One lens-probe for the job on this node (with its guardian, a child of its own),
    // and the job is running (held at the gate).
    let of_job = |p: u32| {
        running(p)
            && comm(p) == "lens-probe"
            && cmdline(p).contains(&format!("SLURM_JOB_ID={job} "))
    };
    let probes: Vec<u32> = pids()
        .into_iter()
        .filter(|&p| of_job(p) && !parent(p).is_some_and(of_job))
        .collect();
    assert_eq!(probes, [pid], "lens-probes of job {job}\n{}", diagnostics());
    // It and its guardian: an exiting process has no command line or environment left to
    // recognise it by, so they are followed by pid until they are gone.
    let lens_probes: Vec<u32> = pids()
        .into_iter()
        .filter(|&p| p == pid || (parent(p) == Some(pid) && of_job(p)))
        .collect();
    wait_for("the job to run", JOB_DEADLINE, diagnostics, || {
        cluster.job(&job).get("JobState").map(String::as_str) == Some("RUNNING")
    });
    fs::write(&gate, "").unwrap();

    // The job ends; the epilog runs before the controller calls it COMPLETED.
    wait_for("the job to complete", JOB_DEADLINE, diagnostics, || {
        let state = cluster
            .job(&job)
            .get("JobState")
            .cloned()
            .unwrap_or_default();
        assert!(
            ![
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
                "BOOT_FAIL"
            ]
            .contains(&state.as_str()),
            "job {job} is {state}\n{}",
            diagnostics()
        );
        state == "COMPLETED"
    });
    let fields = cluster.job(&job);
    assert_eq!(fields["ExitCode"], "0:0", "{}", diagnostics());
    let log = fs::read_to_string(&log_file).unwrap();
    assert!(
        !pid_file.exists(),
        "the pid file is left\n{}",
        diagnostics()
    );
    assert!(
        !running(pid),
        "lens-probe {pid} still runs\n{}",
        diagnostics()
    );
    assert_eq!(
        log.matches("lens-probe-prolog: ").count(),
        1,
        "one prolog line (started):\n{log}"
    );
    assert!(
        log.contains(&format!(
            "started {LENS_PROBE} (pid {pid}) for processes with SLURM_JOB_ID={job}"
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!("lens-probe (pid {pid}) stopped")),
        "{log}"
    );
    assert!(log.contains("spans exported to"), "{log}");
    // Nothing of the job is left: no slurmstepd, task or lens-probe. At exit lens-probe
    // forks a child that holds its BPF links while the kernel removes the uprobes (~0.1 s
    // each), so that the epilog does not wait for that; it has no command line left to
    // recognise it by, but it is in slurmd's cgroup.
    let slurmd = cluster.slurmd.as_ref().map(Child::id).unwrap();
    let mut left = Vec::new();
    let start = Instant::now();
    while start.elapsed() < TEARDOWN {
        left = job_processes(&job);
        left.extend(
            lens_probes
                .iter()
                .filter(|&&p| running(p))
                .map(|p| format!("{p} {} (lens-probe)", comm(*p))),
        );
        // Whatever slurmd started (prolog, lens-probe and its teardown child, slurmstepd,
        // tasks): an exiting process is still in its cgroup, nameless or not.
        left.extend(
            cluster
                .cgroup_pids()
                .into_iter()
                .filter(|&p| p != slurmd)
                .map(|p| format!("{p} {} (in slurmd's cgroup)", comm(p))),
        );
        if left.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(left.is_empty(), "left running after job {job}: {left:#?}");

    // The tasks SLURM started: ranks 0 and 1 of step 0, each its own process.
    let output_text = fs::read_to_string(&job_output).unwrap();
    let tasks = tasks(&output_text);
    assert_eq!(
        tasks.keys().map(String::as_str).collect::<Vec<_>>(),
        ["0", "1"],
        "{output_text}"
    );
    for task in tasks.values() {
        assert_eq!(task["job"], job, "{output_text}");
        assert_eq!(
            task["step"], "0",
            "the batch job's first srun step: {output_text}"
        );
        assert_eq!(task["ntasks"], "2", "{output_text}");
    }
    assert_eq!(
        output_text
            .matches(&format!("trainer_torch: {STEPS} steps done"))
            .count(),
        2,
        "{output_text}"
    );

    // The spans: one train.job per task, with the job's SLURM attributes and the task's
    // rank, nothing from another process.
    let spans: Vec<FileSpan> = otlp_file_spans(&export_file);
    let jobs: Vec<&FileSpan> = spans
        .iter()
        .filter(|(_, s)| s["name"] == "train.job")
        .collect();
    assert_eq!(jobs.len(), 2, "a train.job per task:\n{log}");
    let mut ranks = Vec::new();
    for (resource, _) in &jobs {
        let get = |key: &str| attribute(resource, key).unwrap_or_default();
        let rank = get("dl.rank");
        let task = tasks
            .get(&rank)
            .unwrap_or_else(|| panic!("rank {rank:?} is no task of the job: {resource:?}"));
        assert_eq!(get("process.pid"), task["pid"], "rank {rank}'s process");
        assert_eq!(get("dl.world_size"), "2");
        assert_eq!(get("slurm.job.id"), job);
        assert_eq!(get("nemo.run.id"), job);
        assert_eq!(get("slurm.job.name"), JOB_NAME);
        assert_eq!(get("slurm.ntasks"), "2");
        assert_eq!(get("slurm.nodelist"), cluster.host);
        // From SLURM_JOB_PARTITION: a real task has no SLURM_PARTITION (Lens' variable).
        assert_eq!(get("slurm.partition"), PARTITION);
        assert_eq!(get("slurm.step.id"), task["step"], "rank {rank}'s step");
        assert_eq!(get("slurm.cluster.name"), CLUSTER);
        ranks.push(rank);
    }
    ranks.sort();
    assert_eq!(ranks, ["0", "1"]);
    for rank in ["0", "1"] {
        let steps = spans
            .iter()
            .filter(|(r, s)| {
                s["name"] == "train.step" && attribute(r, "dl.rank").as_deref() == Some(rank)
            })
            .count();
        assert_eq!(steps, STEPS, "rank {rank}'s steps:\n{log}");
    }
    for (resource, span) in &spans {
        assert_eq!(
            attribute(resource, "slurm.job.id").as_deref(),
            Some(job.as_str()),
            "a span of another process: {span}"
        );
    }
    // All ranks of the run share one trace.
    let traces: std::collections::BTreeSet<&str> = spans
        .iter()
        .filter_map(|(_, s)| s["traceId"].as_str())
        .collect();
    assert_eq!(traces.len(), 1, "{traces:?}");

    eprintln!(
        "{TEST}: job {job} traced; cluster up in {:.1} s, all in {:.1} s",
        cluster_up.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    drop(cluster);
    let left = job_processes(&job);
    assert!(left.is_empty(), "{left:#?}");
}
