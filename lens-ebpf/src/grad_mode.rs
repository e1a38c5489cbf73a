//! Grad mode, decided in the kernel: a thread's grad mode is the evaluation signal (grad
//! off between steps, then batches), but activation checkpointing and autograd's own
//! guards switch it hundreds of times a step. Where Python sets it, it is read at
//! `torch._C._set_grad_enabled` (libtorch_python's binding: what `torch.no_grad()`,
//! `enable_grad()` and `set_grad_enabled()` call), which autograd's C++ guards do not
//! pass through: 2.4× fewer traps on a checkpointed model. A process without
//! libtorch_python (a LibTorch C++ program) has `c10::GradMode::set_enabled` probed
//! instead (the loader chooses: `probes::catalog`). A thread's grad mode is followed here
//! (`GRAD_MODES`), and only what the loader's phase rules can tell apart is sent:
//!
//! - a call that does not change the thread's grad mode is counted, not sent (the loader
//!   ignores it);
//! - the first change after the thread's last other phase mark is sent at once;
//! - later changes are held (their marks kept, one per direction) until the thread's next
//!   phase mark of any other kind, which first sends what the loader needs of them: the
//!   last change, and before it the last change the other way when the thread came back
//!   to the mode last sent. A thread that exits sends its held changes first (the exit
//!   tracepoint).
//!
//! The phase rules (`spans/phases/evaluation.rs`) read of a run of changes with no other
//! mark between them only the first change and the last change each way: what an
//! evaluation loop's batches, the steps and the optimizer scopes look like is unchanged,
//! while a checkpointed model's recompute toggles cost a counted probe hit instead of an
//! event each.
use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user};
use aya_ebpf::macros::map;
use aya_ebpf::maps::LruHashMap;
use aya_ebpf::programs::ProbeContext;
use lens_common::record::{LaunchMark, PhaseEntry};
use lens_common::{ProbeId, TargetState, limits};

use crate::ctx::{arg_u64, count_call, new_record, probe_id, read_user_u64, send, traced};
use crate::launches::{mark_in_epoch, open_epoch};

/// A thread's grad mode: `OFF` or `ON` (0: not known).
const OFF: u8 = 1;
const ON: u8 = 2;

/// What the thread's grad-mode changes since its last other phase mark were.
const NO_CHANGE: u8 = 0;
const FIRST_SENT: u8 = 1;
const LATER_HELD: u8 = 2;

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct GradModeState {
    /// The mode the loader was last told.
    sent: u8,
    /// The mode now.
    current: u8,
    /// `NO_CHANGE`, `FIRST_SENT` or `LATER_HELD`.
    changes: u8,
    _pad: [u8; 5],
    /// The marks of the last held change to off and to on.
    held_off: LaunchMark,
    held_on: LaunchMark,
}

/// Each traced thread's grad mode (pid_tgid → state). LRU: a thread that is gone leaves
/// its entry to fall out; one that fell out is told afresh at its next call.
#[map(name = "GRAD_MODES")]
pub(crate) static GRAD_MODES: LruHashMap<u64, GradModeState> =
    LruHashMap::with_max_entries(limits::MAX_GRAD_MODE_THREADS, 0);

uprobe_and_multi! {
    /// `c10::GradMode::set_enabled(bool)` entered: the thread's grad mode, sent as a phase
    /// mark only when the loader needs it (module doc).
    grad_mode_entry, grad_mode_entry_m => grad_mode_entry_body
}

#[inline(always)]
fn grad_mode_entry_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    count_call(target, probe_id(&ctx));
    let mode = if arg_u64(&ctx, 0) & 1 != 0 { ON } else { OFF };
    follow(pid_tgid, target, mode);
    0
}

uprobe_and_multi! {
    /// `torch._C._set_grad_enabled(mode)` entered (`torch::autograd::set_grad_enabled(self,
    /// args, kwargs)`): the mode Python asks for, followed as at `set_enabled` (module doc).
    py_grad_mode_entry, py_grad_mode_entry_m => py_grad_mode_entry_body
}

/// Where the binding's one positional argument is: `args` is a tuple (`ob_size` at 16,
/// `ob_item[0]` at 24), the argument `True` or `False`, whose first digit (at 24) is 1 or
/// 0. The same in CPython 3.10 to 3.14's default builds (a 16-byte object header); a
/// free-threaded build's header is larger, and its libtorch_python keeps libc10's probe.
const TUPLE_SIZE: u64 = 16;
const BOOL_DIGIT: u64 = 24;

/// A one-item tuple's size and item, read together.
#[repr(C)]
struct TupleOfOne {
    size: u64,
    item: u64,
}

#[inline(always)]
fn py_grad_mode_entry_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    count_call(target, probe_id(&ctx));
    let args = arg_u64(&ctx, 1);
    // A keyword call (`_set_grad_enabled(mode=False)`) passes no positional argument:
    // none of torch's callers make one, and its mode is not read.
    // SAFETY: reading the traced thread's memory through the checked helper.
    let Ok(tuple) = (unsafe { bpf_probe_read_user((args + TUPLE_SIZE) as *const TupleOfOne) })
    else {
        return 0;
    };
    if tuple.size != 1 || tuple.item == 0 {
        return 0;
    }
    let mode = if read_user_u64(tuple.item + BOOL_DIGIT) as u32 != 0 {
        ON
    } else {
        OFF
    };
    follow(pid_tgid, target, mode);
    0
}

/// The thread's grad mode is `mode` now: sent, held or only counted (module doc).
#[inline(always)]
fn follow(pid_tgid: u64, target: *mut TargetState, mode: u8) {
    let Some(state) = GRAD_MODES.get_ptr_mut(&pid_tgid) else {
        send_mode(pid_tgid, open_epoch(target), mode);
        let state = GradModeState {
            sent: mode,
            current: mode,
            changes: FIRST_SENT,
            _pad: [0; 5],
            held_off: LaunchMark::ZERO,
            held_on: LaunchMark::ZERO,
        };
        let _ = GRAD_MODES.insert(&pid_tgid, &state, 0);
        return;
    };
    // SAFETY: a live map value of this thread's only.
    unsafe {
        if (*state).current == mode {
            return;
        }
        (*state).current = mode;
        if (*state).changes == NO_CHANGE {
            (*state).changes = FIRST_SENT;
            (*state).sent = mode;
            send_mode(pid_tgid, open_epoch(target), mode);
            return;
        }
        (*state).changes = LATER_HELD;
        let mark = mark_in_epoch(target);
        if mode == ON {
            (*state).held_on = mark;
        } else {
            (*state).held_off = mark;
        }
    }
}

/// Another phase mark of the current thread is about to be sent: first what the loader
/// needs of its held grad-mode changes (module doc).
#[inline(always)]
pub(crate) fn flush_held_changes() {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(state) = GRAD_MODES.get_ptr_mut(&pid_tgid) else {
        return;
    };
    // SAFETY: a live map value of this thread's only.
    unsafe {
        let changes = (*state).changes;
        (*state).changes = NO_CHANGE;
        if changes != LATER_HELD {
            return;
        }
        let current = (*state).current;
        if current == (*state).sent {
            // Back to the mode last sent: the last change away from it first.
            if current == ON {
                send_mode(pid_tgid, (*state).held_off, OFF);
            } else {
                send_mode(pid_tgid, (*state).held_on, ON);
            }
        }
        if current == ON {
            send_mode(pid_tgid, (*state).held_on, ON);
        } else {
            send_mode(pid_tgid, (*state).held_off, OFF);
        }
        (*state).sent = current;
    }
}

/// The thread is gone or runs a new program, or inference mode changed the loader's grad
/// mode too (the thread's next `set_enabled` is told afresh).
#[inline(always)]
pub(crate) fn forget_thread(pid_tgid: u64) {
    let _ = GRAD_MODES.remove(&pid_tgid);
}

#[inline(always)]
fn send_mode(pid_tgid: u64, mark: LaunchMark, mode: u8) {
    let mut record = new_record::<PhaseEntry>(ProbeId::TorchGradMode as u32, pid_tgid);
    record.body = PhaseEntry {
        mark,
        argument: u64::from(mode == ON),
    };
    send(&record);
}
