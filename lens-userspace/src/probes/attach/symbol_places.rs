//! Where each catalog probe goes in a library: its symbols found, one place per
//! address, missing ones reported; and the attaching there.
use std::collections::{BTreeMap, HashMap};

use aya::{
    Ebpf,
    programs::uprobe::{UProbeLinkId, UProbeScope},
};
use log::debug;

use super::{ProbeOutcome, attach_at, attach_points};
use crate::bpf::{is_multi, uprobe_mut};
use crate::probes::catalog::{self, Program};
use crate::sys::{
    library::MappedLibrary,
    symbols::{Symbol, Symbols},
};

/// Where the probe of `spec` goes in `library`: its symbol and the optional aliases the
/// library defines, once per address. A missing symbol, or one at an address another
/// probe took already (`claimed`: two probed names for one function, as aliases or folded
/// identical code), is reported in `outcomes` and left out: a call there is counted once,
/// under the first name. Older versions of a symbol, not probed, are said in `notes`.
pub(super) fn places<'a>(
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
pub(super) fn missing_reason(library: &MappedLibrary, symbols: &Symbols) -> String {
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

/// One point of a library's [`Batch`]: where, with which cookie, and the slot in the
/// outcomes it fills.
struct Point {
    symbol: String,
    offset: u64,
    version: Option<String>,
    cookie: u64,
    slot: usize,
    /// Said before the reason if the point fails (a configured rule's origin).
    origin: Option<String>,
}

/// What [`Batch::attach`] did.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Attached {
    /// Links it made in the kernel: one per uprobe_multi link, one per perf uprobe.
    pub(super) kernel_links: usize,
    /// Points it did not try because a stop was requested.
    pub(super) not_tried: usize,
}

/// A library's probes, by program, attached with one call per program: one uprobe_multi
/// link for all its points where the kernel has them (one grace period to remove it, not
/// one per point), else one perf link per point under one link id.
#[derive(Default)]
pub(super) struct Batch {
    by_program: BTreeMap<Program, Vec<Point>>,
}

impl Batch {
    /// Adds the places of `spec` (entry and return program each), reserving their
    /// outcomes in order; [`Batch::attach`] fills them.
    pub(super) fn add(
        &mut self,
        spec: &catalog::ProbeSpec,
        places: &[(&str, Symbol)],
        outcomes: &mut Vec<ProbeOutcome>,
    ) {
        for (symbol, place) in places {
            for program in spec.entry.into_iter().chain(spec.exit) {
                self.add_point(program, symbol, place, spec.cookie(), None, outcomes);
            }
        }
    }

    /// Adds `program` at `place` (the function `symbol`) with `cookie`, reserving its
    /// outcome; a failure is said after `origin`, if any.
    pub(super) fn add_point(
        &mut self,
        program: Program,
        symbol: &str,
        place: &Symbol,
        cookie: u64,
        origin: Option<&str>,
        outcomes: &mut Vec<ProbeOutcome>,
    ) {
        let slot = outcomes.len();
        outcomes.push(ProbeOutcome::Failed {
            symbol: symbol.to_string(),
            reason: "not attached".into(),
        });
        self.by_program.entry(program).or_default().push(Point {
            symbol: symbol.to_string(),
            offset: place.offset,
            version: place.version.clone(),
            cookie,
            slot,
            origin: origin.map(str::to_string),
        });
    }

    /// Attaches every program's points: as one uprobe_multi link where the program's twin
    /// is loaded, else (or if that fails) one by one, so that each failure names its
    /// symbol and the others still go in. Perf links go one by one anyway: each waits for
    /// the kernel, and a stop request must be able to end the attaching between two.
    pub(super) fn attach(
        self,
        ebpf: &mut Ebpf,
        scope: UProbeScope,
        library: &MappedLibrary,
        outcomes: &mut Vec<ProbeOutcome>,
        links: &mut Vec<(Program, UProbeLinkId)>,
    ) -> Attached {
        let mut kernel_links = 0;
        let mut not_tried = Vec::new();
        let path = &library.open_path;
        let attached = |p: &Point| ProbeOutcome::Attached {
            symbol: p.symbol.clone(),
            offset: p.offset,
            version: p.version.clone(),
        };
        for (program, points) in self.by_program {
            // Each attach can wait for the kernel (seconds, while another tracer's teardown
            // runs): a stop request ends the attaching.
            if crate::sys::target::stop_requested() {
                not_tried.extend(points.iter().map(|p| p.slot));
                continue;
            }
            if is_multi(ebpf, program) {
                let all = uprobe_mut(ebpf, program).and_then(|uprobe| {
                    attach_points(
                        uprobe,
                        program,
                        path,
                        points.iter().map(|p| (p.offset, p.cookie)),
                        scope,
                    )
                });
                match all {
                    Ok(id) => {
                        links.push((program, id));
                        kernel_links += 1;
                        for p in &points {
                            outcomes[p.slot] = attached(p);
                        }
                        continue;
                    }
                    Err(error) => debug!(
                        "{} points of {} in {} as one link: {error}; one by one",
                        points.len(),
                        program.name(),
                        library.shown_path.display()
                    ),
                }
            }
            for p in &points {
                if crate::sys::target::stop_requested() {
                    not_tried.push(p.slot);
                    continue;
                }
                let one = uprobe_mut(ebpf, program)
                    .and_then(|uprobe| attach_at(uprobe, program, path, p.offset, p.cookie, scope));
                outcomes[p.slot] = match one {
                    Ok(id) => {
                        links.push((program, id));
                        kernel_links += 1;
                        attached(p)
                    }
                    Err(error) => ProbeOutcome::Failed {
                        symbol: p.symbol.clone(),
                        reason: match &p.origin {
                            Some(origin) => format!("{origin}: {error}"),
                            None => error.to_string(),
                        },
                    },
                };
            }
        }
        // As before a stop: the probes not tried are not reported.
        not_tried.sort_unstable();
        let not_tried_count = not_tried.len();
        for slot in not_tried.into_iter().rev() {
            outcomes.remove(slot);
        }
        Attached {
            kernel_links,
            not_tried: not_tried_count,
        }
    }
}
