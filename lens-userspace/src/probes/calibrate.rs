//! What a probe hit costs on this machine, measured at start-up: a `count_only` probe
//! (the launches' program) on a function of lens-probe itself, then a return probe on it
//! too, the function called in a loop with and without them. VMs differ from bare metal
//! by 2–3× here, so a constant would be wrong somewhere. The overhead budget works from
//! the entry cost; the exit summary and `lens_probe.overhead` estimate each process's
//! cost from both.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use lens_common::{LossCause, ProbeId, TARGET_CALIBRATION, TargetState};
use log::warn;

use super::attach;
use super::catalog::{self, Program};
use crate::bpf::BpfObject;
use crate::error::{LensError, Result};
use crate::sys::symbols;

/// Used when the measurement cannot be made (a stripped lens-probe binary): the entry is
/// the median `cargo xtask bench` found on the 2-vCPU CI VM (docs/performance.md); the
/// return is a deliberate over-estimate (start-up measured 325–575 ns there).
pub const DEFAULT_HIT_COSTS: HitCosts = HitCosts {
    entry: Duration::from_nanos(1_500),
    ret: Duration::from_nanos(2_000),
};

/// What one probe hit costs the thread that makes the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HitCosts {
    /// The trap into the kernel and an entry program.
    pub entry: Duration,
    /// A return probe on top: its own trap and program.
    pub ret: Duration,
}

impl HitCosts {
    /// The estimated cost of `calls` (the kernel's counts, by probe): an entry hit each,
    /// and a return hit for the probes that have a return program.
    pub fn of_calls(&self, calls: &BTreeMap<ProbeId, u64>) -> Duration {
        let ns: u128 = calls
            .iter()
            .map(|(&probe, &count)| {
                let per_call = self.entry
                    + if catalog::spec_of(probe).exit.is_some() {
                        self.ret
                    } else {
                        Duration::ZERO
                    };
                per_call.as_nanos() * u128::from(count)
            })
            .sum();
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }
}
const CALLS: u32 = 10_000;
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

/// What a probe hit costs here, or [`DEFAULT_HIT_COSTS`] (with a warning).
pub fn hit_costs(bpf: &mut BpfObject) -> HitCosts {
    match measure(bpf) {
        Ok(costs) => costs,
        Err(error) => {
            warn!(
                "cannot measure what a probe hit costs ({error}): assuming {} ns an entry, \
                 {} ns a return",
                DEFAULT_HIT_COSTS.entry.as_nanos(),
                DEFAULT_HIT_COSTS.ret.as_nanos()
            );
            DEFAULT_HIT_COSTS
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

fn measure(bpf: &mut BpfObject) -> Result<HitCosts> {
    let exe = crate::sys::process::own_executable();
    let offset = *symbols::resolve_file_offsets(exe, &[TARGET_SYMBOL])?
        .get(TARGET_SYMBOL)
        .ok_or_else(|| LensError::Elf {
            path: exe.to_path_buf(),
            reason: format!("no symbol {TARGET_SYMBOL} (stripped binary?)"),
        })?;
    let pid = std::process::id();
    let baseline = fastest();
    // The program does all its work only for a traced process: be one, briefly.
    bpf.maps
        .targets
        .insert(&pid, &TargetState::new(TARGET_CALIBRATION))?;
    // The return probe's hits find no entry to pair, which the kernel counts as lost
    // events: those counters are put back as they were.
    let unmatched_before = bpf.maps.losses.per_cpu(LossCause::UnmatchedReturn);
    // Entry alone, then entry and return: the difference is the return's cost. A return
    // program with no entry to pair finds none and stops, as cheap as a return gets; a
    // real one also sends its record (tens of ns more).
    let measured = attach::attach_own(
        &mut bpf.programs,
        Program::CountOnly,
        exe,
        offset,
        ProbeId::CudaLaunchKernel,
    )
    .and_then(|entry_link| {
        let with_entry = fastest();
        let both = attach::attach_own(
            &mut bpf.programs,
            Program::CudaSyncReturn,
            exe,
            offset,
            ProbeId::CudaStreamSynchronize,
        )
        .map(|return_link| {
            let with_both = fastest();
            // Taking a uprobe out can take the kernel ~0.1 s: not on the start-up path.
            std::thread::spawn(move || drop((entry_link, return_link)));
            with_both
        });
        Ok((with_entry, both?))
    });
    // Leaves no trace of lens-probe itself in the kernel's maps.
    bpf.maps.targets.remove(&pid);
    bpf.maps.launches.kernel_counts.forget(pid);
    if let Some(before) = unmatched_before {
        bpf.maps
            .losses
            .set_per_cpu(LossCause::UnmatchedReturn, before);
    }
    let (with_entry, with_both) = measured?;
    Ok(HitCosts {
        entry: with_entry.saturating_sub(baseline) / CALLS,
        ret: with_both.saturating_sub(with_entry) / CALLS,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_costs_an_entry_hit_and_a_return_hit_where_the_probe_has_one() {
        let costs = HitCosts {
            entry: Duration::from_nanos(1_000),
            ret: Duration::from_nanos(400),
        };
        // Launches have an entry program only; an all-reduce and a stream sync also a
        // return program.
        assert!(catalog::spec_of(ProbeId::CudaLaunchKernel).exit.is_none());
        assert!(catalog::spec_of(ProbeId::NcclAllReduce).exit.is_some());
        let calls: BTreeMap<ProbeId, u64> = [
            (ProbeId::CudaLaunchKernel, 1_000),
            (ProbeId::NcclAllReduce, 10),
            (ProbeId::CudaStreamSynchronize, 5),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            costs.of_calls(&calls),
            Duration::from_nanos(1_000 * 1_000 + 15 * 1_400)
        );
        assert_eq!(costs.of_calls(&BTreeMap::new()), Duration::ZERO);
    }
}
