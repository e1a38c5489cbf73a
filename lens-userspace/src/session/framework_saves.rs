//! Which traced processes are inside a framework save or load, as the kernel must know it
//! (`PY_SAVING`: their collective and sync entries take a Python stack sample first, and
//! files opened during a load are counted). Kept from the framework calls the Python
//! rules report; no BPF here: the session writes what [`FrameworkSaves`] says changed.
use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use lens_common::saving;

/// How long a load's preparation (DCP's `get_state_dict`) keeps its process loading
/// after it returned, waiting for the load it prepares.
const ARMED_LOAD: Duration = Duration::from_secs(1);

/// A framework function's part: a save, a load, or both (DCP's `get_state_dict`, which
/// prepares either).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FrameworkRole {
    pub(super) save: bool,
    pub(super) load: bool,
}

/// Framework save and load calls open per process.
#[derive(Default)]
pub(super) struct FrameworkSaves {
    /// Save and load calls open, per process.
    depth: HashMap<u32, [u32; 2]>,
    /// Processes whose load preparation returned and whose next framework call is not
    /// seen yet: their load part is kept for it until [`ARMED_LOAD`] has passed.
    armed_loads: HashMap<u32, Instant>,
}

impl FrameworkSaves {
    /// What `PY_SAVING` says of `pid` now (`lens_common::saving` bits).
    pub(super) fn bits(&self, pid: u32) -> u8 {
        self.depth.get(&pid).map_or(0, |d| {
            (if d[0] > 0 { saving::SAVE } else { 0 }) | (if d[1] > 0 { saving::LOAD } else { 0 })
        })
    }

    /// A framework function of `role` entered (or returned, `at_return`) in `pid` at
    /// `now`. Returns the process's new bits if they changed.
    pub(super) fn call(
        &mut self,
        pid: u32,
        role: FrameworkRole,
        at_return: bool,
        now: Instant,
    ) -> Option<u8> {
        let was = self.bits(pid);
        let prelude_return = at_return && role.save && role.load;
        let depths = self.depth.entry(pid).or_default();
        // A load's preparation keeps its load part past its return, until the process's
        // next framework call is seen: the load after it reads its first file
        // (`.metadata`) at once, often before a sample shows the load itself (the sample
        // between may show neither).
        if !prelude_return && self.armed_loads.remove(&pid).is_some() {
            depths[1] = depths[1].saturating_sub(1);
        }
        for (index, (depth, part)) in depths.iter_mut().zip([role.save, role.load]).enumerate() {
            if !part || (prelude_return && index == 1) {
                continue;
            }
            *depth = if at_return {
                depth.saturating_sub(1)
            } else {
                *depth + 1
            };
        }
        if prelude_return {
            self.armed_loads.insert(pid, now);
        }
        self.changed(pid, was)
    }

    /// A preparation no load followed within [`ARMED_LOAD`] was for something else (a
    /// save, or the job's own use of the state dict): its files are no load's. Returns
    /// the processes whose bits changed, with their new bits.
    pub(super) fn expire(&mut self, now: Instant) -> Vec<(u32, u8)> {
        let expired: Vec<u32> = self
            .armed_loads
            .iter()
            .filter(|(_, since)| now.saturating_duration_since(**since) >= ARMED_LOAD)
            .map(|(pid, _)| *pid)
            .collect();
        let mut changes = Vec::new();
        for pid in expired {
            self.armed_loads.remove(&pid);
            let was = self.bits(pid);
            if let Some(depths) = self.depth.get_mut(&pid) {
                depths[1] = depths[1].saturating_sub(1);
            }
            changes.extend(self.changed(pid, was).map(|bits| (pid, bits)));
        }
        changes
    }

    /// `pid` is gone.
    pub(super) fn forget(&mut self, pid: u32) {
        self.depth.remove(&pid);
        self.armed_loads.remove(&pid);
    }

    /// The new bits of `pid` if they differ from `was`; a process with none left is
    /// forgotten.
    fn changed(&mut self, pid: u32, was: u8) -> Option<u8> {
        let now = self.bits(pid);
        if now == 0 {
            self.depth.remove(&pid);
        }
        (now != was).then_some(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAVE: FrameworkRole = FrameworkRole {
        save: true,
        load: false,
    };
    const LOAD: FrameworkRole = FrameworkRole {
        save: false,
        load: true,
    };
    const PREPARE: FrameworkRole = FrameworkRole {
        save: true,
        load: true,
    };

    #[test]
    fn nested_saves_keep_the_bit_until_the_outer_one_returns() {
        let mut saves = FrameworkSaves::default();
        let t = Instant::now();
        assert_eq!(saves.call(7, SAVE, false, t), Some(saving::SAVE));
        assert_eq!(saves.call(7, SAVE, false, t), None);
        assert_eq!(saves.call(7, SAVE, true, t), None);
        assert_eq!(saves.call(7, SAVE, true, t), Some(0));
        // Nothing left of it.
        assert_eq!(saves.bits(7), 0);
        assert!(saves.depth.is_empty());
    }

    #[test]
    fn a_prepared_load_stays_a_load_until_the_next_call_or_a_second() {
        let mut saves = FrameworkSaves::default();
        let t = Instant::now();
        assert_eq!(
            saves.call(7, PREPARE, false, t),
            Some(saving::SAVE | saving::LOAD)
        );
        // Its return keeps the load part, armed.
        assert_eq!(saves.call(7, PREPARE, true, t), Some(saving::LOAD));
        // The load it prepared: entered, the armed part given up for it.
        assert_eq!(saves.call(7, LOAD, false, t), None);
        assert_eq!(saves.call(7, LOAD, true, t), Some(0));
        // A preparation nothing followed: a load for a second, then not.
        saves.call(8, PREPARE, false, t);
        saves.call(8, PREPARE, true, t);
        assert!(saves.expire(t + Duration::from_millis(999)).is_empty());
        assert_eq!(saves.bits(8), saving::LOAD);
        assert_eq!(saves.expire(t + ARMED_LOAD), vec![(8, 0)]);
        assert_eq!(saves.bits(8), 0);
    }

    #[test]
    fn a_save_during_a_load_sets_both_bits() {
        let mut saves = FrameworkSaves::default();
        let t = Instant::now();
        saves.call(7, LOAD, false, t);
        assert_eq!(
            saves.call(7, SAVE, false, t),
            Some(saving::SAVE | saving::LOAD)
        );
        saves.forget(7);
        assert_eq!(saves.bits(7), 0);
    }
}
