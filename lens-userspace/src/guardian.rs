//! A target stopped at a library load (see `docs/architecture.md`) waits for lens-probe's
//! SIGCONT. If lens-probe dies first (SIGKILL, the OOM killer), nobody would send it. The
//! guardian, a small process forked at start-up, learns each target's pid through a pipe;
//! when the pipe closes (lens-probe gone, however it ended), it continues every stopped
//! target, and every stopped child of one (a child is traced before lens-probe hears of
//! it), then exits.
use std::{
    collections::HashSet,
    fs::File,
    io::{Read, Write},
    os::fd::FromRawFd,
};

pub struct Guardian {
    pids: File,
}

impl Guardian {
    /// Forks the guardian. Call while lens-probe is still single-threaded: the child runs
    /// ordinary Rust code after the fork.
    pub fn start() -> std::io::Result<Guardian> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two fds we then own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: both fds are fresh and owned here.
        let (read, write) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        // SAFETY: the caller guarantees a single-threaded process, so the child may do
        // anything the parent could.
        match unsafe { libc::fork() } {
            -1 => Err(std::io::Error::last_os_error()),
            0 => {
                drop(write);
                guard(read)
            }
            _ => Ok(Guardian { pids: write }),
        }
    }

    /// `pid` is a target now.
    pub fn watch(&mut self, pid: u32) {
        // A guardian that is gone cannot help; tracing goes on.
        let _ = self.pids.write_all(&pid.to_le_bytes());
    }
}

fn guard(mut pids: File) -> ! {
    // SAFETY: plain signal dispositions of this process. A Ctrl-C on the terminal reaches
    // the whole process group; the guardian must outlive lens-probe, not die with it.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
    // All it does is SIGCONT, to processes of other users too: CAP_KILL, nothing else.
    let _ = crate::privileges::keep_only_in_this_thread(crate::privileges::CAP_KILL.mask());
    let mut known = HashSet::new();
    let mut buffer = [0u8; 4];
    // EOF (or an error): every write end is closed, lens-probe is gone.
    while pids.read_exact(&mut buffer).is_ok() {
        known.insert(u32::from_le_bytes(buffer));
    }
    continue_stopped(&known);
    // SAFETY: ends this process without running the parent's exit handlers.
    unsafe { libc::_exit(0) }
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
}
