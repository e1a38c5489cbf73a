//! What one launch-probe hit costs on this machine, measured at start-up for the overhead
//! budget: a `count_only` probe (the launches' program) on a function of lens-probe
//! itself, called in a loop with and without it. VMs differ from bare metal by 2–3×
//! here, so a constant would be wrong somewhere.
use std::{
    path::Path,
    time::{Duration, Instant},
};

use aya::{
    Ebpf,
    maps::{HashMap as BpfHashMap, MapData, PerCpuHashMap},
};
use lens_common::{CallKey, KernelKey, LaunchTotals, ProbeId, TargetConfig, maps};
use log::warn;

use super::attach;
use crate::error::{LensError, Result};
use crate::sys::symbols;

/// Used when the measurement cannot be made (a stripped lens-probe binary): the median
/// `cargo xtask bench` found on the 2-vCPU CI VM (docs/performance.md).
pub const DEFAULT_PER_HIT: Duration = Duration::from_nanos(1_500);
const CALLS: u32 = 20_000;
const ROUNDS: usize = 3;
const TARGET_SYMBOL: &str = "lens_probe_calibration_target";

// The probed function, in assembly so that it starts like the probed library functions
// do (`push %rbp; mov %rsp,%rbp`): the kernel emulates that first instruction, while
// most others are single-stepped out of line, several times slower.
#[cfg(target_arch = "x86_64")]
std::arch::global_asm!(
    ".globl lens_probe_calibration_target",
    ".type lens_probe_calibration_target,@function",
    "lens_probe_calibration_target:",
    "push rbp",
    "mov rbp, rsp",
    "lea rax, [rdi + 1]",
    "pop rbp",
    "ret",
    ".size lens_probe_calibration_target, . - lens_probe_calibration_target",
);

#[cfg(target_arch = "x86_64")]
unsafe extern "C" {
    fn lens_probe_calibration_target(value: u64) -> u64;
}

#[cfg(not(target_arch = "x86_64"))]
#[unsafe(no_mangle)]
#[inline(never)]
extern "C" fn lens_probe_calibration_target(value: u64) -> u64 {
    std::hint::black_box(value).wrapping_add(1)
}

/// The cost of one launch-probe hit, or [`DEFAULT_PER_HIT`] (with a warning).
pub fn per_hit_cost(ebpf: &mut Ebpf) -> Duration {
    match measure(ebpf) {
        Ok(cost) => cost,
        Err(error) => {
            warn!(
                "cannot measure what a probe hit costs ({error}): assuming {} ns",
                DEFAULT_PER_HIT.as_nanos()
            );
            DEFAULT_PER_HIT
        }
    }
}

fn time_calls() -> Duration {
    let start = Instant::now();
    let mut value = 0;
    for _ in 0..CALLS {
        // SAFETY: a leaf function of four instructions that only reads its argument.
        #[allow(unused_unsafe)]
        {
            value = unsafe { lens_probe_calibration_target(value) };
        }
    }
    std::hint::black_box(value);
    start.elapsed()
}

/// The fastest of a few rounds: the least disturbed by the rest of the machine.
fn fastest() -> Duration {
    (0..ROUNDS).map(|_| time_calls()).min().unwrap_or_default()
}

fn measure(ebpf: &mut Ebpf) -> Result<Duration> {
    let exe = Path::new("/proc/self/exe");
    let offset = *symbols::resolve_file_offsets(exe, &[TARGET_SYMBOL])?
        .get(TARGET_SYMBOL)
        .ok_or_else(|| LensError::Elf {
            path: exe.to_path_buf(),
            reason: format!("no symbol {TARGET_SYMBOL} (stripped binary?)"),
        })?;
    let pid = std::process::id();
    let baseline = fastest();
    // The program does all its work only for a traced process: be one, briefly.
    map_error(
        maps::TARGETS,
        targets(ebpf)?.insert(&pid, &TargetConfig::default(), 0),
    )?;
    let probed =
        attach::attach_count_only(ebpf, exe, offset, ProbeId::CudaLaunchKernel).map(|link| {
            let probed = fastest();
            // Taking a uprobe out takes the kernel ~0.1 s: not on the start-up path.
            std::thread::spawn(move || drop(link));
            probed
        });
    forget_own_counters(ebpf, pid);
    let probed = probed?;
    Ok(probed.saturating_sub(baseline) / CALLS)
}

fn map_error<T>(
    map: &'static str,
    result: std::result::Result<T, aya::maps::MapError>,
) -> Result<T> {
    result.map_err(|source| LensError::Map { map, source })
}

fn targets(ebpf: &mut Ebpf) -> Result<BpfHashMap<&mut MapData, u32, TargetConfig>> {
    let map = ebpf
        .map_mut(maps::TARGETS)
        .ok_or(LensError::MissingInObject {
            kind: "map",
            name: maps::TARGETS,
        })?;
    map_error(maps::TARGETS, BpfHashMap::try_from(map))
}

/// Leaves no trace of lens-probe itself in the kernel's maps.
fn forget_own_counters(ebpf: &mut Ebpf, pid: u32) {
    if let Ok(mut targets) = targets(ebpf) {
        let _ = targets.remove(&pid);
    }
    if let Some(map) = ebpf.map_mut(maps::CALL_COUNTS)
        && let Ok(mut counts) = PerCpuHashMap::<_, CallKey, u64>::try_from(map)
    {
        let _ = counts.remove(&CallKey {
            tgid: pid,
            probe: ProbeId::CudaLaunchKernel as u32,
        });
    }
    if let Some(map) = ebpf.map_mut(maps::LAUNCH_TOTALS)
        && let Ok(mut totals) = BpfHashMap::<_, u32, LaunchTotals>::try_from(map)
    {
        let _ = totals.remove(&pid);
    }
    if let Some(map) = ebpf.map_mut(maps::KERNEL_COUNTS)
        && let Ok(mut counts) = BpfHashMap::<_, KernelKey, u64>::try_from(map)
    {
        let own: Vec<KernelKey> = counts
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| k.tgid == pid)
            .collect();
        for key in own {
            let _ = counts.remove(&key);
        }
    }
}
