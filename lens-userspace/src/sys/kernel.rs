//! The running kernel, as `/proc/sys/kernel` tells it.

/// This kernel's release (`uname -r`).
pub fn release() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()
}
