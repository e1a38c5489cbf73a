//! Naming code by address: the build-id of a library, and the function symbol that
//! covers a file offset (kernel host stubs, native hang locations).
use super::ElfError;
use std::{collections::HashMap, fs::File, mem, os::unix::fs::FileExt, path::Path};

use object::{
    Endianness, elf,
    read::elf::{FileHeader, Sym},
};

use super::CHUNK;
use super::layout::{Class, Layout, SymbolTable};
use crate::error::{LensError, Result};

/// A library's GNU build-id, if it has one (the key under which what was read of a
/// library is remembered).
pub fn build_id(path: &Path) -> Result<Option<Vec<u8>>> {
    let elf_error = |reason: ElfError| LensError::Elf {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let file = File::open(path).map_err(|e| elf_error(e.to_string().into()))?;
    Ok(Layout::read(&file).map_err(elf_error)?.build_id)
}

/// The names of the functions that hold each of `file_offsets` (places in the file, as a
/// mapping's offset plus the distance into it), found in `.symtab` and `.dynsym`: a
/// function whose symbol starts exactly there, else one whose `[start, start + size)`
/// holds it. Offsets outside every loadable segment or function are left out. The tables
/// are streamed as for [`resolve_symbols`]: memory stays bounded whatever their size.
pub fn functions_at(path: &Path, file_offsets: &[u64]) -> Result<HashMap<u64, String>> {
    let elf_error = |reason: ElfError| LensError::Elf {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let file = File::open(path).map_err(|e| elf_error(e.to_string().into()))?;
    let layout = Layout::read(&file).map_err(elf_error)?;
    // Wanted addresses, sorted, with the file offset each stands for.
    let mut wanted: Vec<(u64, u64)> = file_offsets
        .iter()
        .filter_map(|&offset| {
            layout.loads.iter().find_map(|load| {
                (offset >= load.file_offset && offset - load.file_offset < load.file_size)
                    .then(|| (offset - load.file_offset + load.address, offset))
            })
        })
        .collect();
    wanted.sort_unstable();
    wanted.dedup();
    // address → (exact start, name offset in its string table, which table)
    let mut best: HashMap<u64, (bool, u64, (u64, u64))> = HashMap::new();
    for table in [layout.symtab, layout.dynsym].into_iter().flatten() {
        let scan = match layout.class {
            Class::Elf32 => functions_in::<elf::FileHeader32<Endianness>>,
            Class::Elf64 => functions_in::<elf::FileHeader64<Endianness>>,
        };
        scan(&file, layout.endian, table, &wanted, CHUNK, &mut best).map_err(elf_error)?;
        if wanted
            .iter()
            .all(|(address, _)| best.get(address).is_some_and(|b| b.0))
        {
            break;
        }
    }
    let mut names = HashMap::with_capacity(best.len());
    for (address, (_, name_at, strings)) in best {
        let Some(&(_, offset)) = wanted.iter().find(|(a, _)| *a == address) else {
            continue;
        };
        if let Some(name) = read_name(&file, strings, name_at) {
            names.insert(offset, name);
        }
    }
    Ok(names)
}

/// Adds to `best` the function symbols of `table` that hold a wanted address (an exact
/// start beats an enclosing range; a first find is kept).
pub(super) fn functions_in<Elf: FileHeader<Endian = Endianness>>(
    file: &File,
    endian: Endianness,
    table: SymbolTable,
    wanted: &[(u64, u64)],
    chunk: usize,
    best: &mut HashMap<u64, (bool, u64, (u64, u64))>,
) -> std::result::Result<(), ElfError> {
    let (offset, size) = table.symbols;
    let entry = mem::size_of::<Elf::Sym>();
    let count = size / entry as u64;
    let per_read = (chunk / entry).max(1);
    let mut words = vec![0u64; (per_read.min(count as usize) * entry).div_ceil(8)];
    let mut done = 0u64;
    while done < count {
        let entries = (count - done).min(per_read as u64) as usize;
        let bytes = &mut object::pod::bytes_of_slice_mut(&mut words)[..entries * entry];
        file.read_exact_at(bytes, offset + done * entry as u64)
            .map_err(|e| format!("reading the symbol table: {e}"))?;
        let (symbols, _) = object::pod::slice_from_bytes::<Elf::Sym>(bytes, entries)
            .map_err(|()| "misaligned symbol table buffer".to_string())?;
        for symbol in symbols {
            if symbol.st_type() != elf::STT_FUNC {
                continue;
            }
            let shndx = symbol.st_shndx(endian);
            if shndx == elf::SHN_UNDEF || (shndx >= elf::SHN_LORESERVE && shndx != elf::SHN_XINDEX)
            {
                continue;
            }
            let start: u64 = symbol.st_value(endian).into();
            let length: u64 = symbol.st_size(endian).into();
            let end = start.saturating_add(length.max(1));
            // The wanted addresses in [start, end).
            let first = wanted.partition_point(|(address, _)| *address < start);
            for (address, _) in wanted[first..].iter().take_while(|(a, _)| *a < end) {
                let exact = *address == start;
                let name_at = u64::from(symbol.st_name(endian));
                match best.get(address) {
                    Some((true, _, _)) => {}
                    Some((false, _, _)) if !exact => {}
                    _ => {
                        best.insert(*address, (exact, name_at, table.strings));
                    }
                }
            }
        }
        done += entries as u64;
    }
    Ok(())
}

/// The NUL-terminated name at `at` in the string table at `(offset, size)`, up to 4 KiB.
pub(super) fn read_name(file: &File, (offset, size): (u64, u64), at: u64) -> Option<String> {
    const LIMIT: u64 = 4096;
    if at >= size {
        return None;
    }
    let mut buffer = vec![0u8; (size - at).min(LIMIT) as usize];
    file.read_exact_at(&mut buffer, offset + at).ok()?;
    let end = buffer.iter().position(|b| *b == 0).unwrap_or(buffer.len());
    (end > 0).then(|| String::from_utf8_lossy(&buffer[..end]).into_owned())
}
