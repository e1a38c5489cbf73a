//! The kernel's `task_struct`, read at offsets the loader sets from the running kernel's
//! BTF: a thread's tgid, exit code, thread count, thread pointer and sleeps.
use aya_ebpf::helpers::generated;

// Offsets in `struct task_struct`, set by the loader from the kernel's BTF (read
// volatile: the compiler must not fold the placeholder values).
#[unsafe(no_mangle)]
pub(crate) static TASK_TGID_OFFSET: u32 = 0;

#[unsafe(no_mangle)]
pub(crate) static TASK_EXIT_CODE_OFFSET: u32 = 0;

#[unsafe(no_mangle)]
pub(crate) static EXIT_HAS_GROUP_DEAD: u32 = 0;

#[unsafe(no_mangle)]
pub(crate) static TASK_SIGNAL_OFFSET: u32 = 0;

#[unsafe(no_mangle)]
pub(crate) static SIGNAL_NR_THREADS_OFFSET: u32 = 0;

#[unsafe(no_mangle)]
pub(crate) static TASK_FSBASE_OFFSET: u32 = 0;

#[unsafe(no_mangle)]
pub(crate) static TASK_NVCSW_OFFSET: u32 = 0;

/// The current thread's voluntary context switches (`task->nvcsw`: the times it slept),
/// `None` when the kernel's layout is unknown.
#[inline(always)]
pub(crate) fn voluntary_switches() -> Option<u64> {
    // SAFETY: as in `has_other_threads`.
    unsafe {
        let offset = core::ptr::read_volatile(&TASK_NVCSW_OFFSET) as u64;
        if offset == 0 {
            return None;
        }
        let task = generated::bpf_get_current_task();
        aya_ebpf::helpers::bpf_probe_read_kernel((task + offset) as *const u64).ok()
    }
}

/// The current thread's thread pointer (`pthread_self()`), 0 when unknown.
#[inline(always)]
pub(crate) fn thread_pointer() -> u64 {
    // SAFETY: as in `has_other_threads`.
    unsafe {
        let offset = core::ptr::read_volatile(&TASK_FSBASE_OFFSET) as u64;
        if offset == 0 {
            return 0;
        }
        let task = generated::bpf_get_current_task();
        aya_ebpf::helpers::bpf_probe_read_kernel((task + offset) as *const u64).unwrap_or(0)
    }
}

/// Whether the current process has threads besides the current one (`task->signal->
/// nr_threads`); false when the kernel's layout is unknown.
#[inline(always)]
pub(crate) fn has_other_threads() -> bool {
    // SAFETY: reads of placeholders the loader set (volatile: not folded) and of kernel
    // memory through the checked helper, at offsets from the running kernel's BTF.
    unsafe {
        let signal_offset = core::ptr::read_volatile(&TASK_SIGNAL_OFFSET) as u64;
        let threads_offset = core::ptr::read_volatile(&SIGNAL_NR_THREADS_OFFSET) as u64;
        if signal_offset == 0 || threads_offset == 0 {
            return false;
        }
        let task = generated::bpf_get_current_task();
        let Ok(signal) =
            aya_ebpf::helpers::bpf_probe_read_kernel((task + signal_offset) as *const u64)
        else {
            return false;
        };
        aya_ebpf::helpers::bpf_probe_read_kernel((signal + threads_offset) as *const i32)
            .is_ok_and(|threads| threads > 1)
    }
}
