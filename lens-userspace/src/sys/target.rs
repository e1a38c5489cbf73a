//! The processes being traced: attaching to a running one, starting one gated until the
//! probes are in place, and noticing when they exit.
use std::{
    ffi::{CString, OsStr, OsString},
    fs,
    io::{self, Read, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::error::{LensError, Result};

/// What is known about a traced process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessInfo {
    pub pid: u32,
    /// Short name (`/proc/PID/comm`).
    pub name: String,
    pub command_line: Vec<String>,
    /// Started by lens-probe (`--exec`): seen from its first instruction, so the job and
    /// its initialisation are whole. `false` for processes attached to while running.
    pub traced_from_start: bool,
    /// Its place in a distributed job, from its environment.
    pub rank: Option<RankInfo>,
    /// What it sees of itself (environment, cgroup, files in its root), read while it
    /// runs: its spans are often exported after it has gone.
    pub view: Arc<TargetView>,
}

/// A process's own view of where it runs, as resource detection needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TargetView {
    pub environment: Vec<(String, String)>,
    /// `/proc/PID/cgroup`.
    pub cgroup: String,
    /// `/etc/hostname` in its root.
    pub hostname_file: Option<String>,
    /// `/var/run/secrets/kubernetes.io` exists in its root (it runs in a pod).
    pub kubernetes_secrets: bool,
    /// Its service account's namespace file, in its root.
    pub service_account_namespace: Option<String>,
    /// `nvidia[0-9]+` device files in its `/dev`.
    pub nvidia_devices: usize,
    /// Its pid inside its own pid namespace, when that is not the host's (a container).
    pub namespace_pid: Option<u32>,
}

/// The pid of `pid` in its innermost pid namespace (the last `NSpid` entry of its
/// status), when it differs from the host's.
fn namespace_pid(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    let innermost: u32 = line.split_whitespace().last()?.parse().ok()?;
    (innermost != pid).then_some(innermost)
}

/// Inside a process's root.
const K8S_SECRETS: &str = "var/run/secrets/kubernetes.io";
const K8S_NAMESPACE_FILE: &str = "var/run/secrets/kubernetes.io/serviceaccount/namespace";
const HOSTNAME_FILE: &str = "etc/hostname";
const DEV: &str = "dev";

/// Opens `relative` inside the directory tree rooted at `root` as a process with that
/// root would: symlinks, absolute ones included (`/var/run` → `/run` in most images),
/// resolve within it (`openat2(RESOLVE_IN_ROOT)`), not in lens-probe's own tree.
fn open_in_root(root: &Path, relative: &str, flags: i32) -> io::Result<fs::File> {
    let root = fs::File::open(root)?;
    let path = CString::new(relative).map_err(io::Error::other)?;
    // SAFETY: open_how is plain integers; all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_IN_ROOT;
    // SAFETY: valid fd, NUL-terminated path and a correctly sized open_how.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            path.as_ptr(),
            &how as *const libc::open_how,
            size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd we own.
    Ok(unsafe { fs::File::from_raw_fd(fd as RawFd) })
}

fn read_trimmed(root: &Path, relative: &str) -> Option<String> {
    let mut text = String::new();
    open_in_root(root, relative, libc::O_RDONLY)
        .ok()?
        .read_to_string(&mut text)
        .ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// `nvidia[0-9]+` entries of `dev` inside `root`.
fn nvidia_devices(root: &Path) -> usize {
    let Ok(dev) = open_in_root(root, DEV, libc::O_RDONLY | libc::O_DIRECTORY) else {
        return 0;
    };
    fs::read_dir(format!("/proc/self/fd/{}", dev.as_raw_fd()))
        .map(|entries| {
            entries
                .filter_map(|entry| entry.ok())
                .filter(|entry| {
                    let name = entry.file_name();
                    let name = name.to_string_lossy();
                    name.strip_prefix("nvidia").is_some_and(|number| {
                        !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit())
                    })
                })
                .count()
        })
        .unwrap_or(0)
}

impl TargetView {
    /// The view of a process whose root directory is `root` (`/proc/PID/root`, which
    /// resolves in its own mount namespace).
    pub fn read(root: &Path, environment: Vec<(String, String)>, cgroup: String) -> TargetView {
        TargetView {
            environment,
            cgroup,
            hostname_file: read_trimmed(root, HOSTNAME_FILE),
            kubernetes_secrets: open_in_root(root, K8S_SECRETS, libc::O_PATH).is_ok(),
            service_account_namespace: read_trimmed(root, K8S_NAMESPACE_FILE),
            nvidia_devices: nvidia_devices(root),
            namespace_pid: None,
        }
    }

    /// The view of running process `pid`.
    pub fn capture(pid: u32) -> TargetView {
        TargetView {
            namespace_pid: namespace_pid(pid),
            ..TargetView::read(
                Path::new(&format!("/proc/{pid}/root")),
                read_environment(pid),
                fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default(),
            )
        }
    }
}

/// A process's rank as its launcher set it in its environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: i64,
    pub world_size: Option<i64>,
    pub local_rank: Option<i64>,
}

/// (rank, world size, local rank) variables, by launcher, in order of preference:
/// torchrun/torch.distributed, SLURM, Open MPI.
const RANK_VARIABLES: [[&str; 3]; 3] = [
    ["RANK", "WORLD_SIZE", "LOCAL_RANK"],
    ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"],
    [
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ],
];

impl RankInfo {
    pub fn from_environment(environment: &[(String, String)]) -> Option<RankInfo> {
        let get = |key: &str| -> Option<i64> {
            environment
                .iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, v)| v.trim().parse().ok())
        };
        RANK_VARIABLES.iter().find_map(|[rank, world, local]| {
            Some(RankInfo {
                rank: get(rank)?,
                world_size: get(world),
                local_rank: get(local),
            })
        })
    }
}

/// The only variables kept from a target's environment: what its rank
/// ([`RANK_VARIABLES`]) and its resource (`export/resource.rs`) are made of. Everything
/// else in `/proc/PID/environ` is dropped as it is read, so it cannot reach telemetry, a
/// log or a summary. None of these names looks like a secret ([`looks_secret`]).
pub const ENVIRONMENT_ALLOW_LIST: [&str; 35] = [
    // Rank, world size, local rank: torchrun, SLURM, Open MPI.
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    // NeMo Lens' resource attributes.
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "NEMO_LENS_RUN_ID",
    "NEMO_LENS_USER_ID",
    "TORCHELASTIC_RUN_ID",
    "WANDB_ENTITY",
    "WANDB_PROJECT",
    "DEPLOYMENT_ENV",
    "ENVIRONMENT",
    "HOSTNAME",
    "CUDA_VISIBLE_DEVICES",
    // SLURM.
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_NODELIST",
    "SLURM_NNODES",
    "SLURM_PARTITION",
    "SLURM_JOB_PARTITION",
    "SLURM_STEP_ID",
    "SLURM_CLUSTER_NAME",
    // Kubernetes (the downward API variables Lens reads).
    "KUBERNETES_SERVICE_HOST",
    "K8S_NAMESPACE",
    "K8S_POD_NAME",
    "K8S_POD_UID",
    "K8S_NODE_NAME",
    "K8S_CONTAINER_NAME",
    "K8S_JOB_NAME",
];

/// Words in a name (of a variable, a resource attribute, a command-line option) that mark
/// its value as a secret: such values are never kept, whatever the name's place.
const SECRET_WORDS: [&str; 12] = [
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "PASSPHRASE",
    "CREDENTIAL",
    "PRIVATE",
    "KEY",
    "COOKIE",
    "AUTHORIZATION",
    "BEARER",
    "APIKEY",
];

/// Short words that mark a secret only as a whole part of a name (`--auth`, `--db_pass`,
/// `--pat`, `GITLAB_PAT`), not inside another word (`PATH`, `--author`, `--compass`).
const SECRET_PARTS: [&str; 6] = ["AUTH", "PASS", "PAT", "PW", "PWD", "CRED"];

/// Whether `name` looks like it names a secret (`MY_API_TOKEN`, `db.password`,
/// `--wandb-api-key`, `AWS_SECRET_ACCESS_KEY`, `--auth`, `--db_pass`): case-insensitive,
/// anywhere in the name, or, for short words, as one of its parts. A false positive only
/// costs an attribute; there are no exceptions.
pub fn looks_secret(name: &str) -> bool {
    let name = name.to_ascii_uppercase();
    SECRET_WORDS.iter().any(|word| name.contains(word))
        || name
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|part| SECRET_PARTS.contains(&part))
}

/// `scheme://user:secret@host/...` → `scheme://…@host/...`, for every URL in `text`:
/// credentials in a URL are never shown nor exported, whatever carries them (an error
/// message, a command line).
pub fn redact_url_userinfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let authority_end = after
            .find(|c: char| matches!(c, '/' | '?' | '#') || c.is_whitespace() || c == '"')
            .unwrap_or(after.len());
        match after[..authority_end].rfind('@') {
            Some(user_end) => {
                out.push('…');
                rest = &after[user_end..];
            }
            None => rest = after,
        }
    }
    out.push_str(rest);
    out
}

fn allowed_variable(name: &str) -> bool {
    ENVIRONMENT_ALLOW_LIST.contains(&name) && !looks_secret(name)
}

/// `NAME=VALUE` entries of a `/proc/PID/environ`, for which `keep(NAME)` holds.
fn environment_entries(environ: &[u8], keep: impl Fn(&str) -> bool) -> Vec<(String, String)> {
    environ
        .split(|b| *b == 0)
        .filter_map(|entry| {
            let at = entry.iter().position(|b| *b == b'=')?;
            let key = std::str::from_utf8(&entry[..at]).ok()?;
            keep(key).then(|| {
                (
                    key.to_string(),
                    String::from_utf8_lossy(&entry[at + 1..]).into_owned(),
                )
            })
        })
        .collect()
}

/// The allow-listed variables ([`ENVIRONMENT_ALLOW_LIST`]) of the environment the process
/// started its current program with (`/proc/PID/environ`).
pub fn read_environment(pid: u32) -> Vec<(String, String)> {
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    environment_entries(&environ, allowed_variable)
}

/// The value of one variable of `pid`'s environment, allow-listed or not, for a
/// comparison the user asked for (`--match-env`); kept nowhere.
pub fn read_variable(pid: u32, name: &str) -> Option<String> {
    let environ = fs::read(format!("/proc/{pid}/environ")).ok()?;
    environment_entries(&environ, |key| key == name)
        .pop()
        .map(|(_, value)| value)
}

/// The processes descended from `pid` now (children, theirs, …), from
/// `/proc/PID/task/TID/children`, parents before their children.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut queue = vec![pid];
    while let Some(parent) = queue.pop() {
        let Ok(tasks) = fs::read_dir(format!("/proc/{parent}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children = fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                // Bounded: a pid seen twice (reused while reading) is not walked again.
                if child != pid && !found.contains(&child) && found.len() < 65_536 {
                    found.push(child);
                    queue.push(child);
                }
            }
        }
    }
    found
}

/// A command line with the values of secret-looking options and assignments replaced by
/// `***`: `--api-key=X`, `--token X`, `WANDB_API_KEY=X` (as `env` takes it).
pub fn redact_command_line(arguments: Vec<String>) -> Vec<String> {
    let mut redact_next = false;
    arguments
        .into_iter()
        .map(|argument| {
            if std::mem::take(&mut redact_next) && !argument.starts_with('-') {
                return "***".to_string();
            }
            let argument = redact_url_userinfo(&argument);
            if let Some((name, _)) = argument.split_once('=')
                && looks_secret(name)
            {
                return format!("{name}=***");
            }
            redact_next = argument.starts_with('-') && looks_secret(&argument);
            argument
        })
        .collect()
}

impl ProcessInfo {
    pub fn read(pid: u32) -> Result<ProcessInfo> {
        // The process wrote both: shown everywhere with control characters escaped.
        let name = fs::read_to_string(format!("/proc/{pid}/comm"))
            .map_err(|_| LensError::NoSuchProcess(pid))?;
        let name = super::text::printable(name.trim_end()).into_owned();
        let command_line = redact_command_line(
            fs::read(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .split(|b| *b == 0)
                .filter(|arg| !arg.is_empty())
                .map(|arg| super::text::printable(&String::from_utf8_lossy(arg)).into_owned())
                .collect(),
        );
        let view = TargetView::capture(pid);
        Ok(ProcessInfo {
            pid,
            name,
            command_line,
            traced_from_start: false,
            rank: RankInfo::from_environment(&view.environment),
            view: Arc::new(view),
        })
    }
}

/// A pidfd: readable once the process has exited, for processes that are not our children
/// too.
pub fn pidfd_open(pid: u32) -> Result<OwnedFd> {
    // SAFETY: plain syscall; the returned fd is owned by us.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        let error = io::Error::last_os_error();
        return Err(if error.raw_os_error() == Some(libc::ESRCH) {
            LensError::NoSuchProcess(pid)
        } else {
            error.into()
        });
    }
    // SAFETY: a fresh fd from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Finds `program` the way execvp would (PATH lookup when it has no slash).
pub fn resolve_program(program: &OsStr) -> Option<PathBuf> {
    let is_executable = |path: &Path| {
        fs::metadata(path)
            .map(|m| {
                m.is_file()
                    && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
            })
            .unwrap_or(false)
    };
    if program.as_bytes().contains(&b'/') {
        let path = PathBuf::from(program);
        return is_executable(&path).then_some(path);
    }
    let search = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&search)
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
}

/// A child forked and waiting at a gate: it has not exec'ed yet, so it can be registered
/// as a target before any of its code runs.
pub struct GatedChild {
    pub pid: u32,
    gate: OwnedFd,
    exec_status: OwnedFd,
    command: String,
}

fn pipe(flags: libc::c_int) -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid 2-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fds from the kernel.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Forks a child that will exec `argv` once [`GatedChild::release`] is called.
pub fn spawn_gated(argv: &[OsString]) -> Result<GatedChild> {
    let command = argv
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let spawn_error = |source: io::Error| LensError::Spawn {
        command: command.clone(),
        source,
    };
    let program = argv
        .first()
        .ok_or_else(|| spawn_error(io::Error::new(io::ErrorKind::InvalidInput, "empty command")))?;
    let path = resolve_program(program).ok_or_else(|| {
        spawn_error(io::Error::new(
            io::ErrorKind::NotFound,
            "command not found or not executable",
        ))
    })?;
    // Everything the child needs is allocated before fork: after it, only
    // async-signal-safe calls (read, execv, write, _exit).
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| spawn_error(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    let c_args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| spawn_error(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    let mut c_argv: Vec<*const libc::c_char> = c_args.iter().map(|a| a.as_ptr()).collect();
    c_argv.push(std::ptr::null());

    let (gate_read, gate_write) = pipe(libc::O_CLOEXEC).map_err(spawn_error)?;
    let (status_read, status_write) = pipe(libc::O_CLOEXEC).map_err(spawn_error)?;

    // The command must not inherit lens-probe's held signals (a mask survives exec).
    let held = stop_signals();
    // SAFETY: the child only calls async-signal-safe functions before exec or _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(spawn_error(io::Error::last_os_error()));
    }
    if pid == 0 {
        // Child.
        unsafe {
            let mut byte = 0u8;
            let n = libc::read(gate_read.as_raw_fd(), (&raw mut byte).cast(), 1);
            if n != 1 {
                // The loader went away before releasing us: do not run untraced.
                libc::_exit(127);
            }
            libc::sigprocmask(libc::SIG_UNBLOCK, &held, std::ptr::null_mut());
            libc::execv(c_path.as_ptr(), c_argv.as_ptr());
            let errno = *libc::__errno_location();
            libc::write(
                status_write.as_raw_fd(),
                (&raw const errno).cast(),
                size_of::<libc::c_int>(),
            );
            libc::_exit(127);
        }
    }
    drop(gate_read);
    drop(status_write);
    Ok(GatedChild {
        pid: pid as u32,
        gate: gate_write,
        exec_status: status_read,
        command,
    })
}

impl GatedChild {
    /// Lets the child exec and reports whether the exec succeeded.
    pub fn release(self) -> Result<u32> {
        let mut gate = fs::File::from(self.gate);
        gate.write_all(&[1]).map_err(|source| LensError::Spawn {
            command: self.command.clone(),
            source,
        })?;
        let mut status = fs::File::from(self.exec_status);
        let mut errno = [0u8; size_of::<libc::c_int>()];
        // EOF: the CLOEXEC end closed, i.e. the exec succeeded.
        match status.read(&mut errno) {
            Ok(0) => Ok(self.pid),
            Ok(_) => {
                reap(self.pid);
                Err(LensError::Spawn {
                    command: self.command,
                    source: io::Error::from_raw_os_error(libc::c_int::from_ne_bytes(errno)),
                })
            }
            Err(source) => Err(LensError::Spawn {
                command: self.command,
                source,
            }),
        }
    }
}

fn reap(pid: u32) {
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) };
}

/// How a process ended, when we can know (only for our own children).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitStatus {
    Exited(i32),
    Signaled(i32),
    /// Not our child: it is gone, but its status went to its own parent.
    Unknown,
}

impl ExitStatus {
    /// From a wait status as `waitpid` (or the kernel's `task_struct.exit_code`) has it.
    pub fn from_wait_status(status: i32) -> ExitStatus {
        if libc::WIFEXITED(status) {
            ExitStatus::Exited(libc::WEXITSTATUS(status))
        } else if libc::WIFSIGNALED(status) {
            ExitStatus::Signaled(libc::WTERMSIG(status))
        } else {
            ExitStatus::Unknown
        }
    }

    /// The exit code a shell would report.
    pub fn shell_code(self) -> i32 {
        match self {
            ExitStatus::Exited(code) => code,
            ExitStatus::Signaled(signal) => 128 + signal,
            ExitStatus::Unknown => 0,
        }
    }
}

/// The signals that stop lens-probe cleanly (flush, summary, the job's exit code): SIGINT,
/// SIGTERM, and SIGHUP (a closed terminal or ssh session: its default would end lens-probe
/// at once, with nothing flushed).
pub const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// [`STOP_SIGNALS`], which lens-probe holds (blocked, so pending) from its start until its
/// handlers are in place: stopping it mid-start-up must still flush and exit cleanly.
fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigset operations on a local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in STOP_SIGNALS {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

/// Set when a stop signal arrives once the run loop's handlers are in (they take the
/// signal; long synchronous work, attaching thousands of probes, looks here).
static STOP_REQUESTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The last stop signal taken, and how many were: after tracing stopped, lens-probe waits
/// for the command it started and passes each new one on ([`wait_forwarding_stops`]).
static LAST_STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
static STOP_SIGNALS_SEEN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Waits for our child `pid` to exit, untraced, passing on to it every stop signal that
/// lens-probe takes meanwhile (a command that needs two Ctrl-C gets them), and returns
/// how it ended.
pub fn wait_forwarding_stops(pid: u32) -> ExitStatus {
    use std::sync::atomic::Ordering::Relaxed;
    let mut seen = STOP_SIGNALS_SEEN.load(Relaxed);
    loop {
        if let Some(status) = try_wait_child(pid) {
            return status;
        }
        let now = STOP_SIGNALS_SEEN.load(Relaxed);
        if now != seen {
            seen = now;
            // SAFETY: plain kill(2) of our own child, not yet reaped.
            unsafe { libc::kill(pid as libc::pid_t, LAST_STOP_SIGNAL.load(Relaxed)) };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Whether a stop signal came: pending (held during start-up) or taken by the run
/// loop's handlers. Work that can take long (attaching) stops early when it did.
pub fn stop_requested() -> bool {
    if STOP_REQUESTED.load(std::sync::atomic::Ordering::Relaxed) {
        return true;
    }
    // SAFETY: sigpending fills a local set; sigismember reads it.
    unsafe {
        let mut pending: libc::sigset_t = std::mem::zeroed();
        libc::sigpending(&mut pending) == 0
            && STOP_SIGNALS
                .iter()
                .any(|signal| libc::sigismember(&pending, *signal) == 1)
    }
}

/// Blocks the stop signals in the calling thread and the threads it starts later; they
/// wait, pending, for [`release_stop_signals`]. Call first thing, before any thread.
pub fn hold_stop_signals() {
    for signal in STOP_SIGNALS {
        // SAFETY: the action only stores to atomics (async-signal-safe); the run loop's
        // own handlers (tokio's, through the same registry) still run.
        let _ = unsafe {
            signal_hook_registry::register(signal, move || {
                use std::sync::atomic::Ordering::Relaxed;
                STOP_REQUESTED.store(true, Relaxed);
                LAST_STOP_SIGNAL.store(signal, Relaxed);
                STOP_SIGNALS_SEEN.fetch_add(1, Relaxed);
            })
        };
    }
    let set = stop_signals();
    // SAFETY: changes this thread's signal mask only.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Unblocks them in the calling thread (the one whose handlers are now ready); pending
/// ones are delivered at once.
pub fn release_stop_signals() {
    let set = stop_signals();
    // SAFETY: as above.
    unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
}

/// Collects the exit status of our child `pid` if it has exited (non-blocking).
pub fn try_wait_child(pid: u32) -> Option<ExitStatus> {
    let mut status = 0;
    // SAFETY: WNOHANG wait on our own child.
    let waited = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) };
    if waited != pid as libc::pid_t {
        return None;
    }
    match ExitStatus::from_wait_status(status) {
        ExitStatus::Unknown => None,
        status => Some(status),
    }
}

/// Pauses a running process (SIGSTOP) and returns whether it did: a process that is
/// already stopped (by its user, a debugger) is left alone, so that it is not resumed by
/// us either.
pub fn stop(pid: u32) -> bool {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // `pid (comm) S ...`: the state follows the last ')'.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    if !matches!(state, Some('R' | 'S' | 'D')) {
        return false;
    }
    // SAFETY: plain signal send.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) == 0 }
}

/// Resumes a target stopped by the probe at a library load.
pub fn resume(pid: u32) {
    // SAFETY: plain signal send.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_resolves_absolute_symlinks_inside_the_targets_root() {
        // As in most images: /var/run -> /run (absolute), the secret under /run.
        let root = std::env::temp_dir().join(format!("lens-view-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let secrets = root.join("run/secrets/kubernetes.io/serviceaccount");
        fs::create_dir_all(&secrets).unwrap();
        fs::write(secrets.join("namespace"), "team-b\n").unwrap();
        fs::create_dir_all(root.join("var")).unwrap();
        std::os::unix::fs::symlink("/run", root.join("var/run")).unwrap();
        fs::create_dir_all(root.join("dev")).unwrap();
        for device in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
            fs::write(root.join("dev").join(device), "").unwrap();
        }
        let view = TargetView::read(&root, Vec::new(), String::new());
        let _ = fs::remove_dir_all(&root);
        assert!(view.kubernetes_secrets);
        assert_eq!(view.service_account_namespace.as_deref(), Some("team-b"));
        assert_eq!(view.nvidia_devices, 2);
        assert_eq!(view.hostname_file, None);
    }

    #[test]
    fn only_allow_listed_variables_are_kept() {
        let environ = b"RANK=3\0FOO=bar\0MY_API_TOKEN=hunter2\0WORLD_SIZE=8\0\
                        AWS_SECRET_ACCESS_KEY=abc\0SLURM_JOB_ID=42\0PATH=/bin\0=x\0noequals\0";
        assert_eq!(
            environment_entries(environ, allowed_variable),
            [
                ("RANK".to_string(), "3".to_string()),
                ("WORLD_SIZE".to_string(), "8".to_string()),
                ("SLURM_JOB_ID".to_string(), "42".to_string()),
            ]
        );
        // Every variable the rank is read from is on the list.
        for variable in RANK_VARIABLES.iter().flatten() {
            assert!(allowed_variable(variable), "{variable}");
        }
    }

    #[test]
    fn no_allow_listed_name_looks_secret_and_secret_names_do() {
        for name in ENVIRONMENT_ALLOW_LIST {
            assert!(!looks_secret(name), "{name}");
        }
        for name in [
            "MY_API_TOKEN",
            "AWS_SECRET_ACCESS_KEY",
            "db.password",
            "PGPASSWD",
            "api_key",
            "WANDB_API_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "ssh.private",
            "--hf-token",
            "Authorization",
        ] {
            assert!(looks_secret(name), "{name}");
        }
        for name in ["team", "RANK", "service.name", "--lr", "LOCAL_RANK"] {
            assert!(!looks_secret(name), "{name}");
        }
    }

    #[test]
    fn secret_options_and_assignments_are_redacted_in_command_lines() {
        let args = |text: &str| -> Vec<String> { text.split(' ').map(str::to_string).collect() };
        assert_eq!(
            redact_command_line(args(
                "env WANDB_API_KEY=abc python train.py --hf-token hunter2 --lr 3e-4 \
                 --db-password=hunter2 --key-file k.pem --token --verbose"
            )),
            args(
                "env WANDB_API_KEY=*** python train.py --hf-token *** --lr 3e-4 \
                 --db-password=*** --key-file *** --token --verbose"
            )
        );
        assert_eq!(
            redact_command_line(args("python train.py --batch-size 8")),
            args("python train.py --batch-size 8")
        );
        // Found by an adversarial pass: URL user-info, and short secret words as parts.
        assert_eq!(
            redact_command_line(args(
                "python t.py --url https://user:pw@host/x --auth X --db_pass X --pat X \
                 --bearer X --patience 3 --author me"
            )),
            args(
                "python t.py --url https://…@host/x --auth *** --db_pass *** --pat *** \
                 --bearer *** --patience 3 --author me"
            )
        );
    }

    #[test]
    fn credentials_in_urls_are_masked_wherever_they_are() {
        assert_eq!(
            redact_url_userinfo(
                "error sending request for url (http://user:secret@collector:4318/v1/traces)"
            ),
            "error sending request for url (http://…@collector:4318/v1/traces)"
        );
        assert_eq!(
            redact_url_userinfo("a=https://u@h b=http://h:1/p@x"),
            "a=https://…@h b=http://h:1/p@x"
        );
        assert!(!looks_secret("PATH") && !looks_secret("--compass") && looks_secret("GITLAB_PAT"));
    }

    #[test]
    fn one_variable_is_read_for_a_comparison() {
        let me = std::process::id();
        assert!(read_variable(me, "PATH").is_some() || std::env::var_os("PATH").is_none());
        assert_eq!(read_variable(me, "LENS_NO_SUCH_VARIABLE_XYZ"), None);
        assert!(
            read_environment(me)
                .iter()
                .all(|(k, _)| allowed_variable(k))
        );
    }

    #[test]
    fn programs_are_found_on_path_or_by_path() {
        assert!(resolve_program(OsStr::new("sh")).is_some());
        assert_eq!(
            resolve_program(OsStr::new("/bin/sh")),
            Some(PathBuf::from("/bin/sh"))
        );
        assert_eq!(resolve_program(OsStr::new("no-such-program-xyz")), None);
        assert_eq!(resolve_program(OsStr::new("/etc/passwd")), None);
        assert_eq!(resolve_program(OsStr::new("/etc")), None);
    }

    #[test]
    fn a_gated_child_runs_only_after_release_and_reports_its_status() {
        let child = spawn_gated(&["sh".into(), "-c".into(), "exit 7".into()]).unwrap();
        let pid = child.pid;
        assert_eq!(try_wait_child(pid), None, "must wait at the gate");
        assert_eq!(child.release().unwrap(), pid);
        let mut status = None;
        for _ in 0..500 {
            status = try_wait_child(pid);
            if status.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(status, Some(ExitStatus::Exited(7)));
    }

    #[test]
    fn a_missing_command_is_one_clear_error() {
        let error = spawn_gated(&["no-such-program-xyz".into()]).err().unwrap();
        assert_eq!(
            error.to_string(),
            "cannot run no-such-program-xyz: command not found or not executable"
        );
    }
}
