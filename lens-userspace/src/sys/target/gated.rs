//! Starting the --exec command gated: forked, registered as a target, and let exec only
//! once its probes are in place.
use std::{
    ffi::{CString, OsStr, OsString},
    fs,
    io::{self, Read, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use super::signals::stop_signals;
use crate::error::{LensError, Result};

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
