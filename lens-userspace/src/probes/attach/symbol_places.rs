//! Where each catalog probe goes in a library: its symbols found, one place per
//! address, missing ones reported; and the attaching there.
use std::collections::{BTreeMap, HashMap};

use aya::{Ebpf, programs::uprobe::UProbeLinkId};
use log::debug;

use super::object::uprobe_mut;
use super::{ProbeOutcome, attach_at, attach_points};
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
}

/// A library's catalog probes, by program, attached with one call per program: one
/// uprobe_multi link for all its points where the kernel has them (one grace period to
/// remove it, not one per point), else one perf link per point under one link id.
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
                let slot = outcomes.len();
                outcomes.push(ProbeOutcome::Failed {
                    symbol: symbol.to_string(),
                    reason: "not attached".into(),
                });
                self.by_program.entry(program).or_default().push(Point {
                    symbol: symbol.to_string(),
                    offset: place.offset,
                    version: place.version.clone(),
                    cookie: spec.cookie(),
                    slot,
                });
            }
        }
    }

    /// Attaches every program's points in one call. If that fails, the points go in one
    /// by one, so that each failure names its symbol as before and the others still go in.
    pub(super) fn attach(
        self,
        ebpf: &mut Ebpf,
        library: &MappedLibrary,
        outcomes: &mut Vec<ProbeOutcome>,
        links: &mut Vec<(Program, UProbeLinkId)>,
    ) {
        let mut not_tried = Vec::new();
        for (program, points) in self.by_program {
            // Each attach can wait for the kernel (seconds, while another tracer's teardown
            // runs): a stop request ends the attaching.
            if crate::sys::target::stop_requested() {
                not_tried.extend(points.iter().map(|p| p.slot));
                continue;
            }
            let path = &library.open_path;
            let all = uprobe_mut(ebpf, program).and_then(|uprobe| {
                attach_points(
                    uprobe,
                    program,
                    path,
                    points.iter().map(|p| (p.offset, p.cookie)),
                )
            });
            let attached = |p: &Point| ProbeOutcome::Attached {
                symbol: p.symbol.clone(),
                offset: p.offset,
                version: p.version.clone(),
            };
            match all {
                Ok(id) => {
                    links.push((program, id));
                    for p in &points {
                        outcomes[p.slot] = attached(p);
                    }
                }
                Err(error) => {
                    if points.len() > 1 {
                        debug!(
                            "{} points of {} in {} at once: {error}; one by one",
                            points.len(),
                            program.name(),
                            library.shown_path.display()
                        );
                    }
                    for p in &points {
                        if points.len() > 1 && crate::sys::target::stop_requested() {
                            not_tried.push(p.slot);
                            continue;
                        }
                        let one = if points.len() == 1 {
                            Err(error.to_string())
                        } else {
                            uprobe_mut(ebpf, program)
                                .and_then(|uprobe| {
                                    attach_at(uprobe, program, path, p.offset, p.cookie)
                                })
                                .map_err(|e| e.to_string())
                        };
                        outcomes[p.slot] = match one {
                            Ok(id) => {
                                links.push((program, id));
                                attached(p)
                            }
                            Err(reason) => ProbeOutcome::Failed {
                                symbol: p.symbol.clone(),
                                reason,
                            },
                        };
                    }
                }
            }
        }
        // As before a stop: the probes not tried are not reported.
        not_tried.sort_unstable();
        for slot in not_tried.into_iter().rev() {
            outcomes.remove(slot);
        }
    }
}
