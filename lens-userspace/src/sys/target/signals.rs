//! Stop signals (held through start-up, then taken by the run loop), waiting for the
//! command lens-probe started, and pausing or resuming a target.
use std::fs;

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
pub(super) fn stop_signals() -> libc::sigset_t {
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

/// `work` with every signal blocked in the calling thread, then its mask as it was: a
/// signal for the process goes to another thread meanwhile, or waits until then.
pub fn with_signals_blocked<T>(work: impl FnOnce() -> T) -> T {
    // SAFETY: plain sigset_t values filled by the libc calls; this thread's mask only.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut before: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut before);
        let result = work();
        libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut());
        result
    }
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
