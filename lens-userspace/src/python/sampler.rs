//! The Python sampler's kernel side: the `python_sample` program on the CPU clocks of the
//! sampled processes' threads (`PY_TARGETS` says how each process is read:
//! `bpf::maps`), each process at the rate the tracker asks for ([`SampleRate`]).
//!
//! The clocks are the threads', not the CPUs': a 1 kHz clock interrupt costs the thread
//! it lands on several percent of its time on a virtual machine (docs/performance.md),
//! and a clock on every CPU took that from every process on the node, traced or not.
use std::{
    collections::{HashMap, HashSet},
    io,
    os::fd::AsFd,
    time::Duration,
};

use aya::{
    Ebpf,
    programs::{PerfEvent, ProgramFd},
};

use crate::{
    error::{LensError, Result},
    sys::{process::Process, thread_clock::ThreadClock},
};

const PROGRAM: &str = "python_sample";

/// How often a followed process's threads are sampled (docs/python.md: the precision of
/// a Python span's ends).
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(1);

/// How often a watched process's threads are sampled: often enough to see within a few
/// of them that a framework has begun to run.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(10);

/// How closely a process is sampled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleRate {
    /// Every [`WATCH_INTERVAL`]: no rule's function can be running unseen.
    Watch,
    /// Every [`SAMPLE_INTERVAL`]: a rule's function runs or may begin at any time.
    Follow,
}

impl SampleRate {
    /// How much of a thread's running time passes between two of its samples.
    pub fn interval(self) -> Duration {
        match self {
            SampleRate::Watch => WATCH_INTERVAL,
            SampleRate::Follow => SAMPLE_INTERVAL,
        }
    }
}

/// The sampler: its program, and the clocks of the processes it samples.
pub struct Sampler {
    program: ProgramFd,
    processes: HashMap<u32, ProcessClocks>,
}

/// One process's clocks: two per thread that existed when it was added (its later threads
/// inherit them), one at each rate, the one of its rate enabled.
struct ProcessClocks {
    threads: Vec<ThreadClocks>,
    rate: SampleRate,
}

struct ThreadClocks {
    watch: ThreadClock,
    follow: ThreadClock,
}

impl ThreadClocks {
    fn open(tid: u32, program: &ProgramFd) -> io::Result<ThreadClocks> {
        Ok(ThreadClocks {
            watch: ThreadClock::open(tid, WATCH_INTERVAL, program.as_fd())?,
            follow: ThreadClock::open(tid, SAMPLE_INTERVAL, program.as_fd())?,
        })
    }

    /// The clock of `rate` on, the other off (off first: a thread is never sampled at
    /// both rates).
    fn run_at(&self, rate: SampleRate) -> io::Result<()> {
        let (on, off) = match rate {
            SampleRate::Watch => (&self.watch, &self.follow),
            SampleRate::Follow => (&self.follow, &self.watch),
        };
        off.disable()?;
        on.enable()
    }
}

/// [`ThreadClocks::open`], again after raising lens-probe's open-file limit if it was
/// reached. Raised only then, not at start: an `--exec` command inherits the limit.
fn open_raising_limit(tid: u32, program: &ProgramFd) -> io::Result<ThreadClocks> {
    match ThreadClocks::open(tid, program) {
        Err(error) if error.raw_os_error() == Some(libc::EMFILE) => {
            let limit = crate::sys::process::raise_open_files_limit()?;
            log::info!("open-file limit raised to {limit} for the sampler's clocks");
            ThreadClocks::open(tid, program)
        }
        opened => opened,
    }
}

impl Sampler {
    /// Loads the sampler's program; it samples no process yet. Fails on a kernel whose
    /// clocks cannot follow a thread's new threads alone (`inherit_thread`: Linux 5.13).
    pub fn load(ebpf: &mut Ebpf) -> Result<Sampler> {
        let program_error = |source| LensError::Program {
            program: PROGRAM,
            source,
        };
        let program: &mut PerfEvent = crate::bpf::program_mut(ebpf, PROGRAM)?;
        // Signals blocked: the verifier gives up on one pending (`bpf::programs`).
        crate::sys::target::with_signals_blocked(|| program.load()).map_err(program_error)?;
        let program = program
            .fd()
            .map_err(program_error)?
            .try_clone()
            .map_err(LensError::Io)?;
        // A clock on this thread, closed at once: whether the kernel has them.
        // SAFETY: gettid has no preconditions.
        let own_thread = unsafe { libc::gettid() } as u32;
        ThreadClock::open(own_thread, WATCH_INTERVAL, program.as_fd()).map_err(|error| {
            LensError::Io(io::Error::new(
                error.kind(),
                format!(
                    "per-thread CPU clocks (perf_event_open, inherit_thread: Linux 5.13+): {error}"
                ),
            ))
        })?;
        Ok(Sampler {
            program,
            processes: HashMap::new(),
        })
    }

    /// Samples `pid`'s threads at `rate` from now on: a clock on each of its threads,
    /// which its later threads inherit. Threads are listed until a listing finds none
    /// new. One started between two listings by a thread that had no clock yet has none;
    /// one started then by a thread that had gets a second (sampled twice as often).
    pub fn add(&mut self, pid: u32, rate: SampleRate) -> io::Result<()> {
        self.remove(pid);
        let mut threads = Vec::new();
        let mut seen = HashSet::new();
        loop {
            let new: Vec<u32> = Process::new(pid)
                .threads()?
                .into_iter()
                .filter(|tid| seen.insert(*tid))
                .collect();
            if new.is_empty() {
                break;
            }
            for tid in new {
                match open_raising_limit(tid, &self.program) {
                    Ok(clocks) => {
                        clocks.run_at(rate)?;
                        threads.push(clocks);
                    }
                    // It ended since the listing.
                    Err(error) if error.raw_os_error() == Some(libc::ESRCH) => {}
                    Err(error) => return Err(error),
                }
            }
        }
        self.processes.insert(pid, ProcessClocks { threads, rate });
        Ok(())
    }

    /// `pid`'s threads are sampled at `rate` from now on.
    pub fn set_rate(&mut self, pid: u32, rate: SampleRate) -> io::Result<()> {
        let Some(process) = self.processes.get_mut(&pid) else {
            return Ok(());
        };
        if process.rate == rate {
            return Ok(());
        }
        process.rate = rate;
        for thread in &process.threads {
            thread.run_at(rate)?;
        }
        Ok(())
    }

    /// `pid` is not sampled any more (its clocks are closed).
    pub fn remove(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }
}
