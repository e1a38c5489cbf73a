//! Code objects → (qualified name, file), read from the process's memory once per code
//! object address.
use std::{collections::HashMap, fs::File, os::unix::fs::FileExt, sync::Arc};

use super::runtime::CodeLayout;

/// What a code object says about its function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeName {
    /// `co_qualname` (3.11+), `co_name` on 3.10.
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
}

/// Code objects this long are not read further (a name or path is not).
const MAX_STRING_BYTES: u64 = 4096;

/// Names remembered per process before the memo starts over.
const MAX_NAMES: usize = 65_536;

/// Reads code objects of one process. A code object's address alone does not name it:
/// start-up and imports free code objects (a module's body, once run) and a later one
/// takes the address. So the two `str` pointers are read every time (one small read) and
/// the names are remembered under (code, qualname, filename) pointers. One that cannot be
/// read yet (a sample during an import can show an object still being built) is tried
/// again.
pub struct CodeReader {
    mem: File,
    layout: CodeLayout,
    names: HashMap<(u64, u64, u64), CodeName>,
}

impl CodeReader {
    pub fn open(pid: u32, layout: CodeLayout) -> std::io::Result<CodeReader> {
        Ok(CodeReader {
            mem: File::open(format!("/proc/{pid}/mem"))?,
            layout,
            names: HashMap::new(),
        })
    }

    /// The name of the code object at `code`, `None` if it cannot be read.
    pub fn name(&mut self, code: u64) -> Option<&CodeName> {
        if code == 0 {
            return None;
        }
        let key = (
            code,
            self.u64_at(code.checked_add(self.layout.qualname)?)?,
            self.u64_at(code.checked_add(self.layout.filename)?)?,
        );
        if !self.names.contains_key(&key) {
            let name = CodeName {
                qualname: self.ascii(key.1)?.into(),
                filename: self.ascii(key.2)?.into(),
            };
            if self.names.len() >= MAX_NAMES {
                self.names.clear();
            }
            self.names.insert(key, name);
        }
        self.names.get(&key)
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
            str_length: 16,
            str_state: 32,
            str_data: 40,
            str_state_mask: 0x7c,
            str_state_compact_ascii: 0x64,
        };
        let mut reader = CodeReader::open(std::process::id(), layout).unwrap();
        for code in [0, 1, u64::MAX, u64::MAX - 100, 0x10, 1 << 63] {
            assert_eq!(reader.name(code), None, "{code:#x}");
        }
    }
}
