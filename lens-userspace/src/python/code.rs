//! Code objects → (qualified name, file), read from the process's memory once per code
//! object address (on 3.10 the qualified name comes from the source: `source`).
use std::{collections::HashMap, fs::File, os::unix::fs::FileExt, sync::Arc};

use super::{runtime::CodeLayout, source::SourceNames};

/// What a code object says about its function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeName {
    /// `co_qualname` (3.11+); on 3.10 the same name found in the source from
    /// `co_firstlineno`, or `co_name` where the source cannot be read.
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
}

/// Code objects this long are not read further (a name or path is not).
const MAX_STRING_BYTES: u64 = 4096;

/// Names remembered per process before the memo starts over.
const MAX_NAMES: usize = 65_536;

/// Reads code objects of one process. A code object's address alone does not name it:
/// start-up and imports free code objects (a module's body, once run) and a later one
/// takes the address. So the two `str` pointers (and on 3.10 `co_firstlineno`) are read
/// every time (small reads) and the names are remembered under (code, name, filename,
/// first line). One that cannot be read yet (a sample during an import can show an
/// object still being built) is tried again.
pub struct CodeReader {
    mem: File,
    layout: CodeLayout,
    names: HashMap<(u64, u64, u64, u32), CodeName>,
    /// 3.10: the process's source files, for the classes of its methods.
    sources: Option<SourceNames>,
}

impl CodeReader {
    pub fn open(pid: u32, layout: CodeLayout) -> std::io::Result<CodeReader> {
        Ok(CodeReader {
            mem: File::open(format!("/proc/{pid}/mem"))?,
            layout,
            names: HashMap::new(),
            sources: layout.firstlineno.map(|_| SourceNames::new(pid)),
        })
    }

    /// The name of the code object at `code`, `None` if it cannot be read.
    pub fn name(&mut self, code: u64) -> Option<&CodeName> {
        if code == 0 {
            return None;
        }
        let first_line = match self.layout.firstlineno {
            Some(offset) => self.u32_at(code.checked_add(offset)?)?,
            None => 0,
        };
        let key = (
            code,
            self.u64_at(code.checked_add(self.layout.qualname)?)?,
            self.u64_at(code.checked_add(self.layout.filename)?)?,
            first_line,
        );
        if !self.names.contains_key(&key) {
            let name = self.ascii(key.1)?;
            let filename = self.ascii(key.2)?;
            let qualname = match self.sources.as_mut() {
                Some(sources) => sources
                    .qualname(&filename, first_line, &name)
                    .map_or(name, str::to_string),
                None => name,
            };
            let name = CodeName {
                qualname: qualname.into(),
                filename: filename.into(),
            };
            if self.names.len() >= MAX_NAMES {
                self.names.clear();
            }
            self.names.insert(key, name);
        }
        self.names.get(&key)
    }

    fn u32_at(&self, address: u64) -> Option<u32> {
        let mut bytes = [0u8; 4];
        self.mem.read_exact_at(&mut bytes, address).ok()?;
        Some(u32::from_ne_bytes(bytes))
    }

    fn u64_at(&self, address: u64) -> Option<u64> {
        let mut bytes = [0u8; 8];
        self.mem.read_exact_at(&mut bytes, address).ok()?;
        Some(u64::from_ne_bytes(bytes))
    }

    /// A compact ASCII `str` object's text (names and paths are; others are skipped).
    fn ascii(&self, object: u64) -> Option<String> {
        // Pointers come from the target's memory, sampled mid-update at times: any value.
        let length = self.u64_at(object.checked_add(self.layout.str_length)?)?;
        // Only the low byte: 3.12+ leave the padding after it uninitialised.
        let mut state = [0u8; 1];
        self.mem
            .read_exact_at(&mut state, object.checked_add(self.layout.str_state)?)
            .ok()?;
        if state[0] & self.layout.str_state_mask != self.layout.str_state_compact_ascii
            || length > MAX_STRING_BYTES
        {
            return None;
        }
        let mut text = vec![0u8; length as usize];
        self.mem
            .read_exact_at(&mut text, object.checked_add(self.layout.str_data)?)
            .ok()?;
        String::from_utf8(text).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::python::runtime::CodeLayout;

    #[test]
    fn any_pointer_a_sample_holds_is_read_or_refused_never_a_panic() {
        let layout = CodeLayout {
            qualname: 128,
            filename: 112,
            firstlineno: None,
            str_length: 16,
            str_state: 32,
            str_data: 40,
            str_state_mask: 0x7c,
            str_state_compact_ascii: 0x64,
        };
        // 3.11+, and 3.10 (which also reads `co_firstlineno`).
        for layout in [
            layout,
            CodeLayout {
                firstlineno: Some(40),
                ..layout
            },
        ] {
            let mut reader = CodeReader::open(std::process::id(), layout).unwrap();
            for code in [0, 1, u64::MAX, u64::MAX - 100, u64::MAX - 40, 0x10, 1 << 63] {
                assert_eq!(reader.name(code), None, "{code:#x}");
            }
        }
    }
}
