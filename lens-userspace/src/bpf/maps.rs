//! The kernel's maps, each taken out of the loaded object once and held typed: what it
//! holds, who writes it, and the few operations lens-probe needs on it. Nothing outside
//! `bpf/` names a map.
//!
//! Every per-process map is keyed by, or by something holding, the process's tgid: a
//! process that ends or is let go is forgotten in all of them through
//! [`KernelMaps::forget_process`].
use aya::{
    Ebpf, Pod,
    maps::{Array, HashMap as BpfHashMap, IterableMap, MapData, PerCpuArray, PerCpuValues},
};
use lens_common::{
    Body, CodeRanges, HandleKey, InflightKey, KernelKey, LossCause, PyOffsets, Record, TargetState,
    maps, python_gates,
    record::{ApiCall, CollectiveCall, CommInitCall, EventQuery, RETURNED_KIND, SyncCall},
};

use crate::error::{LensError, Result};

/// A key that names the process it belongs to.
pub trait ProcessKey: Pod {
    fn pid(&self) -> u32;
}

impl ProcessKey for u32 {
    fn pid(&self) -> u32 {
        *self
    }
}

impl ProcessKey for KernelKey {
    fn pid(&self) -> u32 {
        self.tgid
    }
}

impl ProcessKey for HandleKey {
    fn pid(&self) -> u32 {
        self.tgid
    }
}

impl ProcessKey for InflightKey {
    fn pid(&self) -> u32 {
        (self.pid_tgid >> 32) as u32
    }
}

/// Takes map `name` out of `ebpf`, as the map type `M`.
fn take<M>(ebpf: &mut Ebpf, name: &'static str) -> Result<M>
where
    M: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or(LensError::MissingInObject { kind: "map", name })?;
    M::try_from(map).map_err(|source| LensError::Map { map: name, source })
}

/// A hash map keyed by process (or by something of one process).
pub struct ProcessMap<K: ProcessKey, V: Pod> {
    name: &'static str,
    map: BpfHashMap<MapData, K, V>,
}

impl<K: ProcessKey, V: Pod> ProcessMap<K, V> {
    fn from_object(ebpf: &mut Ebpf, name: &'static str) -> Result<Self> {
        Ok(ProcessMap {
            name,
            map: take(ebpf, name)?,
        })
    }

    pub fn get(&self, key: &K) -> Option<V> {
        self.map.get(key, 0).ok()
    }

    pub fn insert(&mut self, key: &K, value: &V) -> Result<()> {
        self.map
            .insert(key, value, 0)
            .map_err(|source| LensError::Map {
                map: self.name,
                source,
            })
    }

    /// Removes `key`; whether it was there.
    pub fn remove(&mut self, key: &K) -> bool {
        self.map.remove(key).is_ok()
    }

    /// Removes `key`, giving what it held.
    pub fn take(&mut self, key: &K) -> Option<V> {
        let value = self.get(key);
        self.remove(key);
        value
    }

    /// Every entry (a hash map walk: every bucket is visited, even of an empty map).
    pub fn entries(&self) -> Vec<(K, V)> {
        self.map.iter().filter_map(|entry| entry.ok()).collect()
    }

    /// The keys of the processes `wanted` says yes to.
    pub fn keys_of(&self, wanted: impl Fn(u32) -> bool) -> Vec<K> {
        self.map
            .keys()
            .filter_map(|key| key.ok())
            .filter(|key| wanted(key.pid()))
            .collect()
    }

    /// Drops every entry of `pid`.
    pub fn forget(&mut self, pid: u32) {
        for key in self.keys_of(|owner| owner == pid) {
            self.remove(&key);
        }
    }

    pub fn len(&self) -> usize {
        self.map.keys().count()
    }

    pub fn is_empty(&self) -> bool {
        self.map.keys().next().is_none()
    }

    /// The map's descriptor, for a process of our own that shares it (the guardian).
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::{AsFd, AsRawFd};
        self.map.map().fd().as_fd().as_raw_fd()
    }
}

/// One in-flight map: the entry record of each call a thread is in, kept until its
/// return pairs it (then marked returned, the slot kept for the thread's next call).
/// Written by the entry and return probes; read for hang reports, cleaned at exit.
pub type InflightMap<B> = ProcessMap<InflightKey, Record<B>>;

impl<B: Body> InflightMap<B> {
    /// The calls in flight now, with their entry records.
    pub fn calls(&self) -> Vec<(InflightKey, Record<B>)> {
        self.entries()
            .into_iter()
            .filter(|(_, record)| record.header.kind != RETURNED_KIND)
            .collect()
    }
}

/// The in-flight maps, one per record body that pairs an entry with a return.
pub struct InflightMaps {
    pub collectives: InflightMap<CollectiveCall>,
    pub syncs: InflightMap<SyncCall>,
    pub comm_inits: InflightMap<CommInitCall>,
    pub queries: InflightMap<EventQuery>,
    pub api_calls: InflightMap<ApiCall>,
}

impl InflightMaps {
    fn forget(&mut self, pid: u32) {
        self.collectives.forget(pid);
        self.syncs.forget(pid);
        self.comm_inits.forget(pid);
        self.queries.forget(pid);
        self.api_calls.forget(pid);
    }

    fn len(&self) -> usize {
        self.collectives.len()
            + self.syncs.len()
            + self.comm_inits.len()
            + self.queries.len()
            + self.api_calls.len()
    }

    /// Every call in flight now, of every kind: its thread and probe, when it began, and a
    /// collective's entry record (its communicator and payload).
    pub fn calls(&self) -> Vec<CallInFlight> {
        let mut calls: Vec<CallInFlight> = (self.collectives.calls().into_iter())
            .map(|(key, entry)| CallInFlight {
                key,
                start_ns: entry.body.times.start_ns,
                collective: Some(entry.body),
            })
            .collect();
        calls.extend(started(&self.syncs, |call| call.times.start_ns));
        calls.extend(started(&self.comm_inits, |call| call.times.start_ns));
        calls.extend(started(&self.queries, |call| call.times.start_ns));
        calls.extend(started(&self.api_calls, |call| call.times.start_ns));
        calls
    }
}

/// The calls in flight in `map`, a kind other than the collectives: their start alone.
fn started<B: Body>(
    map: &InflightMap<B>,
    start_ns: impl Fn(&B) -> u64,
) -> impl Iterator<Item = CallInFlight> {
    map.calls()
        .into_iter()
        .map(move |(key, entry)| CallInFlight {
            key,
            start_ns: start_ns(&entry.body),
            collective: None,
        })
}

/// A call a thread is in (its entry seen, its return not yet).
#[derive(Clone, Copy, Debug)]
pub struct CallInFlight {
    pub key: InflightKey,
    /// `CLOCK_MONOTONIC` ns at entry.
    pub start_ns: u64,
    /// A collective's entry record; `None` for the other kinds.
    pub collective: Option<CollectiveCall>,
}

/// `LOSSES`: events the probes could not produce, per cause and CPU. Written by the
/// probes; read at the end, and by the calibration, which must leave it as it found it.
pub struct LossCounts(PerCpuArray<MapData, u64>);

impl LossCounts {
    /// The count of `cause` over all CPUs.
    pub fn total(&self, cause: LossCause) -> u64 {
        self.per_cpu(cause).map_or(0, |values| values.iter().sum())
    }

    pub fn per_cpu(&self, cause: LossCause) -> Option<PerCpuValues<u64>> {
        self.0.get(&(cause as u32), 0).ok()
    }

    pub fn set_per_cpu(&mut self, cause: LossCause, values: PerCpuValues<u64>) {
        let _ = self.0.set(cause as u32, values, 0);
    }
}

/// `SETTINGS`: the run-wide switches (`lens_common::settings`), written by lens-probe
/// before the probes that read them go in.
pub struct Settings(Array<MapData, u32>);

impl Settings {
    pub fn set(&mut self, index: u32, value: u32) -> Result<()> {
        self.0
            .set(index, &value, 0)
            .map_err(|source| LensError::Map {
                map: maps::SETTINGS,
                source,
            })
    }
}

/// The launch probes' per-process maps.
pub struct LaunchMaps {
    /// `KERNEL_COUNTS`: launches per (process, epoch, kernel), written by the launch
    /// probes with the `step` group on; read and taken by lens-probe.
    pub kernel_counts: ProcessMap<KernelKey, u64>,
    /// `KERNEL_REGISTRY`: the names CUDA modules registered for their host stubs,
    /// written by the registration probes (LRU).
    pub kernel_registry: ProcessMap<HandleKey, u64>,
    /// `RUNTIME_RANGES`: where each process maps libcudart, written by lens-probe: a
    /// driver launch returning there is the runtime's own.
    pub runtime_ranges: ProcessMap<u32, CodeRanges>,
}

/// The Python sampler's maps, and the gates that say whether each may hold anything
/// (`lens_common::python_gates`): every write goes through here so that they agree.
pub struct PythonMaps {
    /// `PY_TARGETS`: the processes the sampler reads, and how (written by lens-probe).
    targets: ProcessMap<u32, PyOffsets>,
    /// `PY_SAVING`: processes with a framework save or load running
    /// (`lens_common::saving` bits, written by lens-probe, and by the DCP load probe).
    saving: ProcessMap<u32, u8>,
    /// `PY_GATES`.
    gates: Array<MapData, u32>,
    /// `PY_NAMED`: the code objects lens-probe has named (written by lens-probe, LRU).
    named: ProcessMap<HandleKey, u8>,
}

impl PythonMaps {
    /// Starts sampling `pid` with `offsets`.
    pub fn add_target(&mut self, pid: u32, offsets: &PyOffsets) -> Result<()> {
        self.targets.insert(&pid, offsets)?;
        self.set_gate(python_gates::TARGETS, true);
        Ok(())
    }

    /// Stops sampling `pid` (only lens-probe writes `PY_TARGETS`).
    pub fn remove_target(&mut self, pid: u32) {
        self.targets.remove(&pid);
        self.named.forget(pid);
        if self.targets.is_empty() {
            self.set_gate(python_gates::TARGETS, false);
        }
    }

    /// lens-probe has read the name of `pid`'s code object at `code`: samples of it need
    /// not wake lens-probe at once, unless it may be a rule's function (`ruled`: its
    /// calls are followed as they come). A full map only means more wakeups: no error.
    pub fn code_named(&mut self, pid: u32, code: u64, ruled: bool) {
        let key = HandleKey {
            tgid: pid,
            _pad: 0,
            handle: code,
        };
        let value = if ruled {
            lens_common::py_named::RULED
        } else {
            lens_common::py_named::PLAIN
        };
        let _ = self.named.insert(&key, &value);
    }

    /// What `pid`'s framework calls make of it now (`lens_common::saving` bits; 0:
    /// nothing runs).
    pub fn set_saving(&mut self, pid: u32, bits: u8) {
        if bits == 0 {
            self.forget_saving(pid);
            return;
        }
        // Open before the entry goes in: a probe that finds the entry found the gate open.
        self.set_gate(python_gates::SAVING, true);
        let _ = self.saving.insert(&pid, &bits);
    }

    /// `pid` saves and loads nothing any more.
    pub fn forget_saving(&mut self, pid: u32) {
        self.saving.remove(&pid);
        if !self.saving.is_empty() {
            return;
        }
        self.set_gate(python_gates::SAVING, false);
        // The DCP load probe may have put an entry in since the map was found empty; it
        // opens the gate after its insert too, but its first opening may have come before
        // the closing above.
        if !self.saving.is_empty() {
            self.set_gate(python_gates::SAVING, true);
        }
    }

    fn set_gate(&mut self, gate: u32, open: bool) {
        // An array slot inside the map's bounds: it cannot fail.
        let _ = self.gates.set(gate, &u32::from(open), 0);
    }
}

/// Every map lens-probe reads or writes, typed.
pub struct KernelMaps {
    /// `TARGETS`: the traced processes: flags written by lens-probe, launch counters and
    /// epochs by the probes.
    pub targets: ProcessMap<u32, TargetState>,
    /// `STOPPED`: targets stopped at a library load (the probe writes the stop time;
    /// lens-probe or its guardian removes it when it lets the target go).
    pub stopped: ProcessMap<u32, u64>,
    pub inflight: InflightMaps,
    pub launches: LaunchMaps,
    pub python: PythonMaps,
    pub losses: LossCounts,
    pub settings: Settings,
}

/// Entries in the kernel's per-process maps ([`KernelMaps::state`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelState {
    pub targets: usize,
    /// Slots of the `INFLIGHT_*` maps: calls in flight, and one per thread and function
    /// called (kept for its next call) until the process ends.
    pub inflight: usize,
    /// Per-kernel launch counters not yet read.
    pub kernel_counters: usize,
    /// Processes whose libcudart mappings the driver probes know.
    pub runtime_ranges: usize,
}

impl KernelMaps {
    /// Takes the maps out of the loaded object (its programs keep using them).
    pub fn take(ebpf: &mut Ebpf) -> Result<KernelMaps> {
        Ok(KernelMaps {
            targets: ProcessMap::from_object(ebpf, maps::TARGETS)?,
            stopped: ProcessMap::from_object(ebpf, maps::STOPPED)?,
            inflight: InflightMaps {
                collectives: ProcessMap::from_object(ebpf, maps::INFLIGHT_COLLECTIVES)?,
                syncs: ProcessMap::from_object(ebpf, maps::INFLIGHT_SYNCS)?,
                comm_inits: ProcessMap::from_object(ebpf, maps::INFLIGHT_COMM_INITS)?,
                queries: ProcessMap::from_object(ebpf, maps::INFLIGHT_QUERIES)?,
                api_calls: ProcessMap::from_object(ebpf, maps::INFLIGHT_API_CALLS)?,
            },
            launches: LaunchMaps {
                kernel_counts: ProcessMap::from_object(ebpf, maps::KERNEL_COUNTS)?,
                kernel_registry: ProcessMap::from_object(ebpf, maps::KERNEL_REGISTRY)?,
                runtime_ranges: ProcessMap::from_object(ebpf, maps::RUNTIME_RANGES)?,
            },
            python: PythonMaps {
                targets: ProcessMap::from_object(ebpf, maps::PY_TARGETS)?,
                saving: ProcessMap::from_object(ebpf, maps::PY_SAVING)?,
                named: ProcessMap::from_object(ebpf, maps::PY_NAMED)?,
                gates: take(ebpf, maps::PY_GATES)?,
            },
            losses: LossCounts(take(ebpf, maps::LOSSES)?),
            settings: Settings(take(ebpf, maps::SETTINGS)?),
        })
    }

    /// Drops what the kernel keeps for `pid` besides its `TARGETS` entry, call counters
    /// and per-kernel counters (taken by their readers): a stop not yet continued, its
    /// Python state, where it maps libcudart, and the entries of calls it never returned
    /// from (a thread killed in a sync wait).
    pub fn forget_process(&mut self, pid: u32) {
        self.stopped.remove(&pid);
        self.python.forget_saving(pid);
        self.launches.runtime_ranges.remove(&pid);
        self.inflight.forget(pid);
    }

    /// Entries in the per-process maps now: bounded by the maps' sizes; all 0 once every
    /// target has ended.
    pub fn state(&self) -> KernelState {
        KernelState {
            targets: self.targets.len(),
            inflight: self.inflight.len(),
            kernel_counters: self.launches.kernel_counts.len(),
            runtime_ranges: self.launches.runtime_ranges.len(),
        }
    }
}
