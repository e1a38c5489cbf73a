//! A target stopped at a library load (see `docs/architecture.md`) waits for lens-probe's
//! SIGCONT. If lens-probe dies first (SIGKILL, the OOM killer), or is stopped or stuck,
//! nobody would send it. The guardian, a small process forked at start-up, learns each
//! target's pid through a socket, and the kernel map of the stops the probes made
//! (`STOPPED`: pid → when) as a file descriptor passed over it. A stop that lasted
//! [`MAX_HOLD`] while lens-probe itself was stopped (SIGSTOP, a debugger, a frozen
//! cgroup), or [`MAX_HOLD_WORKING`] in any case (stuck), is ended by the guardian (lens-probe counts it as
//! a library attached late); when the socket closes (lens-probe gone, however it
//! ended), it continues every stopped target, and every stopped child of one (a child is
//! traced before lens-probe hears of it), then exits.
use std::{
    collections::HashSet,
    io::Write,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::net::UnixStream,
    },
    time::Duration,
};

/// How long a target waits at a library load while lens-probe is stopped (SIGSTOP, a
/// debugger, a frozen cgroup): then the guardian lets it go on.
pub const MAX_HOLD: Duration = Duration::from_millis(500);

/// How long it waits at most, whatever lens-probe does: attaching libtorch's probes reads
/// a symbol table of ~10^5 names, and each uprobe waits for the kernel, which another
/// tracer's teardown can hold up for seconds (neither is lens-probe being stuck, and
/// letting the target go would lose its first steps).
pub const MAX_HOLD_WORKING: Duration = Duration::from_secs(30);

/// How often the guardian looks at the stops.
const CHECK_EVERY: Duration = Duration::from_millis(100);

pub struct Guardian {
    socket: UnixStream,
}

impl Guardian {
    /// Forks the guardian. Call while lens-probe is still single-threaded: the child runs
    /// ordinary Rust code after the fork.
    pub fn start() -> std::io::Result<Guardian> {
        let (ours, theirs) = UnixStream::pair()?;
        // SAFETY: the caller guarantees a single-threaded process, so the child may do
        // anything the parent could.
        match unsafe { libc::fork() } {
            -1 => Err(std::io::Error::last_os_error()),
            0 => {
                drop(ours);
                guard(theirs)
            }
            _ => Ok(Guardian { socket: ours }),
        }
    }

    /// `pid` is a target now.
    pub fn watch(&mut self, pid: u32) {
        // A guardian that is gone cannot help; tracing goes on.
        let _ = self.socket.write_all(&pid.to_le_bytes());
    }

    /// The kernel map of stops (`lens_common::maps::STOPPED`), for the guardian to end
    /// the ones that last too long.
    pub fn share_stops(&mut self, map: RawFd) {
        let _ = send_fd(&self.socket, map);
    }
}

fn guard(socket: UnixStream) -> ! {
    // SAFETY: plain signal dispositions of this process. A Ctrl-C on the terminal reaches
    // the whole process group; the guardian must outlive lens-probe, not die with it.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
    // All it does is SIGCONT, to processes of other users too, and read and delete the
    // entries of one map it was handed: CAP_KILL, nothing else.
    let _ =
        crate::sys::privileges::keep_only_in_this_thread(crate::sys::privileges::CAP_KILL.mask());
    let _ = socket.set_read_timeout(Some(CHECK_EVERY));
    let mut known = HashSet::new();
    let mut stops: Option<OwnedFd> = None;
    let mut pending = Vec::new();
    // SAFETY: plain getppid: the parent is lens-probe.
    let lens_probe = unsafe { libc::getppid() } as u32;
    let mut stopped = StoppedFor::new(lens_probe);
    loop {
        let mut buffer = [0u8; 64];
        match receive(&socket, &mut buffer) {
            // EOF: every write end is closed, lens-probe is gone.
            Ok((0, _)) => break,
            Ok((read, fd)) => {
                if let Some(fd) = fd {
                    stops = Some(fd);
                }
                pending.extend_from_slice(&buffer[..read]);
                for &pid in pending.as_chunks::<4>().0 {
                    known.insert(u32::from_le_bytes(pid));
                }
                let whole = pending.len() / 4 * 4;
                pending.drain(..whole);
            }
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => break,
        }
        if let Some(stops) = &stops {
            end_long_stops(stops.as_raw_fd(), stopped.duration());
        }
    }
    known.remove(&0);
    continue_stopped(&known);
    // SAFETY: ends this process without running the parent's exit handlers.
    unsafe { libc::_exit(0) }
}

/// How long lens-probe has been stopped (state `T` or `t`), as seen at each check.
struct StoppedFor {
    pid: u32,
    since: Option<std::time::Instant>,
}

impl StoppedFor {
    fn new(pid: u32) -> StoppedFor {
        StoppedFor { pid, since: None }
    }

    fn duration(&mut self) -> Duration {
        let stopped = matches!(state_and_parent(self.pid), Some((b'T' | b't', _)));
        match (stopped, self.since) {
            (false, _) => {
                self.since = None;
                Duration::ZERO
            }
            (true, None) => {
                self.since = Some(std::time::Instant::now());
                Duration::ZERO
            }
            (true, Some(since)) => since.elapsed(),
        }
    }
}

/// Continues every target the probes stopped while lens-probe has been stopped for
/// [`MAX_HOLD`] (`lens_probe_stopped`), however recent the stop: a process loading many
/// libraries stops at each, and waiting [`MAX_HOLD`] at every one added up to seconds
/// (25 stops of one `import ctypes` on a loaded machine: 16 s); or stopped longer than
/// [`MAX_HOLD_WORKING`] ago in any case. Its entry is deleted first: lens-probe, finding
/// it gone when it resumes the target, knows it was late.
fn end_long_stops(map: RawFd, lens_probe_stopped: Duration) {
    let now = monotonic_ns();
    let mut key: Option<u32> = None;
    let mut due = Vec::new();
    while let Some(pid) = bpf_next_key(map, key) {
        key = Some(pid);
        let Some(since) = bpf_lookup(map, pid) else {
            continue;
        };
        let held = Duration::from_nanos(now.saturating_sub(since));
        if held >= MAX_HOLD_WORKING || lens_probe_stopped >= MAX_HOLD {
            due.push(pid);
        }
    }
    for pid in due {
        if bpf_delete(map, pid) {
            // SAFETY: plain signal send.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
        }
    }
}

fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: fills a local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// `union bpf_attr` as the map-element commands read it.
#[repr(C)]
struct MapElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value_or_next_key: u64,
    flags: u64,
}

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;

fn bpf(command: libc::c_long, attr: &mut MapElemAttr) -> bool {
    // SAFETY: the bpf(2) map-element commands with a fully initialised attribute whose
    // pointers point at live locals of the caller.
    unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            attr as *mut MapElemAttr,
            std::mem::size_of::<MapElemAttr>() as libc::c_uint,
        ) == 0
    }
}

fn bpf_next_key(map: RawFd, key: Option<u32>) -> Option<u32> {
    let current = key.unwrap_or(0);
    let mut next = 0u32;
    let mut attr = MapElemAttr {
        map_fd: map as u32,
        _pad: 0,
        // A null key asks for the first one.
        key: key.map_or(0, |_| &current as *const u32 as u64),
        value_or_next_key: &mut next as *mut u32 as u64,
        flags: 0,
    };
    bpf(BPF_MAP_GET_NEXT_KEY, &mut attr).then_some(next)
}

fn bpf_lookup(map: RawFd, pid: u32) -> Option<u64> {
    let mut value = 0u64;
    let mut attr = MapElemAttr {
        map_fd: map as u32,
        _pad: 0,
        key: &pid as *const u32 as u64,
        value_or_next_key: &mut value as *mut u64 as u64,
        flags: 0,
    };
    bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).then_some(value)
}

/// Deletes `pid`'s entry; false if it was not there (lens-probe resumed it meanwhile).
pub(crate) fn bpf_delete(map: RawFd, pid: u32) -> bool {
    let mut attr = MapElemAttr {
        map_fd: map as u32,
        _pad: 0,
        key: &pid as *const u32 as u64,
        value_or_next_key: 0,
        flags: 0,
    };
    bpf(BPF_MAP_DELETE_ELEM, &mut attr)
}

/// Sends `fd` (and one byte) over `socket` (SCM_RIGHTS).
fn send_fd(socket: &UnixStream, fd: RawFd) -> std::io::Result<()> {
    // Pid messages are 4 bytes: a lone marker byte would split them, so the descriptor
    // rides on a message of no pid bytes... but sendmsg needs one byte: a 4-byte zero pid
    // (never a process) carries it.
    let data = 0u32.to_le_bytes();
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: msghdr and its control buffer are locals that outlive the call; the cmsg
    // macros stay within `control`.
    unsafe {
        let mut message: libc::msghdr = std::mem::zeroed();
        message.msg_iov = &mut iov;
        message.msg_iovlen = 1;
        message.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        message.msg_controllen = space as _;
        let header = libc::CMSG_FIRSTHDR(&message);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(header) as *mut RawFd, fd);
        if libc::sendmsg(socket.as_raw_fd(), &message, libc::MSG_NOSIGNAL) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Reads what `socket` has (blocking up to its timeout): the bytes read and a
/// descriptor passed with them, if any.
fn receive(socket: &UnixStream, buffer: &mut [u8]) -> std::io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buffer.as_mut_ptr() as *mut libc::c_void,
        iov_len: buffer.len(),
    };
    // SAFETY: as in `send_fd`.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: as in `send_fd`; a descriptor received is owned from here on.
    unsafe {
        let mut message: libc::msghdr = std::mem::zeroed();
        message.msg_iov = &mut iov;
        message.msg_iovlen = 1;
        message.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        message.msg_controllen = space as _;
        let read = libc::recvmsg(socket.as_raw_fd(), &mut message, libc::MSG_CMSG_CLOEXEC);
        if read < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let header = libc::CMSG_FIRSTHDR(&message);
        let fd = (!header.is_null()
            && (*header).cmsg_level == libc::SOL_SOCKET
            && (*header).cmsg_type == libc::SCM_RIGHTS)
            .then(|| {
                OwnedFd::from_raw_fd(std::ptr::read_unaligned(
                    libc::CMSG_DATA(header) as *const RawFd
                ))
            });
        Ok((read as usize, fd))
    }
}

/// State and parent of `pid` from /proc/PID/stat (the command may contain anything, so
/// the fields are read after its closing parenthesis).
fn state_and_parent(pid: u32) -> Option<(u8, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.bytes().next()?;
    let parent = fields.next()?.parse().ok()?;
    Some((state, parent))
}

fn continue_stopped(known: &HashSet<u32>) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some((b'T', parent)) = state_and_parent(pid)
            && (known.contains(&pid) || known.contains(&parent))
        {
            // SAFETY: plain signal send.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_state_and_parent_of_a_process() {
        let (state, parent) = state_and_parent(std::process::id()).unwrap();
        assert!(matches!(state, b'R' | b'S'), "{}", state as char);
        // SAFETY: plain getppid.
        assert_eq!(parent, unsafe { libc::getppid() } as u32);
    }

    #[test]
    fn a_descriptor_passes_over_the_socket_with_its_pid_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        send_fd(&a, file.as_raw_fd()).unwrap();
        let mut buffer = [0u8; 16];
        let (read, fd) = receive(&b, &mut buffer).unwrap();
        assert_eq!(read, 4);
        assert_eq!(&buffer[..4], &[0, 0, 0, 0]);
        assert!(fd.is_some());
    }
}
