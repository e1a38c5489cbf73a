//! Code objects → (qualified name, file), read from the process's memory once per code
//! object address (on 3.10 the qualified name comes from the source: `source`).
use std::{
    collections::{HashMap, HashSet},
    fs::File,
    os::unix::fs::FileExt,
    sync::Arc,
};

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

/// Location tables longer than this are not read (a function of ~100 000 lines).
const MAX_LINETABLE_BYTES: u64 = 1 << 20;

/// The line of the instruction at `index` (in code units) of a code object whose
/// definition starts at `first_line`, from its 3.11+ location table (CPython's
/// `Objects/locations.md`): entries of one header byte (bit 7 set; code in bits 3-6;
/// the instructions it covers, minus one, in bits 0-2) and the code's data.
pub fn line_in_table(table: &[u8], first_line: u32, index: u64) -> Option<u32> {
    fn varint(bytes: &mut impl Iterator<Item = u8>) -> Option<u64> {
        let mut value = 0u64;
        let mut shift = 0u32;
        loop {
            let byte = bytes.next()?;
            value |= u64::from(byte & 63).checked_shl(shift)?;
            if byte & 64 == 0 {
                return Some(value);
            }
            shift += 6;
        }
    }
    let mut bytes = table.iter().copied();
    let mut line = i64::from(first_line);
    let mut start = 0u64;
    while let Some(header) = bytes.next() {
        if header & 0x80 == 0 {
            return None;
        }
        let code = (header >> 3) & 15;
        let length = u64::from(header & 7) + 1;
        let delta = match code {
            // No location.
            15 => None,
            // Long form: line delta, end line delta, column, end column.
            14 | 13 => {
                let raw = varint(&mut bytes)?;
                let delta = if raw & 1 == 1 {
                    -((raw >> 1) as i64)
                } else {
                    (raw >> 1) as i64
                };
                if code == 14 {
                    for _ in 0..3 {
                        varint(&mut bytes)?;
                    }
                }
                Some(delta)
            }
            // One-line form: the delta is in the code; two column bytes.
            10..=12 => {
                bytes.next()?;
                bytes.next()?;
                Some(i64::from(code) - 10)
            }
            // Short form: the same line; one column byte.
            _ => {
                bytes.next()?;
                Some(0)
            }
        };
        if let Some(delta) = delta {
            line += delta;
        }
        if index < start + length {
            return delta.and_then(|_| u32::try_from(line).ok());
        }
        start += length;
    }
    None
}

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
    /// The name last read at each code object address: what a sample of a process that
    /// has ended since (its memory gone with it) is named by.
    last_at: HashMap<u64, CodeName>,
    /// Code objects named since [`Self::take_named`] last took them (`None`: one that
    /// could not be read, such as an interpreter's shim frame's).
    named_since: Vec<(u64, Option<CodeName>)>,
    /// Code objects that could not be read, each given to `named_since` once.
    unreadable: HashSet<u64>,
    /// 3.10: the process's source files, for the classes of its methods.
    sources: Option<SourceNames>,
}

impl CodeReader {
    pub fn open(pid: u32, layout: CodeLayout) -> std::io::Result<CodeReader> {
        Ok(CodeReader {
            mem: crate::sys::process::Process::new(pid).memory()?,
            layout,
            names: HashMap::new(),
            last_at: HashMap::new(),
            named_since: Vec::new(),
            unreadable: HashSet::new(),
            sources: layout.firstlineno.map(|_| SourceNames::new(pid)),
        })
    }

    /// The name of the code object at `code`, `None` if it cannot be read.
    pub fn name(&mut self, code: u64) -> Option<&CodeName> {
        if code == 0 {
            return None;
        }
        let first_line = match self.layout.firstlineno {
            Some(offset) => self.u32_at(code.checked_add(offset)?),
            None => Some(0),
        };
        let pointers = self.two_u64_at(code, self.layout.qualname, self.layout.filename);
        let (Some(first_line), Some((qualname, filename))) = (first_line, pointers) else {
            self.note_unreadable(code);
            return self.last_at.get(&code);
        };
        let key = (code, qualname, filename, first_line);
        if !self.names.contains_key(&key) {
            let (Some(name), Some(filename)) = (self.ascii(key.1), self.ascii(key.2)) else {
                self.note_unreadable(code);
                return None;
            };
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
                self.last_at.clear();
                self.unreadable.clear();
            }
            self.last_at.insert(code, name.clone());
            self.named_since.push((code, Some(name.clone())));
            self.names.insert(key, name);
        }
        self.names.get(&key)
    }

    /// A code object that could not be read: told once (a frame that is no function's
    /// is never read, and the sampler need not wake lens-probe for it again; one still
    /// being built is read at a later sample).
    fn note_unreadable(&mut self, code: u64) {
        if self.unreadable.len() < MAX_NAMES && self.unreadable.insert(code) {
            self.named_since.push((code, None));
        }
    }

    /// The code objects named (or found unreadable) since the last call, by address.
    pub fn take_named(&mut self) -> Vec<(u64, Option<CodeName>)> {
        std::mem::take(&mut self.named_since)
    }

    /// The line the definition of the code object at `code` starts at.
    pub fn first_line(&self, code: u64) -> Option<u32> {
        self.u32_at(code.checked_add(self.layout.first_line)?)
    }

    /// The line `frame` (running `code`) is at: the instruction it executes (its caller's
    /// call, for an outer frame), looked up in the location table (3.11+).
    pub fn line_at(&self, code: u64, frame: u64) -> Option<u32> {
        let lines = self.layout.lines?;
        let instruction = self.u64_at(frame.checked_add(lines.frame_instruction)?)?;
        let index = instruction.checked_sub(code.checked_add(lines.code_adaptive)?)? / 2;
        let table = self.u64_at(code.checked_add(lines.linetable)?)?;
        // `bytes`: its size at 16, its text at 32.
        let size = self.u64_at(table.checked_add(16)?)?;
        if size > MAX_LINETABLE_BYTES {
            return None;
        }
        let mut bytes = vec![0u8; size as usize];
        self.mem
            .read_exact_at(&mut bytes, table.checked_add(32)?)
            .ok()?;
        line_in_table(&bytes, self.first_line(code)?, index)
    }

    fn u32_at(&self, address: u64) -> Option<u32> {
        let mut bytes = [0u8; 4];
        self.mem.read_exact_at(&mut bytes, address).ok()?;
        Some(u32::from_ne_bytes(bytes))
    }

    /// The words at `base + a` and `base + b`, read at once where they are close (the
    /// pointers of a code object: one system call, not two, per new frame).
    fn two_u64_at(&self, base: u64, a: u64, b: u64) -> Option<(u64, u64)> {
        let (low, high) = (a.min(b), a.max(b));
        if high - low > 56 {
            return Some((
                self.u64_at(base.checked_add(a)?)?,
                self.u64_at(base.checked_add(b)?)?,
            ));
        }
        let mut bytes = [0u8; 64];
        let span = &mut bytes[..(high - low + 8) as usize];
        self.mem.read_exact_at(span, base.checked_add(low)?).ok()?;
        let word = |offset: u64| {
            let at = (offset - low) as usize;
            u64::from_ne_bytes(span[at..at + 8].try_into().expect("8 bytes"))
        };
        Some((word(a), word(b)))
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

    #[test]
    fn lines_come_from_a_real_location_table() {
        // CPython 3.12.1's table of a function defined at line 2 (comprehension, blank
        // lines, a tuple over two lines, a `None` location), and the line of each
        // instruction as `co_positions()` gives it.
        let table = [
            128, 0, 216, 8, 9, 136, 65, 137, 5, 128, 65, 216, 7, 8, 136, 49, 130, 117, 220, 24, 29,
            152, 97, 155, 8, 214, 12, 33, 144, 49, 138, 81, 208, 12, 33, 136, 1, 208, 12, 33, 240,
            6, 0, 16, 17, 136, 8, 216, 12, 13, 216, 12, 13, 240, 3, 1, 12, 15, 240, 0, 1, 5, 15,
            249, 242, 9, 0, 13, 34,
        ];
        let mut expected = vec![Some(2)];
        expected.extend([Some(3); 5]);
        expected.extend([Some(4); 5]);
        expected.extend([Some(5); 24]);
        expected.extend([
            Some(8),
            Some(8),
            Some(9),
            Some(10),
            Some(9),
            Some(9),
            None,
            None,
        ]);
        expected.extend([Some(5); 3]);
        let lines: Vec<Option<u32>> = (0..expected.len() as u64)
            .map(|index| line_in_table(&table, 2, index))
            .collect();
        assert_eq!(lines, expected);
        assert_eq!(line_in_table(&table, 2, 1000), None);
        assert_eq!(line_in_table(&[0x00, 1, 2], 2, 0), None, "no header bit");
    }
    use crate::python::runtime::CodeLayout;

    /// 3.11's layout: the readers below are pointed at this process's memory.
    const TEST_LAYOUT: CodeLayout = CodeLayout {
        qualname: 128,
        filename: 112,
        firstlineno: None,
        first_line: 68,
        lines: None,
        str_length: 16,
        str_state: 32,
        str_data: 40,
        str_state_mask: 0x7c,
        str_state_compact_ascii: 0x64,
    };

    #[test]
    fn any_pointer_a_sample_holds_is_read_or_refused_never_a_panic() {
        let layout = TEST_LAYOUT;
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

    /// What the sampler may deliver without a wakeup (`PY_NAMED`): each code object
    /// once, named or found unreadable (an interpreter's shim frame's is never read).
    #[test]
    fn each_code_object_read_is_told_once_named_or_not() {
        let layout = TEST_LAYOUT;
        let mut reader = CodeReader::open(std::process::id(), layout).unwrap();
        for _ in 0..3 {
            assert_eq!(reader.name(0x10), None);
            assert_eq!(reader.name(1 << 63), None);
        }
        let told: Vec<(u64, bool)> = reader
            .take_named()
            .into_iter()
            .map(|(code, name)| (code, name.is_some()))
            .collect();
        assert_eq!(told, [(0x10, false), (1 << 63, false)]);
        assert!(reader.take_named().is_empty());
    }
}
