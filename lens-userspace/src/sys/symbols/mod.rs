//! ELF symbols → file offsets, the unit uprobes attach by.
//!
//! The libraries probed can be large (libtorch_cpu.so: ~450 MB, 546 k static symbols,
//! 78 MB of names), and every page of a mapped file that is read counts in lens-probe's
//! memory. So the file is never mapped: `object` parses the headers (ELF, program and
//! section headers, notes) through a small read cache, and the symbol and string tables
//! are streamed through bounded buffers with `pread`: the string table once, to find
//! where the wanted names are, then the symbol table once, for the symbols naming them.
//!
//! A versioned library may define a name more than once (`ncclAllReduce@@NCCL_2.0`, the
//! default, and an old `ncclAllReduce@NCCL_1.0`): the default definition is the one an
//! unversioned `dlsym` and newly linked programs get, so it is the one chosen, whatever
//! the order of the table; the others are named in the result.
use std::{
    collections::HashMap,
    fs::File,
    path::Path,
    sync::{Mutex, PoisonError},
};

use crate::error::{LensError, Result};
use crate::patterns::SymbolPattern;

mod functions;
mod layout;
mod matching;
mod scan;

pub use functions::{build_id, functions_at};
use layout::Layout;
pub use matching::{Matches, resolve_matching};

crate::error::reason_error! {
    /// What is wrong with a library's ELF headers or tables, for [`LensError::Elf`].
    pub(crate) struct ElfError;
}

/// How much of a symbol or string table is read at a time.
const CHUNK: usize = 1 << 20;

/// Note sections and segments larger than this are not searched for a build-id (it sits
/// in a note of its own, a few dozen bytes).
const NOTE_LIMIT: u64 = 64 << 10;

/// How many (library, wanted names) results the build-id memo holds before it is cleared.
const MEMO_CAPACITY: usize = 64;

/// A wanted symbol the library defines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Symbol {
    /// Where it starts in the file: the offset uprobes attach at.
    pub offset: u64,
    /// The version of the definition chosen, in a library that versions its symbols
    /// (`NCCL_2.0` for `ncclAllReduce@@NCCL_2.0`): the default one.
    pub version: Option<String>,
    /// The versions of the name's other definitions (`NCCL_1.0` for
    /// `ncclAllReduce@NCCL_1.0`), kept for programs linked against them; not chosen.
    pub other_versions: Vec<String>,
}

/// What a library defines of the wanted names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Symbols {
    /// The wanted names the library defines; the others are missing.
    pub found: HashMap<String, Symbol>,
    /// Whether the library has a static symbol table (`.symtab`) to find local symbols
    /// in: false for a stripped one, where only its exports (`.dynsym`) can be found.
    pub has_static_symbols: bool,
}

impl Symbols {
    /// The file offset of each symbol found.
    pub fn offsets(&self) -> HashMap<String, u64> {
        self.found
            .iter()
            .map(|(name, symbol)| (name.clone(), symbol.offset))
            .collect()
    }
}

/// Where each wanted symbol starts in the file, for the symbols the file defines.
/// Looks at `.dynsym` first, then `.symtab` (local symbols of unstripped libraries) when
/// a wanted name is still missing. Version suffixes (`@@libcudart.so.12`) are not part
/// of the names matched: of several definitions of a name in `.dynsym`, the default
/// version's is chosen (the one that is not hidden; a hidden one only when it is all
/// there is, as the dynamic loader does), otherwise the first definition of a name wins.
///
/// The symbols' addresses are remembered per GNU build-id, so the same library seen
/// through different files (containers, node mode) is scanned once.
///
/// A name ending in [`super::plt::SUFFIX`] (`name@plt`) is the library's PLT stub for
/// the import `name` (see `sys::plt`); a name with `*` is a glob (Rust names end in a
/// hash of the build), of which the first match (by name) is taken.
pub fn resolve_symbols(path: &Path, wanted: &[&str]) -> Result<Symbols> {
    static MEMO: Memo = Mutex::new(None);
    let (stubs, names): (Vec<&str>, Vec<&str>) = wanted
        .iter()
        .partition(|name| name.ends_with(super::plt::SUFFIX));
    let (globs, plain): (Vec<&str>, Vec<&str>) = names.iter().partition(|name| name.contains('*'));
    let mut symbols = resolve(path, &plain, CHUNK, Some(&MEMO))?;
    if !globs.is_empty() {
        let patterns: Vec<SymbolPattern> = globs.iter().map(|g| SymbolPattern::new(g)).collect();
        let pattern_refs: Vec<&SymbolPattern> = patterns.iter().collect();
        let matches = resolve_matching(path, &pattern_refs, &vec![1; globs.len()])?;
        for (glob, found) in globs.iter().zip(matches.found) {
            if let Some((_, symbol)) = found.into_iter().next() {
                symbols.found.insert(glob.to_string(), symbol);
            }
        }
    }
    if !stubs.is_empty() {
        let imports: Vec<&str> = stubs
            .iter()
            .map(|name| name.trim_end_matches(super::plt::SUFFIX))
            .collect();
        for (name, offset) in super::plt::stub_offsets(path, &imports)? {
            symbols.found.insert(
                format!("{name}{}", super::plt::SUFFIX),
                Symbol {
                    offset,
                    version: None,
                    other_versions: Vec::new(),
                },
            );
        }
    }
    Ok(symbols)
}

/// [`resolve_symbols`], offsets only.
pub fn resolve_file_offsets(path: &Path, wanted: &[&str]) -> Result<HashMap<String, u64>> {
    Ok(resolve_symbols(path, wanted)?.offsets())
}

/// What the symbols' addresses depend on: the library's contents (its build-id, and the
/// sizes of its symbol tables, which tell a stripped copy from the unstripped one) and
/// the names. Addresses, not file offsets, are remembered: tools that keep the build-id
/// (patchelf) may move a library's segments in the file, never its symbols in memory.
#[derive(PartialEq, Eq, Hash)]
struct MemoKey {
    build_id: Vec<u8>,
    table_sizes: [u64; 2],
    names: Vec<String>,
}

/// A definition chosen for a wanted name: its address and versions.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Definition {
    address: u64,
    version: Option<String>,
    other_versions: Vec<String>,
}

/// Symbol definitions by build-id and names, up to [`MEMO_CAPACITY`] entries.
type Memo = Mutex<Option<HashMap<MemoKey, HashMap<String, Definition>>>>;

/// [`resolve_symbols`], reading the tables `chunk` bytes at a time, with the memo
/// or without.
fn resolve(path: &Path, wanted: &[&str], chunk: usize, memo: Option<&Memo>) -> Result<Symbols> {
    let elf_error = |reason: ElfError| LensError::Elf {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let file = File::open(path).map_err(|e| elf_error(e.to_string().into()))?;
    let layout = Layout::read(&file).map_err(elf_error)?;
    let names = wanted_names(wanted);

    let key = memo.and(layout.build_id.as_ref()).map(|build_id| MemoKey {
        build_id: build_id.clone(),
        table_sizes: [&layout.dynsym, &layout.symtab]
            .map(|table| table.as_ref().map_or(0, |t| t.symbols.1)),
        names: names.iter().map(|name| name.to_string()).collect(),
    });
    let remembered = memo.zip(key.as_ref()).and_then(|(memo, key)| {
        let memo = memo.lock().unwrap_or_else(PoisonError::into_inner);
        memo.as_ref()?.get(key).cloned()
    });
    let definitions = match remembered {
        Some(definitions) => definitions,
        None => {
            let definitions = layout
                .definitions(&file, &names, chunk)
                .map_err(elf_error)?;
            if let Some((memo, key)) = memo.zip(key) {
                let mut memo = memo.lock().unwrap_or_else(PoisonError::into_inner);
                let memo = memo.get_or_insert_with(HashMap::new);
                if memo.len() >= MEMO_CAPACITY {
                    memo.clear();
                }
                memo.insert(key, definitions.clone());
            }
            definitions
        }
    };
    Ok(Symbols {
        found: layout.file_offsets(definitions).map_err(elf_error)?,
        has_static_symbols: layout.symtab.is_some(),
    })
}

/// The wanted names, sorted and without duplicates. A name that is empty or holds a NUL
/// is no symbol's name.
fn wanted_names<'a>(wanted: &[&'a str]) -> Vec<&'a str> {
    let mut names: Vec<&str> = wanted
        .iter()
        .copied()
        .filter(|name| !name.is_empty() && !name.contains('\0'))
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use object::elf;

    use super::matching::*;
    use std::{
        fs,
        path::PathBuf,
        process::Command,
        time::{Duration, Instant},
    };

    use memmap2::Mmap;
    use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};

    use super::*;

    /// A library with symbols in both tables: exported ones (`.dynsym` and `.symtab`),
    /// local ones (`.symtab` only), and names that are tails of other names.
    const SOURCE: &str = r#"
        int lens_dynamic(int a) { return a + 1; }
        static __attribute__((noinline, used)) int lens_static_only(int a) { return a * 3; }
        int lens_calls_static(int a) { return lens_static_only(a) + 1; }
        /* lens_tail is only ever the end of a longer name. */
        int xlens_tail(int a) { return a + 4; }
        static __attribute__((noinline, used)) int xlens_static_tail(int a) { return a + 5; }
        int lens_calls_static_tail(int a) { return xlens_static_tail(a) + 1; }
        /* lens_shared is a name of its own, which GNU ld stores as the tail of xlens_shared. */
        int xlens_shared(int a) { return a + 6; }
        int lens_shared(int a) { return a + 7; }
    "#;

    const WANTED: &[&str] = &[
        "lens_dynamic",
        "lens_static_only",
        "lens_tail",
        "lens_static_tail",
        "lens_shared",
        "xlens_shared",
        "lens_missing",
        "lens_dynamic",
        "",
    ];

    /// A fresh directory, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let path = std::env::temp_dir()
                .join(format!("lens-probe-symbols-{}-{name}", std::process::id()));
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).unwrap();
            Dir(path)
        }

        /// Compiles `source` into a shared library named `name`.
        fn library(&self, name: &str, source: &str, flags: &[&str]) -> PathBuf {
            let c = self.0.join(format!("{name}.c"));
            fs::write(&c, source).unwrap();
            let library = self.0.join(name);
            let out = Command::new("cc")
                .args(["-shared", "-fPIC", "-O1", "-fno-inline"])
                .args(flags)
                .arg("-o")
                .arg(&library)
                .arg(&c)
                .output()
                .expect("a C compiler (cc) to build the test library");
            assert!(
                out.status.success(),
                "cc failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            library
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// The implementation this module replaced: the whole file mapped, `object` walking
    /// its symbols.
    fn with_object(path: &Path, wanted: &[&str]) -> HashMap<String, u64> {
        let file = File::open(path).unwrap();
        // SAFETY: a read-only mapping of a library nobody writes meanwhile.
        let data = unsafe { Mmap::map(&file) }.unwrap();
        let elf = object::File::parse(&*data).unwrap();
        let mut addresses: HashMap<String, u64> = HashMap::new();
        let collect = |symbols: &mut dyn Iterator<Item = object::Symbol<'_, '_>>,
                       addresses: &mut HashMap<String, u64>| {
            for symbol in symbols {
                if !symbol.is_definition() || symbol.address() == 0 {
                    continue;
                }
                let Ok(name) = symbol.name_bytes() else {
                    continue;
                };
                if let Some(found) = wanted.iter().find(|w| w.as_bytes() == name) {
                    addresses
                        .entry((*found).to_string())
                        .or_insert(symbol.address());
                }
            }
        };
        collect(&mut elf.dynamic_symbols(), &mut addresses);
        if addresses.len() < wanted.len() {
            collect(&mut elf.symbols(), &mut addresses);
        }
        addresses
            .into_iter()
            .map(|(name, address)| {
                let offset = elf
                    .segments()
                    .find_map(|segment| {
                        let start = segment.address();
                        let (file_start, file_size) = segment.file_range();
                        (address >= start && address - start < file_size)
                            .then(|| address - start + file_start)
                    })
                    .unwrap();
                (name, offset)
            })
            .collect()
    }

    /// A copy of `library` at `copy` with its string tables zeroed (no symbol names, the
    /// same build-id) and its `PT_LOAD` segments said to start `shift` bytes further into
    /// the file (a 64-bit little-endian library).
    fn copy_without_names(library: &Path, copy: &Path, shift: u64) {
        let mut bytes = fs::read(library).unwrap();
        let field = |bytes: &[u8], at: usize, size: usize| {
            let mut word = [0; 8];
            word[..size].copy_from_slice(&bytes[at..at + size]);
            u64::from_le_bytes(word) as usize
        };
        let (phoff, phentsize, phnum) = (
            field(&bytes, 32, 8),
            field(&bytes, 54, 2),
            field(&bytes, 56, 2),
        );
        for header in (0..phnum).map(|i| phoff + i * phentsize) {
            if field(&bytes, header, 4) == elf::PT_LOAD as usize {
                let offset = field(&bytes, header + 8, 8) as u64 + shift;
                bytes[header + 8..header + 16].copy_from_slice(&offset.to_le_bytes());
            }
        }
        let ranges: Vec<(u64, u64)> = {
            let elf = object::File::parse(&*bytes).unwrap();
            [".dynstr", ".strtab"]
                .iter()
                .filter_map(|name| elf.section_by_name(name)?.file_range())
                .collect()
        };
        assert_eq!(
            ranges.len(),
            2,
            "{} has both string tables",
            library.display()
        );
        for (start, size) in ranges {
            bytes[start as usize..(start + size) as usize].fill(0);
        }
        fs::write(copy, bytes).unwrap();
    }

    fn new_memo() -> Memo {
        Mutex::new(None)
    }

    /// [`resolve`], offsets only.
    fn resolve_offsets(
        path: &Path,
        wanted: &[&str],
        chunk: usize,
        memo: Option<&Memo>,
    ) -> Result<HashMap<String, u64>> {
        resolve(path, wanted, chunk, memo).map(|symbols| symbols.offsets())
    }

    /// A library with symbol versions: `lens_versioned@@LENS_2.0` (the default) and an
    /// old `lens_versioned@LENS_1.0` of its own body, and an unversioned-looking
    /// `lens_plain@@LENS_2.0`.
    const VERSIONED: &str = r#"
        int lens_versioned(int a) { return a + 1; }
        int lens_old_versioned(int a) { return a + 2; }
        __asm__(".symver lens_old_versioned, lens_versioned@LENS_1.0");
        int lens_plain(int a) { return a + 3; }
    "#;

    const VERSION_SCRIPT: &str = "LENS_1.0 { };
        LENS_2.0 { global: lens_versioned; lens_plain; local: *; } LENS_1.0;";

    fn versioned_library(dir: &Dir) -> PathBuf {
        let script = dir.0.join("versions.map");
        fs::write(&script, VERSION_SCRIPT).unwrap();
        let flag = format!("-Wl,--version-script={}", script.display());
        dir.library("libversioned.so", VERSIONED, &[&flag])
    }

    /// A copy of `library` with `.dynsym` entries `a` and `b` swapped, and their
    /// `.gnu.version` entries with them (a 64-bit library).
    fn swap_dynamic_symbols(library: &Path, copy: &Path, a: usize, b: usize) {
        let mut bytes = fs::read(library).unwrap();
        let (dynsym, versym) = {
            let elf = object::File::parse(&*bytes).unwrap();
            let range = |name| elf.section_by_name(name).unwrap().file_range().unwrap();
            (range(".dynsym"), range(".gnu.version"))
        };
        for ((start, _), size) in [(dynsym, 24), (versym, 2)] {
            let (x, y) = (start as usize + a * size, start as usize + b * size);
            let first = bytes[x..x + size].to_vec();
            bytes.copy_within(y..y + size, x);
            bytes[y..y + size].copy_from_slice(&first);
        }
        fs::write(copy, bytes).unwrap();
    }

    /// The `.dynsym` indexes of the definitions named `name` (any version).
    fn dynamic_indexes(library: &Path, name: &str) -> Vec<usize> {
        let bytes = fs::read(library).unwrap();
        let elf = object::File::parse(&*bytes).unwrap();
        elf.dynamic_symbols()
            .filter(|symbol| symbol.name() == Ok(name) && symbol.is_definition())
            .map(|symbol| symbol.index().0)
            .collect()
    }

    #[test]
    fn the_default_version_is_chosen_in_any_order_and_the_others_named() {
        let dir = Dir::new("versions");
        let library = versioned_library(&dir);
        // The old body, by its own (local) name.
        let old = resolve_offsets(&library, &["lens_old_versioned"], 7, None).unwrap();
        let old = old["lens_old_versioned"];
        let indexes = dynamic_indexes(&library, "lens_versioned");
        assert_eq!(indexes.len(), 2, "two definitions of lens_versioned");
        let swapped = dir.0.join("libswapped.so");
        swap_dynamic_symbols(&library, &swapped, indexes[0], indexes[1]);
        for path in [&library, &swapped] {
            for chunk in [7, CHUNK] {
                let symbols =
                    resolve(path, &["lens_versioned", "lens_plain"], chunk, None).unwrap();
                let versioned = &symbols.found["lens_versioned"];
                assert_ne!(versioned.offset, old, "{}: the old version", path.display());
                assert_eq!(versioned.version.as_deref(), Some("LENS_2.0"));
                assert_eq!(versioned.other_versions, ["LENS_1.0"]);
                let plain = &symbols.found["lens_plain"];
                assert_eq!(plain.version.as_deref(), Some("LENS_2.0"));
                assert!(plain.other_versions.is_empty());
            }
        }
        let a = resolve_offsets(&library, &["lens_versioned"], 7, None).unwrap();
        let b = resolve_offsets(&swapped, &["lens_versioned"], 7, None).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn a_hidden_version_alone_is_chosen() {
        let dir = Dir::new("hidden-only");
        let script = dir.0.join("versions.map");
        fs::write(
            &script,
            "LENS_1.0 { }; LENS_2.0 { global: lens_plain; local: *; } LENS_1.0;",
        )
        .unwrap();
        let flag = format!("-Wl,--version-script={}", script.display());
        let source = r#"
            int lens_old_versioned(int a) { return a + 2; }
            __asm__(".symver lens_old_versioned, lens_versioned@LENS_1.0");
            int lens_plain(int a) { return a + 3; }
        "#;
        let library = dir.library("libhidden.so", source, &["-s", &flag]);
        let symbols = resolve(&library, &["lens_versioned"], CHUNK, None).unwrap();
        let symbol = &symbols.found["lens_versioned"];
        assert_eq!(symbol.version.as_deref(), Some("LENS_1.0"));
        assert!(symbol.other_versions.is_empty());
    }

    #[test]
    fn unversioned_symbols_have_no_version_and_stripped_libraries_say_so() {
        let dir = Dir::new("unversioned");
        let library = dir.library("libboth.so", SOURCE, &[]);
        let symbols = resolve(&library, &["lens_dynamic"], CHUNK, None).unwrap();
        assert_eq!(symbols.found["lens_dynamic"].version, None);
        assert!(symbols.has_static_symbols);
        let stripped = dir.library("libstripped.so", SOURCE, &["-s"]);
        let symbols = resolve(&stripped, &["lens_dynamic"], CHUNK, None).unwrap();
        assert!(!symbols.has_static_symbols);
        assert!(symbols.found.contains_key("lens_dynamic"));
    }

    #[test]
    fn offsets_are_the_ones_object_finds_for_any_chunk_size() {
        let dir = Dir::new("chunks");
        let library = dir.library("libboth.so", SOURCE, &[]);
        let expected = with_object(&library, WANTED);
        // 7 bytes: every name here straddles reads; 1: the extreme.
        for chunk in [1, 2, 3, 7, 13, 64, 4096, CHUNK] {
            let offsets = resolve_offsets(&library, WANTED, chunk, None).unwrap();
            assert_eq!(offsets, expected, "chunk of {chunk} bytes");
        }
    }

    #[test]
    fn a_dynamic_symbol_resolves() {
        let dir = Dir::new("dynamic");
        let library = dir.library("libboth.so", SOURCE, &[]);
        let offsets = resolve_offsets(&library, &["lens_dynamic"], 7, None).unwrap();
        let expected = with_object(&library, &["lens_dynamic"]);
        assert!(expected.contains_key("lens_dynamic"));
        assert_eq!(offsets, expected);
    }

    #[test]
    fn a_static_only_symbol_resolves_from_symtab() {
        let dir = Dir::new("static");
        let library = dir.library("libboth.so", SOURCE, &[]);
        let offsets =
            resolve_offsets(&library, &["lens_static_only", "lens_dynamic"], 7, None).unwrap();
        let expected = with_object(&library, &["lens_static_only", "lens_dynamic"]);
        assert!(expected.contains_key("lens_static_only"));
        assert_eq!(offsets, expected);
        // Stripped of .symtab, only the exported one is left.
        let stripped = dir.library("libstripped.so", SOURCE, &["-s"]);
        let offsets =
            resolve_offsets(&stripped, &["lens_static_only", "lens_dynamic"], 7, None).unwrap();
        assert_eq!(offsets.keys().collect::<Vec<_>>(), ["lens_dynamic"]);
    }

    #[test]
    fn a_missing_name_is_left_out() {
        let dir = Dir::new("missing");
        let library = dir.library("libboth.so", SOURCE, &[]);
        let offsets = resolve_offsets(&library, &["lens_missing", ""], 7, None).unwrap();
        assert!(offsets.is_empty(), "{offsets:?}");
    }

    #[test]
    fn a_name_is_not_found_as_the_tail_of_a_longer_one() {
        let dir = Dir::new("tails");
        let library = dir.library("libboth.so", SOURCE, &[]);
        let wanted = [
            "lens_tail",
            "lens_static_tail",
            "lens_shared",
            "xlens_shared",
        ];
        let offsets = resolve_offsets(&library, &wanted, 7, None).unwrap();
        assert_eq!(offsets, with_object(&library, &wanted));
        assert!(!offsets.contains_key("lens_tail"));
        assert!(!offsets.contains_key("lens_static_tail"));
        // A name of its own stored as another's tail is found, at its own symbol.
        assert_ne!(offsets["lens_shared"], offsets["xlens_shared"]);
    }

    #[test]
    fn patterns_find_dynamic_and_local_symbols_for_any_chunk_size() {
        let dir = Dir::new("patterns");
        let library = dir.library("libboth.so", SOURCE, &[]);
        let glob = SymbolPattern::new("lens_*tail");
        let statics = SymbolPattern::new("lens_static_*");
        let none = SymbolPattern::new("nothing_*");
        let expected = with_object(&library, &["lens_calls_static_tail", "lens_static_only"]);
        for chunk in [1, 7, 64, CHUNK] {
            let matches =
                resolve_matching_chunked(&library, &[&glob, &statics, &none], &[8, 8, 8], chunk)
                    .unwrap();
            let names = |i: usize| -> Vec<&str> {
                matches.found[i]
                    .iter()
                    .map(|(name, _)| name.as_str())
                    .collect()
            };
            // `lens_tail` is only ever the tail of `xlens_tail`: no symbol of that name.
            assert_eq!(names(0), ["lens_calls_static_tail"], "chunk {chunk}");
            assert_eq!(names(1), ["lens_static_only"], "chunk {chunk}");
            assert!(names(2).is_empty());
            assert_eq!(matches.capped, [false, false, false]);
            assert_eq!(
                matches.found[1][0].1.offset, expected["lens_static_only"],
                "chunk {chunk}"
            );
        }
        // A name of its own stored as another's tail is found through the anchor.
        let shared = SymbolPattern::new("lens_sha*");
        let matches = resolve_matching_chunked(&library, &[&shared], &[8], 7).unwrap();
        let offsets = with_object(&library, &["lens_shared"]);
        assert_eq!(matches.found[0].len(), 1);
        assert_eq!(matches.found[0][0].1.offset, offsets["lens_shared"]);
        // Capped: the first names, sorted, and the cap said.
        let all = SymbolPattern::new("*lens_*");
        let matches = resolve_matching_chunked(&library, &[&all], &[2], CHUNK).unwrap();
        assert_eq!(matches.found[0].len(), 2);
        assert_eq!(matches.capped, [true]);
        // Functions only: data a glob catches is no place for a uprobe.
        let data = dir.library(
            "libdata.so",
            "int lens_rule_table[8] = {1}; int lens_rule_fn(int a) { return a + lens_rule_table[a & 7]; }",
            &[],
        );
        let glob = SymbolPattern::new("lens_rule_*");
        let matches = resolve_matching_chunked(&data, &[&glob], &[8], CHUNK).unwrap();
        let names: Vec<&str> = matches.found[0].iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["lens_rule_fn"]);
    }

    #[test]
    fn the_memo_answers_for_a_copy_with_the_same_build_id() {
        let dir = Dir::new("memo");
        let library = dir.library("libboth.so", SOURCE, &["-Wl,--build-id=sha1"]);
        let copy = dir.0.join("libcopy.so");
        copy_without_names(&library, &copy, 0x1000);
        let memo = new_memo();
        let offsets = resolve_offsets(&library, WANTED, CHUNK, Some(&memo)).unwrap();
        assert!(!offsets.is_empty());
        assert!(
            resolve_offsets(&copy, WANTED, CHUNK, None)
                .unwrap()
                .is_empty()
        );
        // Same build-id and table sizes, same names (in any order): not scanned again, and
        // the offsets are the copy's own.
        let mut reordered = WANTED.to_vec();
        reordered.reverse();
        let shifted: HashMap<String, u64> = offsets
            .iter()
            .map(|(name, offset)| (name.clone(), offset + 0x1000))
            .collect();
        assert_eq!(
            resolve_offsets(&copy, &reordered, CHUNK, Some(&memo)).unwrap(),
            shifted
        );
        // Other names are another question.
        assert!(
            resolve_offsets(&copy, &["lens_dynamic"], CHUNK, Some(&memo))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_library_without_build_id_is_not_remembered() {
        let dir = Dir::new("no-build-id");
        let library = dir.library("libboth.so", SOURCE, &["-Wl,--build-id=none"]);
        let copy = dir.0.join("libcopy.so");
        copy_without_names(&library, &copy, 0);
        let memo = new_memo();
        assert!(
            !resolve_offsets(&library, WANTED, CHUNK, Some(&memo))
                .unwrap()
                .is_empty()
        );
        assert!(
            resolve_offsets(&copy, WANTED, CHUNK, Some(&memo))
                .unwrap()
                .is_empty()
        );
        assert!(memo.lock().unwrap().as_ref().is_none_or(HashMap::is_empty));
    }

    #[test]
    fn the_memo_stays_bounded() {
        let dir = Dir::new("bounded");
        let library = dir.library("libboth.so", SOURCE, &["-Wl,--build-id=sha1"]);
        let memo = new_memo();
        for i in 0..MEMO_CAPACITY * 2 + 1 {
            let name = format!("lens_name_{i}");
            resolve_offsets(&library, &[&name], CHUNK, Some(&memo)).unwrap();
            let held = memo.lock().unwrap().as_ref().map_or(0, HashMap::len);
            assert!(held <= MEMO_CAPACITY, "{held} results held");
        }
    }

    #[test]
    fn unreadable_libraries_are_elf_errors() {
        let dir = Dir::new("errors");
        let library = dir.library("libboth.so", SOURCE, &[]);
        let text = dir.0.join("not-elf.so");
        fs::write(&text, "not an ELF file\n").unwrap();
        let bytes = fs::read(&library).unwrap();
        let truncated = dir.0.join("truncated.so");
        fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
        for path in [dir.0.join("absent.so"), text, truncated] {
            match resolve_file_offsets(&path, &["lens_dynamic"]) {
                Err(LensError::Elf { path: at, .. }) => assert_eq!(at, path),
                other => panic!("{}: {other:?}", path.display()),
            }
        }
    }

    fn peak_rss_kib() -> u64 {
        let status = fs::read_to_string("/proc/self/status").unwrap();
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))
            .and_then(|kib| kib.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }

    /// The real libtorch_cpu.so (`LENS_LIBTORCH_CPU`, else the test venv's): the offsets
    /// are the ones `object` finds, and the peak RSS and time of both are printed.
    /// `cargo test -p lens-userspace --lib sys::symbols -- --ignored --nocapture`
    #[test]
    #[ignore = "needs libtorch_cpu.so; measures memory"]
    fn libtorch_offsets_and_peak_memory() {
        let library = std::env::var_os("LENS_LIBTORCH_CPU")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let home = PathBuf::from(std::env::var_os("HOME").unwrap());
                let lib = home.join(".cache/lens-probe/torch-venv/lib");
                fs::read_dir(&lib)
                    .unwrap()
                    .flatten()
                    .map(|python| {
                        python
                            .path()
                            .join("site-packages/torch/lib/libtorch_cpu.so")
                    })
                    .find(|path| path.exists())
                    .expect("libtorch_cpu.so in the torch venv")
            });
        let wanted = [
            // .dynsym
            "_ZN5torch8autograd6Engine7executeERKSt6vectorINS0_4EdgeESaIS3_EERKS2_IN2at6TensorESaIS9_EEbbbS7_",
            "_ZN5torch8autograd8profiler25record_function_enter_newERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERKSt8optionalIS7_E",
            "_ZN6caffe29serialize19PyTorchStreamWriterD1Ev",
            "_ZN4c10d16ProcessGroupGloo7barrierERKNS_14BarrierOptionsE",
            "_ZN2at14RecordFunction3endEv",
            // .symtab only
            "_ZN5torch8autograd8profilerL24record_function_exit_newERKN3c1013intrusive_ptrINS1_20PythonRecordFunctionENS2_6detail34intrusive_target_default_null_typeIS4_EEEE",
            "_ZN5torch8autograd8profilerL27record_function_exit_legacyERKN2at6TensorE",
        ];
        let measure = |what: &str, resolve: &dyn Fn() -> HashMap<String, u64>| {
            let before = peak_rss_kib();
            let start = Instant::now();
            let offsets = resolve();
            let took: Duration = start.elapsed();
            let after = peak_rss_kib();
            println!(
                "{what}: {} of {} names, {took:.2?}, VmHWM {before} kB -> {after} kB (+{} kB)",
                offsets.len(),
                wanted.len(),
                after - before
            );
            offsets
        };
        // The bounded reads first: VmHWM only grows.
        let streamed = measure("pread, bounded buffers", &|| {
            resolve_offsets(&library, &wanted, CHUNK, None).unwrap()
        });
        let memo = new_memo();
        resolve_offsets(&library, &wanted, CHUNK, Some(&memo)).unwrap();
        let remembered = measure("build-id memo hit", &|| {
            resolve_offsets(&library, &wanted, CHUNK, Some(&memo)).unwrap()
        });
        let mapped = measure("mmap + object", &|| with_object(&library, &wanted));
        assert_eq!(streamed, mapped);
        assert_eq!(remembered, mapped);
        assert_eq!(streamed.len(), wanted.len());
    }

    /// The real libtorch_cpu.so through configured-rule patterns: a demangled name (every
    /// overload) and C++ globs, each found at the offset the exact look-up gives, with
    /// the time and peak RSS printed.
    /// `cargo test -p lens-userspace --lib sys::symbols -- --ignored --nocapture`
    #[test]
    #[ignore = "needs libtorch_cpu.so; measures memory"]
    fn libtorch_patterns_and_peak_memory() {
        let home = PathBuf::from(std::env::var_os("HOME").unwrap());
        let library = std::env::var_os("LENS_LIBTORCH_CPU")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                fs::read_dir(home.join(".cache/lens-probe/torch-venv/lib"))
                    .unwrap()
                    .flatten()
                    .map(|python| {
                        python
                            .path()
                            .join("site-packages/torch/lib/libtorch_cpu.so")
                    })
                    .find(|path| path.exists())
                    .expect("libtorch_cpu.so in the torch venv")
            });
        let execute = "_ZN5torch8autograd6Engine7executeERKSt6vectorINS0_4EdgeESaIS3_EERKS2_IN2at6TensorESaIS9_EEbbbS7_";
        let allreduce = "_ZN4c10d16ProcessGroupGloo9allreduceERSt6vectorIN2at6TensorESaIS3_EERKNS_16AllreduceOptionsE";
        let demangled = SymbolPattern::new("torch::autograd::Engine::execute");
        let cpp_glob = SymbolPattern::new("c10d::ProcessGroupGloo::allreduce*");
        let mangled_glob = SymbolPattern::new("_ZN4c10d16ProcessGroupGloo9allreduce*");
        let before = peak_rss_kib();
        let start = Instant::now();
        let matches = resolve_matching(
            &library,
            &[&demangled, &cpp_glob, &mangled_glob],
            &[64, 64, 64],
        )
        .unwrap();
        let took = start.elapsed();
        let after = peak_rss_kib();
        for (pattern, found) in ["demangled", "C++ glob", "mangled glob"]
            .iter()
            .zip(&matches.found)
        {
            let names: Vec<&str> = found.iter().map(|(name, _)| name.as_str()).collect();
            println!("{pattern}: {names:?}");
        }
        println!(
            "3 patterns: {took:.2?}, VmHWM {before} kB -> {after} kB (+{} kB)",
            after - before
        );
        let exact = resolve_offsets(&library, &[execute, allreduce], CHUNK, None).unwrap();
        let offset = |i: usize, name: &str| {
            matches.found[i]
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, symbol)| symbol.offset)
        };
        assert_eq!(offset(0, execute), Some(exact[execute]));
        assert_eq!(offset(1, allreduce), Some(exact[allreduce]));
        assert_eq!(offset(2, allreduce), Some(exact[allreduce]));
        assert_eq!(matches.capped, [false, false, false]);
    }
}
