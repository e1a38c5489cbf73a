//! ELF symbols → file offsets, the unit uprobes attach by.
use std::{collections::HashMap, fs::File, path::Path};

use memmap2::Mmap;
use object::{Object, ObjectSegment, ObjectSymbol};

use crate::error::{LensError, Result};

/// Adds the defined symbols named in `wanted` to `addresses` (first definition wins).
fn collect<'data: 'file, 'file>(
    symbols: impl Iterator<Item = object::Symbol<'data, 'file>>,
    wanted: &[&str],
    addresses: &mut HashMap<String, u64>,
) {
    for symbol in symbols {
        if !symbol.is_definition() || symbol.address() == 0 {
            continue;
        }
        let Ok(name) = symbol.name_bytes() else {
            continue;
        };
        // Compare bytes against the short wanted list: no allocation (and no demangling)
        // per symbol, which matters for libraries with hundreds of thousands of them.
        if let Some(found) = wanted.iter().find(|w| w.as_bytes() == name) {
            addresses
                .entry((*found).to_string())
                .or_insert(symbol.address());
        }
    }
}

/// Where each wanted symbol starts in the file, for the symbols the file defines.
/// Looks at `.dynsym` first, then `.symtab` (local symbols of unstripped libraries).
/// Version suffixes (`@@libcudart.so.12`) are not part of the names matched.
pub fn resolve_file_offsets(path: &Path, wanted: &[&str]) -> Result<HashMap<String, u64>> {
    let elf_error = |reason: String| LensError::Elf {
        path: path.to_path_buf(),
        reason,
    };
    let file = File::open(path).map_err(|e| elf_error(e.to_string()))?;
    // SAFETY: read-only mapping of a library; a concurrent truncation would fault, which
    // is the same risk every debugger and profiler takes on shared libraries.
    let data = unsafe { Mmap::map(&file) }.map_err(|e| elf_error(e.to_string()))?;
    let elf = object::File::parse(&*data).map_err(|e| elf_error(e.to_string()))?;

    let mut addresses: HashMap<String, u64> = HashMap::new();
    collect(elf.dynamic_symbols(), wanted, &mut addresses);
    // The static table is read only when the dynamic one lacks a wanted name: it is the
    // large one (libtorch_cpu: 546 k symbols, 78 MB of names) and the file pages read
    // count in lens-probe's memory while they are mapped.
    if addresses.len() < wanted.len() {
        collect(elf.symbols(), wanted, &mut addresses);
    }

    let mut offsets = HashMap::with_capacity(addresses.len());
    for (name, address) in addresses {
        let offset = elf
            .segments()
            .find_map(|segment| {
                let start = segment.address();
                let (file_start, file_size) = segment.file_range();
                (address >= start && address - start < file_size)
                    .then(|| address - start + file_start)
            })
            .ok_or_else(|| {
                elf_error(format!(
                    "symbol {name} at {address:#x} is in no loadable segment"
                ))
            })?;
        offsets.insert(name, offset);
    }
    Ok(offsets)
}
