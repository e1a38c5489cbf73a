//! Configured probe rules (`--config`): every function each rule's symbol pattern
//! matches in a library, entry and return, the rule in the attach cookie.
use std::collections::HashSet;

use aya::Ebpf;

use lens_common::rule_cookie;
use log::warn;

use super::symbol_places::Batch;
use super::{Attacher, ProbeOutcome, ProbeScope};
use crate::LensError;
use crate::patterns::may_unwind;
use crate::probes::catalog::Program;
use crate::settings::{
    groups::SpanGroups,
    probe_rules::{ArgType, NativeRule},
};
use crate::sys::{
    library::MappedLibrary,
    symbols::{Matches, Symbol, Symbols, resolve_matching, resolve_symbols},
};

impl Attacher {
    /// Attaches the configured rules (of enabled groups) whose `library` names `library`:
    /// every function each one's `symbol` matches, entry and return, the cookie saying
    /// which rule, in one batch (one uprobe_multi link per program where the kernel has
    /// them). Returns how many kernel links that made. A rule that matches nothing here is one failed outcome (one warning); a
    /// rule that matches more than its `max_matches` is probed on the first ones, said in
    /// one warning.
    pub(super) fn attach_rules(
        &mut self,
        ebpf: &mut Ebpf,
        scope: ProbeScope,
        library: &MappedLibrary,
        groups: &SpanGroups,
        outcomes: &mut Vec<ProbeOutcome>,
    ) -> usize {
        let all = self.rules.clone();
        let rules: Vec<&NativeRule> = all
            .native
            .iter()
            .filter(|rule| groups.contains(rule.group) && rule.library.matches(&library.shown_path))
            .collect();
        if rules.is_empty() {
            return 0;
        }
        self.rules_seen.extend(rules.iter().map(|rule| rule.index));
        let lookups = RuleLookups::resolve(library, &rules);
        let links = self.links.entry((scope, library.file)).or_default();
        let mut batch = Batch::default();
        for rule in rules {
            let symbol = rule.symbol.text();
            let places = match lookups.places(rule) {
                Ok(places) => places,
                Err(error) => {
                    outcomes.push(ProbeOutcome::Failed {
                        symbol: symbol.to_string(),
                        reason: format!("{}: {error}", rule.origin),
                    });
                    continue;
                }
            };
            add_rule_probes(&mut batch, rule, places, library, outcomes);
        }
        let attached = batch.attach(ebpf, scope.kernel(), library, outcomes, links);
        if attached.not_tried > 0 {
            warn!(
                "stopping: {} of the configured rules' probes in {} were not probed",
                attached.not_tried,
                library.shown_path.display()
            );
        }
        attached.kernel_links
    }
}

/// Where a configured rule goes in one library: the functions it matched (name and
/// place), whether more matched than its cap, and whether the file has a `.symtab`.
#[derive(Default)]
pub(super) struct RulePlaces {
    pub(super) places: Vec<(String, Symbol)>,
    pub(super) capped: bool,
    pub(super) has_static: bool,
}

/// The symbol lookups for one library's rules: exact names in one pass, patterns in
/// another (each with its rule's cap).
struct RuleLookups<'r> {
    patterns: Vec<&'r NativeRule>,
    exact: crate::Result<Option<Symbols>>,
    matched: crate::Result<Option<Matches>>,
}

impl<'r> RuleLookups<'r> {
    fn resolve(library: &MappedLibrary, rules: &[&'r NativeRule]) -> Self {
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
        let exact = (!exact.is_empty())
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
        RuleLookups {
            patterns,
            exact,
            matched,
        }
    }

    /// Where `rule` goes, or why the library could not be searched for it.
    fn places(&self, rule: &NativeRule) -> Result<RulePlaces, &LensError> {
        let symbol = rule.symbol.text();
        if rule.symbol.is_pattern() {
            let at = self.patterns.iter().position(|p| p.index == rule.index);
            match (&self.matched, at) {
                (Ok(Some(matches)), Some(at)) => Ok(RulePlaces {
                    places: matches.found[at].clone(),
                    capped: matches.capped[at],
                    has_static: matches.has_static_symbols,
                }),
                (Err(error), _) => Err(error),
                _ => Ok(RulePlaces::default()),
            }
        } else {
            match &self.exact {
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
                Err(error) => Err(error),
                Ok(None) => Ok(RulePlaces::default()),
            }
        }
    }
}

/// Adds a rule's entry and return probes on every place it matched to the batch; a rule
/// that matched nothing, or a C++ function that may unwind, is a failed outcome.
fn add_rule_probes(
    batch: &mut Batch,
    rule: &NativeRule,
    found: RulePlaces,
    library: &MappedLibrary,
    outcomes: &mut Vec<ProbeOutcome>,
) {
    let symbol = rule.symbol.text();
    let RulePlaces {
        places,
        capped,
        has_static,
    } = found;
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
        return;
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
    // Aliases of one function fire once.
    let mut offsets = HashSet::new();
    for (name, place) in &places {
        // A glob that reached a C++ name (`_ZN4c10d*`, `*allreduce*`): no return
        // probe where an exception can leave (probe_rules.rs refuses C++ names given
        // as such before anything starts).
        if !rule.noexcept && may_unwind(name) {
            outcomes.push(ProbeOutcome::Failed {
                symbol: name.clone(),
                reason: format!(
                    "{}: a C++ function, left out: an exception leaving it through \
                     its return probe would abort the process; add noexcept = true \
                     to the rule if none can",
                    rule.origin
                ),
            });
            continue;
        }
        if offsets.insert(place.offset) {
            for program in [Program::UserRuleEntry, Program::UserRuleReturn] {
                batch.add_point(program, name, place, cookie, Some(&rule.origin), outcomes);
            }
        }
    }
}
