//! What the session tells the kernel's per-process maps about a target: that it is
//! traced, where it maps libcudart, and that it is gone.
use lens_common::{CODE_RANGES, CodeRanges, TargetState};
use log::warn;

use crate::{
    error::Result,
    sys::{
        library::{LibraryKind, MappedLibrary, MapsEntry},
        process::Process,
    },
};

use super::{KernelState, Session};

impl Session {
    /// Tells the driver probes where `pid` maps libcudart (all its mappings, merged): a
    /// driver launch returning there is the runtime's own, counted at the runtime.
    /// `libraries` are what `pid` maps of interest: without a libcudart, the maps (long
    /// in a torch process, and read at every library load) are not read again.
    pub(super) fn set_runtime_ranges(&mut self, pid: u32, libraries: &[MappedLibrary]) {
        if !libraries.iter().any(|l| l.kind == LibraryKind::CudaRuntime) {
            return;
        }
        let Ok(mappings) = Process::new(pid).mappings() else {
            return;
        };
        let ranges = runtime_ranges(&mappings);
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
        if let Err(error) = self.bpf.maps.launches.runtime_ranges.insert(&pid, &value) {
            warn!("pid {pid}: cannot tell the driver probes where libcudart is: {error}");
        }
    }

    /// Driver launches of `pid` left out as the runtime's own (counted at the runtime):
    /// each a probe hit it paid for.
    pub(super) fn runtime_driver_hits(&self, pid: u32) -> u64 {
        self.bpf
            .maps
            .targets
            .get(&pid)
            .map_or(0, |target| target.runtime_driver_hits)
    }

    /// Traces `pid` from now, with `flags` (`TARGET_*`) and nothing counted yet.
    pub(super) fn set_target(&mut self, pid: u32, flags: u32) -> Result<()> {
        self.bpf.maps.targets.insert(&pid, &TargetState::new(flags))
    }

    /// Drops what the kernel keeps for `pid` besides its `TARGETS` entry and call counters
    /// (taken by the caller).
    pub(super) fn forget_kernel_state(&mut self, pid: u32) {
        self.python.forget_saves(pid);
        self.bpf.maps.forget_process(pid);
    }

    /// Entries in the kernel's per-process maps now: targets, calls in flight, call
    /// counters and launch totals. Bounded by the maps' sizes; all 0 once every target
    /// has ended.
    pub fn kernel_state(&self) -> KernelState {
        self.bpf.maps.state()
    }
}

/// Where a process maps libcudart, from its mappings: adjacent ones merged, in address
/// order.
fn runtime_ranges(mappings: &[MapsEntry]) -> Vec<[u64; 2]> {
    let mut ranges: Vec<[u64; 2]> = Vec::new();
    for entry in mappings {
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
    ranges
}

#[cfg(test)]
mod tests {
    use super::runtime_ranges;
    use crate::sys::library::parse_maps;

    #[test]
    fn libcudart_mappings_are_merged_where_adjacent() {
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 08:01 11 /venv/nvidia/cu13/lib/libcudart.so.13
7f0000001000-7f0000005000 r-xp 00001000 08:01 11 /venv/nvidia/cu13/lib/libcudart.so.13
7f0000005000-7f0000006000 rw-p 00005000 08:01 11 /venv/nvidia/cu13/lib/libcudart.so.13
7f0000006000-7f0000007000 rw-p 00000000 00:00 0
7f0000008000-7f0000009000 r-xp 00000000 08:01 12 /usr/lib/libc.so.6
7f1000000000-7f1000001000 r-xp 00000000 08:01 13 /opt/other/libcudart.so.12
";
        assert_eq!(
            runtime_ranges(&parse_maps(maps)),
            [
                [0x7f00_0000_0000, 0x7f00_0000_6000],
                [0x7f10_0000_0000, 0x7f10_0000_1000]
            ]
        );
        assert!(runtime_ranges(&[]).is_empty());
    }
}
