//! One pass over a symbol table for the names wanted: definitions only, the default
//! version of a versioned name chosen.
use super::ElfError;
use std::{collections::HashMap, fs::File, mem, os::unix::fs::FileExt};

use object::{
    Endian, Endianness, elf,
    read::elf::{FileHeader, Sym},
};

/// A definition found for a wanted name while scanning.
#[derive(Debug)]
pub(super) struct Candidate {
    pub(super) address: u64,
    /// Its version index (`.gnu.version`, without the hidden bit), when above 1: a
    /// version the library defines.
    pub(super) version: Option<u16>,
    /// Whether it is a hidden, non-default version (`name@V`, not `name@@V`).
    pub(super) hidden: bool,
    /// The version indexes of the name's other definitions, not chosen.
    pub(super) other_versions: Vec<u16>,
    /// A function (`STT_FUNC`), not data, an IFUNC resolver or an untyped symbol.
    pub(super) function: bool,
}

/// What a symbol table's scan knows of versions.
#[derive(Clone, Copy, Debug)]
pub(super) struct Versions {
    /// The table's `.gnu.version`, as (offset, size): for `.dynsym` only.
    pub(super) versym: Option<(u64, u64)>,
    /// Whether the library defines versions, so that a name may have several definitions.
    pub(super) defined: bool,
}

/// The version index of symbol `index` (`.gnu.version` at `versym`), with the hidden bit;
/// 1 (global, unversioned) when there is none.
pub(super) fn version_of(
    file: &File,
    endian: Endianness,
    versym: Option<(u64, u64)>,
    index: u64,
) -> u16 {
    let Some((offset, size)) = versym else {
        return elf::VER_NDX_GLOBAL;
    };
    let mut entry = [0u8; 2];
    if index.saturating_mul(2).saturating_add(2) > size
        || file.read_exact_at(&mut entry, offset + index * 2).is_err()
    {
        return elf::VER_NDX_GLOBAL;
    }
    endian.read_u16(entry)
}

/// Adds to `found` each symbol of the table at `(offset, size)` whose name is at one of
/// the string table offsets `at` (the names' indexes in `names`), if it is a definition
/// with a non-zero address: of several, the default version's (not hidden), else the
/// first.
#[allow(clippy::too_many_arguments)]
pub(super) fn scan_symbols<'a, Elf: FileHeader<Endian = Endianness>>(
    file: &File,
    endian: Endianness,
    (offset, size): (u64, u64),
    versions: Versions,
    at: &[(u64, usize)],
    names: &[&'a str],
    chunk: usize,
    found: &mut HashMap<&'a str, Candidate>,
) -> std::result::Result<(), ElfError> {
    let entry = mem::size_of::<Elf::Sym>();
    // As `object`: a trailing partial entry is ignored.
    let count = size / entry as u64;
    let per_read = (chunk / entry).max(1);
    // u64 words: the entries read in place need their alignment.
    let mut words = vec![0u64; (per_read.min(count as usize) * entry).div_ceil(8)];
    // Names with a definition that no later one can replace.
    let mut settled = 0;
    let mut done = 0u64;
    while done < count && (versions.defined || settled < names.len()) {
        let entries = (count - done).min(per_read as u64) as usize;
        let bytes = &mut object::pod::bytes_of_slice_mut(&mut words)[..entries * entry];
        file.read_exact_at(bytes, offset + done * entry as u64)
            .map_err(|e| format!("reading the symbol table: {e}"))?;
        let (symbols, _) = object::pod::slice_from_bytes::<Elf::Sym>(bytes, entries)
            .map_err(|()| "misaligned symbol table buffer".to_string())?;
        for (symbol_index, symbol) in (done..).zip(symbols) {
            let st_name = u64::from(symbol.st_name(endian));
            let Ok(found_at) = at.binary_search_by_key(&st_name, |(offset, _)| *offset) else {
                continue;
            };
            let index = at[found_at].1;
            let name = names[index];
            let address: u64 = symbol.st_value(endian).into();
            if address == 0 || !is_definition::<Elf>(symbol, endian, name) {
                continue;
            }
            let raw = version_of(file, endian, versions.versym, symbol_index);
            let hidden = raw & elf::VERSYM_HIDDEN != 0;
            let version = Some(raw & elf::VERSYM_VERSION).filter(|v| *v > elf::VER_NDX_GLOBAL);
            match found.get_mut(name) {
                None => {
                    found.insert(
                        name,
                        Candidate {
                            address,
                            version,
                            hidden,
                            other_versions: Vec::new(),
                            function: symbol.st_type() == elf::STT_FUNC,
                        },
                    );
                    if !hidden {
                        settled += 1;
                    }
                }
                // The default version comes after a hidden one: it is chosen.
                Some(chosen) if chosen.hidden && !hidden => {
                    chosen.other_versions.extend(chosen.version);
                    chosen.address = address;
                    chosen.version = version;
                    chosen.hidden = false;
                    chosen.function = symbol.st_type() == elf::STT_FUNC;
                    settled += 1;
                }
                Some(chosen) => chosen.other_versions.extend(version),
            }
        }
        done += entries as u64;
    }
    Ok(())
}

/// `object`'s `Sym::is_definition`, given the name: a symbol in a section (or one named
/// through `SHT_SYMTAB_SHNDX`) that is a function, an object or untyped, except the local
/// untyped mapping symbols (`$x`, `$d`).
pub(super) fn is_definition<Elf: FileHeader<Endian = Endianness>>(
    symbol: &Elf::Sym,
    endian: Endianness,
    name: &str,
) -> bool {
    let shndx = symbol.st_shndx(endian);
    if shndx == elf::SHN_UNDEF || (shndx >= elf::SHN_LORESERVE && shndx != elf::SHN_XINDEX) {
        return false;
    }
    match symbol.st_type() {
        elf::STT_NOTYPE if symbol.st_bind() == elf::STB_LOCAL => !name.starts_with('$'),
        elf::STT_FUNC | elf::STT_OBJECT | elf::STT_NOTYPE => true,
        _ => false,
    }
}
