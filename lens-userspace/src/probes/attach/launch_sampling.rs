//! `--overhead-budget`'s launch probes: attached once, then switched in and out of the
//! kernel as the budget's windows say; which processes they count.

use aya::{Ebpf, programs::uprobe::UProbeLinkId};

use lens_common::ProbeId;
use log::warn;

use super::object::uprobe_mut;
use super::{Attacher, ProbeOutcome, attach_at};
use crate::probes::catalog::{self, Program};
use crate::sys::{
    library::{FileId, MappedLibrary},
    symbols::Symbol,
};

/// A launch probe an overhead budget moves in and out: where it goes, and its link while
/// it is in. The library stays open so that it can go in again after the process that
/// showed it to us is gone (`/proc/self/fd/N` names the same inode in any namespace).
pub(super) struct SampledProbe {
    pub(super) file: FileId,
    pub(super) library: std::sync::Arc<std::fs::File>,
    pub(super) offset: u64,
    pub(super) id: ProbeId,
    /// `count_only` (runtime) or `driver_launch` (driver).
    pub(super) program: Program,
    pub(super) link: Option<UProbeLinkId>,
}

impl SampledProbe {
    fn path(&self) -> std::path::PathBuf {
        use std::os::fd::AsRawFd;
        format!("/proc/self/fd/{}", self.library.as_raw_fd()).into()
    }
}

/// Launch probes under an overhead budget ([`Attacher::sample_launches`]).
#[derive(Default)]
pub(super) struct SampledLaunches {
    pub(super) probes_in: bool,
    pub(super) probes: Vec<SampledProbe>,
}

impl Attacher {
    /// From now on launch probes can be taken out and put back ([`Self::set_launch_probes`])
    /// for an overhead budget. Call before attaching.
    pub fn sample_launches(&mut self) {
        self.sampled = Some(SampledLaunches {
            probes_in: true,
            probes: Vec::new(),
        });
    }

    /// Puts the launch probes in or takes them out (on a thread of its own: the kernel
    /// takes ~0.1 s per uprobe to remove it). Returns how many moved.
    pub fn set_launch_probes(&mut self, ebpf: &mut Ebpf, probes_in: bool) -> usize {
        let Some(sampled) = self.sampled.as_mut() else {
            return 0;
        };
        if sampled.probes_in == probes_in {
            return 0;
        }
        sampled.probes_in = probes_in;
        let mut moved = 0;
        let mut released = Vec::new();
        for probe in &mut sampled.probes {
            let Ok(uprobe) = uprobe_mut(ebpf, probe.program) else {
                continue;
            };
            if probes_in {
                match attach_at(
                    uprobe,
                    probe.program,
                    &probe.path(),
                    probe.offset,
                    catalog::cookie(probe.id),
                ) {
                    Ok(link) => {
                        probe.link = Some(link);
                        moved += 1;
                    }
                    Err(error) => warn!("cannot put back the launch probe {:?}: {error}", probe.id),
                }
            } else if let Some(link) = probe.link.take()
                && let Ok(link) = uprobe.take_link(link)
            {
                released.push(link);
                moved += 1;
            }
        }
        if !released.is_empty() {
            std::thread::spawn(move || drop(released));
        }
        moved
    }

    /// Whether launches of target `pid` are counted now: a library it maps has its
    /// launch probes in.
    pub fn counts_launches(&self, pid: u32) -> bool {
        let uses = |file: &FileId| self.users.get(file).is_some_and(|u| u.contains(&pid));
        let fixed = self.links.iter().any(|(file, links)| {
            uses(file)
                && links.iter().any(|(program, _)| {
                    matches!(program, Program::CountOnly | Program::DriverLaunch)
                })
        });
        let sampled = self.sampled.as_ref().is_some_and(|s| {
            s.probes_in && s.probes.iter().any(|p| p.link.is_some() && uses(&p.file))
        });
        fixed || sampled
    }

    /// Whether a library target `pid` maps has the driver's launch probes (in, or in and
    /// out under an overhead budget).
    pub fn probes_driver(&self, pid: u32) -> bool {
        let uses = |file: &FileId| self.users.get(file).is_some_and(|u| u.contains(&pid));
        let fixed = self.links.iter().any(|(file, links)| {
            uses(file)
                && links
                    .iter()
                    .any(|(program, _)| *program == Program::DriverLaunch)
        });
        let sampled = self.sampled.as_ref().is_some_and(|s| {
            s.probes
                .iter()
                .any(|p| p.program == Program::DriverLaunch && uses(&p.file))
        });
        fixed || sampled
    }
}

/// A launch probe under an overhead budget: remembered so that it can be taken out and
/// put back, and put in now if the budget has the launch probes in.
pub(super) fn sample_spec(
    ebpf: &mut Ebpf,
    library: &MappedLibrary,
    spec: &catalog::ProbeSpec,
    places: &[(&str, Symbol)],
    outcomes: &mut Vec<ProbeOutcome>,
    sampled: &mut SampledLaunches,
) {
    if places.is_empty() {
        return;
    }
    let file = match std::fs::File::open(&library.open_path) {
        Ok(file) => std::sync::Arc::new(file),
        Err(error) => {
            outcomes.push(ProbeOutcome::Failed {
                symbol: spec.symbol.to_string(),
                reason: error.to_string(),
            });
            return;
        }
    };
    let program = spec.entry.unwrap_or(Program::CountOnly);
    for (symbol, place) in places {
        let offset = place.offset;
        let mut probe = SampledProbe {
            file: library.file,
            library: file.clone(),
            offset,
            id: spec.id,
            program,
            link: None,
        };
        if sampled.probes_in {
            let attached = uprobe_mut(ebpf, program).and_then(|uprobe| {
                attach_at(
                    uprobe,
                    program,
                    &probe.path(),
                    offset,
                    catalog::cookie(spec.id),
                )
            });
            match attached {
                Ok(link) => probe.link = Some(link),
                Err(error) => {
                    outcomes.push(ProbeOutcome::Failed {
                        symbol: symbol.to_string(),
                        reason: error.to_string(),
                    });
                    continue;
                }
            }
        }
        outcomes.push(ProbeOutcome::Attached {
            symbol: symbol.to_string(),
            offset,
            version: place.version.clone(),
        });
        sampled.probes.push(probe);
    }
}
