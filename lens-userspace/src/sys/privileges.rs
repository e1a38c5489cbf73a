//! Privileges: what lens-probe needs to start (checked up front, so that the user gets one
//! line naming the missing capability instead of an EPERM from deep inside the loader),
//! what it needs to read a target of another user, and what it keeps once its probes are
//! in: every other capability is dropped, in every thread (see `docs/security.md`).
use std::{
    collections::BTreeSet,
    fs, io,
    path::{Path, PathBuf},
    sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use crate::error::{LensError, Result};

/// A Linux capability: its bit in the `Cap*` masks and its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Capability {
    pub bit: u32,
    pub name: &'static str,
}

impl Capability {
    pub const fn mask(self) -> u64 {
        1 << self.bit
    }

    fn held_in(self, set: u64) -> bool {
        set & self.mask() != 0
    }
}

pub const CAP_DAC_OVERRIDE: Capability = Capability {
    bit: 1,
    name: "CAP_DAC_OVERRIDE",
};
pub const CAP_DAC_READ_SEARCH: Capability = Capability {
    bit: 2,
    name: "CAP_DAC_READ_SEARCH",
};
pub const CAP_KILL: Capability = Capability {
    bit: 5,
    name: "CAP_KILL",
};
pub const CAP_SETPCAP: Capability = Capability {
    bit: 8,
    name: "CAP_SETPCAP",
};
pub const CAP_SYS_PTRACE: Capability = Capability {
    bit: 19,
    name: "CAP_SYS_PTRACE",
};
pub const CAP_SYS_ADMIN: Capability = Capability {
    bit: 21,
    name: "CAP_SYS_ADMIN",
};
pub const CAP_PERFMON: Capability = Capability {
    bit: 38,
    name: "CAP_PERFMON",
};
pub const CAP_BPF: Capability = Capability {
    bit: 39,
    name: "CAP_BPF",
};
pub const CAP_CHECKPOINT_RESTORE: Capability = Capability {
    bit: 40,
    name: "CAP_CHECKPOINT_RESTORE",
};

/// What lens-probe needs to start, whoever the target is:
/// - `CAP_BPF`: create the maps, load the programs (the kernel's `bpf_capable()`);
/// - `CAP_PERFMON`: tracing programs and what they call (`perfmon_capable()`);
/// - `CAP_SYS_ADMIN`: `perf_event_open` on the uprobe PMU, which checks for it alone
///   (EACCES with `CAP_PERFMON`), and following `/proc/PID/map_files/` links, through
///   which every library is read and attached to.
///
/// (Kernels up to at least 6.18 also accept `CAP_SYS_ADMIN` for the first two checks; the
/// start check asks for all three, the set the kernel documents for BPF tracing.)
pub const REQUIRED: [Capability; 3] = [CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN];

/// What reading a process of another user takes: `CAP_SYS_PTRACE` for the ptrace-read
/// check of `/proc/PID/{maps,environ,root}`, `CAP_DAC_READ_SEARCH` for the owner-only
/// `/proc/PID/environ` (0400) and `/proc/PID/map_files` (0500).
pub const FOR_OTHER_USERS: [Capability; 2] = [CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH];

/// Where the kernel publishes its uprobe PMU; absent on kernels without uprobe events.
pub const UPROBE_PMU_TYPE: &str = "/sys/bus/event_source/devices/uprobe/type";

pub fn check() -> Result<()> {
    check_uprobe_support(Path::new(UPROBE_PMU_TYPE))?;
    let status = fs::read_to_string("/proc/self/status")?;
    let missing = missing_capabilities(&status);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(LensError::MissingPrivileges {
            missing: missing.join(", "),
        })
    }
}

pub fn check_uprobe_support(pmu_type: &Path) -> Result<()> {
    if pmu_type.exists() {
        Ok(())
    } else {
        Err(LensError::NoUprobeSupport(pmu_type.to_path_buf()))
    }
}

/// A capability mask from a `Cap*:` line of a `/proc/PID/status` (0 when absent).
pub fn status_mask(proc_status: &str, field: &str) -> u64 {
    proc_status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0)
}

/// The capabilities of [`REQUIRED`] this process lacks, from the `CapEff:` line of
/// /proc/self/status.
pub fn missing_capabilities(proc_status: &str) -> Vec<&'static str> {
    let effective = status_mask(proc_status, "CapEff");
    REQUIRED
        .into_iter()
        .filter(|cap| !cap.held_in(effective))
        .map(|cap| cap.name)
        .collect()
}

/// Can lens-probe read what it needs of running process `pid` (`--pid`)? For a process of
/// another user that takes [`FOR_OTHER_USERS`]; without them the kernel says EACCES and
/// the process would be attached to nothing. One error naming what is missing instead.
pub fn check_target(pid: u32) -> Result<()> {
    let effective = status_mask(&fs::read_to_string("/proc/self/status")?, "CapEff");
    let proc = PathBuf::from(format!("/proc/{pid}"));
    if let Some(name) = kernel_thread(pid) {
        return Err(LensError::KernelThread { pid, name });
    }
    let denied = |path: PathBuf, error: io::Error| -> LensError {
        match error.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ESRCH) => LensError::NoSuchProcess(pid),
            Some(libc::EACCES) | Some(libc::EPERM) => {
                let missing: Vec<&str> = FOR_OTHER_USERS
                    .into_iter()
                    .filter(|cap| !cap.held_in(effective))
                    .map(|cap| cap.name)
                    .collect();
                if missing.is_empty() {
                    LensError::TargetRefused {
                        pid,
                        path,
                        reason: error.to_string(),
                    }
                } else {
                    LensError::TargetNotReadable {
                        pid,
                        path,
                        missing: format!("missing {}", missing.join(", ")),
                    }
                }
            }
            _ => LensError::ReadProc {
                path,
                source: error,
            },
        }
    };
    for file in ["maps", "environ"] {
        let path = proc.join(file);
        fs::File::open(&path).map_err(|error| denied(path, error))?;
    }
    let map_files = proc.join("map_files");
    fs::read_dir(&map_files)
        .and_then(|mut entries| entries.next().transpose())
        .map_err(|error| denied(map_files, error))?;
    Ok(())
}

/// The name of `pid` when it is a kernel thread (`PF_KTHREAD` in the flags of
/// `/proc/PID/stat`, field 9): it has no program, no maps, nothing to probe.
fn kernel_thread(pid: u32) -> Option<String> {
    const PF_KTHREAD: u64 = 0x0020_0000;
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`: comm may hold spaces and parentheses.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_string();
    let flags: u64 = rest.split_whitespace().nth(6)?.parse().ok()?;
    (flags & PF_KTHREAD != 0).then_some(name)
}

/// Capabilities that are kept after attaching (those of them that are held), each because
/// the run still needs it:
/// - [`REQUIRED`]: libraries loaded later (dlopen, a Python `import torch`) and, in node
///   mode, processes that start later are attached the same way;
/// - `CAP_SYS_PTRACE`: reading `/proc/PID/{maps,map_files,environ,root}` of a process is a
///   ptrace-read check, which fails for a process of another user and for one that holds
///   a capability lens-probe no longer has (a root job: every process of it has the full
///   set);
/// - `CAP_DAC_READ_SEARCH`: `/proc/PID/environ` (0400) and `/proc/PID/map_files` (0500)
///   of another user's process;
/// - `CAP_KILL`, node mode only: a process of another user is paused (SIGSTOP, then
///   SIGCONT) while its probes go in.
///
/// The map reads and updates, the ring buffer and the detaching of probes need none.
pub fn kept_after_attach(node_mode: bool, held: u64) -> u64 {
    let mut keep = 0;
    for cap in REQUIRED.into_iter().chain(FOR_OTHER_USERS) {
        keep |= cap.mask();
    }
    if node_mode {
        keep |= CAP_KILL.mask();
    }
    keep & held
}

/// Every capability's name, by bit (`capability.h` up to Linux 6.18).
const NAMES: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

/// The names of the capabilities in `mask`, lowest bit first (`CAP_<bit>` for one newer
/// than this list).
pub fn names(mask: u64) -> Vec<String> {
    (0..64)
        .filter(|bit| mask & (1 << bit) != 0)
        .map(|bit| {
            NAMES
                .get(bit)
                .map_or_else(|| format!("CAP_{bit}"), |name| name.to_string())
        })
        .collect()
}

/// What [`drop_after_attach`] left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dropped {
    /// The effective and permitted set of every thread now.
    pub kept: u64,
    /// What the permitted set lost.
    pub dropped: u64,
    /// The bounding set was cleared too (needs `CAP_SETPCAP`, which root has).
    pub bounding_cleared: bool,
}

/// Drops every capability lens-probe no longer needs once its probes are attached (see
/// [`kept_after_attach`]) from the effective, permitted and inheritable sets, clears the
/// ambient set and, when it may (`CAP_SETPCAP`), the bounding set of everything but what
/// is kept, and sets `no_new_privs`. Capabilities belong to threads, not processes: every
/// thread does it (signalled in turn, as glibc does for `setuid`), and the result is read
/// back from `/proc/self/task/*/status`.
///
/// Processes started before (an `--exec` command) keep what they had.
pub fn drop_after_attach(node_mode: bool) -> Result<Dropped> {
    let before = status_mask(&fs::read_to_string("/proc/self/status")?, "CapPrm");
    let keep = kept_after_attach(node_mode, before);
    let bounding_cleared = CAP_SETPCAP.held_in(status_mask(
        &fs::read_to_string("/proc/self/status")?,
        "CapEff",
    ));
    restrict_every_thread(keep)?;
    Ok(Dropped {
        kept: keep,
        dropped: before & !keep,
        bounding_cleared,
    })
}

/// [`drop_after_attach`], said in the log (`-v`); a failure is a warning: tracing goes on.
pub fn drop_unneeded(node_mode: bool) {
    match drop_after_attach(node_mode) {
        Ok(dropped) => log::info!(
            "capabilities kept: {}; dropped: {}",
            names(dropped.kept).join(", "),
            names(dropped.dropped).join(", ")
        ),
        Err(error) => log::warn!("{error}"),
    }
}

/// The calling thread (all of a single-threaded process, such as the guardian) keeps
/// `keep`, or what it has of it, and nothing else; as [`drop_after_attach`] does.
pub fn keep_only_in_this_thread(keep: u64) -> Result<()> {
    match restrict_this_thread(keep, last_capability()) {
        0 => Ok(()),
        errno => Err(LensError::CapabilityDrop {
            reason: io::Error::from_raw_os_error(errno).to_string(),
        }),
    }
}

/// The highest capability this kernel knows.
fn last_capability() -> u64 {
    fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(63)
}

// The plan every thread carries out, set before the first signal.
static PLAN_KEEP: AtomicU64 = AtomicU64::new(0);
static PLAN_LAST_CAP: AtomicU64 = AtomicU64::new(0);
static THREADS_DONE: AtomicUsize = AtomicUsize::new(0);
static THREAD_ERROR: AtomicI32 = AtomicI32::new(0);

/// The signal that asks a thread to restrict itself. A real-time signal nothing else here
/// uses; its previous disposition is restored afterwards.
fn restrict_signal() -> libc::c_int {
    libc::SIGRTMAX() - 3
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// The calling thread keeps `keep` and nothing else. Only raw system calls: it runs in a
/// signal handler. Returns 0 or an errno.
fn restrict_this_thread(keep: u64, last_cap: u64) -> i32 {
    // SAFETY: prctl and capset with valid arguments; no memory is shared but the two
    // local structures passed by pointer.
    unsafe {
        // The bounding set first: dropping from it needs CAP_SETPCAP, which goes next. A
        // thread without it keeps its bounding set (no_new_privs makes it moot: no exec
        // can raise anything).
        for bit in 0..=last_cap {
            if keep & (1 << bit) == 0 {
                libc::prctl(libc::PR_CAPBSET_DROP, bit as libc::c_ulong, 0, 0, 0);
            }
        }
        if libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        ) != 0
        {
            return *libc::__errno_location();
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return *libc::__errno_location();
        }
        let mut header = CapHeader {
            version: LINUX_CAPABILITY_VERSION_3,
            pid: 0,
        };
        let mut data = [CapData::default(); 2];
        if libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) != 0 {
            return *libc::__errno_location();
        }
        for (half, word) in data.iter_mut().enumerate() {
            let keep = (keep >> (32 * half)) as u32;
            word.permitted &= keep;
            word.effective = word.permitted;
            word.inheritable = 0;
        }
        if libc::syscall(libc::SYS_capset, &header, data.as_ptr()) != 0 {
            return *libc::__errno_location();
        }
    }
    0
}

extern "C" fn on_restrict_signal(_: libc::c_int) {
    // SAFETY: errno is thread-local; saved and restored around the handler's calls.
    let saved = unsafe { *libc::__errno_location() };
    let error = restrict_this_thread(
        PLAN_KEEP.load(Ordering::SeqCst),
        PLAN_LAST_CAP.load(Ordering::SeqCst),
    );
    if error != 0 {
        THREAD_ERROR.store(error, Ordering::SeqCst);
    }
    THREADS_DONE.fetch_add(1, Ordering::SeqCst);
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = saved };
}

/// The threads of this process that still hold more than `keep`, or still have an
/// inheritable or ambient capability, or not `no_new_privs`.
fn unrestricted_threads(keep: u64) -> io::Result<BTreeSet<u32>> {
    let mut threads = BTreeSet::new();
    for entry in fs::read_dir("/proc/self/task")? {
        let Some(tid) = entry?.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        // A thread that just exited has no status any more.
        if let Ok(status) = fs::read_to_string(format!("/proc/self/task/{tid}/status"))
            && !restricted(&status, keep)
        {
            threads.insert(tid);
        }
    }
    Ok(threads)
}

/// Whether a thread's `status` shows it restricted to `keep`.
fn restricted(status: &str, keep: u64) -> bool {
    (status_mask(status, "CapEff") | status_mask(status, "CapPrm")) & !keep == 0
        && status_mask(status, "CapInh") == 0
        && status_mask(status, "CapAmb") == 0
        && status
            .lines()
            .any(|line| line.split_whitespace().eq(["NoNewPrivs:", "1"]))
}

fn restrict_every_thread(keep: u64) -> Result<()> {
    let failed = |reason: String| LensError::CapabilityDrop { reason };
    let last_cap = last_capability();
    PLAN_KEEP.store(keep, Ordering::SeqCst);
    PLAN_LAST_CAP.store(last_cap, Ordering::SeqCst);
    THREAD_ERROR.store(0, Ordering::SeqCst);

    // This thread first.
    let error = restrict_this_thread(keep, last_cap);
    if error != 0 {
        return Err(failed(io::Error::from_raw_os_error(error).to_string()));
    }
    // SAFETY: getpid/gettid have no preconditions.
    let (pid, me) = unsafe { (libc::getpid(), libc::syscall(libc::SYS_gettid) as u32) };

    let signal = restrict_signal();
    // SAFETY: a zeroed sigaction is valid; the handler only makes raw system calls and
    // touches atomics.
    let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_restrict_signal as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(signal, &action, &mut previous) != 0 {
            return Err(failed(io::Error::last_os_error().to_string()));
        }
    }
    // Threads may start threads meanwhile (with what their creator had): repeat until
    // every thread there is holds `keep` at most.
    let deadline = Instant::now() + Duration::from_secs(5);
    let outcome = loop {
        let pending = match unrestricted_threads(keep) {
            Ok(threads) => threads,
            Err(error) => break Err(failed(error.to_string())),
        };
        if pending.is_empty() {
            break Ok(());
        }
        if Instant::now() > deadline {
            break Err(failed(format!(
                "threads {pending:?} did not drop their capabilities"
            )));
        }
        THREADS_DONE.store(0, Ordering::SeqCst);
        let mut signalled = 0;
        for tid in pending.iter().filter(|tid| **tid != me) {
            // SAFETY: a signal to a thread of this process; ESRCH if it just exited.
            if unsafe { libc::syscall(libc::SYS_tgkill, pid, *tid as libc::pid_t, signal) } == 0 {
                signalled += 1;
            }
        }
        let wait_until = Instant::now() + Duration::from_millis(500);
        while THREADS_DONE.load(Ordering::SeqCst) < signalled && Instant::now() < wait_until {
            std::thread::sleep(Duration::from_millis(1));
        }
        let error = THREAD_ERROR.load(Ordering::SeqCst);
        if error != 0 {
            break Err(failed(io::Error::from_raw_os_error(error).to_string()));
        }
    };
    // SAFETY: restores the disposition saved above.
    unsafe { libc::sigaction(signal, &previous, std::ptr::null_mut()) };
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_has_everything() {
        assert!(missing_capabilities("Name:\tx\nCapEff:\t000001ffffffffff\n").is_empty());
    }

    #[test]
    fn an_unprivileged_user_misses_all_three() {
        assert_eq!(
            missing_capabilities("CapEff:\t0000000000000000\n"),
            ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_ADMIN"]
        );
    }

    #[test]
    fn bpf_and_perfmon_without_sys_admin() {
        let caps = CAP_BPF.mask() | CAP_PERFMON.mask();
        let status = format!("CapEff:\t{caps:016x}\n");
        assert_eq!(missing_capabilities(&status), ["CAP_SYS_ADMIN"]);
        // It is not a stand-in: the uprobe PMU asks for CAP_SYS_ADMIN itself.
        let caps = caps | CAP_CHECKPOINT_RESTORE.mask();
        let status = format!("CapEff:\t{caps:016x}\n");
        assert_eq!(missing_capabilities(&status), ["CAP_SYS_ADMIN"]);
    }

    #[test]
    fn status_masks_are_read_by_field() {
        let status = "CapInh:\t0000000000000000\nCapPrm:\t000001ffffffffff\n\
                      CapEff:\t0000000000200000\nCapBnd:\t000001ffffffffff\n";
        assert_eq!(status_mask(status, "CapEff"), CAP_SYS_ADMIN.mask());
        assert_eq!(status_mask(status, "CapPrm"), 0x1ff_ffff_ffff);
        assert_eq!(status_mask(status, "CapAmb"), 0);
    }

    #[test]
    fn a_thread_is_restricted_when_nothing_more_is_left_to_it() {
        let keep = CAP_BPF.mask() | CAP_SYS_ADMIN.mask();
        let status = |eff: u64, prm: u64, inh: u64, amb: u64, nnp: u8| {
            format!(
                "CapInh:\t{inh:016x}\nCapPrm:\t{prm:016x}\nCapEff:\t{eff:016x}\n\
                 CapAmb:\t{amb:016x}\nNoNewPrivs:\t{nnp}\n"
            )
        };
        assert!(restricted(&status(keep, keep, 0, 0, 1), keep));
        assert!(restricted(&status(0, CAP_BPF.mask(), 0, 0, 1), keep));
        assert!(!restricted(&status(keep, keep | 1, 0, 0, 1), keep));
        assert!(!restricted(&status(keep, keep, keep, 0, 1), keep));
        assert!(!restricted(&status(keep, keep, 0, keep, 1), keep));
        assert!(!restricted(&status(keep, keep, 0, 0, 0), keep));
    }

    #[test]
    fn root_keeps_only_what_the_run_needs() {
        let root = 0x1ff_ffff_ffff;
        assert_eq!(
            names(kept_after_attach(false, root)),
            [
                "CAP_DAC_READ_SEARCH",
                "CAP_SYS_PTRACE",
                "CAP_SYS_ADMIN",
                "CAP_PERFMON",
                "CAP_BPF"
            ]
        );
        assert_eq!(
            names(kept_after_attach(true, root)),
            [
                "CAP_DAC_READ_SEARCH",
                "CAP_KILL",
                "CAP_SYS_PTRACE",
                "CAP_SYS_ADMIN",
                "CAP_PERFMON",
                "CAP_BPF"
            ]
        );
    }

    #[test]
    fn the_minimal_set_is_kept_whole_and_nothing_is_added() {
        let minimal = CAP_BPF.mask() | CAP_PERFMON.mask() | CAP_SYS_ADMIN.mask();
        assert_eq!(kept_after_attach(false, minimal), minimal);
        assert_eq!(kept_after_attach(true, minimal), minimal);
        let with_ptrace = minimal | CAP_SYS_PTRACE.mask() | CAP_DAC_READ_SEARCH.mask();
        assert_eq!(kept_after_attach(false, with_ptrace), with_ptrace);
        assert_eq!(kept_after_attach(false, 0), 0);
        assert_eq!(names(1 << 12), ["CAP_NET_ADMIN"]);
        assert_eq!(names(1 << 41), ["CAP_41"]);
        for cap in [
            CAP_DAC_OVERRIDE,
            CAP_DAC_READ_SEARCH,
            CAP_KILL,
            CAP_SETPCAP,
            CAP_SYS_PTRACE,
            CAP_SYS_ADMIN,
            CAP_PERFMON,
            CAP_BPF,
            CAP_CHECKPOINT_RESTORE,
        ] {
            assert_eq!(NAMES[cap.bit as usize], cap.name);
        }
    }

    #[test]
    fn a_kernel_without_the_uprobe_pmu_is_named() {
        let error = check_uprobe_support(Path::new("/nonexistent/uprobe/type")).unwrap_err();
        assert!(error.to_string().contains("no uprobe support"), "{error}");
    }

    #[test]
    fn a_missing_target_is_no_such_process() {
        let error = check_target(u32::MAX - 1).unwrap_err();
        assert!(matches!(error, LensError::NoSuchProcess(_)), "{error}");
    }

    #[test]
    fn a_kernel_thread_is_named_as_one() {
        // kthreadd is pid 2 on Linux.
        let error = check_target(2).unwrap_err().to_string();
        assert_eq!(
            error,
            "pid 2 (kthreadd) is a kernel thread: it runs no program to trace"
        );
    }
}
