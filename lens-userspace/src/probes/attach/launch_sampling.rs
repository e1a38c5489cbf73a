//! `--overhead-budget`'s launch probes: attached once, then switched in and out of the
//! kernel as the budget's windows say; which processes they count.

use aya::{
    Ebpf,
    programs::uprobe::{UProbeLink, UProbeLinkId},
};

use lens_common::ProbeId;
use log::warn;

use super::{AttachKey, Attacher, ProbeOutcome, ProbeScope, attach_points};
use crate::bpf::{is_multi, uprobe_mut};
use crate::probes::catalog::{self, Program};
use crate::sys::{
    library::{FileId, MappedLibrary},
    symbols::Symbol,
};

/// The launch probes of one program in one library that an overhead budget moves in and
/// out together: one link for all of them (a uprobe_multi link, where the kernel has
/// them), so that a cycle costs the kernel one removal per group, not one per point. The
/// library stays open so that they can go in again after the process that showed it to
/// us is gone (`/proc/self/fd/N` names the same inode in any namespace).
pub(super) struct SampledGroup {
    /// The process its probes fire in.
    scope: ProbeScope,
    pub(super) file: FileId,
    library: std::fs::File,
    /// `count_only` (runtime) or `driver_launch` (driver).
    pub(super) program: Program,
    /// Where its probes go: (offset, probe).
    points: Vec<(u64, ProbeId)>,
    /// Its links while in: one, or one more per point added while in (until the next
    /// window puts the group in as one).
    pub(super) links: Vec<UProbeLinkId>,
}

impl SampledGroup {
    fn path(&self) -> std::path::PathBuf {
        use std::os::fd::AsRawFd;
        crate::sys::process::own_descriptor_path(self.library.as_raw_fd())
    }

    fn cookies(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.points
            .iter()
            .map(|&(offset, id)| (offset, catalog::cookie(id)))
    }
}

/// Launch probes under an overhead budget ([`Attacher::sample_launches`]).
#[derive(Default)]
pub(super) struct SampledLaunches {
    pub(super) probes_in: bool,
    pub(super) groups: Vec<SampledGroup>,
}

impl SampledLaunches {
    /// Takes the groups of `key` (a file in a scope) out of the kernel and forgets them;
    /// returns their links.
    pub(super) fn forget(&mut self, ebpf: &mut Ebpf, key: AttachKey) -> Vec<UProbeLink> {
        let mut released = Vec::new();
        let of_key = |g: &SampledGroup| (g.scope, g.file) == key;
        for group in self.groups.iter_mut().filter(|g| of_key(g)) {
            released.extend(take_links(ebpf, group));
        }
        self.groups.retain(|g| !of_key(g));
        released
    }
}

/// Takes `group`'s links out of the program (dropping them removes the probes).
fn take_links(ebpf: &mut Ebpf, group: &mut SampledGroup) -> Vec<UProbeLink> {
    let Ok(uprobe) = uprobe_mut(ebpf, group.program) else {
        return Vec::new();
    };
    group
        .links
        .drain(..)
        .filter_map(|link| uprobe.take_link(link).ok())
        .collect()
}

impl Attacher {
    /// From now on launch probes can be taken out and put back ([`Self::set_launch_probes`])
    /// for an overhead budget. Call before attaching.
    pub fn sample_launches(&mut self) {
        self.sampled = Some(SampledLaunches {
            probes_in: true,
            groups: Vec::new(),
        });
    }

    /// Whether a library's launch probes go in and out as one link (their programs'
    /// uprobe_multi twins are loaded), so that an overhead budget can cycle faster.
    pub fn launch_probes_move_as_one(ebpf: &Ebpf) -> bool {
        is_multi(ebpf, Program::CountOnly) && is_multi(ebpf, Program::DriverLaunch)
    }

    /// Puts the launch probes in or takes them out (on a thread of its own: the kernel
    /// takes ~0.1 s per link to remove it). Returns how many probes moved.
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
        for group in &mut sampled.groups {
            if !probes_in {
                let links = take_links(ebpf, group);
                if !links.is_empty() {
                    moved += group.points.len();
                }
                released.extend(links);
                continue;
            }
            let path = group.path();
            let scope = group.scope.kernel();
            let attached = uprobe_mut(ebpf, group.program).and_then(|uprobe| {
                attach_points(uprobe, group.program, &path, group.cookies(), scope)
            });
            match attached {
                Ok(link) => {
                    group.links.push(link);
                    moved += group.points.len();
                }
                Err(error) => warn!(
                    "cannot put back {} launch probes ({}): {error}",
                    group.points.len(),
                    group.program.name()
                ),
            }
        }
        crate::sys::teardown::release_in_background(released);
        moved
    }

    /// Whether launches of target `pid` are counted now: a library it maps has its
    /// launch probes in.
    pub fn counts_launches(&self, pid: u32) -> bool {
        let scope = ProbeScope::Process(pid);
        let fixed = self.links.iter().any(|((s, _), links)| {
            *s == scope
                && links.iter().any(|(program, _)| {
                    matches!(program, Program::CountOnly | Program::DriverLaunch)
                })
        });
        let sampled = self.sampled.as_ref().is_some_and(|s| {
            s.probes_in
                && s.groups
                    .iter()
                    .any(|g| !g.links.is_empty() && g.scope == scope)
        });
        fixed || sampled
    }

    /// Whether a library target `pid` maps has the driver's launch probes (in, or in and
    /// out under an overhead budget).
    pub fn probes_driver(&self, pid: u32) -> bool {
        let scope = ProbeScope::Process(pid);
        let fixed = self.links.iter().any(|((s, _), links)| {
            *s == scope
                && links
                    .iter()
                    .any(|(program, _)| *program == Program::DriverLaunch)
        });
        let sampled = self.sampled.as_ref().is_some_and(|s| {
            s.groups
                .iter()
                .any(|g| g.program == Program::DriverLaunch && g.scope == scope)
        });
        fixed || sampled
    }
}

/// A launch probe under an overhead budget: remembered in its library's group for its
/// program, so that it can be taken out and put back, and put in now (a link of its own
/// until the next window) if the budget has the launch probes in.
pub(super) fn sample_spec(
    ebpf: &mut Ebpf,
    scope: ProbeScope,
    library: &MappedLibrary,
    spec: &catalog::ProbeSpec,
    places: &[(&str, Symbol)],
    outcomes: &mut Vec<ProbeOutcome>,
    sampled: &mut SampledLaunches,
) {
    if places.is_empty() {
        return;
    }
    let program = spec.entry.unwrap_or(Program::CountOnly);
    let index = match sampled
        .groups
        .iter()
        .position(|g| g.scope == scope && g.file == library.file && g.program == program)
    {
        Some(index) => index,
        None => match std::fs::File::open(&library.open_path) {
            Ok(file) => {
                sampled.groups.push(SampledGroup {
                    scope,
                    file: library.file,
                    library: file,
                    program,
                    points: Vec::new(),
                    links: Vec::new(),
                });
                sampled.groups.len() - 1
            }
            Err(error) => {
                outcomes.push(ProbeOutcome::Failed {
                    symbol: spec.symbol.to_string(),
                    reason: error.to_string(),
                });
                return;
            }
        },
    };
    let group = &mut sampled.groups[index];
    for (symbol, place) in places {
        let offset = place.offset;
        if sampled.probes_in {
            let path = group.path();
            let attached = uprobe_mut(ebpf, program).and_then(|uprobe| {
                attach_points(
                    uprobe,
                    program,
                    &path,
                    [(offset, catalog::cookie(spec.id))],
                    scope.kernel(),
                )
            });
            match attached {
                Ok(link) => group.links.push(link),
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
        group.points.push((offset, spec.id));
    }
}
