//! The session's typed access to the kernel's per-process maps: targets (with their
//! launch counters), libcudart's code ranges, the run-wide switches; and their cleanup.

use aya::{
    Ebpf,
    maps::{Array as BpfArray, HashMap as BpfHashMap, MapData, PerCpuHashMap},
};
use lens_common::record::{CollectiveCall, CommInitCall, EventQuery, RETURNED_KIND, SyncCall};
use lens_common::{
    Body, CODE_RANGES, CallKey, CodeRanges, InflightKey, KernelKey, Record, TargetState, maps,
};
use log::warn;

use crate::{
    error::{LensError, Result},
    sys::library::{self, LibraryKind, MappedLibrary},
};

use super::{KernelState, Session};

/// Calls `function::<Body>(args…, map name)` for each in-flight map (one per record
/// body, `maps::INFLIGHT_*`), giving an array of the results.
macro_rules! each_inflight_map {
    ($function:ident($($arg:expr),*)) => {
        [
            $function::<CollectiveCall>($($arg,)* maps::INFLIGHT_COLLECTIVES),
            $function::<SyncCall>($($arg,)* maps::INFLIGHT_SYNCS),
            $function::<CommInitCall>($($arg,)* maps::INFLIGHT_COMM_INITS),
            $function::<EventQuery>($($arg,)* maps::INFLIGHT_QUERIES),
        ]
    };
}

impl Session {
    /// Tells the driver probes where `pid` maps libcudart (all its mappings, merged): a
    /// driver launch returning there is the runtime's own, counted at the runtime.
    /// `libraries` are what `pid` maps of interest: without a libcudart, the maps (long
    /// in a torch process, and read at every library load) are not read again.
    pub(super) fn set_runtime_ranges(&mut self, pid: u32, libraries: &[MappedLibrary]) {
        if !libraries.iter().any(|l| l.kind == LibraryKind::CudaRuntime) {
            return;
        }
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
            return;
        };
        let mut ranges: Vec<[u64; 2]> = Vec::new();
        for entry in library::parse_maps(&text) {
            let name = std::path::Path::new(&entry.path)
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if LibraryKind::from_file_name(name) != Some(LibraryKind::CudaRuntime) {
                continue;
            }
            match ranges.last_mut() {
                Some(last) if last[1] == entry.start => last[1] = entry.end,
                _ => ranges.push([entry.start, entry.end]),
            }
        }
        if ranges.is_empty() {
            return;
        }
        if ranges.len() > CODE_RANGES {
            warn!(
                "pid {pid} maps libcudart in {} places, the driver probes know {CODE_RANGES}: \
                 runtime launches from the others may count twice",
                ranges.len()
            );
        }
        let mut value = CodeRanges::default();
        for (slot, range) in value.ranges.iter_mut().zip(ranges) {
            *slot = range;
        }
        let Some(map) = self.ebpf.map_mut(maps::RUNTIME_RANGES) else {
            return;
        };
        if let Ok(mut map) = BpfHashMap::<_, u32, CodeRanges>::try_from(map)
            && let Err(error) = map.insert(&pid, &value, 0)
        {
            warn!("pid {pid}: cannot tell the driver probes where libcudart is: {error}");
        }
    }

    /// Driver launches of `pid` left out as the runtime's own (counted at the runtime):
    /// each a probe hit it paid for.
    pub(super) fn runtime_driver_hits(&self, pid: u32) -> u64 {
        self.ebpf
            .map(maps::TARGETS)
            .and_then(|map| BpfHashMap::<_, u32, TargetState>::try_from(map).ok())
            .and_then(|map| map.get(&pid, 0).ok())
            .map_or(0, |target| target.runtime_driver_hits)
    }

    pub(super) fn targets_map(&mut self) -> Result<BpfHashMap<&mut MapData, u32, TargetState>> {
        hash_map_mut(&mut self.ebpf, maps::TARGETS)
    }

    /// Traces `pid` from now, with `flags` (`TARGET_*`) and nothing counted yet.
    pub(super) fn set_target(&mut self, pid: u32, flags: u32) -> Result<()> {
        self.targets_map()?
            .insert(&pid, &TargetState::new(flags), 0)
            .map_err(|source| LensError::Map {
                map: maps::TARGETS,
                source,
            })
    }

    /// Drops what the kernel keeps for `pid` besides its `TARGETS` entry and call counters
    /// (taken by the caller): a stop not yet continued, its Python save state, where it
    /// maps libcudart, and the entries of calls it never returned from (a thread killed in
    /// a sync wait).
    pub(super) fn forget_kernel_state(&mut self, pid: u32) {
        if let Some(map) = self.ebpf.map_mut(maps::STOPPED)
            && let Ok(mut stops) = BpfHashMap::<_, u32, u64>::try_from(map)
        {
            let _ = stops.remove(&pid);
        }
        self.armed_loads.remove(&pid);
        if self.saving_depth.remove(&pid).is_some()
            && let Some(map) = self.ebpf.map_mut(maps::PY_SAVING)
            && let Ok(mut saving) = BpfHashMap::<_, u32, u8>::try_from(map)
        {
            let _ = saving.remove(&pid);
        }
        if let Some(map) = self.ebpf.map_mut(maps::RUNTIME_RANGES)
            && let Ok(mut ranges) = BpfHashMap::<_, u32, CodeRanges>::try_from(map)
        {
            let _ = ranges.remove(&pid);
        }
        each_inflight_map!(forget_process_calls(&mut self.ebpf, pid));
    }

    /// Entries in the kernel's per-process maps now: targets, calls in flight, call
    /// counters and launch totals. Bounded by the maps' sizes; all 0 once every target
    /// has ended.
    pub fn kernel_state(&self) -> KernelState {
        fn entries<K: aya::Pod, V: aya::Pod>(ebpf: &Ebpf, name: &str) -> usize {
            ebpf.map(name)
                .and_then(|map| BpfHashMap::<_, K, V>::try_from(map).ok())
                .map_or(0, |map| map.keys().count())
        }
        let call_counters = self
            .ebpf
            .map(maps::CALL_COUNTS)
            .and_then(|map| PerCpuHashMap::<_, CallKey, u64>::try_from(map).ok())
            .map_or(0, |map| map.keys().count());
        KernelState {
            targets: entries::<u32, TargetState>(&self.ebpf, maps::TARGETS),
            inflight: each_inflight_map!(inflight_count(&self.ebpf)).iter().sum(),
            call_counters,
            kernel_counters: entries::<KernelKey, u64>(&self.ebpf, maps::KERNEL_COUNTS),
            runtime_ranges: entries::<u32, CodeRanges>(&self.ebpf, maps::RUNTIME_RANGES),
        }
    }
}

/// The calls in flight in one in-flight map, with their entry records (not the slots of
/// calls that returned, kept for their thread's next call).
pub(super) fn inflight_entries<B: Body>(
    ebpf: &Ebpf,
    name: &'static str,
) -> Vec<(InflightKey, Record<B>)> {
    ebpf.map(name)
        .and_then(|map| BpfHashMap::<_, InflightKey, Record<B>>::try_from(map).ok())
        .map(|map| {
            map.iter()
                .filter_map(|entry| entry.ok())
                .filter(|(_, record)| record.header.kind != RETURNED_KIND)
                .collect()
        })
        .unwrap_or_default()
}

fn inflight_count<B: Body>(ebpf: &Ebpf, name: &'static str) -> usize {
    ebpf.map(name)
        .and_then(|map| BpfHashMap::<_, InflightKey, Record<B>>::try_from(map).ok())
        .map_or(0, |map| map.keys().count())
}

/// Drops `pid`'s calls from one in-flight map (a process that ended mid-call).
fn forget_process_calls<B: Body>(ebpf: &mut Ebpf, pid: u32, name: &'static str) {
    let Some(map) = ebpf.map_mut(name) else {
        return;
    };
    let Ok(mut inflight) = BpfHashMap::<_, InflightKey, Record<B>>::try_from(map) else {
        return;
    };
    let stale: Vec<InflightKey> = inflight
        .keys()
        .filter_map(|k| k.ok())
        .filter(|k| (k.pid_tgid >> 32) as u32 == pid)
        .collect();
    for key in stale {
        let _ = inflight.remove(&key);
    }
}

/// The kernel's hash map `name`, typed.
pub(super) fn hash_map_mut<'a, K: aya::Pod, V: aya::Pod>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<BpfHashMap<&'a mut MapData, K, V>> {
    let map = ebpf
        .map_mut(name)
        .ok_or(LensError::MissingInObject { kind: "map", name })?;
    BpfHashMap::try_from(map).map_err(|source| LensError::Map { map: name, source })
}

/// Sets one of the run-wide switches (`lens_common::settings`).
pub(super) fn set_setting(ebpf: &mut Ebpf, index: u32, value: u32) -> Result<()> {
    let map = ebpf
        .map_mut(maps::SETTINGS)
        .ok_or(LensError::MissingInObject {
            kind: "map",
            name: maps::SETTINGS,
        })?;
    let mut settings_map: BpfArray<&mut MapData, u32> =
        BpfArray::try_from(map).map_err(|source| LensError::Map {
            map: maps::SETTINGS,
            source,
        })?;
    settings_map
        .set(index, &value, 0)
        .map_err(|source| LensError::Map {
            map: maps::SETTINGS,
            source,
        })
}
