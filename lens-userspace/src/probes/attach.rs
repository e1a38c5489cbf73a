//! Loading the BPF object and attaching its programs to the libraries a target maps.
//!
//! Probes are attached once per library *file* (uprobes are keyed by inode) for all
//! processes; the kernel side filters by the `TARGETS` map. So a library shared by many
//! traced processes costs one set of probes, and a process that maps an already-probed
//! file is covered the moment it is added to `TARGETS`.
use std::collections::{BTreeMap, HashMap, HashSet};

use aya::{
    Ebpf, EbpfLoader,
    programs::{
        ProgramError, UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
    },
};
use std::{path::Path, sync::Arc};

use lens_common::{ProbeId, rule_cookie};
use log::{debug, warn};

use super::{
    catalog::{self, Program},
    library::{FileId, LibraryKind, MappedLibrary},
    symbols::{Symbol, Symbols, resolve_matching, resolve_symbols},
};
use crate::{
    config::{ArgType, NativeRule, ProbeRules},
    error::{LensError, Result},
    groups::SpanGroups,
};

/// The BPF object built from `lens-ebpf` by the build script.
static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lens-ebpf.o"));

/// Loads the BPF object and its programs. `kernel_logs` keeps the kernel-side diagnostics
/// (aya-log) on; otherwise they are compiled in but switched off at load.
pub fn load_object(kernel_logs: bool) -> Result<Ebpf> {
    let level: u8 = if kernel_logs { 0xff } else { 0 };
    let layout = super::processes::kernel_layout_or_warn();
    let mut loader = EbpfLoader::new();
    loader.override_global("AYA_LOG_LEVEL", &level, false);
    if let Some(layout) = &layout {
        super::processes::configure(&mut loader, layout);
    }
    let mut ebpf = loader.load(BPF_OBJECT)?;
    for &program in Program::ALL {
        uprobe_mut(&mut ebpf, program)?
            .load()
            .map_err(|source| match source {
                ProgramError::LoadError {
                    io_error,
                    verifier_log,
                } => {
                    // The verifier's log is long: for -vv, not for the one-line error.
                    debug!("verifier log of {}:\n{verifier_log}", program.name());
                    LensError::VerifierRejected {
                        program: program.name(),
                        reason: io_error.to_string(),
                    }
                }
                source => LensError::Program {
                    program: program.name(),
                    source,
                },
            })?;
    }
    if layout.is_some() {
        super::processes::attach(&mut ebpf)?;
    }
    Ok(ebpf)
}

/// Takes the events ring buffer out of the loaded object, for the one reader that drains
/// it (a session, or the throughput bench).
pub fn take_event_ring(ebpf: &mut Ebpf) -> Result<aya::maps::RingBuf<aya::maps::MapData>> {
    let map = ebpf
        .take_map(lens_common::maps::EVENTS)
        .ok_or(LensError::MissingInObject {
            kind: "map",
            name: lens_common::maps::EVENTS,
        })?;
    aya::maps::RingBuf::try_from(map).map_err(|source| LensError::Map {
        map: lens_common::maps::EVENTS,
        source,
    })
}

fn uprobe_mut(ebpf: &mut Ebpf, program: Program) -> Result<&mut UProbe> {
    program_mut(ebpf, program.name())
}

/// The object's program `name` as the program type `P` (`UProbe`, `RawTracePoint`…).
pub fn program_mut<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(LensError::MissingInObject {
            kind: "program",
            name,
        })?
        .try_into()
        .map_err(|source| LensError::Program {
            program: name,
            source,
        })
}

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

/// The result of attaching to one library file.
#[derive(Clone, Debug)]
pub struct LibraryAttachment {
    pub library: MappedLibrary,
    pub outcomes: Vec<ProbeOutcome>,
}

impl LibraryAttachment {
    pub fn attached(&self) -> impl Iterator<Item = &str> {
        self.outcomes.iter().filter_map(|o| match o {
            ProbeOutcome::Attached { symbol, .. } => Some(symbol.as_str()),
            ProbeOutcome::Failed { .. } => None,
        })
    }
}

/// A launch probe an overhead budget moves in and out: where it goes, and its link while
/// it is in. The library stays open so that it can go in again after the process that
/// showed it to us is gone (`/proc/self/fd/N` names the same inode in any namespace).
struct SampledProbe {
    file: FileId,
    library: std::sync::Arc<std::fs::File>,
    offset: u64,
    id: ProbeId,
    /// `count_only` (runtime) or `driver_launch` (driver).
    program: Program,
    link: Option<UProbeLinkId>,
}

impl SampledProbe {
    fn path(&self) -> std::path::PathBuf {
        use std::os::fd::AsRawFd;
        format!("/proc/self/fd/{}", self.library.as_raw_fd()).into()
    }
}

/// Launch probes under an overhead budget ([`Attacher::sample_launches`]).
#[derive(Default)]
struct SampledLaunches {
    probes_in: bool,
    probes: Vec<SampledProbe>,
}

/// Keeps track of which files were already probed, so each is attached once, which
/// targets use each, and its links, so a library no target maps any more is detached.
#[derive(Default)]
pub struct Attacher {
    done: HashSet<FileId>,
    attachments: Vec<LibraryAttachment>,
    links: HashMap<FileId, Vec<(Program, UProbeLinkId)>>,
    users: HashMap<FileId, HashSet<u32>>,
    sampled: Option<SampledLaunches>,
    /// Configured probe rules (`--config`, `--profile`).
    rules: Arc<ProbeRules>,
    /// Rules whose `library` matched a file of a target.
    rules_seen: HashSet<u32>,
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
                match attach_at(uprobe, probe.program, &probe.path(), probe.offset, probe.id) {
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

    pub fn is_attached(&self, file: FileId) -> bool {
        self.done.contains(&file)
    }

    pub fn attachments(&self) -> &[LibraryAttachment] {
        &self.attachments
    }

    /// Records that target `pid` maps these files.
    pub fn use_libraries(&mut self, pid: u32, files: impl IntoIterator<Item = FileId>) {
        for file in files {
            self.users.entry(file).or_default().insert(pid);
        }
    }

    /// Target `pid` is gone: the probes of libraries no other target maps are detached
    /// (the dynamic loader's stay: it finds the next targets). The kernel takes ~0.1 s
    /// per uprobe to remove them, so they go on a thread of their own. Returns how many
    /// uprobes were let go.
    pub fn release(&mut self, ebpf: &mut Ebpf, pid: u32) -> usize {
        let mut unused = Vec::new();
        for (file, users) in &mut self.users {
            if users.remove(&pid) && users.is_empty() {
                unused.push(*file);
            }
        }
        let mut count = 0;
        for file in unused {
            self.users.remove(&file);
            let loader = self
                .attachments
                .iter()
                .any(|a| a.library.file == file && a.library.kind == LibraryKind::DynamicLoader);
            if !loader {
                debug!("no target maps {file:?} any more: detaching its probes");
                count += self.forget(ebpf, file);
            }
        }
        count
    }

    /// Detaches every probe of `file` (on a thread of its own: the kernel is slow to
    /// remove uprobes) and forgets it was attached. Returns how many went.
    fn forget(&mut self, ebpf: &mut Ebpf, file: FileId) -> usize {
        let mut released = Vec::new();
        let mut released_sampled = Vec::new();
        for (program, id) in self.links.remove(&file).unwrap_or_default() {
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
            for probe in sampled.probes.iter_mut().filter(|p| p.file == file) {
                if let Some(link) = probe.link.take()
                    && let Ok(uprobe) = uprobe_mut(ebpf, probe.program)
                    && let Ok(link) = uprobe.take_link(link)
                {
                    released_sampled.push(link);
                }
            }
            sampled.probes.retain(|p| p.file != file);
        }
        self.done.remove(&file);
        self.attachments.retain(|a| a.library.file != file);
        let count = released.len() + released_sampled.len();
        if count > 0 {
            std::thread::spawn(move || drop((released, released_sampled)));
        }
        count
    }

    /// Number of uprobes (entry and return) attached now.
    pub fn uprobe_count(&self) -> usize {
        self.attachments
            .iter()
            .flat_map(|a| &a.outcomes)
            .filter(|o| matches!(o, ProbeOutcome::Attached { .. }))
            .count()
    }

    /// Attaches every probe the enabled groups need to `library`. Probes that fail are
    /// reported (once, as a warning) and skipped; the others still attach.
    pub fn attach_library(
        &mut self,
        ebpf: &mut Ebpf,
        library: &MappedLibrary,
        groups: &SpanGroups,
    ) -> Option<&LibraryAttachment> {
        if !self.done.insert(library.file) {
            return None;
        }
        let specs: Vec<_> = catalog::enabled_for(library.kind, groups).collect();
        let mut outcomes = Vec::new();
        // Notes on what was chosen (older symbol versions left out), for after the outcomes.
        let mut notes = Vec::new();
        if !specs.is_empty() {
            let mut wanted: Vec<&str> = Vec::new();
            for spec in &specs {
                wanted.push(spec.symbol);
                wanted.extend(spec.optional_aliases);
            }
            match resolve_symbols(&library.open_path, &wanted) {
                Ok(symbols) => {
                    let mut claimed = HashMap::new();
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
                            sample_spec(ebpf, library, spec, &places, &mut outcomes, sampled);
                            continue;
                        }
                        attach_spec(
                            ebpf,
                            library,
                            spec,
                            &places,
                            &mut outcomes,
                            self.links.entry(library.file).or_default(),
                        );
                    }
                }
                Err(error) => outcomes.extend(specs.iter().map(|spec| ProbeOutcome::Failed {
                    symbol: spec.symbol.to_string(),
                    reason: error.to_string(),
                })),
            }
        }
        self.attach_rules(ebpf, library, groups, &mut outcomes);
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
            self.forget(ebpf, library.file);
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
            library: library.clone(),
            outcomes,
        });
        self.attachments.last()
    }

    /// Attaches the configured rules (of enabled groups) whose `library` names `library`:
    /// every function each one's `symbol` matches, entry and return, the cookie saying
    /// which rule. A rule that matches nothing here is one failed outcome (one warning); a
    /// rule that matches more than its `max_matches` is probed on the first ones, said in
    /// one warning.
    fn attach_rules(
        &mut self,
        ebpf: &mut Ebpf,
        library: &MappedLibrary,
        groups: &SpanGroups,
        outcomes: &mut Vec<ProbeOutcome>,
    ) {
        let all = self.rules.clone();
        let rules: Vec<&NativeRule> = all
            .native
            .iter()
            .filter(|rule| groups.contains(rule.group) && rule.library.matches(&library.shown_path))
            .collect();
        if rules.is_empty() {
            return;
        }
        self.rules_seen.extend(rules.iter().map(|rule| rule.index));
        let exact: Vec<&str> = rules
            .iter()
            .filter(|rule| !rule.symbol.is_pattern())
            .map(|rule| rule.symbol.text())
            .collect();
        let patterns: Vec<&NativeRule> = rules
            .iter()
            .copied()
            .filter(|rule| rule.symbol.is_pattern())
            .collect();
        let exact_found = (!exact.is_empty())
            .then(|| resolve_symbols(&library.open_path, &exact))
            .transpose();
        let matched = (!patterns.is_empty())
            .then(|| {
                let symbols: Vec<_> = patterns.iter().map(|rule| &rule.symbol).collect();
                let caps: Vec<usize> = patterns
                    .iter()
                    .map(|rule| rule.max_matches as usize)
                    .collect();
                resolve_matching(&library.open_path, &symbols, &caps)
            })
            .transpose();
        let links = self.links.entry(library.file).or_default();
        for rule in rules {
            let symbol = rule.symbol.text();
            let found: std::result::Result<RulePlaces, String> = if rule.symbol.is_pattern() {
                let at = patterns.iter().position(|p| p.index == rule.index);
                match (&matched, at) {
                    (Ok(Some(matches)), Some(at)) => Ok(RulePlaces {
                        places: matches.found[at].clone(),
                        capped: matches.capped[at],
                        has_static: matches.has_static_symbols,
                    }),
                    (Err(error), _) => Err(error.to_string()),
                    _ => Ok(RulePlaces::default()),
                }
            } else {
                match &exact_found {
                    Ok(Some(symbols)) => Ok(RulePlaces {
                        places: symbols
                            .found
                            .get(symbol)
                            .map(|place| (symbol.to_string(), place.clone()))
                            .into_iter()
                            .collect(),
                        capped: false,
                        has_static: symbols.has_static_symbols,
                    }),
                    Err(error) => Err(error.to_string()),
                    Ok(None) => Ok(RulePlaces::default()),
                }
            };
            let RulePlaces {
                places,
                capped,
                has_static,
            } = match found {
                Ok(found) => found,
                Err(reason) => {
                    outcomes.push(ProbeOutcome::Failed {
                        symbol: symbol.to_string(),
                        reason: format!("{}: {reason}", rule.origin),
                    });
                    continue;
                }
            };
            if places.is_empty() {
                let searched = if has_static {
                    ".dynsym and .symtab"
                } else {
                    ".dynsym only: the file is stripped"
                };
                outcomes.push(ProbeOutcome::Failed {
                    symbol: symbol.to_string(),
                    reason: format!(
                        "{}: no symbol matches it (searched {searched})",
                        rule.origin
                    ),
                });
                continue;
            }
            if capped {
                warn!(
                    "{}: {symbol} matches more than {} functions in {}: the first {} (by name) \
                     are probed; raise max_matches to probe more",
                    rule.origin,
                    rule.max_matches,
                    library.shown_path.display(),
                    places.len()
                );
            }
            let string = rule.string_arg();
            let cookie = rule_cookie(
                rule.index,
                string.map(|arg| arg.index),
                string.is_some_and(|arg| arg.kind == ArgType::StdString),
            );
            let mut offsets = HashSet::new();
            let total = places.len();
            for (done, (name, place)) in places.into_iter().enumerate() {
                // Thousands of probes take minutes (~20 ms each): a stop request ends it.
                if crate::target::stop_requested() {
                    warn!(
                        "stopping: {} of the {total} functions {symbol} matches in {} were \
                         not probed",
                        total - done,
                        library.shown_path.display()
                    );
                    return;
                }
                // Aliases of one function fire once.
                if !offsets.insert(place.offset) {
                    continue;
                }
                for program in [Program::UserRuleEntry, Program::UserRuleReturn] {
                    let result = uprobe_mut(ebpf, program).and_then(|uprobe| {
                        uprobe
                            .attach(
                                UProbeAttachPoint {
                                    location: UProbeAttachLocation::AbsoluteOffset(place.offset),
                                    cookie: Some(cookie),
                                },
                                &library.open_path,
                                UProbeScope::AllProcesses,
                            )
                            .map_err(|source| LensError::Program {
                                program: program.name(),
                                source,
                            })
                    });
                    outcomes.push(match result {
                        Ok(id) => {
                            links.push((program, id));
                            ProbeOutcome::Attached {
                                symbol: name.clone(),
                                offset: place.offset,
                                version: place.version.clone(),
                            }
                        }
                        Err(error) => ProbeOutcome::Failed {
                            symbol: name.clone(),
                            reason: format!("{}: {error}", rule.origin),
                        },
                    });
                }
            }
        }
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

/// Where a configured rule goes in one library: the functions it matched (name and
/// place), whether more matched than its cap, and whether the file has a `.symtab`.
#[derive(Default)]
struct RulePlaces {
    places: Vec<(String, Symbol)>,
    capped: bool,
    has_static: bool,
}

/// A `count_only` probe (a launch's program) at `offset` in `path`, outside the
/// bookkeeping of libraries: for measuring what one probe hit costs. Dropping the link
/// takes it out.
pub fn attach_count_only(
    ebpf: &mut Ebpf,
    path: &std::path::Path,
    offset: u64,
    id: ProbeId,
) -> Result<aya::programs::uprobe::UProbeLink> {
    let uprobe = uprobe_mut(ebpf, Program::CountOnly)?;
    let link = attach_at(uprobe, Program::CountOnly, path, offset, id)?;
    uprobe.take_link(link).map_err(|source| LensError::Program {
        program: Program::CountOnly.name(),
        source,
    })
}

fn attach_at(
    uprobe: &mut UProbe,
    program: Program,
    path: &std::path::Path,
    offset: u64,
    id: ProbeId,
) -> Result<UProbeLinkId> {
    uprobe
        .attach(
            UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(offset),
                cookie: Some(catalog::cookie(id)),
            },
            path,
            UProbeScope::AllProcesses,
        )
        .map_err(|source| LensError::Program {
            program: program.name(),
            source,
        })
}

/// A launch probe under an overhead budget: remembered so that it can be taken out and
/// put back, and put in now if the budget has the launch probes in.
fn sample_spec(
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
            let attached = uprobe_mut(ebpf, program)
                .and_then(|uprobe| attach_at(uprobe, program, &probe.path(), offset, spec.id));
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

/// Where the probe of `spec` goes in `library`: its symbol and the optional aliases the
/// library defines, once per address. A missing symbol, or one at an address another
/// probe took already (`claimed`: two probed names for one function, as aliases or folded
/// identical code), is reported in `outcomes` and left out: a call there is counted once,
/// under the first name. Older versions of a symbol, not probed, are said in `notes`.
fn places<'a>(
    library: &MappedLibrary,
    spec: &'a catalog::ProbeSpec,
    symbols: &Symbols,
    claimed: &mut HashMap<u64, &'a str>,
    outcomes: &mut Vec<ProbeOutcome>,
    notes: &mut Vec<String>,
) -> Vec<(&'a str, Symbol)> {
    let primary = spec.symbol;
    let mut places: Vec<(&str, Symbol)> = Vec::new();
    for &symbol in std::iter::once(&primary).chain(spec.optional_aliases) {
        let Some(place) = symbols.found.get(symbol) else {
            if symbol == primary && !spec.optional {
                outcomes.push(ProbeOutcome::Failed {
                    symbol: primary.to_string(),
                    reason: missing_reason(library, symbols),
                });
            }
            continue;
        };
        // Aliases of one API at one address (`cudaLaunchKernel_ptsz`, if it were) fire once.
        if places.iter().any(|(_, p)| p.offset == place.offset) {
            continue;
        }
        if let Some(&first) = claimed.get(&place.offset) {
            outcomes.push(ProbeOutcome::Failed {
                symbol: symbol.to_string(),
                reason: format!(
                    "at the same address as {first} (one function under two names): \
                     its calls are counted as {first}"
                ),
            });
            continue;
        }
        claimed.insert(place.offset, symbol);
        if let Some(version) = &place.version
            && !place.other_versions.is_empty()
        {
            let older: Vec<String> = place
                .other_versions
                .iter()
                .map(|old| format!("{symbol}@{old}"))
                .collect();
            notes.push(format!(
                "probed {symbol}@@{version}, the default version, not {}: calls from \
                 programs linked against an older version are not seen",
                older.join(", ")
            ));
        }
        places.push((symbol, place.clone()));
    }
    places
}

/// Why a probed symbol is not found in `library`.
fn missing_reason(library: &MappedLibrary, symbols: &Symbols) -> String {
    let kind = library.kind.display_name();
    if symbols.has_static_symbols {
        format!("{kind} defines no such symbol")
    } else {
        format!(
            "{kind} does not export it, and the library is stripped (no .symtab): \
             a local symbol cannot be found"
        )
    }
}

fn attach_spec(
    ebpf: &mut Ebpf,
    library: &MappedLibrary,
    spec: &catalog::ProbeSpec,
    places: &[(&str, Symbol)],
    outcomes: &mut Vec<ProbeOutcome>,
    links: &mut Vec<(Program, UProbeLinkId)>,
) {
    for (symbol, place) in places {
        // Each uprobe can wait for the kernel (seconds, while another tracer's teardown
        // runs): a stop request ends the attaching.
        if crate::target::stop_requested() {
            return;
        }
        let offset = place.offset;
        for program in spec.entry.into_iter().chain(spec.exit) {
            let result = uprobe_mut(ebpf, program).and_then(|uprobe| {
                uprobe
                    .attach(
                        UProbeAttachPoint {
                            location: UProbeAttachLocation::AbsoluteOffset(offset),
                            cookie: Some(spec.cookie()),
                        },
                        &library.open_path,
                        UProbeScope::AllProcesses,
                    )
                    .map_err(|source| LensError::Program {
                        program: program.name(),
                        source,
                    })
            });
            outcomes.push(match result {
                Ok(id) => {
                    links.push((program, id));
                    ProbeOutcome::Attached {
                        symbol: symbol.to_string(),
                        offset,
                        version: place.version.clone(),
                    }
                }
                Err(error) => ProbeOutcome::Failed {
                    symbol: symbol.to_string(),
                    reason: error.to_string(),
                },
            });
        }
    }
}

/// The loader's own dynamic linker, as this process maps it: the one a child started
/// with `--exec` will almost always use too.
pub fn own_dynamic_loader() -> Result<Option<MappedLibrary>> {
    let pid = std::process::id();
    Ok(super::library::find_libraries(pid)?
        .into_iter()
        .find(|l| l.kind == LibraryKind::DynamicLoader))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::library::{FileId, LibraryKind};

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
