//! File-creation probes: libc's `open` and `openat`, whose calls with `O_CREAT` are what
//! a checkpoint's `nemo.checkpoint.files` counts (Python's `open`, `fopen`, Rust's
//! `File::create` all end there). Like every library probe, they are attached to each
//! traced process alone (every process on a node maps libc): one link per process, the
//! kernel's breakpoints in that process only, and the link goes when the process ends.
use std::{collections::HashMap, num::NonZeroU32};

use aya::{
    Ebpf,
    programs::uprobe::{UProbeLinkId, UProbeScope},
};
use log::{debug, warn};

use super::attach::{attach_points, uprobe_mut};
use super::catalog::{self, Program};
use crate::sys::{
    library::{self, LibraryKind},
    symbols::resolve_symbols,
};
use crate::{error::LensError, settings::groups::SpanGroups};

/// The file-creation links of every traced process that has them.
#[derive(Default)]
pub struct FileProbes {
    links: HashMap<u32, UProbeLinkId>,
    /// Processes whose libc could not be probed (said once each).
    refused: Vec<u32>,
}

impl FileProbes {
    /// Attaches the enabled groups' file probes to `pid`'s libc, once per process, in one
    /// link. Returns how many probes were attached now.
    pub fn attach(&mut self, ebpf: &mut Ebpf, pid: u32, groups: &SpanGroups) -> usize {
        let specs: Vec<_> = catalog::enabled_for(LibraryKind::Libc, groups).collect();
        if specs.is_empty() || self.links.contains_key(&pid) || self.refused.contains(&pid) {
            return 0;
        }
        match attach_to(ebpf, pid, &specs) {
            // Not mapped yet (a program started with `--exec` stops at its loader's first
            // event, before libc is loaded): tried again at its next library load.
            Ok(None) => 0,
            Ok(Some(link)) => {
                debug!(
                    "pid {pid}: {} file-creation probes in its libc",
                    specs.len()
                );
                self.links.insert(pid, link);
                specs.len()
            }
            Err(error) => {
                warn!("pid {pid}: files created are not counted: {error}");
                self.refused.push(pid);
                0
            }
        }
    }

    /// `pid` ended (or is no longer traced): its link goes, on a thread of its own (the
    /// kernel is slow to remove uprobes).
    pub fn release(&mut self, ebpf: &mut Ebpf, pid: u32) {
        self.refused.retain(|p| *p != pid);
        let Some(id) = self.links.remove(&pid) else {
            return;
        };
        let Ok(uprobe) = uprobe_mut(ebpf, Program::FileOpenEntry) else {
            return;
        };
        if let Ok(link) = uprobe.take_link(id) {
            crate::sys::teardown::release_in_background(vec![link]);
        }
    }
}

/// Why a process's file probes could not be attached, in a line.
type Refusal = String;

fn attach_to(
    ebpf: &mut Ebpf,
    pid: u32,
    specs: &[&catalog::ProbeSpec],
) -> std::result::Result<Option<UProbeLinkId>, Refusal> {
    let text = |error: LensError| error.to_string();
    let Some(libc) = library::find_libc(pid).map_err(text)? else {
        return Ok(None);
    };
    let wanted: Vec<&str> = specs.iter().map(|spec| spec.symbol).collect();
    let symbols = resolve_symbols(&libc.open_path, &wanted).map_err(text)?;
    let scope = UProbeScope::OneProcess(NonZeroU32::new(pid).ok_or("pid 0")?);
    let mut points = Vec::new();
    for spec in specs {
        let Some(place) = symbols.found.get(spec.symbol) else {
            return Err(format!(
                "{} defines no {}",
                libc.shown_path.display(),
                spec.symbol
            ));
        };
        points.push((place.offset, spec.cookie()));
    }
    // One link for all of them (one uprobe_multi link, or a perf link per point).
    let uprobe = uprobe_mut(ebpf, Program::FileOpenEntry).map_err(text)?;
    let link = attach_points(
        uprobe,
        Program::FileOpenEntry,
        &libc.open_path,
        points,
        scope,
    )
    .map_err(text)?;
    Ok(Some(link))
}
