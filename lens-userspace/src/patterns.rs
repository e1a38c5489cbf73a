//! Matching configured probe rules (`crate::settings::probe_rules`) against what a process maps: a
//! rule's `library` against the mapped files' names, its `symbol` against the names in
//! their symbol tables — mangled, demangled (C++) or as a glob (`*`, `?`).
use std::path::Path;

use cpp_demangle::{DemangleOptions, Symbol as CppSymbol};

/// A rule's `library`: a file name (`libtorch_cpu.so`, which also matches versioned names
/// such as `libtorch_cpu.so.2`), a glob on the file name (`libmy*.so*`), or, with a `/`,
/// a glob on the whole path the process maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibraryPattern(String);

impl LibraryPattern {
    pub fn new(pattern: &str) -> LibraryPattern {
        LibraryPattern(pattern.to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the mapped file at `path` is one this pattern names.
    pub fn matches(&self, path: &Path) -> bool {
        let pattern = self.0.as_bytes();
        if self.0.contains('/') {
            return glob_match(pattern, path.as_os_str().as_encoded_bytes());
        }
        let Some(name) = path.file_name() else {
            return false;
        };
        let name = name.as_encoded_bytes();
        if has_wildcards(pattern) {
            return glob_match(pattern, name);
        }
        // `libnccl.so` names `libnccl.so.2` and `libnccl.so.2.21.5` too.
        name == pattern
            || name.strip_prefix(pattern).is_some_and(|rest| {
                rest.starts_with(b".") && rest[1..].iter().all(|b| b.is_ascii_digit() || *b == b'.')
            })
    }
}

/// A rule's `symbol`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SymbolPattern {
    /// A name as the symbol table holds it (a C function, or a mangled C++ name).
    Exact(String),
    /// A demangled C++ name: `ns::Class::method` matches every overload (the name without
    /// its parameters), `ns::f(int)` only that one (as `c++filt` prints it).
    Demangled(String),
    /// `*` (any run of characters) and `?` (one character), matched against the symbol's
    /// name and, when the pattern looks like C++ (`::`, `(`, `<`, a blank), against its
    /// demangled name with and without parameters.
    Glob { pattern: String, cpp: bool },
}

impl SymbolPattern {
    pub fn new(text: &str) -> SymbolPattern {
        let cpp = ["::", "(", "<", " ", "~"]
            .iter()
            .any(|marker| text.contains(marker));
        if has_wildcards(text.as_bytes()) {
            SymbolPattern::Glob {
                pattern: text.to_string(),
                cpp,
            }
        } else if cpp {
            SymbolPattern::Demangled(text.to_string())
        } else {
            SymbolPattern::Exact(text.to_string())
        }
    }

    pub fn text(&self) -> &str {
        match self {
            SymbolPattern::Exact(text)
            | SymbolPattern::Demangled(text)
            | SymbolPattern::Glob { pattern: text, .. } => text,
        }
    }

    /// Whether it names C++ (or Rust) functions: a demangled name, a C++-looking glob, or a
    /// mangled name. An exception (a panic) can leave such a function, and one that
    /// leaves it through a return probe aborts the process.
    pub fn names_cpp(&self) -> bool {
        match self {
            SymbolPattern::Exact(text) => may_unwind(text),
            SymbolPattern::Demangled(_) => true,
            SymbolPattern::Glob { pattern, cpp } => *cpp || may_unwind(pattern),
        }
    }

    /// Whether matching needs more than an exact look-up: then every name of a symbol
    /// table is tested ([`crate::sys::symbols::resolve_matching`]).
    pub fn is_pattern(&self) -> bool {
        !matches!(self, SymbolPattern::Exact(_))
    }

    /// Where else than at the start of a string table entry a matching name may start:
    /// linkers share tails (`foo` stored as the end of `xfoo`), so names that begin with
    /// this are looked for inside longer strings too. `None`: only whole entries.
    pub fn anchor(&self) -> Option<&[u8]> {
        match self {
            SymbolPattern::Exact(_) => None,
            SymbolPattern::Demangled(_) | SymbolPattern::Glob { cpp: true, .. } => Some(b"_Z"),
            SymbolPattern::Glob { pattern, .. } => {
                let literal = pattern
                    .as_bytes()
                    .iter()
                    .take_while(|b| !matches!(b, b'*' | b'?'))
                    .count();
                (literal >= 2).then(|| &pattern.as_bytes()[..literal])
            }
        }
    }

    /// Whether the symbol named `name` (raw bytes from the string table) matches.
    /// Compiler-made parts and clones (`f.cold`, `f.part.0`, `f.isra.0`,
    /// `f.constprop.0`: a fragment, or a copy with another calling convention) match only
    /// a pattern that names them with their `.`.
    pub fn matches(&self, name: &[u8]) -> bool {
        if name.contains(&b'.') && !self.text().contains('.') {
            return false;
        }
        match self {
            SymbolPattern::Exact(text) => name == text.as_bytes(),
            SymbolPattern::Demangled(text) => {
                name.starts_with(b"_Z")
                    && mentions_identifier(text, name)
                    && demangled(name).is_some_and(|(full, bare)| full == *text || bare == *text)
            }
            SymbolPattern::Glob { pattern, cpp } => {
                let pattern = pattern.as_bytes();
                if glob_match(pattern, name) {
                    return true;
                }
                *cpp && name.starts_with(b"_Z")
                    && mentions_identifier(pattern_text(pattern), name)
                    && demangled(name).is_some_and(|(full, bare)| {
                        glob_match(pattern, full.as_bytes()) || glob_match(pattern, bare.as_bytes())
                    })
            }
        }
    }
}

fn pattern_text(pattern: &[u8]) -> &str {
    std::str::from_utf8(pattern).unwrap_or_default()
}

/// The demangled name of a mangled C++ symbol, with and without its parameters.
fn demangled(name: &[u8]) -> Option<(String, String)> {
    let symbol = CppSymbol::new(name).ok()?;
    let full = symbol.demangle(&DemangleOptions::default()).ok()?;
    let bare = symbol
        .demangle(&DemangleOptions::new().no_params().no_return_type())
        .ok()?;
    Some((full, bare))
}

/// Names libstdc++'s mangling abbreviates (`St`, `Ss`, `Sa`...): absent from the mangled
/// bytes even when the demangled name has them.
const ABBREVIATED: &[&str] = &[
    "std",
    "string",
    "basic_string",
    "allocator",
    "char_traits",
    "istream",
    "ostream",
    "iostream",
    "basic_istream",
    "basic_ostream",
    "basic_iostream",
    "operator",
];

/// A cheap test before demangling: every identifier of the qualified name in the
/// demangled name (or glob) `text` (what comes before its parameters or template
/// arguments), of three characters or more, appears in the mangled bytes, as mangling
/// keeps identifiers verbatim (prefixed with their length); the names libstdc++'s
/// mangling abbreviates, and `operator`, are not required.
fn mentions_identifier(text: &str, mangled: &[u8]) -> bool {
    let name = text.split(['(', '<']).next().unwrap_or_default();
    name.split(|c: char| !(c == '_' || c.is_ascii_alphanumeric()))
        .filter(|word| word.len() >= 3 && !word.starts_with(|c: char| c.is_ascii_digit()))
        .filter(|word| !ABBREVIATED.contains(word))
        .all(|word| memchr::memmem::find(mangled, word.as_bytes()).is_some())
}

fn has_wildcards(pattern: &[u8]) -> bool {
    pattern.iter().any(|b| matches!(b, b'*' | b'?'))
}

/// `*` matches any run of bytes (also none), `?` any one byte; everything else itself.
pub fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    // Where the last `*` was, and the text position it is trying to cover up to.
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(b'?') => {
                p += 1;
                t += 1;
            }
            Some(byte) if *byte == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((star_p, star_t)) => {
                    p = star_p + 1;
                    t = star_t + 1;
                    star = Some((star_p, star_t + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|b| *b == b'*')
}

/// Whether the function named by symbol `name` may be left by an exception: a C++
/// (`_Z`, Itanium) or Rust (`_R`, v0; legacy Rust names are `_Z` too) mangled name. The
/// unwinder finds no unwind information for the return probe's trampoline, which a
/// return probe puts in the place of the function's return address, and calls
/// `std::terminate` (Rust: aborts) when an exception must cross it: the traced program,
/// which would have caught it, dies. C functions are left by returning.
pub fn may_unwind(name: &str) -> bool {
    name.starts_with("_Z") || name.starts_with("_R")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_stars_and_question_marks() {
        assert!(glob_match(b"my_*", b"my_train_step"));
        assert!(glob_match(b"*step", b"my_train_step"));
        assert!(glob_match(b"my_?val*", b"my_evaluate"));
        assert!(glob_match(b"*", b""));
        assert!(glob_match(b"a*b*c", b"axxbyyc"));
        assert!(!glob_match(b"a*b*c", b"axxbyy"));
        assert!(!glob_match(b"my_*", b"xmy_train"));
        assert!(!glob_match(b"abc", b"abcd"));
    }

    #[test]
    fn library_names_match_with_version_suffixes_and_globs() {
        let nccl = LibraryPattern::new("libnccl.so");
        assert!(nccl.matches(Path::new("/x/libnccl.so")));
        assert!(nccl.matches(Path::new("/x/libnccl.so.2.21.5")));
        assert!(!nccl.matches(Path::new("/x/libnccl.so-net")));
        assert!(!nccl.matches(Path::new("/x/libnccl-net.so")));
        assert!(LibraryPattern::new("libmy*.so*").matches(Path::new("/a/libmytrain.so.1")));
        assert!(LibraryPattern::new("/opt/*/libx.so").matches(Path::new("/opt/v1/libx.so")));
        assert!(!LibraryPattern::new("/opt/*/libx.so").matches(Path::new("/usr/libx.so")));
    }

    #[test]
    fn symbols_match_mangled_demangled_and_globs() {
        // my::Trainer::forward(int)
        let mangled = b"_ZN2my7Trainer7forwardEi";
        assert!(SymbolPattern::new("_ZN2my7Trainer7forwardEi").matches(mangled));
        assert!(!SymbolPattern::new("_ZN2my7Trainer7forwardEi").is_pattern());
        let by_name = SymbolPattern::new("my::Trainer::forward");
        assert!(matches!(by_name, SymbolPattern::Demangled(_)));
        assert!(by_name.matches(mangled));
        assert!(SymbolPattern::new("my::Trainer::forward(int)").matches(mangled));
        assert!(!SymbolPattern::new("my::Trainer::forward(long)").matches(mangled));
        assert!(!SymbolPattern::new("my::Trainer::backward").matches(mangled));
        assert!(SymbolPattern::new("my::Trainer::*").matches(mangled));
        assert!(SymbolPattern::new("*Trainer::forward*").matches(mangled));
        assert!(SymbolPattern::new("_ZN2my*").matches(mangled));
        assert_eq!(SymbolPattern::new("my_*").anchor(), Some(&b"my_"[..]));
        assert_eq!(SymbolPattern::new("*step").anchor(), None);
        assert!(SymbolPattern::new("my_*").matches(b"my_evaluate"));
        // Fragments and clones only when named.
        assert!(
            !SymbolPattern::new("my::Trainer::forward").matches(b"_ZN2my7Trainer7forwardEi.cold")
        );
        assert!(!SymbolPattern::new("my_*").matches(b"my_evaluate.part.0"));
        assert!(SymbolPattern::new("my_*.part.*").matches(b"my_evaluate.part.0"));
        assert!(!SymbolPattern::new("my_*").matches(b"_ZN2my7Trainer7forwardEi"));
    }
}
