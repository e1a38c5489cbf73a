//! Loading the BPF object and attaching its programs to the libraries a target maps.
//!
//! Probes are attached per traced process and library *file* (uprobes are keyed by
//! inode): the kernel plants each breakpoint in that process's memory alone, so an
//! untraced process that maps the same file never traps and never runs a probe (a
//! uprobe for all processes slowed every neighbour's calls of `cudaLaunchKernel` from
//! 1.5 ns to 571 ns, and its return probes could abort them). One exception: the dynamic
//! loader's `_dl_debug_state` (entry only, an empty function the loader calls at each
//! library load) stays node-wide, since it is how processes that are not traced yet are
//! found (`ProbeScope::Node`).
use std::collections::{BTreeMap, HashMap, HashSet};

use aya::{
    Ebpf,
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
    },
};
use std::{num::NonZeroU32, path::Path, sync::Arc};

use lens_common::ProbeId;
use log::{debug, info, warn};

use super::catalog::{self, Program};
use crate::sys::{
    library::{FileId, LibraryKind, MappedLibrary},
    symbols::resolve_symbols,
};
use crate::{
    error::{LensError, Result},
    settings::{groups::SpanGroups, probe_rules::ProbeRules},
};

mod launch_sampling;
mod rule_attach;
mod symbol_places;

pub(crate) use crate::bpf::uprobe_mut;
use launch_sampling::{SampledLaunches, sample_spec};
use symbol_places::{Batch, places};

/// What happened to one probe on one library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// Attached at `offset` in the file. `version`: the symbol's version in a library
    /// that versions its symbols (`NCCL_2.0` for `ncclAllReduce@@NCCL_2.0`), always the
    /// default one.
    Attached {
        symbol: String,
        offset: u64,
        version: Option<String>,
    },
    Failed {
        symbol: String,
        reason: String,
    },
}

/// Which processes a library's probes fire in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProbeScope {
    /// Every process that maps the file: the dynamic loader's probe only.
    Node,
    /// One traced process (all its threads).
    Process(u32),
}

impl ProbeScope {
    /// Where `library`'s probes go for target `pid`.
    pub fn of(pid: u32, library: &MappedLibrary) -> ProbeScope {
        match library.kind {
            LibraryKind::DynamicLoader => ProbeScope::Node,
            _ => ProbeScope::Process(pid),
        }
    }

    fn kernel(self) -> UProbeScope {
        match self {
            ProbeScope::Process(pid) => match NonZeroU32::new(pid) {
                Some(pid) => UProbeScope::OneProcess(pid),
                None => UProbeScope::AllProcesses,
            },
            ProbeScope::Node => UProbeScope::AllProcesses,
        }
    }
}

/// One set of probes in the kernel: a library file, in the processes of a scope.
type AttachKey = (ProbeScope, FileId);

/// The result of attaching to one library file.
#[derive(Clone, Debug)]
pub struct LibraryAttachment {
    /// The processes its probes fire in.
    pub scope: ProbeScope,
    pub library: MappedLibrary,
    pub outcomes: Vec<ProbeOutcome>,
    /// The kernel links its probes went in as: one per uprobe_multi link (a program's
    /// points in the file), one per perf uprobe. Each is removed on its own at exit.
    pub kernel_links: usize,
}

impl LibraryAttachment {
    pub fn attached(&self) -> impl Iterator<Item = &str> {
        self.outcomes.iter().filter_map(|o| match o {
            ProbeOutcome::Attached { symbol, .. } => Some(symbol.as_str()),
            ProbeOutcome::Failed { .. } => None,
        })
    }
}

/// Keeps track of which files were already probed in which process, so each is attached
/// once, and of their links, so that an ended process's probes can go.
#[derive(Default)]
pub struct Attacher {
    done: HashSet<AttachKey>,
    attachments: Vec<LibraryAttachment>,
    links: HashMap<AttachKey, Vec<(Program, UProbeLinkId)>>,
    sampled: Option<SampledLaunches>,
    /// Configured probe rules (`--config`, `--profile`).
    rules: Arc<ProbeRules>,
    /// Rules whose `library` matched a file of a target.
    rules_seen: HashSet<u32>,
    /// Whether a library file imports a symbol (`ProbeSpec::unreadable_if_imports`): read
    /// once per file (~15 ms for libtorch_python), not once per process that maps it.
    imports: HashMap<(FileId, &'static str), bool>,
}

impl Attacher {
    /// Configured probe rules to attach, besides the catalog's. Call before attaching.
    pub fn set_rules(&mut self, rules: Arc<ProbeRules>) {
        self.rules = rules;
    }

    pub fn rules(&self) -> &Arc<ProbeRules> {
        &self.rules
    }

    /// Whether a configured rule names the file at `path` (a process's mapping).
    pub fn is_configured_library(&self, path: &Path) -> bool {
        self.rules
            .native
            .iter()
            .any(|rule| rule.library.matches(path))
    }

    /// One line for each rule (of an enabled group) whose library no target mapped: its
    /// probe was never attached.
    pub fn unmatched_rules(&self, groups: &SpanGroups) -> Vec<String> {
        self.rules
            .native
            .iter()
            .filter(|rule| groups.contains(rule.group) && !self.rules_seen.contains(&rule.index))
            .map(|rule| {
                format!(
                    "{}: no traced process mapped a file matching library {:?}: {} was never \
                     probed",
                    rule.origin,
                    rule.library.as_str(),
                    rule.symbol.text()
                )
            })
            .collect()
    }

    /// Whether `library` is probed for target `pid` (the dynamic loader: for all).
    pub fn is_attached(&self, pid: u32, library: &MappedLibrary) -> bool {
        self.done
            .contains(&(ProbeScope::of(pid, library), library.file))
    }

    /// Whether the dynamic loader `loader` is probed (node-wide).
    pub fn is_loader_attached(&self, loader: &MappedLibrary) -> bool {
        self.done.contains(&(ProbeScope::Node, loader.file))
    }

    pub fn attachments(&self) -> &[LibraryAttachment] {
        &self.attachments
    }

    /// Target `pid` is gone: its probes are detached (the dynamic loader's stay: they
    /// find the next targets). The kernel takes a grace period (~0.1 s) per link to
    /// remove them (a perf link per uprobe, or a uprobe_multi link per program), so they
    /// go on a thread of their own, together. Returns how many links were let go.
    pub fn release(&mut self, ebpf: &mut Ebpf, pid: u32) -> usize {
        let scope = ProbeScope::Process(pid);
        let keys: Vec<AttachKey> = self
            .done
            .iter()
            .filter(|(s, _)| *s == scope)
            .copied()
            .collect();
        let mut released = Vec::new();
        for key in keys {
            debug!("pid {pid} ended: detaching its probes of {:?}", key.1);
            released.extend(self.take(ebpf, key));
        }
        let count = released.len();
        crate::sys::teardown::release_in_background(released);
        count
    }

    /// Takes every probe of `key` out of the bookkeeping and returns its links (dropping
    /// them detaches; the kernel is slow to, so the caller does it on a thread).
    fn take(&mut self, ebpf: &mut Ebpf, key: AttachKey) -> Vec<aya::programs::uprobe::UProbeLink> {
        let mut released = Vec::new();
        for (program, id) in self.links.remove(&key).unwrap_or_default() {
            if let Ok(link) = uprobe_mut(ebpf, program).and_then(|uprobe| {
                uprobe.take_link(id).map_err(|source| LensError::Program {
                    program: program.name(),
                    source,
                })
            }) {
                released.push(link);
            }
        }
        if let Some(sampled) = self.sampled.as_mut() {
            released.extend(sampled.forget(ebpf, key));
        }
        self.done.remove(&key);
        self.attachments
            .retain(|a| (a.scope, a.library.file) != key);
        released
    }

    /// Number of uprobes (entry and return) attached now.
    pub fn uprobe_count(&self) -> usize {
        self.attachments
            .iter()
            .flat_map(|a| &a.outcomes)
            .filter(|o| matches!(o, ProbeOutcome::Attached { .. }))
            .count()
    }

    /// Attaches every probe the enabled groups need to `library` in target `pid` (the
    /// dynamic loader: in every process, [`ProbeScope::of`]). Probes that fail are
    /// reported (once, as a warning) and skipped; the others still attach.
    pub fn attach_library(
        &mut self,
        ebpf: &mut Ebpf,
        pid: u32,
        library: &MappedLibrary,
        groups: &SpanGroups,
    ) -> Option<&LibraryAttachment> {
        self.attach_in(ebpf, ProbeScope::of(pid, library), library, groups)
    }

    /// Attaches to each of `libraries` that target `pid` maps and that is not probed there
    /// yet, in [`catalog::attach_order`]: a probe another library's supersedes goes in
    /// knowing whether that one did.
    pub fn attach_libraries(
        &mut self,
        ebpf: &mut Ebpf,
        pid: u32,
        libraries: &[MappedLibrary],
        groups: &SpanGroups,
    ) {
        let mut pending: Vec<&MappedLibrary> = libraries
            .iter()
            .filter(|library| !self.is_attached(pid, library))
            .collect();
        pending.sort_by_key(|library| catalog::attach_order(library.kind));
        for library in pending {
            info!("pid {pid} maps {}: attaching", library.shown_path.display());
            self.attach_library(ebpf, pid, library, groups);
        }
    }

    /// Whether `probe` is attached in the processes of `scope`.
    fn has_attached(&self, scope: ProbeScope, probe: ProbeId) -> bool {
        let spec = catalog::spec_of(probe);
        self.attachments
            .iter()
            .filter(|a| a.scope == scope && a.library.kind == spec.library)
            .flat_map(|a| a.attached())
            .any(|symbol| symbol == spec.symbol)
    }

    /// Whether `spec` goes in `library` for the processes of `scope`: not where a probe
    /// that supersedes it is attached, nor where its program cannot read the library's
    /// calls (said in the debug log).
    fn wanted_here(
        &mut self,
        scope: ProbeScope,
        library: &MappedLibrary,
        spec: &catalog::ProbeSpec,
    ) -> bool {
        if let Some(other) = spec.superseded_by
            && self.has_attached(scope, other)
        {
            debug!(
                "{} not probed in {}: {} sees its calls",
                spec.symbol,
                library.shown_path.display(),
                catalog::symbol(other)
            );
            return false;
        }
        if let Some(import) = spec.unreadable_if_imports
            && self.library_imports(library, import)
        {
            debug!(
                "{} not probed in {}: it imports {import}, a layout its program cannot read",
                spec.symbol,
                library.shown_path.display()
            );
            return false;
        }
        true
    }

    /// Whether `library` imports `symbol`, read once per file. A file that cannot be read
    /// (its process gone meanwhile) says no, and is read again for the next process.
    fn library_imports(&mut self, library: &MappedLibrary, symbol: &'static str) -> bool {
        let key = (library.file, symbol);
        if let Some(&imported) = self.imports.get(&key) {
            return imported;
        }
        match crate::sys::plt::imports(&library.open_path, symbol) {
            Ok(imported) => *self.imports.entry(key).or_insert(imported),
            Err(_) => false,
        }
    }

    /// Attaches the dynamic loader `loader`'s probe in every process that maps it, before
    /// any process that uses it is a target: how their library loads are seen.
    pub fn attach_loader(
        &mut self,
        ebpf: &mut Ebpf,
        loader: &MappedLibrary,
        groups: &SpanGroups,
    ) -> Option<&LibraryAttachment> {
        self.attach_in(ebpf, ProbeScope::Node, loader, groups)
    }

    fn attach_in(
        &mut self,
        ebpf: &mut Ebpf,
        scope: ProbeScope,
        library: &MappedLibrary,
        groups: &SpanGroups,
    ) -> Option<&LibraryAttachment> {
        let key = (scope, library.file);
        if !self.done.insert(key) {
            return None;
        }
        let specs: Vec<_> = catalog::enabled_for(library.kind, groups)
            .filter(|spec| self.wanted_here(scope, library, spec))
            .collect();
        let mut outcomes = Vec::new();
        // Notes on what was chosen (older symbol versions left out), for after the outcomes.
        let mut notes = Vec::new();
        let mut kernel_links = 0;
        if !specs.is_empty() {
            let mut wanted: Vec<&str> = Vec::new();
            for spec in &specs {
                wanted.push(spec.symbol);
                wanted.extend(spec.optional_aliases);
            }
            match resolve_symbols(&library.open_path, &wanted) {
                Ok(symbols) => {
                    let mut claimed = HashMap::new();
                    let mut batch = Batch::default();
                    for spec in &specs {
                        let places = places(
                            library,
                            spec,
                            &symbols,
                            &mut claimed,
                            &mut outcomes,
                            &mut notes,
                        );
                        if spec.id.is_launch()
                            && let Some(sampled) = self.sampled.as_mut()
                        {
                            sample_spec(
                                ebpf,
                                scope,
                                library,
                                spec,
                                &places,
                                &mut outcomes,
                                sampled,
                            );
                            continue;
                        }
                        batch.add(spec, &places, &mut outcomes);
                    }
                    let attached = batch.attach(
                        ebpf,
                        scope.kernel(),
                        library,
                        &mut outcomes,
                        self.links.entry(key).or_default(),
                    );
                    kernel_links += attached.kernel_links;
                }
                Err(error) => outcomes.extend(specs.iter().map(|spec| ProbeOutcome::Failed {
                    symbol: spec.symbol.to_string(),
                    reason: error.to_string(),
                })),
            }
        }
        kernel_links += self.attach_rules(ebpf, scope, library, groups, &mut outcomes);
        let failed = outcomes
            .iter()
            .any(|o| matches!(o, ProbeOutcome::Failed { .. }));
        if failed && !library.open_path.exists() {
            // The process exited while we attached: nothing is wrong with the library.
            // Undo, so that the next process that maps it gets it probed.
            debug!(
                "{} went away while attaching; will attach again",
                library.shown_path.display()
            );
            crate::sys::teardown::release_in_background(self.take(ebpf, key));
            return None;
        }
        for outcome in &outcomes {
            match outcome {
                ProbeOutcome::Attached {
                    symbol,
                    offset,
                    version,
                } => debug!(
                    "attached {symbol}{} at {offset:#x} in {}",
                    version.as_ref().map_or(String::new(), |v| format!("@@{v}")),
                    library.shown_path.display()
                ),
                ProbeOutcome::Failed { symbol, reason } => warn!(
                    "cannot probe {symbol} in {}: {reason}",
                    library.shown_path.display()
                ),
            }
        }
        for note in notes {
            warn!("{}: {note}", library.shown_path.display());
        }
        self.attachments.push(LibraryAttachment {
            scope,
            library: library.clone(),
            outcomes,
            kernel_links,
        });
        self.attachments.last()
    }

    /// Attached probes per probe id (both entry and return count as one probe each).
    pub fn attached_by_probe(&self) -> BTreeMap<ProbeId, usize> {
        let mut by_probe = BTreeMap::new();
        for attachment in &self.attachments {
            for symbol in attachment.attached() {
                if let Some(spec) = catalog::CATALOG
                    .iter()
                    .find(|s| s.symbol == symbol || s.optional_aliases.contains(&symbol))
                {
                    *by_probe.entry(spec.id).or_default() += 1;
                }
            }
        }
        by_probe
    }
}

/// `program` at `offset` in `path` with the cookie of `id`, outside the bookkeeping of
/// libraries: for measuring what a probe hit costs. Dropping the link takes it out.
pub fn attach_own(
    ebpf: &mut Ebpf,
    program: Program,
    path: &std::path::Path,
    offset: u64,
    id: ProbeId,
) -> Result<aya::programs::uprobe::UProbeLink> {
    let uprobe = uprobe_mut(ebpf, program)?;
    let own = ProbeScope::Process(std::process::id()).kernel();
    let link = attach_at(uprobe, program, path, offset, catalog::cookie(id), own)?;
    uprobe.take_link(link).map_err(|source| LensError::Program {
        program: program.name(),
        source,
    })
}

/// Attaches `uprobe` (the object's `program`) at `offset` in the file at `path`, in
/// the processes of `scope`, with `cookie`.
pub(super) fn attach_at(
    uprobe: &mut UProbe,
    program: Program,
    path: &std::path::Path,
    offset: u64,
    cookie: u64,
    scope: UProbeScope,
) -> Result<UProbeLinkId> {
    attach_points(uprobe, program, path, [(offset, cookie)], scope)
}

/// Attaches `uprobe` (the object's `program`) at each `(offset, cookie)` in the file at
/// `path`, in the processes of `scope`, under one link id: the one way every library
/// probe goes in. With the program's `uprobe.multi` twin loaded that is one uprobe_multi
/// link (its pid the kernel's filter), else one perf link per point, each opened for the
/// process (all detached if one fails).
pub(crate) fn attach_points(
    uprobe: &mut UProbe,
    program: Program,
    path: &std::path::Path,
    points: impl IntoIterator<Item = (u64, u64)>,
    scope: UProbeScope,
) -> Result<UProbeLinkId> {
    uprobe
        .attach(
            points
                .into_iter()
                .map(|(offset, cookie)| UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(offset),
                    cookie: Some(cookie),
                }),
            path,
            scope,
        )
        .map_err(|source| LensError::Program {
            program: program.name(),
            source,
        })
}

/// The loader's own dynamic linker, as this process maps it: the one a child started
/// with `--exec` will almost always use too.
pub fn own_dynamic_loader() -> Result<Option<MappedLibrary>> {
    let pid = std::process::id();
    Ok(crate::sys::library::find_libraries(pid)?
        .into_iter()
        .find(|l| l.kind == LibraryKind::DynamicLoader))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::library::{FileId, LibraryKind};
    use crate::sys::symbols::{Symbol, Symbols};

    fn nccl_without(missing: &str) -> (MappedLibrary, Symbols) {
        let library = MappedLibrary {
            kind: LibraryKind::Nccl,
            file: FileId { dev: 1, ino: 2 },
            shown_path: "/opt/nccl/libnccl.so.2".into(),
            open_path: "/opt/nccl/libnccl.so.2".into(),
        };
        let found = catalog::CATALOG
            .iter()
            .filter(|spec| spec.library == LibraryKind::Nccl && spec.symbol != missing)
            .enumerate()
            .map(|(i, spec)| {
                let place = Symbol {
                    offset: 0x1000 + 0x100 * i as u64,
                    version: None,
                    other_versions: Vec::new(),
                };
                (spec.symbol.to_string(), place)
            })
            .collect();
        let symbols = Symbols {
            found,
            has_static_symbols: true,
        };
        (library, symbols)
    }

    fn outcomes_for(id: ProbeId, missing: &str) -> (usize, Vec<ProbeOutcome>) {
        let (library, symbols) = nccl_without(missing);
        let (mut outcomes, mut notes) = (Vec::new(), Vec::new());
        let found = places(
            &library,
            catalog::spec_of(id),
            &symbols,
            &mut HashMap::new(),
            &mut outcomes,
            &mut notes,
        );
        (found.len(), outcomes)
    }

    #[test]
    fn an_older_library_without_a_newer_api_is_not_reported() {
        // ncclAlltoAll is newer than many NCCL releases users run.
        let (found, outcomes) = outcomes_for(ProbeId::NcclAlltoAll, "ncclAlltoAll");
        assert_eq!((found, outcomes.len()), (0, 0), "{outcomes:?}");
        let (found, outcomes) = outcomes_for(ProbeId::NcclAlltoAll, "");
        assert_eq!((found, outcomes.len()), (1, 0), "{outcomes:?}");
    }

    #[test]
    fn a_library_without_a_core_api_is_reported() {
        let (found, outcomes) = outcomes_for(ProbeId::NcclAllReduce, "ncclAllReduce");
        assert_eq!(found, 0);
        assert!(
            matches!(&outcomes[..], [ProbeOutcome::Failed { symbol, reason }]
                if symbol == "ncclAllReduce" && reason.contains("defines no such symbol")),
            "{outcomes:?}"
        );
    }
}
