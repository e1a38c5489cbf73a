//! Symbols matched by a configured rule's pattern (exact, demangled or glob), found by
//! streaming the string table once.
use super::ElfError;
use std::{collections::HashMap, fs::File, os::unix::fs::FileExt, path::Path};

use super::layout::Layout;
use super::scan::Candidate;
use super::{CHUNK, Definition, Symbol};
use crate::error::{LensError, Result};
use crate::patterns::SymbolPattern;

/// What a library defines of the names some patterns match ([`resolve_matching`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Matches {
    /// For each pattern, in order: the names it matched that the library defines, with
    /// their definitions, sorted by name, at most its cap.
    pub found: Vec<Vec<(String, Symbol)>>,
    /// For each pattern: it matched more names than its cap (the others are left out).
    pub capped: Vec<bool>,
    /// Whether the library has a `.symtab` (local symbols were searched too).
    pub has_static_symbols: bool,
}

/// The longest name tested against patterns; longer ones are passed over.
pub(super) const LONGEST_MATCHED_NAME: usize = 64 << 10;

/// The symbols of `path` whose names match each of `patterns` (demangled C++ names and
/// globs, see [`SymbolPattern`]), at most `caps[i]` for pattern `i`. Both symbol tables
/// are searched (a pattern may name local functions); of a name in both, `.dynsym`'s
/// definition is chosen (its default version, as [`resolve_symbols`] does).
///
/// Memory stays bounded as for exact names: the string tables are streamed in chunks,
/// every whole name is tested in place (no allocation unless it matches; demangling only
/// for C++ patterns, after a check that the name mentions the pattern's identifier), and
/// the matches kept per pattern are capped.
pub fn resolve_matching(
    path: &Path,
    patterns: &[&SymbolPattern],
    caps: &[usize],
) -> Result<Matches> {
    resolve_matching_chunked(path, patterns, caps, CHUNK)
}

pub(super) fn resolve_matching_chunked(
    path: &Path,
    patterns: &[&SymbolPattern],
    caps: &[usize],
    chunk: usize,
) -> Result<Matches> {
    let elf_error = |reason: ElfError| LensError::Elf {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let file = File::open(path).map_err(|e| elf_error(e.to_string().into()))?;
    let layout = Layout::read(&file).map_err(elf_error)?;
    let mut capped = vec![false; patterns.len()];
    // Name → definition, and the patterns each name matched.
    let mut definitions: HashMap<String, Definition> = HashMap::new();
    let mut matched_by: HashMap<String, Vec<usize>> = HashMap::new();
    for (table, versym) in layout.tables() {
        let mut candidates =
            matching_offsets(&file, table.strings, patterns, caps, chunk, &mut capped)
                .map_err(elf_error)?;
        candidates.sort_unstable_by_key(|(offset, _, _)| *offset);
        let mut names: Vec<String> = Vec::new();
        let mut at: Vec<(u64, usize)> = Vec::new();
        for (offset, pattern, name) in candidates {
            let patterns = matched_by.entry(name.clone()).or_default();
            if !patterns.contains(&pattern) {
                patterns.push(pattern);
            }
            if at.last().is_some_and(|(last, _)| *last == offset) {
                continue;
            }
            let index = match names.iter().position(|known| *known == name) {
                Some(index) => index,
                None => {
                    names.push(name);
                    names.len() - 1
                }
            };
            at.push((offset, index));
        }
        if at.is_empty() {
            continue;
        }
        let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut found: HashMap<&str, Candidate> = HashMap::new();
        layout
            .scan_table(&file, table, versym, &at, &name_refs, chunk, &mut found)
            .map_err(elf_error)?;
        let version_name = |index: u16| layout.version_names.get(&index).cloned();
        // Patterns probe functions: data (a glob's `my_*` catching `my_table`) and IFUNC
        // resolvers are no place for a uprobe.
        for (name, candidate) in found.into_iter().filter(|(_, c)| c.function) {
            definitions
                .entry(name.to_string())
                .or_insert_with(|| Definition {
                    address: candidate.address,
                    version: candidate.version.and_then(version_name),
                    other_versions: candidate
                        .other_versions
                        .into_iter()
                        .filter_map(version_name)
                        .collect(),
                });
        }
    }
    let mut found: Vec<Vec<(String, Symbol)>> = vec![Vec::new(); patterns.len()];
    // A name outside every loadable segment (a TLS or absolute symbol a glob caught) is
    // no function to probe: left out, the others kept.
    let symbols = definitions.into_iter().filter_map(|(name, definition)| {
        layout
            .file_offsets(HashMap::from([(name, definition)]))
            .ok()?
            .into_iter()
            .next()
    });
    for (name, symbol) in symbols {
        for pattern in matched_by.get(&name).into_iter().flatten() {
            found[*pattern].push((name.clone(), symbol.clone()));
        }
    }
    for (pattern, names) in found.iter_mut().enumerate() {
        names.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if names.len() > caps[pattern] {
            names.truncate(caps[pattern]);
            capped[pattern] = true;
        }
    }
    Ok(Matches {
        found,
        capped,
        has_static_symbols: layout.symtab.is_some(),
    })
}

/// The names in the string table at `(offset, size)` that match each pattern: (offset,
/// pattern index, name). Whole entries are tested, and, for a pattern with an anchor
/// ([`SymbolPattern::anchor`]), the places inside an entry where the anchor occurs (a
/// name stored as another's tail). At most a few times `caps[i]` are kept per pattern;
/// more set `capped[i]`.
pub(super) fn matching_offsets(
    file: &File,
    (offset, size): (u64, u64),
    patterns: &[&SymbolPattern],
    caps: &[usize],
    chunk: usize,
    capped: &mut [bool],
) -> std::result::Result<Vec<(u64, usize, String)>, ElfError> {
    let chunk = chunk.max(1);
    let limits: Vec<usize> = caps.iter().map(|cap| cap.saturating_mul(4) + 16).collect();
    let mut counts = vec![0usize; patterns.len()];
    let mut out = Vec::new();
    let mut buffer: Vec<u8> = Vec::with_capacity(chunk.min(usize::try_from(size).unwrap_or(chunk)));
    // The string at the start of the buffer began before it (a name longer than
    // LONGEST_MATCHED_NAME): it is passed over.
    let mut skipping = false;
    let mut read = 0u64;
    while read < size {
        let len = (size - read).min(chunk as u64) as usize;
        let kept = buffer.len();
        buffer.resize(kept + len, 0);
        file.read_exact_at(&mut buffer[kept..], offset + read)
            .map_err(|e| format!("reading the string table: {e}"))?;
        let base = read - kept as u64;
        let mut begin = 0;
        for end in nul_positions(&buffer[kept..]).map(|at| kept + at) {
            let name = &buffer[begin..end];
            if !skipping && !name.is_empty() {
                test_name(
                    name,
                    base + begin as u64,
                    patterns,
                    &limits,
                    &mut counts,
                    capped,
                    &mut out,
                );
            }
            skipping = false;
            begin = end + 1;
        }
        read += len as u64;
        buffer.drain(..begin);
        if buffer.len() > LONGEST_MATCHED_NAME {
            buffer.clear();
            skipping = true;
        }
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn test_name(
    name: &[u8],
    at: u64,
    patterns: &[&SymbolPattern],
    limits: &[usize],
    counts: &mut [usize],
    capped: &mut [bool],
    out: &mut Vec<(u64, usize, String)>,
) {
    for (index, pattern) in patterns.iter().enumerate() {
        let mut found = |start: usize, counts: &mut [usize]| {
            if counts[index] >= limits[index] {
                capped[index] = true;
                return;
            }
            counts[index] += 1;
            let text = String::from_utf8_lossy(&name[start..]).into_owned();
            out.push((at + start as u64, index, text));
        };
        if pattern.matches(name) {
            found(0, counts);
        }
        if let Some(anchor) = pattern.anchor() {
            for start in 1..name.len().saturating_sub(anchor.len() - 1) {
                if name[start..].starts_with(anchor) && pattern.matches(&name[start..]) {
                    found(start, counts);
                }
            }
        }
    }
}

/// Where in the string table at `(offset, size)` each of `names` is a whole string: the
/// offsets `o` where the table holds the name followed by NUL, with the name's index,
/// sorted by offset.
/// The byte before `o` may be anything: linkers share tails (`foo` may be the end of
/// `xfoo`), and a symbol named `xfoo` points at the `x`, not at `o`.
///
/// Reads `chunk` bytes at a time, keeping the last bytes of the previous read (as many as
/// the longest name) so that a name across two reads is found.
pub(super) fn name_offsets(
    file: &File,
    (offset, size): (u64, u64),
    names: &[&str],
    chunk: usize,
) -> std::result::Result<Vec<(u64, usize)>, ElfError> {
    let keep = names.iter().map(|name| name.len()).max().unwrap_or(0);
    let chunk = chunk.max(1);
    let mut buffer = Vec::with_capacity(keep + chunk.min(usize::try_from(size).unwrap_or(chunk)));
    let mut at = Vec::new();
    let mut read = 0u64;
    while read < size {
        let len = (size - read).min(chunk as u64) as usize;
        let kept = buffer.len();
        buffer.resize(kept + len, 0);
        file.read_exact_at(&mut buffer[kept..], offset + read)
            .map_err(|e| format!("reading the string table: {e}"))?;
        // The table offset of buffer[0].
        let base = read - kept as u64;
        for end in nul_positions(&buffer[kept..]).map(|at| kept + at) {
            let before = &buffer[..end];
            let Some(&last) = before.last() else {
                continue;
            };
            for (index, name) in names.iter().enumerate() {
                let name = name.as_bytes();
                if name.last() == Some(&last) && before.ends_with(name) {
                    at.push((base + (end - name.len()) as u64, index));
                }
            }
        }
        read += len as u64;
        let done = buffer.len().saturating_sub(keep);
        buffer.drain(..done);
    }
    // Found in the order of their ends; two at one offset would be one name.
    at.sort_unstable();
    Ok(at)
}

/// The positions of the NUL bytes in `bytes`. Names are long (C++ ones, a hundred bytes
/// and more), so most words of eight bytes hold no NUL and are passed over whole.
pub(super) fn nul_positions(bytes: &[u8]) -> impl Iterator<Item = usize> + '_ {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    bytes
        .chunks(8)
        .enumerate()
        .filter(|(_, word)| match <[u8; 8]>::try_from(*word) {
            // Non-zero exactly when one of the bytes is zero.
            Ok(word) => {
                let word = u64::from_ne_bytes(word);
                word.wrapping_sub(ONES) & !word & HIGHS != 0
            }
            Err(_) => true,
        })
        .flat_map(|(index, word)| {
            word.iter()
                .enumerate()
                .filter(|(_, byte)| **byte == 0)
                .map(move |(at, _)| index * 8 + at)
        })
}
