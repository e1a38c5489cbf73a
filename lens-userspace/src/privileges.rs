//! Can this process load BPF programs and attach uprobes at all? Checked up front so the
//! user gets one clear line instead of an EPERM from deep inside the loader.
use std::{fs, path::Path};

use crate::error::{LensError, Result};

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Where the kernel publishes its uprobe PMU; absent on kernels without uprobe events.
pub const UPROBE_PMU_TYPE: &str = "/sys/bus/event_source/devices/uprobe/type";

pub fn check() -> Result<()> {
    check_uprobe_support(Path::new(UPROBE_PMU_TYPE))?;
    let status = fs::read_to_string("/proc/self/status")?;
    let missing = missing_capabilities(&status);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(LensError::MissingPrivileges {
            missing: missing.join(", "),
        })
    }
}

pub fn check_uprobe_support(pmu_type: &Path) -> Result<()> {
    if pmu_type.exists() {
        Ok(())
    } else {
        Err(LensError::NoUprobeSupport(pmu_type.to_path_buf()))
    }
}

/// The capabilities this process lacks, from the `CapEff:` line of /proc/self/status.
pub fn missing_capabilities(proc_status: &str) -> Vec<&'static str> {
    let effective = proc_status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    [
        (CAP_BPF, "CAP_BPF"),
        (CAP_PERFMON, "CAP_PERFMON"),
        (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
    ]
    .into_iter()
    .filter(|(bit, _)| effective & (1 << bit) == 0)
    .map(|(_, name)| name)
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_has_everything() {
        assert!(missing_capabilities("Name:\tx\nCapEff:\t000001ffffffffff\n").is_empty());
    }

    #[test]
    fn an_unprivileged_user_misses_all_three() {
        assert_eq!(
            missing_capabilities("CapEff:\t0000000000000000\n"),
            ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_ADMIN"]
        );
    }

    #[test]
    fn bpf_and_perfmon_without_sys_admin() {
        let caps = (1u64 << CAP_BPF) | (1u64 << CAP_PERFMON);
        let status = format!("CapEff:\t{caps:016x}\n");
        assert_eq!(missing_capabilities(&status), ["CAP_SYS_ADMIN"]);
    }

    #[test]
    fn a_kernel_without_the_uprobe_pmu_is_named() {
        let error = check_uprobe_support(Path::new("/nonexistent/uprobe/type")).unwrap_err();
        assert!(error.to_string().contains("no uprobe support"), "{error}");
    }
}
