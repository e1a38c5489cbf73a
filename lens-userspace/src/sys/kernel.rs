//! The running kernel, as `/proc/sys/kernel` tells it.

/// This kernel's release (`uname -r`).
pub fn release() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()
}

/// This boot's random id (`/proc/sys/kernel/random/boot_id`): with the host name, tells
/// one node's run apart from another's, and from the same node's after a reboot.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|id| id.trim().to_string())
}
