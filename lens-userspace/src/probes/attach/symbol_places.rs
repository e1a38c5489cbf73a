//! Where each catalog probe goes in a library: its symbols found, one place per
//! address, missing ones reported; and the attaching there.
use std::collections::HashMap;

use aya::{Ebpf, programs::uprobe::UProbeLinkId};

use super::object::uprobe_mut;
use super::{ProbeOutcome, attach_at};
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

pub(super) fn attach_spec(
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
        if crate::sys::target::stop_requested() {
            return;
        }
        let offset = place.offset;
        for program in spec.entry.into_iter().chain(spec.exit) {
            let result = uprobe_mut(ebpf, program).and_then(|uprobe| {
                attach_at(uprobe, program, &library.open_path, offset, spec.cookie())
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
