//! Leaving: lens-probe exits at once, and the kernel removes its probes afterwards, all of
//! them at the same time.
//!
//! The kernel removes a uprobe link when its last file descriptor closes, and each removal
//! waits for grace periods (SRCU and RCU Tasks Trace, tens of ms here), one removal after
//! another when one thread closes them all: with a link per traced process and library,
//! 8 traced torch processes held 190 links and took 7.1 s to let go, 32 took 28 s, and
//! until then the breakpoints stay in the traced processes (which may still run) and
//! every other uprobe user on the node waits. Grace periods that several closers wait for
//! at the same time are shared, so the descriptors are closed by a thread each.
//!
//! Threads cannot be started safely in the child of a threaded process, so the child that
//! outlives lens-probe executes lens-probe again, as [`TEARDOWN_ARG`], with the
//! descriptors and nothing else.

use std::{
    ffi::CString,
    os::fd::{FromRawFd, OwnedFd},
};

/// lens-probe's first argument in the process that closes the descriptors it inherited
/// ([`close_inherited`]); not an option a user gives.
pub const TEARDOWN_ARG: &str = "--internal-teardown";

/// Exits with `code` at once. A child inherits the descriptors and, once we are gone (so
/// that our exit is not the last close of any), lets the kernel remove the probes in
/// parallel (see the module's comment): whoever waits for lens-probe (a shell, a SLURM
/// epilog) does not wait for that.
pub fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // Everything the child needs, made before the fork (it may not allocate).
    let fds = open_fds();
    let highest = fds.iter().copied().max().unwrap_or(2);
    // Files, sockets, locks (the spool's): let go by the child at once, so that a
    // lens-probe started right after ours finds them free. It keeps the kernel objects.
    let plain: Vec<i32> = fds
        .into_iter()
        .filter(|fd| {
            std::fs::read_link(format!("/proc/self/fd/{fd}"))
                .is_ok_and(|target| !target.to_string_lossy().starts_with("anon_inode:"))
        })
        .collect();
    let programs: Vec<CString> = [
        std::fs::read_link("/proc/self/exe").ok(),
        Some("/proc/self/exe".into()),
    ]
    .into_iter()
    .flatten()
    .filter_map(|path| CString::new(path.into_os_string().into_encoded_bytes()).ok())
    .collect();
    let name = CString::new("lens-probe").expect("no NUL");
    let arg = CString::new(TEARDOWN_ARG).expect("no NUL");
    let argv = [name.as_ptr(), arg.as_ptr(), std::ptr::null()];
    let envp = [std::ptr::null()];
    // SAFETY: fork, then only async-signal-safe calls (setsid, close, getppid, nanosleep,
    // fcntl, execve, _exit) in the child; the parent only exits.
    unsafe {
        let parent = libc::getpid();
        if libc::fork() == 0 {
            libc::setsid();
            // Nothing to say: let go of the terminal and of pipes others read to EOF.
            for fd in (0..3).chain(plain.iter().copied()) {
                libc::close(fd);
            }
            // Hold the descriptors until the parent is gone, so that its exit is not the
            // last close; ours are.
            let pause = libc::timespec {
                tv_sec: 0,
                tv_nsec: 2_000_000,
            };
            while libc::getppid() == parent {
                libc::nanosleep(&pause, std::ptr::null_mut());
            }
            for fd in 3..=highest {
                libc::fcntl(fd, libc::F_SETFD, 0);
            }
            for program in &programs {
                libc::execve(program.as_ptr(), argv.as_ptr(), envp.as_ptr());
            }
            // No exec (the binary is gone): the descriptors close one after another.
            libc::_exit(0);
        }
        libc::_exit(code)
    }
}

/// This process's open descriptors above the standard ones.
fn open_fds() -> Vec<i32> {
    std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.flatten()
                .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
                .filter(|fd| *fd > 2)
                .collect()
        })
        .unwrap_or_default()
}

/// As [`TEARDOWN_ARG`]: closes every descriptor inherited, each on a thread of its own,
/// all at the same time; returns once all are closed (each close returns once the kernel
/// has removed what it held).
pub fn close_inherited() {
    let fds = open_fds()
        .into_iter()
        // The directory listing's own descriptor was among them, and is closed by now.
        // SAFETY: fcntl only asks whether `fd` is open.
        .filter(|fd| unsafe { libc::fcntl(*fd, libc::F_GETFD) } != -1)
        .map(|fd| {
            // SAFETY: descriptors inherited from lens-probe and open, used by nothing
            // else here: each is owned once.
            unsafe { OwnedFd::from_raw_fd(fd) }
        });
    for closer in drop_each_on_a_thread(fds) {
        let _ = closer.join();
    }
}

/// Drops each of `links` on a thread of its own, now, without waiting: a link's removal
/// waits for grace periods, which concurrent removals share (see the module's comment).
/// For the links of a process that ended while lens-probe goes on; a removal still under
/// way when lens-probe exits holds its exit up.
pub fn release_in_background<L: Send + 'static>(links: Vec<L>) {
    drop(drop_each_on_a_thread(links));
}

/// Drops each of `items` on a thread of its own, all at once, and returns the threads.
/// One no thread could be started for is dropped here, waiting.
fn drop_each_on_a_thread<T: Send + 'static>(
    items: impl IntoIterator<Item = T>,
) -> Vec<std::thread::JoinHandle<()>> {
    items
        .into_iter()
        .filter_map(|item| {
            let spawned = std::thread::Builder::new()
                .name("lens-release".into())
                .stack_size(64 * 1024)
                .spawn(move || drop(item));
            spawned
                .inspect_err(|error| {
                    log::debug!("cannot start a thread to remove a probe link: {error}")
                })
                .ok()
        })
        .collect()
}
