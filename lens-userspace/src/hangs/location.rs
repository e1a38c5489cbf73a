//! Where a rank of a hung collective is, read from the process at that moment (not from
//! samples): its Python stack, walked from `_PyRuntime` through `/proc/PID/mem` with the
//! interpreter layout the sampler uses, and the native place its thread is blocked at,
//! from `/proc/PID/task/TID/syscall` (the instruction pointer and stack pointer): the
//! function holding the instruction pointer, then its callers as a stack scan finds them
//! (words on the stack that point just after a call instruction in a mapped file), named
//! from the mapped files' symbols. A scan needs no frame pointers or unwind tables; it
//! can show a stale return address left on the stack, which is why it says "scanned".
use std::{fmt, fs::File, os::unix::fs::FileExt, path::Path};

use lens_common::{PY_NO_FIELD, PyOffsets};

use crate::{
    python::{self, code::CodeReader},
    sys::{process::Process, symbols, text::Printable},
};

/// Frames read per stack, innermost first.
const MAX_FRAMES: usize = 64;
/// Thread states walked per interpreter.
const MAX_THREADS: usize = 256;

/// One Python frame: function, file, and the line it is at (3.11+; on 3.10 the line its
/// function's definition starts at).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyFrame {
    pub function: String,
    pub file: String,
    pub line: Option<u32>,
}

impl fmt::Display for PyFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Names the target wrote: shown escaped (`sys::text`).
        let (function, file) = (Printable(&self.function), Printable(&self.file));
        match self.line {
            Some(line) => write!(f, "{function} ({file}:{line})"),
            None => write!(f, "{function} ({file})"),
        }
    }
}

/// A native function and the file it is in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NativeFrame {
    pub function: Option<String>,
    pub file: String,
}

impl fmt::Display for NativeFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let file = Printable(self.file.rsplit('/').next().unwrap_or(&self.file));
        match &self.function {
            Some(function) => write!(f, "{} ({file})", Printable(function)),
            None => write!(f, "{file}"),
        }
    }
}

/// A blocked thread's native place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NativePlace {
    /// The system call it is in, if it is in one.
    pub syscall: Option<String>,
    /// Where its instruction pointer is, then callers found by the stack scan.
    pub frames: Vec<NativeFrame>,
}

impl fmt::Display for NativePlace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let frames: Vec<String> = self.frames.iter().map(ToString::to_string).collect();
        if frames.is_empty() && self.syscall.is_none() {
            return write!(f, "running (not in a system call)");
        }
        if frames.is_empty() {
            write!(f, "?")?;
        } else {
            write!(f, "{}", frames.join(" < "))?;
        }
        if let Some(syscall) = &self.syscall {
            write!(f, " (in {syscall}; callers scanned)")?;
        }
        Ok(())
    }
}

/// What one rank is doing, as far as it can be read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankPlace {
    /// Innermost first; empty when the process runs no CPython lens-probe can read.
    pub python: Vec<PyFrame>,
    pub native: Option<NativePlace>,
}

/// Reads `pid`'s place: the Python stack of thread `tid` (3.11+ match threads by tid;
/// on 3.10, whose thread states hold only the thread pointer, the main thread's) and
/// `tid`'s native place.
pub fn read(pid: u32, tid: u32) -> RankPlace {
    RankPlace {
        python: python(pid, tid),
        native: native_place(pid, tid),
    }
}

/// The Python stack of `pid`'s thread `tid` now, innermost first (empty when the
/// process runs no CPython lens-probe can read).
pub fn python(pid: u32, tid: u32) -> Vec<PyFrame> {
    python_stack_retried(pid, tid).unwrap_or_default()
}

/// Reads of a stack that changed under the reader (the rank runs on while it is read).
const STACK_READS: usize = 3;

/// `function` of a frame that is there but could not be read whole.
const NAME_NOT_READ: &str = "<name not read: not a compact ASCII string>";
const CHAIN_CHANGED: &str = "<more frames: the stack changed while it was read>";

/// The Python stack of `tid`, read again while it changes under the reader (up to
/// [`STACK_READS`] times); the last read, marked where it broke off, if none was whole.
fn python_stack_retried(pid: u32, tid: u32) -> Option<Vec<PyFrame>> {
    let mut last = None;
    for _ in 0..STACK_READS {
        match python_stack(pid, tid) {
            Some((frames, true)) => return Some(frames),
            Some((frames, false)) => last = Some(frames),
            None => {}
        }
    }
    last
}

/// The frames read, innermost first, and whether the chain was read to its end.
fn python_stack(pid: u32, tid: u32) -> Option<(Vec<PyFrame>, bool)> {
    let runtime = python::find_runtime(pid).ok()??;
    let mem = Process::new(pid).memory().ok()?;
    let read = |address: u64| -> Option<u64> {
        let mut bytes = [0u8; 8];
        mem.read_exact_at(&mut bytes, address).ok()?;
        Some(u64::from_ne_bytes(bytes))
    };
    let offsets = &runtime.offsets;
    let at = |base: u64, offset: u32| base.checked_add(u64::from(offset));
    let interpreter = read(at(offsets.runtime, offsets.interpreters_head)?)?;
    let mut tstate = read(at(interpreter, offsets.threads_head)?)?;
    // New threads go to the head of the list: the main thread is the last.
    let mut chosen = None;
    let mut last = None;
    for _ in 0..MAX_THREADS {
        if tstate == 0 {
            break;
        }
        last = Some(tstate);
        if offsets.match_thread_pointer == 0
            && read(at(tstate, offsets.tstate_native_thread_id)?) == Some(u64::from(tid))
        {
            chosen = Some(tstate);
            break;
        }
        tstate = read(at(tstate, offsets.tstate_next)?)?;
    }
    let tstate = chosen.or(last)?;
    let mut frame = current_frame(&read, offsets, tstate)?;
    let mut names = CodeReader::open(pid, runtime.code).ok()?;
    // Per frame read: its frame, or (not named) the type of the object it runs, marked
    // once the loop knows which type code objects have.
    let mut read_frames: Vec<Result<PyFrame, Option<u64>>> = Vec::new();
    let mut code_type = None;
    let mut whole = true;
    for _ in 0..MAX_FRAMES {
        if frame == 0 {
            break;
        }
        let Some(code) = at(frame, offsets.frame_code).and_then(read) else {
            whole = false;
            break;
        };
        // Entry frames of C calls hold no code object (3.13: none, or another object) or
        // CPython's shim code object (3.12): skipped.
        match names.name(code) {
            Some(name) if &*name.qualname == "<interpreter trampoline>" => {}
            Some(name) => {
                let (function, file) = (name.qualname.to_string(), name.filename.to_string());
                let line = names
                    .line_at(code, frame)
                    .or_else(|| names.first_line(code));
                code_type = code_type.or_else(|| read(code.checked_add(OB_TYPE)?));
                read_frames.push(Ok(PyFrame {
                    function,
                    file,
                    line,
                }));
            }
            None if code == 0 => {}
            None => read_frames.push(Err(code.checked_add(OB_TYPE).and_then(read))),
        }
        let Some(previous) = at(frame, offsets.frame_previous).and_then(read) else {
            whole = false;
            break;
        };
        frame = previous;
    }
    // A code object whose names are not plain ASCII (or were mid-update): there, marked.
    // Any other object (3.13's entry frames): not a Python function, left out.
    let mut frames: Vec<PyFrame> = read_frames
        .into_iter()
        .filter_map(|read| match read {
            Ok(frame) => Some(frame),
            Err(kind) if kind.is_some() && kind == code_type => Some(PyFrame {
                function: NAME_NOT_READ.into(),
                file: "?".into(),
                line: None,
            }),
            Err(_) => None,
        })
        .collect();
    if !whole {
        frames.push(PyFrame {
            function: CHAIN_CHANGED.into(),
            file: "?".into(),
            line: None,
        });
    }
    Some((frames, whole))
}

/// Where an object's type pointer is (`ob_type`, after the reference count).
const OB_TYPE: u64 = 8;

fn current_frame(
    read: &impl Fn(u64) -> Option<u64>,
    offsets: &PyOffsets,
    tstate: u64,
) -> Option<u64> {
    let frame = read(tstate.checked_add(u64::from(offsets.tstate_frame))?)?;
    if offsets.cframe_current_frame == PY_NO_FIELD || frame == 0 {
        return Some(frame);
    }
    read(frame.checked_add(u64::from(offsets.cframe_current_frame))?)
}

/// x86-64 system calls a waiting thread is typically in.
fn syscall_name(number: i64) -> Option<&'static str> {
    Some(match number {
        0 => "read",
        7 => "poll",
        23 => "select",
        24 => "sched_yield",
        35 => "nanosleep",
        45 => "recvfrom",
        47 => "recvmsg",
        61 => "wait4",
        202 => "futex",
        230 => "clock_nanosleep",
        232 => "epoll_wait",
        270 => "pselect6",
        271 => "ppoll",
        281 => "epoll_pwait",
        _ => return None,
    })
}

/// Stack bytes scanned for return addresses.
const STACK_SCAN_BYTES: usize = 16 * 1024;
/// Native frames shown: the instruction pointer's and this many callers at most. A
/// function with a large local buffer (a path, a message) keeps stale return addresses
/// of the deeper calls it made earlier (lazy binding, `pthread_once`, `getenv`), and
/// the scan names those too: room for the real callers beyond them (the fake NCCL's
/// rendezvous showed five stale frames before `ncclAllReduce`, which 8 cut off).
const MAX_NATIVE_FRAMES: usize = 16;

/// Reads of a running thread's `syscall` file before it is taken as running: a thread
/// that polls (sleeps a little, checks, sleeps again) is caught between two sleeps now
/// and then, more often on a loaded machine.
const SYSCALL_READS: u32 = 100;

/// `tid`'s native place: `/proc/PID/task/TID/syscall` is "NR args… sp pc" while it is in
/// a system call, "running" while it runs (then there is no place to read without
/// stopping it, which a hang report does not do), "-1 sp pc" when stopped elsewhere.
fn native_place(pid: u32, tid: u32) -> Option<NativePlace> {
    let process = Process::new(pid);
    let mut text = process.thread_syscall(tid).ok()?;
    for _ in 1..SYSCALL_READS {
        if !text.starts_with("running") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
        text = process.thread_syscall(tid).ok()?;
    }
    if text.starts_with("running") {
        return Some(NativePlace {
            syscall: None,
            frames: Vec::new(),
        });
    }
    let fields: Vec<&str> = text.split_whitespace().collect();
    let number: i64 = fields.first()?.parse().ok()?;
    let hex = |field: &str| u64::from_str_radix(field.trim_start_matches("0x"), 16).ok();
    let pc = hex(fields.last()?)?;
    let sp = hex(fields.get(fields.len().checked_sub(2)?)?)?;
    let syscall = (number >= 0)
        .then(|| syscall_name(number).map_or_else(|| format!("syscall {number}"), str::to_string));
    let executable: Vec<_> = process
        .mappings()
        .ok()?
        .into_iter()
        .filter(|m| m.executable)
        .collect();
    let mem = process.memory().ok()?;
    let mut addresses = vec![pc];
    addresses.extend(return_addresses(&mem, sp, &executable));
    let mut frames: Vec<NativeFrame> = Vec::new();
    for address in addresses {
        let Some(m) = executable
            .iter()
            .find(|m| (m.start..m.end).contains(&address))
        else {
            continue;
        };
        // The mapped file itself, whatever its path now says. A return address is just
        // after the call: the call is one byte before.
        let mapped = process.mapped_file(m);
        let at = if address == pc { address } else { address - 1 };
        let offset = at - m.start + m.offset;
        let function = symbols::functions_at(Path::new(&mapped), &[offset])
            .ok()
            .and_then(|mut names| names.remove(&offset))
            .map(|name| demangled(&name));
        let frame = NativeFrame {
            function,
            file: m.path.clone(),
        };
        // Recursion and stale copies aside: each function once, in order.
        if !frames.contains(&frame) {
            frames.push(frame);
        }
        if frames.len() >= MAX_NATIVE_FRAMES {
            break;
        }
    }
    Some(NativePlace { syscall, frames })
}

/// Words on the stack from `sp` up that point into an executable mapping just after a
/// call instruction (`call rel32`: e8 + 4 bytes; `call *r/m`: ff /2, 2 to 7 bytes).
fn return_addresses(
    mem: &File,
    sp: u64,
    executable: &[crate::sys::library::MapsEntry],
) -> Vec<u64> {
    let mut stack = vec![0u8; STACK_SCAN_BYTES];
    // The stack may end before the scan does: read what there is.
    let mut read = 0;
    while read < stack.len() {
        match mem.read_at(&mut stack[read..], sp + read as u64) {
            Ok(0) | Err(_) => break,
            Ok(n) => read += n,
        }
    }
    stack.truncate(read - read % 8);
    stack
        .as_chunks::<8>()
        .0
        .iter()
        .map(|&word| u64::from_ne_bytes(word))
        .filter(|&address| {
            executable
                .iter()
                .any(|m| address >= m.start + 8 && address < m.end)
                && follows_call(mem, address)
        })
        .collect()
}

fn follows_call(mem: &File, address: u64) -> bool {
    let mut code = [0u8; 8];
    if mem.read_exact_at(&mut code, address - 8).is_err() {
        return false;
    }
    // code[8 - n] is the first byte of an n-byte instruction ending at `address`.
    let modrm_is_call = |modrm: u8| (modrm >> 3) & 7 == 2;
    code[3] == 0xe8 || (2..=7).any(|n| code[8 - n] == 0xff && modrm_is_call(code[9 - n]))
}

/// A C++ name as a reader wants it in one line: demangled, without parameters, return
/// type or template arguments (`c10d::Work::wait`).
fn demangled(name: &str) -> String {
    let options = cpp_demangle::DemangleOptions::new()
        .no_params()
        .no_return_type();
    let full = cpp_demangle::Symbol::new(name)
        .ok()
        .and_then(|symbol| symbol.demangle(&options).ok())
        .unwrap_or_else(|| name.to_string());
    without_template_arguments(&full)
}

fn without_template_arguments(name: &str) -> String {
    let mut depth = 0usize;
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '<' => depth += 1,
            '>' if depth > 0 => depth -= 1,
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpp_names_are_short() {
        // c10d::Work::wait(std::chrono::duration<long, std::ratio<1l, 1000l> >)
        assert_eq!(
            demangled("_ZN4c10d4Work4waitENSt6chrono8durationIlSt5ratioILl1ELl1000EEEE"),
            "c10d::Work::wait"
        );
        assert_eq!(
            without_template_arguments("pybind11::cpp_function::initialize<A<B>, C>"),
            "pybind11::cpp_function::initialize"
        );
        assert_eq!(demangled("clock_nanosleep"), "clock_nanosleep");
    }
}
