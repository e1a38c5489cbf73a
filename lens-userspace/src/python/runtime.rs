//! Finding a process's CPython interpreter: the file that defines `_PyRuntime` (a shared
//! `libpython3.X.so` or a statically linked `python3.X`), its version, where
//! `_PyRuntime` is in the process, and the struct layout of that version
//! (docs/python-offsets.md has where each number comes from and how it was checked).
use std::path::PathBuf;

use lens_common::{PY_NO_FIELD, PyOffsets};

use crate::sys::{process::Process, symbols};

/// Where a code object and a `str` keep what names a function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeLayout {
    /// `co_qualname` (3.11+) or `co_name` (3.10), and `co_filename`: `str` pointers.
    pub qualname: u64,
    pub filename: u64,
    /// 3.10: `co_firstlineno` (an `int`), whose line in the source names the class a
    /// method is in (`python::source`); `None` where `co_qualname` does.
    pub firstlineno: Option<u64>,
    /// `co_firstlineno` in every version: the line a function's definition starts at
    /// (hang reports name it).
    pub first_line: u64,
    /// Where the line a frame is at is read from (3.11+; 3.10 frames name their
    /// function's first line).
    pub lines: Option<LineLayout>,
    /// `PyASCIIObject.length`, `.state`, and where a compact ASCII string's text starts.
    pub str_length: u64,
    pub str_state: u64,
    pub str_data: u64,
    /// A compact ASCII string: `state`'s low byte & mask == value (kind 1, compact,
    /// ascii; the interned bits aside).
    pub str_state_mask: u8,
    pub str_state_compact_ascii: u8,
}

/// 3.11+: a frame's instruction pointer (`prev_instr`, 3.13 `instr_ptr`), the code
/// object's bytecode (`co_code_adaptive`, inline) and location table (`co_linetable`, a
/// `bytes`): the instruction's index in the bytecode is looked up in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LineLayout {
    pub frame_instruction: u64,
    pub code_adaptive: u64,
    pub linetable: u64,
}

const fn lines(code_adaptive: u64) -> Option<LineLayout> {
    Some(LineLayout {
        frame_instruction: 56,
        code_adaptive,
        linetable: 136,
    })
}

/// One CPython minor version's layout.
#[derive(Clone, Copy, Debug)]
struct Layout {
    minor: u32,
    offsets: PyOffsets,
    code: CodeLayout,
}

const NONE: u32 = PY_NO_FIELD;

/// A thread's id field holds its tid (`native_thread_id`, 3.11+) or its thread pointer
/// (`thread_id`, 3.10).
const BY_TID: u32 = 0;
const BY_THREAD_POINTER: u32 = 1;

/// `str` layout: length, state, text of a compact ASCII string (48 with the 3.10/3.11
/// `wstr` pointer, 40 after).
const fn code_layout(
    qualname: u64,
    filename: u64,
    firstlineno: Option<u64>,
    first_line: u64,
    lines: Option<LineLayout>,
    str_data: u64,
) -> CodeLayout {
    CodeLayout {
        qualname,
        filename,
        firstlineno,
        first_line,
        lines,
        str_length: 16,
        str_state: 32,
        str_data,
        str_state_mask: 0x7c,
        str_state_compact_ascii: 0x64,
    }
}

/// The layouts of the CPython versions lens-probe reads (x86-64, release builds;
/// docs/python-offsets.md: read from DWARF and checked on live processes of pyenv's
/// 3.10.13, 3.11.7, 3.12.1, 3.13.0 and Debian's 3.11.2; 3.13's agree with its
/// `_Py_DebugOffsets`).
const LAYOUTS: [Layout; 4] = [
    Layout {
        minor: 10,
        // `co_name` and `co_firstlineno`: 3.10 has no `co_qualname`.
        offsets: offsets(32, 8, 8, 176, BY_THREAD_POINTER, 24, NONE, 32, 24, 352),
        code: code_layout(112, 104, Some(40), 40, None, 48),
    },
    Layout {
        minor: 11,
        offsets: offsets(40, 16, 8, 160, BY_TID, 56, 8, 32, 48, 72),
        code: code_layout(128, 112, None, 72, lines(184), 48),
    },
    Layout {
        minor: 12,
        offsets: offsets(40, 72, 8, 144, BY_TID, 56, 0, 0, 8, 72),
        code: code_layout(128, 112, None, 68, lines(192), 40),
    },
    Layout {
        minor: 13,
        offsets: offsets(632, 7344, 8, 160, BY_TID, 72, NONE, 0, 8, 72),
        code: code_layout(128, 112, None, 68, lines(200), 40),
    },
];

#[allow(clippy::too_many_arguments)]
const fn offsets(
    interpreters_head: u32,
    threads_head: u32,
    tstate_next: u32,
    tstate_thread_id: u32,
    match_thread_pointer: u32,
    tstate_frame: u32,
    cframe_current_frame: u32,
    frame_code: u32,
    frame_previous: u32,
    frame_first_local: u32,
) -> PyOffsets {
    PyOffsets {
        runtime: 0,
        interpreters_head,
        threads_head,
        tstate_next,
        tstate_native_thread_id: tstate_thread_id,
        match_thread_pointer,
        tstate_frame,
        cframe_current_frame,
        frame_code,
        frame_previous,
        frame_first_local,
        // Set from the code layout's (`runtime_of`).
        str_data: 0,
    }
}

/// A process's interpreter, as the sampler needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PythonRuntime {
    /// `3.X`.
    pub version: (u32, u32),
    /// The file that defines `_PyRuntime`.
    pub path: PathBuf,
    pub offsets: PyOffsets,
    pub code: CodeLayout,
}

/// Why a process's interpreter cannot be read.
#[derive(Debug, PartialEq, Eq)]
pub enum RuntimeError {
    /// A CPython whose layout lens-probe does not know.
    UnsupportedVersion { path: PathBuf, version: String },
    /// The file names a CPython but has no `_PyRuntime` symbol lens-probe can place.
    NoRuntimeSymbol { path: PathBuf },
    /// The file could not be read through the process (and the process still maps it).
    Unreadable { path: PathBuf, reason: String },
}

impl std::fmt::Display for RuntimeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RuntimeError::UnsupportedVersion { path, version } => write!(
                f,
                "{}: CPython {version} is not supported (3.10 to 3.13 are)",
                path.display()
            ),
            RuntimeError::NoRuntimeSymbol { path } => {
                write!(f, "{}: no _PyRuntime symbol found", path.display())
            }
            RuntimeError::Unreadable { path, reason } => {
                write!(f, "{}: cannot read its symbols: {reason}", path.display())
            }
        }
    }
}

/// `3.X` from a CPython file name: `libpython3.11.so.1.0`, `python3.11`,
/// `libpython3.13t.so` (free-threaded: another layout, refused by the caller).
fn version_of(file_name: &str) -> Option<String> {
    let rest = file_name
        .strip_prefix("libpython")
        .or_else(|| file_name.strip_prefix("python"))?;
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let version = rest[..end].trim_end_matches('.');
    let suffix = &rest[end..];
    if suffix.starts_with('t') {
        return Some(format!("{version}t"));
    }
    (version.starts_with("3.") && version.len() > 2).then(|| version.to_string())
}

/// `pid`'s CPython, if it runs one: `Ok(None)` when it maps no interpreter.
pub fn find_runtime(pid: u32) -> Result<Option<PythonRuntime>, RuntimeError> {
    let process = Process::new(pid);
    let Ok(entries) = process.mappings() else {
        return Ok(None);
    };
    // A shared libpython first (pyenv, conda); else the executable itself (Debian).
    let mut candidates: Vec<&crate::sys::library::MapsEntry> = entries
        .iter()
        .filter(|e| {
            let name = file_name(&e.path);
            name.starts_with("libpython3") && version_of(name).is_some()
        })
        .collect();
    if candidates.is_empty() {
        candidates = entries
            .iter()
            .filter(|e| {
                let name = file_name(&e.path);
                name.starts_with("python3") && version_of(name).is_some()
            })
            .collect();
    }
    let Some(first) = candidates.first() else {
        return Ok(None);
    };
    let path = PathBuf::from(&first.path);
    let version = version_of(file_name(&first.path)).unwrap_or_default();
    let minor = version
        .strip_prefix("3.")
        .and_then(|m| m.parse::<u32>().ok());
    let Some(layout) = minor.and_then(|m| LAYOUTS.iter().find(|l| l.minor == m)) else {
        return Err(RuntimeError::UnsupportedVersion { path, version });
    };
    // Read through the process's own view of the file (its mount namespace).
    let mapped = process.mapped_file(first);
    let no_symbol = || RuntimeError::NoRuntimeSymbol { path: path.clone() };
    let found = match symbols::resolve_file_offsets(&mapped, &["_PyRuntime"]) {
        Ok(offsets) => offsets.get("_PyRuntime").copied(),
        // Read while a vfork child shared its parent's mappings, opened after it exec'd
        // or exited (`map_files` then has no such entry): not a broken library. Its exec
        // brings it back here with its own mappings.
        Err(_) if !still_maps(process, &first.path) => return Ok(None),
        Err(error) => {
            return Err(RuntimeError::Unreadable {
                path,
                reason: error.to_string(),
            });
        }
    };
    let file_offset = match found {
        Some(offset) => offset,
        // A `python3.X` linked to a libpython not mapped yet (the loader maps it next):
        // not the runtime.
        None if !file_name(&first.path).starts_with("lib") => return Ok(None),
        None => return Err(no_symbol()),
    };
    // The mapping of that file that holds the symbol's file offset.
    let runtime = entries
        .iter()
        .filter(|e| e.file == first.file)
        .find(|e| file_offset >= e.offset && file_offset < e.offset + (e.end - e.start))
        .map(|e| e.start + (file_offset - e.offset))
        .ok_or_else(no_symbol)?;
    let mut offsets = layout.offsets;
    offsets.runtime = runtime;
    offsets.str_data = layout.code.str_data as u32;
    Ok(Some(PythonRuntime {
        version: (3, layout.minor),
        path,
        offsets,
        code: layout.code,
    }))
}

/// Whether the process is still there and maps `path` (it did not exec or exit since its
/// mappings were read).
fn still_maps(process: Process, path: &str) -> bool {
    process
        .mappings()
        .is_ok_and(|entries| entries.iter().any(|e| e.path == path))
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_come_from_the_file_names() {
        assert_eq!(version_of("libpython3.11.so.1.0").as_deref(), Some("3.11"));
        assert_eq!(version_of("python3.13").as_deref(), Some("3.13"));
        assert_eq!(
            version_of("libpython3.13t.so.1.0").as_deref(),
            Some("3.13t")
        );
        assert_eq!(version_of("python3").as_deref(), None);
        assert_eq!(version_of("pythonista"), None);
    }
}
