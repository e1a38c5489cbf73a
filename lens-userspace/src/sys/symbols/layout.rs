//! Where a library's symbol and string tables lie, read from its headers through a
//! small cache, and the bounded streaming reads of them.
use super::ElfError;
use std::{collections::HashMap, fs::File};

use super::matching::name_offsets;
use super::scan::{Candidate, Versions, scan_symbols};
use super::{Definition, NOTE_LIMIT, Symbol};
use object::{
    Endianness, FileKind, ReadCache, ReadRef, SectionIndex, elf,
    read::elf::{FileHeader, ProgramHeader, SectionHeader},
};

/// A symbol table: where its entries and the names they point into are in the file, as
/// (offset, size).
#[derive(Clone, Copy, Debug)]
pub(super) struct SymbolTable {
    pub(super) symbols: (u64, u64),
    pub(super) strings: (u64, u64),
}

/// A `PT_LOAD` segment: file bytes [file_offset, file_offset + file_size) are loaded at
/// address.
#[derive(Clone, Copy, Debug)]
pub(super) struct Load {
    pub(super) address: u64,
    pub(super) file_offset: u64,
    pub(super) file_size: u64,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Class {
    Elf32,
    Elf64,
}

/// What the headers say: enough to find the symbols and turn addresses into offsets.
#[derive(Debug)]
pub(super) struct Layout {
    pub(super) class: Class,
    pub(super) endian: Endianness,
    pub(super) dynsym: Option<SymbolTable>,
    pub(super) symtab: Option<SymbolTable>,
    /// `.gnu.version`: the version index of each `.dynsym` entry (a `u16` each), as
    /// (offset, size).
    pub(super) versym: Option<(u64, u64)>,
    /// The names of the versions the library defines (`.gnu.version_d`), by index.
    pub(super) version_names: HashMap<u16, String>,
    pub(super) loads: Vec<Load>,
    pub(super) build_id: Option<Vec<u8>>,
}

impl Layout {
    /// Parses the headers, reading only them (the cache is dropped on return).
    pub(super) fn read(file: &File) -> std::result::Result<Layout, ElfError> {
        let cache = ReadCache::new(file);
        match FileKind::parse(&cache).map_err(|e| e.to_string())? {
            FileKind::Elf32 => Layout::parse::<elf::FileHeader32<Endianness>>(&cache, Class::Elf32),
            FileKind::Elf64 => Layout::parse::<elf::FileHeader64<Endianness>>(&cache, Class::Elf64),
            kind => Err(format!("not an ELF file ({kind:?})").into()),
        }
    }

    fn parse<Elf: FileHeader<Endian = Endianness>>(
        data: &ReadCache<&File>,
        class: Class,
    ) -> std::result::Result<Layout, ElfError> {
        let header = Elf::parse(data).map_err(|e| e.to_string())?;
        let endian = header.endian().map_err(|e| e.to_string())?;
        let segments = header
            .program_headers(endian, data)
            .map_err(|e| e.to_string())?;
        let sections = header.sections(endian, data).map_err(|e| e.to_string())?;
        let file_size = data.len().map_err(|()| "unknown file size".to_string())?;

        // As `object::read::elf::SymbolTable::parse`: the first table of the type, its
        // names in the string table its `sh_link` names (none for link 0).
        let table = |sh_type: u32| -> std::result::Result<Option<SymbolTable>, ElfError> {
            let Some((_, section)) = sections
                .enumerate()
                .find(|(_, section)| section.sh_type(endian) == sh_type)
            else {
                return Ok(None);
            };
            let symbols = section.file_range(endian).unwrap_or((0, 0));
            if symbols
                .0
                .checked_add(symbols.1)
                .is_none_or(|end| end > file_size)
            {
                return Err("Invalid ELF symbol table data".to_string().into());
            }
            let link = SectionIndex(section.sh_link(endian) as usize);
            let strings = if link == SectionIndex(0) {
                (0, 0)
            } else {
                let strings = sections.section(link).map_err(|e| e.to_string())?;
                if strings.sh_type(endian) != elf::SHT_STRTAB {
                    return Err("Invalid ELF string section type".to_string().into());
                }
                let range = strings.file_range(endian).unwrap_or((0, 0));
                if range
                    .0
                    .checked_add(range.1)
                    .is_none_or(|end| end > file_size)
                {
                    return Err("Invalid ELF string table data".to_string().into());
                }
                range
            };
            Ok(Some(SymbolTable { symbols, strings }))
        };
        let dynsym = table(elf::SHT_DYNSYM)?;
        let symtab = table(elf::SHT_SYMTAB)?;
        let versym = sections
            .iter()
            .find(|section| section.sh_type(endian) == elf::SHT_GNU_VERSYM)
            .and_then(|section| section.file_range(endian))
            .filter(|(offset, size)| {
                offset
                    .checked_add(*size)
                    .is_some_and(|end| end <= file_size)
            });
        let version_names = Layout::version_names::<Elf>(data, endian, &sections);

        let loads = segments
            .iter()
            .filter(|segment| segment.p_type(endian) == elf::PT_LOAD)
            .map(|segment| Load {
                address: segment.p_vaddr(endian).into(),
                file_offset: segment.p_offset(endian).into(),
                file_size: segment.p_filesz(endian).into(),
            })
            .collect();

        // A library without a (readable) build-id is still resolved, just not remembered.
        let build_id = Layout::build_id::<Elf>(data, endian, segments, &sections);
        Ok(Layout {
            class,
            endian,
            dynsym,
            symtab,
            versym,
            version_names,
            loads,
            build_id,
        })
    }

    /// The names of the versions defined in `.gnu.version_d` (not the library's base
    /// name), by version index. A section larger than [`NOTE_LIMIT`] (a few dozen bytes a
    /// version) or one that does not parse yields none: the symbols are still resolved,
    /// their versions just not named.
    fn version_names<'data, 'file, Elf: FileHeader<Endian = Endianness>>(
        data: &'data ReadCache<&'file File>,
        endian: Endianness,
        sections: &object::read::elf::SectionTable<'data, Elf, &'data ReadCache<&'file File>>,
    ) -> HashMap<u16, String> {
        let mut names = HashMap::new();
        let Some(section) = sections
            .iter()
            .find(|section| section.sh_type(endian) == elf::SHT_GNU_VERDEF)
        else {
            return names;
        };
        if section.sh_size(endian).into() > NOTE_LIMIT {
            return names;
        }
        let Ok(Some((mut verdefs, link))) = section.gnu_verdef(endian, data) else {
            return names;
        };
        let Ok(strings) = sections.strings(endian, data, link) else {
            return names;
        };
        while let Ok(Some((verdef, mut verdauxs))) = verdefs.next() {
            if verdef.vd_flags.get(endian) & elf::VER_FLG_BASE != 0 {
                continue;
            }
            if let Ok(Some(verdaux)) = verdauxs.next()
                && let Ok(name) = verdaux.name(endian, strings)
            {
                names.insert(
                    verdef.vd_ndx.get(endian),
                    String::from_utf8_lossy(name).into_owned(),
                );
            }
        }
        names
    }

    /// The GNU build-id: from `.note.gnu.build-id`, else from any small note section, else
    /// (no section headers) from the `PT_NOTE` segments, as `object` looks for it.
    fn build_id<'data, Elf: FileHeader<Endian = Endianness>>(
        data: &'data ReadCache<&File>,
        endian: Endianness,
        segments: &'data [Elf::ProgramHeader],
        sections: &object::read::elf::SectionTable<'data, Elf, &'data ReadCache<&File>>,
    ) -> Option<Vec<u8>> {
        let from = |notes: object::Result<Option<object::read::elf::NoteIterator<'data, Elf>>>| {
            let mut notes = notes.ok()??;
            while let Ok(Some(note)) = notes.next() {
                if note.name() == elf::ELF_NOTE_GNU && note.n_type(endian) == elf::NT_GNU_BUILD_ID {
                    return Some(note.desc().to_vec());
                }
            }
            None
        };
        if sections.is_empty() {
            return segments
                .iter()
                .filter(|segment| segment.p_filesz(endian).into() <= NOTE_LIMIT)
                .find_map(|segment| from(segment.notes(endian, data)));
        }
        if let Some((_, section)) = sections.section_by_name(endian, b".note.gnu.build-id")
            && let Some(id) = from(section.notes(endian, data))
        {
            return Some(id);
        }
        sections
            .iter()
            .filter(|section| section.sh_size(endian).into() <= NOTE_LIMIT)
            .find_map(|section| from(section.notes(endian, data)))
    }

    /// The symbol tables in the order they are read, each with its version table: the
    /// dynamic one first (the only one with versions), then the static one, the large one.
    pub(super) fn tables(&self) -> impl Iterator<Item = (SymbolTable, Option<(u64, u64)>)> {
        [
            self.dynsym.map(|table| (table, self.versym)),
            self.symtab.map(|table| (table, None)),
        ]
        .into_iter()
        .flatten()
    }

    /// Scans `table` for the entries whose names start at the string offsets `at`
    /// (offset, index into `names`), as `scan_symbols` does, for this file's class.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn scan_table<'a>(
        &self,
        file: &File,
        table: SymbolTable,
        versym: Option<(u64, u64)>,
        at: &[(u64, usize)],
        names: &[&'a str],
        chunk: usize,
        found: &mut HashMap<&'a str, Candidate>,
    ) -> std::result::Result<(), ElfError> {
        let scan = match self.class {
            Class::Elf32 => scan_symbols::<elf::FileHeader32<Endianness>>,
            Class::Elf64 => scan_symbols::<elf::FileHeader64<Endianness>>,
        };
        let versions = Versions {
            versym,
            // Without version definitions a name is defined once: the scan may stop at
            // the last name found.
            defined: !self.version_names.is_empty(),
        };
        scan(
            file,
            self.endian,
            table.symbols,
            versions,
            at,
            names,
            chunk,
            found,
        )
    }

    /// The definitions of the symbols named `names` (sorted, unique) that the library
    /// defines, reading the tables `chunk` bytes at a time.
    pub(super) fn definitions(
        &self,
        file: &File,
        names: &[&str],
        chunk: usize,
    ) -> std::result::Result<HashMap<String, Definition>, ElfError> {
        let mut found: HashMap<&str, Candidate> = HashMap::with_capacity(names.len());
        // The static table is read only when the dynamic one lacks a wanted name.
        for (table, versym) in self.tables() {
            let missing: Vec<&str> = names
                .iter()
                .copied()
                .filter(|name| !found.contains_key(name))
                .collect();
            if missing.is_empty() {
                break;
            }
            let at = name_offsets(file, table.strings, &missing, chunk)?;
            if at.is_empty() {
                continue;
            }
            self.scan_table(file, table, versym, &at, &missing, chunk, &mut found)?;
        }

        let version_name = |index: u16| self.version_names.get(&index).cloned();
        Ok(found
            .into_iter()
            .map(|(name, candidate)| {
                let definition = Definition {
                    address: candidate.address,
                    version: candidate.version.and_then(version_name),
                    other_versions: candidate
                        .other_versions
                        .into_iter()
                        .filter_map(version_name)
                        .collect(),
                };
                (name.to_string(), definition)
            })
            .collect())
    }

    /// Symbol definitions → file offsets, through the `PT_LOAD` segment holding each.
    pub(super) fn file_offsets(
        &self,
        definitions: HashMap<String, Definition>,
    ) -> std::result::Result<HashMap<String, Symbol>, ElfError> {
        let mut offsets = HashMap::with_capacity(definitions.len());
        for (name, definition) in definitions {
            let address = definition.address;
            let offset = self
                .loads
                .iter()
                .find_map(|load| {
                    (address >= load.address && address - load.address < load.file_size)
                        .then(|| address - load.address + load.file_offset)
                })
                .ok_or_else(|| {
                    format!("symbol {name} at {address:#x} is in no loadable segment")
                })?;
            let symbol = Symbol {
                offset,
                version: definition.version,
                other_versions: definition.other_versions,
            };
            offsets.insert(name, symbol);
        }
        Ok(offsets)
    }
}
