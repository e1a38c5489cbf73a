//! A CPU clock on one thread that runs a BPF program at each tick (a software
//! `cpu-clock` perf event on the task). Opened with `inherit` and `inherit_thread`: the
//! threads it starts later get a clock of their own (the same period, program and
//! enabled state), the processes it forks do not; and with `remove_on_exec`: a program
//! it executes is not sampled as the one before was. Enabling or disabling it does the
//! same to its inherited clocks.
//!
//! Per-thread clocks tick only where lens-probe samples (a clock on every CPU interrupts
//! every process on the node), and each can run at its own rate.
use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    time::Duration,
};

/// `struct perf_event_attr` up to `config1` (`PERF_ATTR_SIZE_VER0`): all a clock needs.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_CPU_CLOCK: u64 = 0;
// Bits of `perf_event_attr`'s flags word (include/uapi/linux/perf_event.h).
const DISABLED: u64 = 1 << 0;
const INHERIT: u64 = 1 << 1;
const INHERIT_THREAD: u64 = 1 << 35;
const REMOVE_ON_EXEC: u64 = 1 << 36;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
// `_IO('$', 0)`, `_IO('$', 1)`, `_IOW('$', 8, __u32)`.
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
const PERF_EVENT_IOC_DISABLE: libc::c_ulong = 0x2401;
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;

/// One thread's clock (and, through inheritance, its later threads').
#[derive(Debug)]
pub struct ThreadClock {
    fd: OwnedFd,
}

impl ThreadClock {
    /// A clock ticking every `period` of thread `tid`'s running time, running `program`
    /// (a `perf_event` BPF program's fd) at each tick; disabled until [`Self::enable`].
    /// ESRCH: the thread has ended. EINVAL: a kernel older than `inherit_thread` (5.13).
    pub fn open(tid: u32, period: Duration, program: BorrowedFd<'_>) -> io::Result<ThreadClock> {
        let attr = PerfEventAttr {
            kind: PERF_TYPE_SOFTWARE,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: PERF_COUNT_SW_CPU_CLOCK,
            sample_period: period.as_nanos() as u64,
            flags: DISABLED | INHERIT | INHERIT_THREAD | REMOVE_ON_EXEC,
            ..PerfEventAttr::default()
        };
        // SAFETY: `attr` is a valid, initialized perf_event_attr of the size it states;
        // the kernel only reads it.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                &attr as *const PerfEventAttr,
                tid as libc::pid_t,
                -1 as libc::c_int,
                -1 as libc::c_int,
                PERF_FLAG_FD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor the kernel just returned, owned by nothing else.
        let clock = ThreadClock {
            fd: unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) },
        };
        clock.ioctl(PERF_EVENT_IOC_SET_BPF, program.as_raw_fd() as libc::c_ulong)?;
        Ok(clock)
    }

    /// Ticks from now on, on the thread and the threads it started.
    pub fn enable(&self) -> io::Result<()> {
        self.ioctl(PERF_EVENT_IOC_ENABLE, 0)
    }

    /// No ticks until enabled again.
    pub fn disable(&self) -> io::Result<()> {
        self.ioctl(PERF_EVENT_IOC_DISABLE, 0)
    }

    fn ioctl(&self, request: libc::c_ulong, arg: libc::c_ulong) -> io::Result<()> {
        // SAFETY: a perf event descriptor we own; these requests take an integer.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), request, arg) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attr_is_the_kernels_first_published_size() {
        // PERF_ATTR_SIZE_VER0: a kernel takes any size from it on.
        assert_eq!(std::mem::size_of::<PerfEventAttr>(), 64);
        assert_eq!(std::mem::offset_of!(PerfEventAttr, flags), 40);
    }
}
