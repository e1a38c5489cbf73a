//! PLT stubs: where a library's own calls to an imported function go through. A probe
//! on the stub sees only the calls made from that library, not the function's other
//! callers: `c10::AutogradState::set_tls_state` is called per autograd node by the
//! engine (libtorch_cpu), but from libtorch_python only by the `torch.inference_mode()`
//! guard, so its stub there is the guard's signal at no cost to backward passes.
//!
//! The file is parsed through `object`'s read cache (never mapped, as `symbols` does):
//! only the section headers, `.rela.plt` and the dynamic symbols are read. What a
//! library imports also says what it was built for ([`imports`]).
use std::{collections::HashMap, fs::File, path::Path};

use object::{
    Object, ObjectSection, ObjectSymbol, ObjectSymbolTable, ReadCache, SymbolIndex, elf,
    read::elf::ElfFile64,
};

use crate::error::{LensError, Result};

/// The suffix a probe's symbol carries to mean the stub of that import (`name@plt`).
pub const SUFFIX: &str = "@plt";

/// Size of one x86-64 PLT entry, in `.plt` (after the PLT0 header entry) and `.plt.sec`.
const PLT_ENTRY: u64 = 16;

/// The file offsets of the PLT stubs of the `wanted` imported functions that `path`
/// calls through its PLT (names without [`SUFFIX`]). Lazy-binding layout (`.plt`, entry
/// `i + 1` for relocation `i`) or IBT's (`.plt.sec`, entry `i`).
pub fn stub_offsets(path: &Path, wanted: &[&str]) -> Result<HashMap<String, u64>> {
    with_elf(path, |elf| stubs_in(path, elf, wanted))
}

/// An ELF file read through `object`'s read cache.
type CachedElf<'a> = ElfFile64<'a, object::Endianness, &'a ReadCache<&'a File>>;

fn elf_error(path: &Path, reason: impl ToString) -> LensError {
    LensError::Elf {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Runs `read` on the ELF file at `path`, parsed through a read cache.
fn with_elf<T>(path: &Path, read: impl FnOnce(&CachedElf<'_>) -> Result<T>) -> Result<T> {
    let file = File::open(path).map_err(|e| elf_error(path, e))?;
    let cache = ReadCache::new(&file);
    let elf = ElfFile64::parse(&cache).map_err(|e| elf_error(path, e))?;
    read(&elf)
}

fn stubs_in(path: &Path, elf: &CachedElf<'_>, wanted: &[&str]) -> Result<HashMap<String, u64>> {
    let elf_error = |reason: String| elf_error(path, reason);
    let mut found = HashMap::new();
    let (Some(relocations), Some(symbols)) =
        (elf.section_by_name(".rela.plt"), elf.dynamic_symbol_table())
    else {
        return Ok(found);
    };
    let (stubs, first) = match elf.section_by_name(".plt.sec") {
        Some(section) => (section, 0),
        None => match elf.section_by_name(".plt") {
            Some(section) => (section, 1),
            None => return Ok(found),
        },
    };
    let Some((stubs_offset, stubs_size)) = stubs.file_range() else {
        return Ok(found);
    };
    let data = relocations.data().map_err(|e| elf_error(e.to_string()))?;
    let endian = elf.endian();
    let entries: &[elf::Rela64<object::Endianness>] = object::pod::slice_from_all_bytes(data)
        .map_err(|()| elf_error(".rela.plt is torn".into()))?;
    for (index, rela) in entries.iter().enumerate() {
        let symbol_index = (rela.r_info.get(endian) >> 32) as usize;
        let Ok(symbol) = symbols.symbol_by_index(SymbolIndex(symbol_index)) else {
            continue;
        };
        let Ok(name) = symbol.name() else {
            continue;
        };
        if !wanted.contains(&name) {
            continue;
        }
        let offset = (index as u64 + first) * PLT_ENTRY;
        if offset + PLT_ENTRY <= stubs_size {
            found.insert(name.to_string(), stubs_offset + offset);
        }
    }
    Ok(found)
}

/// Whether `path` imports `name` (an undefined symbol of its `.dynsym`): a Python
/// extension built for a free-threaded CPython imports `_Py_DecRefShared`, which its
/// inlined `Py_DECREF` calls.
pub fn imports(path: &Path, name: &str) -> Result<bool> {
    with_elf(path, |elf| {
        Ok(elf
            .dynamic_symbols()
            .any(|symbol| symbol.is_undefined() && symbol.name() == Ok(name)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small C library calling an import through its PLT: the stub found is where
    /// `objdump` shows `name@plt`.
    #[test]
    fn the_stub_of_an_import_is_where_the_library_calls_it() {
        let dir = std::env::temp_dir().join(format!("lens-plt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let source = dir.join("caller.c");
        std::fs::write(
            &source,
            "extern int imported_one(int); extern int imported_two(int);\n\
             int call_both(int x) { return imported_one(x) + imported_two(x); }\n",
        )
        .unwrap();
        let library = dir.join("libcaller.so");
        let status = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-O1"])
            .arg("-o")
            .arg(&library)
            .arg(&source)
            .status()
            .unwrap();
        assert!(status.success());
        let stubs = stub_offsets(&library, &["imported_two", "absent"]).unwrap();
        let objdump = std::process::Command::new("objdump")
            .args(["-d", "--section=.plt", "--section=.plt.sec"])
            .arg(&library)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&objdump.stdout);
        let line = text
            .lines()
            .find(|l| l.ends_with("<imported_two@plt>:"))
            .unwrap_or_else(|| panic!("{text}"));
        let address = u64::from_str_radix(line.split_whitespace().next().unwrap(), 16).unwrap();
        // A small library's text is mapped at its file offset.
        assert_eq!(stubs.get("imported_two"), Some(&address), "{text}");
        assert_eq!(stubs.len(), 1);
        // What it imports, not what it defines.
        assert!(imports(&library, "imported_one").unwrap());
        assert!(!imports(&library, "call_both").unwrap());
        assert!(!imports(&library, "absent").unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
