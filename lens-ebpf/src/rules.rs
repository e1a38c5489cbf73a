//! Configured probes: the rule's entry and return, the rule in the attach cookie.
use aya_ebpf::helpers::{bpf_probe_read_user, bpf_probe_read_user_str_bytes};
use aya_ebpf::programs::{ProbeContext, RetProbeContext};
use lens_common::record::{RuleEntry, RuleReturn};

use crate::ctx::{arg_u64, attach_cookie, new_record, probe_id, send, traced};
use crate::launches::mark_now;

uprobe_and_multi! {
    /// Entry of a function a configured probe rule names. The cookie carries the rule
    /// (`lens_common::rule_cookie`): its index and which argument, if any, is read as a
    /// string. Sent at once, like a phase mark, with the six argument registers.
    user_rule_entry, user_rule_entry_m => user_rule_entry_body
}

#[inline(always)]
fn user_rule_entry_body(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    let cookie = attach_cookie(&ctx);
    let mut record = new_record::<RuleEntry>(cookie as u32, pid_tgid);
    // A launch mark like a phase mark's: the span's launches (and kernels) are counted
    // between its two marks.
    record.body.mark = mark_now(target);
    let args = [
        arg_u64(&ctx, 0),
        arg_u64(&ctx, 1),
        arg_u64(&ctx, 2),
        arg_u64(&ctx, 3),
        arg_u64(&ctx, 4),
        arg_u64(&ctx, 5),
    ];
    // Which argument is a string: compared as plain integers, no index the verifier
    // would have to trust.
    let pointer = match (cookie >> 32) & 0xff {
        1 => args[0],
        2 => args[1],
        3 => args[2],
        4 => args[3],
        5 => args[4],
        6 => args[5],
        _ => 0,
    };
    record.body.args = args;
    if pointer != 0 {
        // SAFETY: reads of the traced thread's memory through the checked helpers.
        unsafe {
            let data = if (cookie >> 40) & 1 != 0 {
                // libstdc++'s std::string starts with its data pointer.
                bpf_probe_read_user(pointer as *const u64).unwrap_or(0)
            } else {
                pointer
            };
            if data != 0
                && let Ok(text) =
                    bpf_probe_read_user_str_bytes(data as *const u8, &mut record.body.text)
            {
                record.body.text_len = text.len() as u32;
            }
        }
    }
    send(&record);
    0
}

uretprobe_and_multi! {
    /// Return of a function a configured probe rule names: the span it opened ends here.
    user_rule_return, user_rule_return_m => user_rule_return_body
}

#[inline(always)]
fn user_rule_return_body(ctx: RetProbeContext) -> u32 {
    let Some((pid_tgid, target)) = traced() else {
        return 0;
    };
    let mut record = new_record::<RuleReturn>(probe_id(&ctx), pid_tgid);
    record.body = RuleReturn {
        mark: mark_now(target),
        ret: ctx.ret::<i64>(),
    };
    send(&record);
    0
}
