//! Library calls whose arguments and result say what they did (the GPU memory calls, CUDA
//! graph capture and instantiation; a capture's begin and end also tell the launch
//! probes which streams capture, `launches::capture_began`):
//! one entry and one return program for all of them, what to read in the attach cookie
//! (`lens_common::api_shape`). Rare calls: each is sent, and user space gives it its
//! meaning, so a new one is a catalog row, not a new program.
use aya_ebpf::helpers::bpf_probe_read_user;
use aya_ebpf::programs::{ProbeContext, RetProbeContext};
use lens_common::record::{API_ARGS, ApiCall, RETURNED_KIND};
use lens_common::{LossCause, api_shape, cookie_shape};

use crate::ctx::{
    Entry, arg_u64, attach_cookie, call_starting_now, count_call, count_loss, entry_of, new_record,
    now_ns, remember_entry, send, send_now, traced,
};
use crate::launches::{called_from_runtime, capture_began, capture_ended};
use crate::maps::{INFLIGHT_API_CALLS, graph_launch_spans};

uprobe_and_multi! {
    /// Entry of a library call of the generic kind: its first four arguments kept until
    /// its return. A driver call libcudart makes inside its own call (the cookie's
    /// `api_shape::DRIVER`) is left out: the runtime's call is the one seen.
    api_call_entry, api_call_entry_m => api_call_entry_body
}

#[inline(always)]
fn api_call_entry_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    let cookie = attach_cookie(&ctx);
    // SAFETY: reads of the probe's saved registers.
    let stack = unsafe { (*ctx.regs).rsp };
    // The return-address read costs ~140 ns; these calls are rare (an allocator's
    // cache misses), so every driver call pays it.
    let mut record = new_record::<ApiCall>(cookie as u32, pid_tgid);
    if cookie_shape(cookie) & api_shape::DRIVER != 0 && called_from_runtime(stack, pid_tgid) {
        // The thread's slot says no call is in flight: its return is then left out
        // too, and not taken for one whose entry was missed.
        record.header.kind = RETURNED_KIND;
        remember_entry(&ctx, &INFLIGHT_API_CALLS, pid_tgid, &record);
        return 0;
    }
    count_call(target, cookie as u32);
    if cookie_shape(cookie) & api_shape::CAPTURE_END != 0 {
        capture_ended(target, pid_tgid, arg_u64(&ctx, 0));
    }
    record.body.times = call_starting_now();
    let mut i = 0;
    while i < API_ARGS {
        record.body.args[i] = arg_u64(&ctx, i);
        i += 1;
    }
    remember_entry(&ctx, &INFLIGHT_API_CALLS, pid_tgid, &record);
    0
}

uretprobe_and_multi! {
    /// Return of a library call of the generic kind: the out-pointer argument read, the
    /// result taken, one record sent (at once when the call failed: an out-of-memory
    /// process may die next).
    api_call_return, api_call_return_m => api_call_return_body
}

#[inline(always)]
fn api_call_return_body(ctx: RetProbeContext) -> u32 {
    let pid_tgid = aya_ebpf::helpers::bpf_get_current_pid_tgid();
    let mut record = match entry_of(&ctx, &INFLIGHT_API_CALLS, pid_tgid) {
        Entry::Taken(record) => record,
        Entry::NotInFlight => return 0,
        Entry::Missing => {
            if traced().is_some() {
                count_loss(LossCause::UnmatchedReturn);
            }
            return 0;
        }
    };
    record.body.times.end_ns = now_ns();
    record.body.result = ctx.ret::<i64>();
    // The return probe carries the entry's cookie: its shape names the out-pointer.
    let shape = cookie_shape(attach_cookie(&ctx));
    if shape & api_shape::CAPTURE_BEGIN != 0
        && record.body.result == 0
        && let Some((_, target)) = traced()
    {
        capture_began(target, pid_tgid, record.body.args[0]);
    }
    let out_arg = (shape & api_shape::OUT_ARG_MASK) as usize;
    let pointer = match out_arg {
        1 => record.body.args[0],
        2 => record.body.args[1],
        3 => record.body.args[2],
        4 => record.body.args[3],
        _ => 0,
    };
    record.body.out = if pointer != 0 {
        // SAFETY: the out-pointer the caller passed; read through the checked helper.
        unsafe { bpf_probe_read_user(pointer as *const u64) }.unwrap_or(0)
    } else {
        0
    };
    if record.body.result != 0 {
        send_now(&record);
    } else {
        send(&record);
    }
    0
}

uprobe_and_multi! {
    /// Entry of `c10::reportMemoryUsageToProfiler(ptr, size, allocated, reserved,
    /// device)`: PyTorch's caching allocator's totals after each allocation and free.
    /// Thousands a step: counted, and sent (as an `ApiCall`, its end its start) only
    /// when allocated or reserved passes the process's peak so far.
    torch_memory_entry, torch_memory_entry_m => torch_memory_entry_body
}

#[inline(always)]
fn torch_memory_entry_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    let probe = attach_cookie(&ctx) as u32;
    count_call(target, probe);
    let (allocated, reserved) = (arg_u64(&ctx, 2), arg_u64(&ctx, 3));
    // SAFETY: a live map value; the allocator reports under its own lock, and a peak
    // raced by another device's report is at worst sent twice.
    let passed = unsafe {
        let peaks = &raw mut (*target).torch_peaks;
        let passed = allocated > (*peaks)[0] || reserved > (*peaks)[1];
        if passed {
            (*peaks)[0] = (*peaks)[0].max(allocated);
            (*peaks)[1] = (*peaks)[1].max(reserved);
        }
        passed
    };
    if !passed {
        return 0;
    }
    let mut record = new_record::<ApiCall>(probe, pid_tgid);
    let now = now_ns();
    record.body.times.start_ns = now;
    record.body.times.end_ns = now;
    record.body.args = [arg_u64(&ctx, 0), arg_u64(&ctx, 1), allocated, reserved];
    send(&record);
    0
}

/// A graph launch entered (`launches::count_only` / `driver_launch` counted it): its entry
/// is kept for `api_call_return` (its catalog return program), which sends it, so each
/// graph launch is a span. `in_flight` false: the runtime's own driver call, whose slot
/// says nothing is in flight (its return then sends nothing and is no lost event).
#[inline(always)]
pub(crate) fn graph_launch_entered(ctx: &ProbeContext, pid_tgid: u64, probe: u32, in_flight: bool) {
    if !graph_launch_spans() {
        return;
    }
    let mut record = new_record::<ApiCall>(probe, pid_tgid);
    if in_flight {
        record.body.times = call_starting_now();
        record.body.args[0] = arg_u64(ctx, 0);
        record.body.args[1] = arg_u64(ctx, 1);
    } else {
        record.header.kind = RETURNED_KIND;
    }
    remember_entry(ctx, &INFLIGHT_API_CALLS, pid_tgid, &record);
}
