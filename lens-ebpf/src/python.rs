//! The Python sampler: the interpreter's frames walked from the thread state (offsets
//! from `PY_TARGETS`), sent on a timer and before calls made inside a framework save or
//! load.
use aya_ebpf::bindings::BPF_RB_FORCE_WAKEUP;
use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user};
use aya_ebpf::macros::perf_event;
use aya_ebpf::programs::{PerfEventContext, ProbeContext};
use lens_common::record::{LaunchMark, NO_PROBE, PyStack};
use lens_common::{
    DCP_LOAD_API_EVENT, EventKind, HandleKey, LossCause, PY_MAX_DEPTH, PY_MAX_WALK, PY_NO_FIELD,
    PyOffsets, Record, RecordHeader, TargetState, limits, py_named, python_gates, saving,
};

use crate::ctx::{count_loss, now_ns, read_user_u64};
use crate::launches::mark_now;
use crate::maps::{
    LastSample, PY_GATES, PY_LAST_STACK, PY_NAMED, PY_SAVING, PY_TARGETS, TARGETS, python_gate,
};
use crate::ring::{EVENTS, submit_flags};
use crate::task::{thread_pointer, voluntary_switches};

/// Sends the thread's Python stack before a collective or sync entry while the loader
/// has its process inside a framework save: whether the call is the save's is then read.
#[inline(always)]
pub(crate) fn sample_if_saving() {
    if !python_gate(python_gates::SAVING) {
        return;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: only presence is read.
    if unsafe { PY_SAVING.get(&((pid_tgid >> 32) as u32)) }.is_some() {
        send_python_stack(pid_tgid, true);
    }
}

uprobe_and_multi! {
    /// Entry of `torch._C._log_api_usage_once` (`ProbeId::TorchApiUsage`): the first line of
    /// torch's and DCP's save and load functions. The Python stack is sent at once: the
    /// framework call shows there, where it begins.
    python_stack_entry, python_stack_entry_m => python_stack_entry_body
}

#[inline(always)]
fn python_stack_entry_body(ctx: ProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    send_python_stack(pid_tgid, true);
    mark_if_dcp_load(&ctx, pid_tgid);
    0
}

/// DCP's load begins reading (`DCP_LOAD_API_EVENT`, the first argument after the module):
/// the process is loading from here on (`PY_SAVING`), before the loader has handled the
/// sample that shows it, as the `.metadata` file is read next. The loader clears it when
/// that load returns.
#[inline(always)]
pub(crate) fn mark_if_dcp_load(ctx: &ProbeContext, pid_tgid: u64) {
    const N: usize = DCP_LOAD_API_EVENT.len();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: copied out before the map can change under us.
    let Some(offsets) = (unsafe { PY_TARGETS.get(&tgid) }).copied() else {
        return;
    };
    let Some(event) = ctx.arg::<u64>(1) else {
        return;
    };
    // The text and its terminating NUL: an equal prefix of a longer name is not it.
    // SAFETY: reading the traced thread's memory through the checked helper.
    let Ok(text) =
        (unsafe { bpf_probe_read_user((event + offsets.str_data as u64) as *const [u8; N + 1]) })
    else {
        return;
    };
    if text[N] != 0 {
        return;
    }
    for i in 0..N {
        if text[i] != DCP_LOAD_API_EVENT[i] {
            return;
        }
    }
    // SAFETY: copied out.
    let bits = unsafe { PY_SAVING.get(&tgid) }.copied().unwrap_or(0);
    // The gate open before the entry goes in and again after: the loader, clearing it
    // after a removal, checks the map again after it did (`lens_common::python_gates`).
    open_saving_gate();
    let _ = PY_SAVING.insert(&tgid, &(bits | saving::LOAD), 0);
    open_saving_gate();
}

#[inline(always)]
fn open_saving_gate() {
    if let Some(gate) = PY_GATES.get_ptr_mut(python_gates::SAVING) {
        // SAFETY: a live map value; a plain store of a flag.
        unsafe { core::ptr::write_volatile(gate, 1) };
    }
}

/// The sampled thread's `PyThreadState`, 0 if it has none (not a Python thread): the
/// main interpreter's thread whose id is the thread's (tid, or thread pointer on 3.10).
#[inline(always)]
pub(crate) fn python_thread_state(offsets: &PyOffsets, tid: u32) -> u64 {
    let wanted = if offsets.match_thread_pointer != 0 {
        thread_pointer()
    } else {
        tid as u64
    };
    if wanted == 0 {
        return 0;
    }
    let interpreter = read_user_u64(offsets.runtime + offsets.interpreters_head as u64);
    if interpreter == 0 {
        return 0;
    }
    let mut state = read_user_u64(interpreter + offsets.threads_head as u64);
    let mut walked = 0;
    while walked < limits::MAX_PY_THREAD_WALK && state != 0 {
        if read_user_u64(state + offsets.tstate_native_thread_id as u64) == wanted {
            return state;
        }
        state = read_user_u64(state + offsets.tstate_next as u64);
        walked += 1;
    }
    0
}

/// The innermost Python frame of thread `tid` (Some(0) when it runs none); `None` when it
/// is no Python thread of the process.
#[inline(always)]
pub(crate) fn innermost_frame(offsets: &PyOffsets, tid: u32) -> Option<u64> {
    let state = python_thread_state(offsets, tid);
    if state == 0 {
        return None;
    }
    let frame = read_user_u64(state + offsets.tstate_frame as u64);
    if offsets.cframe_current_frame != PY_NO_FIELD && frame != 0 {
        return Some(read_user_u64(frame + offsets.cframe_current_frame as u64));
    }
    Some(frame)
}

/// The code object of the innermost Python frame of the calling thread, in a sampled
/// CPython process (0 otherwise, or when the thread runs no Python).
#[inline(always)]
pub(crate) fn python_caller(pid_tgid: u64) -> u64 {
    if !python_gate(python_gates::TARGETS) {
        return 0;
    }
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: copied out before the map can change under us.
    let Some(offsets) = (unsafe { PY_TARGETS.get(&tgid) }).copied() else {
        return 0;
    };
    let frame = innermost_frame(&offsets, pid_tgid as u32).unwrap_or(0);
    if frame == 0 {
        return 0;
    }
    read_user_u64(frame + offsets.frame_code as u64)
}

/// Samples traced Python threads on their CPU clocks (each sampled thread's own, 1 or 10
/// ms: `python::sampler` in the loader): reads the thread's
/// frame stack (code object, frame, first local per frame) and sends it when it differs
/// from the thread's last one. docs/python.md.
#[perf_event]
pub fn python_sample(_ctx: PerfEventContext) -> u32 {
    send_python_stack(bpf_get_current_pid_tgid(), false);
    0
}

/// A sampled Python thread exits: an empty synchronous stack, stamped now, ends the
/// calls its samples left open here. Its last sample can be up to an interval of running
/// time before its last Python line (DCP's `async_save` writer returns from `save`, sets
/// its future and exits between two ticks), and the thread's memory is gone before the
/// loader could read more. Its remembered stack goes with it (a tid is reused).
#[inline(always)]
pub(crate) fn send_thread_exit(pid_tgid: u64, target: *mut TargetState) {
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    if PY_LAST_STACK.remove(&tid).is_err() {
        // Never sampled: no calls of its are open.
        return;
    }
    // SAFETY: only presence is read.
    if unsafe { PY_TARGETS.get(&tgid) }.is_none() {
        return;
    }
    let Some(mut entry) = EVENTS.reserve::<Record<PyStack>>(0) else {
        count_loss(LossCause::RingBufferFull);
        return;
    };
    let stack = entry.as_mut_ptr();
    // SAFETY: the reserved record, filled before it is submitted; `target` is the live
    // map value `traced()` returned.
    unsafe {
        (*stack).header = stack_header(tgid, tid);
        (*stack).body.depth = 0;
        (*stack).body.synchronous = 1;
        (*stack).body.since_ns = 0;
        (*stack).body.mark = mark_now(target);
    }
    entry.submit(BPF_RB_FORCE_WAKEUP as u64);
}

/// The header of a stack record of thread `tid` of `tgid`.
#[inline(always)]
fn stack_header(tgid: u32, tid: u32) -> RecordHeader {
    RecordHeader {
        kind: EventKind::PyStack as u32,
        probe: NO_PROBE,
        tgid,
        tid,
    }
}

/// Sends the current thread's Python stack (a CPython target's): from the sampler only
/// when it changed (`forced` false), or at once (a file created: which Python call
/// created it is then exact, not sampled).
#[inline(always)]
pub(crate) fn send_python_stack(pid_tgid: u64, forced: bool) {
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    // SAFETY: copied out before the map can change under us.
    let Some(offsets) = (unsafe { PY_TARGETS.get(&tgid) }).copied() else {
        return;
    };
    // A Python thread with no frame (idle in C) is sampled too: an empty stack ends calls.
    let Some(mut frame) = innermost_frame(&offsets, tid) else {
        return;
    };
    // Before the walk: what the walk does not find began after this.
    let started_ns = now_ns();
    let Some(mut entry) = EVENTS.reserve::<Record<PyStack>>(0) else {
        count_loss(LossCause::RingBufferFull);
        return;
    };
    let stack = entry.as_mut_ptr();
    // Walk up to PY_MAX_WALK frames from the innermost, keeping the outermost
    // PY_MAX_DEPTH in a ring (slot = frame number mod PY_MAX_DEPTH): the functions rules
    // name (a step, an evaluation) sit near the bottom of a deep stack. One path through
    // the loop (no per-frame branch but its end): the verifier walks each iteration.
    let mut depth = 0usize;
    for i in 0..PY_MAX_WALK {
        if frame == 0 {
            break;
        }
        let slot = i % PY_MAX_DEPTH;
        // SAFETY: `slot` < PY_MAX_DEPTH: inside the reserved record.
        unsafe {
            (*stack).body.code[slot] = read_user_u64(frame + offsets.frame_code as u64);
            (*stack).body.frame[slot] = frame;
            (*stack).body.first_local[slot] =
                read_user_u64(frame + offsets.frame_first_local as u64);
        }
        depth = i + 1;
        frame = read_user_u64(frame + offsets.frame_previous as u64);
    }
    // The hash of the frames kept: a change deeper inside (a model's layers) is not a
    // change to send.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for slot in 0..PY_MAX_DEPTH {
        if slot >= depth {
            break;
        }
        // SAFETY: as above; written by the walk.
        let (code, frame, local) = unsafe {
            (
                (*stack).body.code[slot],
                (*stack).body.frame[slot],
                (*stack).body.first_local[slot],
            )
        };
        hash = (hash ^ code).wrapping_mul(0x100_0000_01b3);
        hash = (hash ^ frame).wrapping_mul(0x100_0000_01b3);
        hash = (hash ^ local).wrapping_mul(0x100_0000_01b3);
    }
    // A new stack is sent twice, at its first sample and at the next (the user side
    // takes a change two samples agree on: one can catch the chain mid-update); then not
    // again until it changes. The low bit of the remembered hash: the second is due.
    let hash = hash & !1;
    let switches = voluntary_switches().unwrap_or(u64::MAX);
    let mut since_ns = 0;
    match PY_LAST_STACK.get_ptr_mut(&tid) {
        Some(last) => {
            // SAFETY: the live map value; only this thread's samples write it, and a
            // thread runs on one CPU at a time.
            let last = unsafe { &mut *last };
            // A thread that has not slept since its last clock sample ran (or waited
            // for a CPU) all along: what that sample did not show began after it.
            if switches != u64::MAX && last.switches == switches {
                since_ns = last.at_ns;
            }
            // A forced sample leaves the sampler's record alone: its next change is
            // still sent.
            if !forced {
                let unchanged = last.hash & !1 == hash;
                let second_due = last.hash & 1 != 0;
                last.at_ns = started_ns;
                last.switches = switches;
                if unchanged && !second_due {
                    entry.discard(0);
                    return;
                }
                last.hash = if unchanged { hash } else { hash | 1 };
            }
        }
        None if !forced => {
            let first = LastSample {
                hash: hash | 1,
                at_ns: started_ns,
                switches,
            };
            let _ = PY_LAST_STACK.insert(&tid, &first, 0);
        }
        None => {}
    }
    // SAFETY: the reserved record, filled before it is submitted.
    unsafe {
        (*stack).header = stack_header(tgid, tid);
        (*stack).body.depth = depth as u32;
        (*stack).body.synchronous = forced as u32;
        (*stack).body.since_ns = since_ns;
        // The sampler runs without a target check: a Python process that is not (or no
        // longer) a target has no launches counted and opens no epoch.
        (*stack).body.mark = match TARGETS.get_ptr_mut(&tgid) {
            Some(target) => mark_now(target),
            None => LaunchMark {
                at_ns: now_ns(),
                launches: 0,
                epoch: 0,
            },
        };
    }
    // Delivered at once when the loader has a name to read (a code object it has not
    // named: it reads names from the process's memory, which a process that exits soon
    // after takes with it), when it shows a rule's function, or while a save runs (the
    // loader follows those as they come: `PY_SAVING`); else with the ring's batched
    // wakeups. A wakeup is an interrupt on this CPU (a VM
    // exit on a virtual machine), and a training loop's samples are mostly of code
    // named long ago: on `recompute_loop.py`, forced wakeups were 9 % of its time.
    let at_once = forced
        || (python_gate(python_gates::SAVING) && unsafe { PY_SAVING.get(&tgid) }.is_some())
        || !all_named(tgid, unsafe { &(*stack).body.code }, depth);
    let flags = if at_once {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        submit_flags(Record::<PyStack>::RING_BYTES)
    };
    entry.submit(flags);
}

/// Whether lens-probe has named every code object of a sample's kept frames, none of
/// them a rule's function.
#[inline(always)]
fn all_named(tgid: u32, codes: &[u64; PY_MAX_DEPTH], depth: usize) -> bool {
    for (slot, &code) in codes.iter().enumerate() {
        if slot >= depth {
            break;
        }
        if code == 0 {
            continue;
        }
        let key = HandleKey {
            tgid,
            _pad: 0,
            handle: code,
        };
        if unsafe { PY_NAMED.get(&key) }.copied() != Some(py_named::PLAIN) {
            return false;
        }
    }
    true
}
