//! Qualified names from a module's source, for CPython 3.10 (its code objects have no
//! `co_qualname`): the `def` or `class` at a code object's `co_firstlineno` and the
//! `class`/`def` blocks around it, by indentation, as CPython builds `__qualname__`.
use std::{
    collections::HashMap,
    ffi::CString,
    fs::File,
    io::Read,
    os::fd::{AsRawFd, FromRawFd},
    sync::Arc,
};

/// A `def`, `async def` or `class` statement of a source file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Definition {
    /// Its first line (its first decorator's, if any: 3.10's `co_firstlineno`), and the
    /// line of the `def`/`class` itself (1-based).
    pub first_line: u32,
    pub line: u32,
    pub name: String,
    /// `Class.method`, `outer.<locals>.inner`.
    pub qualname: String,
}

/// A line that starts a logical line (not inside a string, brackets or after a
/// backslash), with something other than a comment on it.
struct Statement<'a> {
    line: u32,
    /// Columns, tabs to the next multiple of 8 (CPython's tokenizer).
    indent: u32,
    /// The physical line after its indentation.
    text: &'a str,
}

/// An unterminated string literal at the end of a line.
#[derive(Clone, Copy)]
struct OpenString {
    quote: u8,
    triple: bool,
}

/// The lines of `source` that start statements.
fn statements(source: &str) -> Vec<Statement<'_>> {
    let mut statements = Vec::new();
    let mut string: Option<OpenString> = None;
    let mut depth = 0u32;
    let mut continued = false;
    for (index, line) in source.split('\n').enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if string.is_none() && depth == 0 && !continued {
            let mut indent = 0u32;
            let mut start = line.len();
            for (at, c) in line.char_indices() {
                match c {
                    ' ' => indent += 1,
                    '\t' => indent = (indent / 8 + 1) * 8,
                    '\x0c' => indent = 0,
                    _ => {
                        start = at;
                        break;
                    }
                }
            }
            let text = &line[start..];
            if !text.is_empty() && !text.starts_with('#') {
                statements.push(Statement {
                    line: u32::try_from(index + 1).unwrap_or(u32::MAX),
                    indent,
                    text,
                });
            }
        }
        continued = false;
        let bytes = line.as_bytes();
        let mut i = 0;
        let mut escaped_newline = false;
        while i < bytes.len() {
            let b = bytes[i];
            if let Some(open) = string {
                if b == b'\\' {
                    escaped_newline = i + 1 == bytes.len();
                    i += 2;
                    continue;
                }
                if open.triple {
                    if bytes[i..].starts_with(&[open.quote; 3]) {
                        string = None;
                        i += 3;
                        continue;
                    }
                } else if b == open.quote {
                    string = None;
                }
                i += 1;
                continue;
            }
            match b {
                b'#' => break,
                b'\'' | b'"' => {
                    let triple = bytes[i..].starts_with(&[b; 3]);
                    string = Some(OpenString { quote: b, triple });
                    i += if triple { 3 } else { 1 };
                    continue;
                }
                b'(' | b'[' | b'{' => depth += 1,
                b')' | b']' | b'}' => depth = depth.saturating_sub(1),
                b'\\' if i + 1 == bytes.len() => continued = true,
                _ => {}
            }
            i += 1;
        }
        // A one-quote string ends with its line unless a backslash carries it on.
        if string.is_some_and(|open| !open.triple) && !escaped_newline {
            string = None;
        }
    }
    statements
}

/// `text` after `keyword` and the whitespace that must follow it.
fn after_keyword<'a>(text: &'a str, keyword: &str) -> Option<&'a str> {
    let rest = text.strip_prefix(keyword)?;
    rest.starts_with([' ', '\t', '\x0c'])
        .then(|| rest.trim_start_matches([' ', '\t', '\x0c']))
}

fn identifier(text: &str) -> Option<&str> {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    let name = &text[..end];
    (!name.is_empty() && !name.starts_with(|c: char| c.is_ascii_digit())).then_some(name)
}

/// A `def`/`async def` (true) or `class` (false) statement's name.
fn header(text: &str) -> Option<(bool, &str)> {
    let text = after_keyword(text, "async").unwrap_or(text);
    if let Some(rest) = after_keyword(text, "def") {
        return Some((true, identifier(rest)?));
    }
    Some((false, identifier(after_keyword(text, "class")?)?))
}

/// A block that names what it defines: `C` for a class, `f.<locals>` for a function.
struct Scope {
    indent: u32,
    prefix: String,
    /// Names its `global` statements declare: a class or function of such a name is
    /// named as a module-level one (CPython's `__qualname__` does the same).
    globals: Vec<String>,
}

/// Every `def`, `async def` and `class` of `source`, in order, with its qualified name.
pub fn definitions(source: &str) -> Vec<Definition> {
    definitions_within(source, usize::MAX).map_or_else(Vec::new, |(found, _)| found)
}

/// [`definitions`] and the bytes their names take, or `None` once that would be more
/// than `budget`: a file of deeply nested definitions has names that grow with its depth,
/// so their total grows with the square of its size (432 MB for one 8 MiB file of them).
fn definitions_within(source: &str, budget: usize) -> Option<(Vec<Definition>, usize)> {
    let mut definitions = Vec::new();
    let mut used = 0usize;
    let mut scopes: Vec<Scope> = Vec::new();
    let mut decorated_at: Option<u32> = None;
    for statement in statements(source) {
        while scopes
            .last()
            .is_some_and(|scope| scope.indent >= statement.indent)
        {
            scopes.pop();
        }
        if statement.text.starts_with('@') {
            decorated_at.get_or_insert(statement.line);
            continue;
        }
        let first_line = decorated_at.take().unwrap_or(statement.line);
        if let Some(names) = after_keyword(statement.text, "global")
            && let Some(scope) = scopes.last_mut()
        {
            let names = names.split(['#', ';']).next().unwrap_or_default();
            scope
                .globals
                .extend(names.split(',').map(|name| name.trim().to_string()));
            continue;
        }
        let Some((function, name)) = header(statement.text) else {
            continue;
        };
        let qualname = match scopes.last() {
            Some(scope) if !scope.globals.iter().any(|global| global == name) => {
                format!("{}.{name}", scope.prefix)
            }
            _ => name.to_string(),
        };
        let prefix = if function {
            format!("{qualname}.<locals>")
        } else {
            qualname.clone()
        };
        used += name.len() + qualname.len() + prefix.len() + std::mem::size_of::<Definition>();
        if used > budget {
            return None;
        }
        definitions.push(Definition {
            first_line,
            line: statement.line,
            name: name.to_string(),
            qualname,
        });
        scopes.push(Scope {
            indent: statement.indent,
            prefix,
            globals: Vec::new(),
        });
    }
    Some((definitions, used))
}

/// The definition named `name` whose statement begins at `first_line` (its first
/// decorator or its `def`), in `definitions` (sorted by line).
fn find<'a>(definitions: &'a [Definition], first_line: u32, name: &str) -> Option<&'a Definition> {
    let at = definitions.partition_point(|d| d.line < first_line);
    definitions
        .get(at)
        .filter(|d| d.first_line <= first_line && d.name == name)
}

/// The qualified name of the function or class `name` whose code starts at line
/// `first_line` of `source` (3.10's `co_firstlineno`), if a `def` or `class` of that
/// name is there.
pub fn qualname_at(source: &str, first_line: u32, name: &str) -> Option<String> {
    find(&definitions(source), first_line, name).map(|d| d.qualname.clone())
}

/// Source files larger than this are not read.
const MAX_SOURCE_BYTES: u64 = 8 << 20;

/// Files remembered per process before the memo starts over.
const MAX_FILES: usize = 4096;

/// Bytes the definitions of one file may take: past it, the file's code objects are named
/// by `co_name` alone.
const MAX_FILE_NAMES_BYTES: usize = 16 << 20;

/// Bytes the definitions of all of a process's files may take before the memo starts over.
const MAX_NAMES_BYTES: usize = 64 << 20;

/// Reads one process's source files through its root, once each, and names its 3.10
/// code objects from them.
pub struct SourceNames {
    pid: u32,
    /// Per file: its definitions (sorted by line), or `None` when it cannot be read.
    files: HashMap<Arc<str>, Option<Vec<Definition>>>,
    /// What `files` holds, in bytes, about (names and definitions).
    bytes: usize,
}

impl SourceNames {
    pub fn new(pid: u32) -> SourceNames {
        SourceNames {
            pid,
            files: HashMap::new(),
            bytes: 0,
        }
    }

    /// The qualified name of the code object `name` that starts at `first_line` of
    /// `filename` (`co_filename`), `None` if the file cannot be read or has no such
    /// definition there.
    pub fn qualname(&mut self, filename: &str, first_line: u32, name: &str) -> Option<&str> {
        // `<frozen importlib._bootstrap>`, `<string>`: no file.
        if filename.starts_with('<') || filename.is_empty() || name.starts_with('<') {
            return None;
        }
        if !self.files.contains_key(filename) {
            let read = match read_source(self.pid, filename) {
                Ok(source) => {
                    let found = definitions_within(&source, MAX_FILE_NAMES_BYTES);
                    if found.is_none() {
                        log::debug!(
                            "pid {}: {} defines more names than lens-probe keeps for one \
                             file: its Python 3.10 methods are named by co_name alone",
                            self.pid,
                            crate::sys::text::printable(filename)
                        );
                    }
                    found
                }
                Err(error) => {
                    log::debug!(
                        "pid {}: cannot read {filename} ({error}): its Python 3.10 methods \
                         are named by co_name alone",
                        self.pid
                    );
                    None
                }
            };
            let (read, used) = match read {
                Some((definitions, used)) => (Some(definitions), used),
                None => (None, 0),
            };
            let bytes = used + filename.len();
            if self.files.len() >= MAX_FILES || self.bytes + bytes > MAX_NAMES_BYTES {
                self.files.clear();
                self.bytes = 0;
            }
            self.bytes += bytes;
            self.files.insert(filename.into(), read);
        }
        let definitions = self.files.get(filename)?.as_deref()?;
        find(definitions, first_line, name).map(|d| d.qualname.as_str())
    }
}

/// `open_how` of openat2(2).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `pid`'s file `filename` as that process sees it: an absolute path resolved inside
/// its root (`RESOLVE_IN_ROOT`: its symlinks cannot lead outside), a relative one
/// beneath its working directory; a regular file of at most `MAX_SOURCE_BYTES`.
fn read_source(pid: u32, filename: &str) -> std::io::Result<String> {
    let process = crate::sys::process::Process::new(pid);
    let (dir, resolve) = if filename.starts_with('/') {
        (process.root()?, libc::RESOLVE_IN_ROOT)
    } else {
        (process.working_directory()?, libc::RESOLVE_BENEATH)
    };
    let path = CString::new(filename).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let how = OpenHow {
        // Non-blocking: a FIFO must not hang the loader (it is refused below).
        flags: (libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK) as u64,
        mode: 0,
        resolve: resolve | libc::RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: openat2 with a valid directory descriptor, a NUL-terminated path and an
    // `open_how` of the size passed; it returns a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            path.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let file = unsafe { File::from_raw_fd(fd as i32) };
    let metadata = file.metadata()?;
    if !metadata.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if metadata.len() > MAX_SOURCE_BYTES {
        return Err(std::io::Error::other("larger than 8 MiB"));
    }
    let mut bytes = Vec::with_capacity(metadata.len() as usize);
    file.take(MAX_SOURCE_BYTES).read_to_end(&mut bytes)?;
    // Names and indentation are ASCII; a file in another encoding keeps them.
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (first line, name) → qualified name, for every definition of `source`.
    fn names(source: &str) -> Vec<(u32, String, String)> {
        definitions(source)
            .into_iter()
            .map(|d| (d.first_line, d.name, d.qualname))
            .collect()
    }

    fn owned(expected: &[(u32, &str, &str)]) -> Vec<(u32, String, String)> {
        expected
            .iter()
            .map(|(line, name, qualname)| (*line, name.to_string(), qualname.to_string()))
            .collect()
    }

    #[test]
    fn methods_are_named_by_their_classes() {
        let source = "\
import os

class Trainer:
    def __init__(self):
        self.x = 1

    def train_step(self, batch):
        return batch

def main():
    pass
";
        assert_eq!(
            names(source),
            owned(&[
                (3, "Trainer", "Trainer"),
                (4, "__init__", "Trainer.__init__"),
                (7, "train_step", "Trainer.train_step"),
                (10, "main", "main"),
            ])
        );
        assert_eq!(
            qualname_at(source, 7, "train_step").as_deref(),
            Some("Trainer.train_step")
        );
        assert_eq!(qualname_at(source, 10, "main").as_deref(), Some("main"));
    }

    #[test]
    fn nested_classes_and_async_methods() {
        let source = "\
class A:
    class B:
        async def fetch(self):
            pass
        async  def\tsecond(self): pass
    def after(self):
        pass
";
        assert_eq!(
            qualname_at(source, 3, "fetch").as_deref(),
            Some("A.B.fetch")
        );
        assert_eq!(
            qualname_at(source, 5, "second").as_deref(),
            Some("A.B.second")
        );
        assert_eq!(qualname_at(source, 6, "after").as_deref(), Some("A.after"));
        assert_eq!(qualname_at(source, 2, "B").as_deref(), Some("A.B"));
    }

    #[test]
    fn decorated_methods_start_at_their_first_decorator() {
        let source = "\
class Trainer:
    @property
    @functools.lru_cache(
        maxsize=None,
    )
    # a comment between
    def cached(self):
        pass

    @staticmethod
    def plain():
        pass
";
        // 3.10's co_firstlineno is the first decorator's line.
        assert_eq!(
            qualname_at(source, 2, "cached").as_deref(),
            Some("Trainer.cached")
        );
        assert_eq!(
            qualname_at(source, 7, "cached").as_deref(),
            Some("Trainer.cached")
        );
        assert_eq!(
            qualname_at(source, 10, "plain").as_deref(),
            Some("Trainer.plain")
        );
        assert_eq!(qualname_at(source, 1, "cached"), None);
    }

    #[test]
    fn nested_functions_are_locals_of_their_function() {
        let source = "\
def outer():
    def inner():
        class Local:
            def method(self):
                def deepest():
                    pass
        return Local
    if True:
        for _ in range(1):
            def in_a_block():
                pass
    return inner

if __name__ == '__main__':
    def guarded():
        pass

def pickles():
    global Picklable, other  # module-level names
    class Picklable:
        def method(self):
            pass
";
        assert_eq!(
            names(source),
            owned(&[
                (1, "outer", "outer"),
                (2, "inner", "outer.<locals>.inner"),
                (3, "Local", "outer.<locals>.inner.<locals>.Local"),
                (4, "method", "outer.<locals>.inner.<locals>.Local.method"),
                (
                    5,
                    "deepest",
                    "outer.<locals>.inner.<locals>.Local.method.<locals>.deepest"
                ),
                (10, "in_a_block", "outer.<locals>.in_a_block"),
                (15, "guarded", "guarded"),
                (18, "pickles", "pickles"),
                (20, "Picklable", "Picklable"),
                (21, "method", "Picklable.method"),
            ])
        );
    }

    #[test]
    fn class_in_comments_and_strings_is_not_a_class() {
        let source = "\
class Real:
    '''A docstring that mentions
class Fake:
    def nope(self):
    '''
    # class Commented:
    text = \"class Quoted: def f(): pass\"
    table = {
        'k': '''
def not_here():
''',
    }
    joined = 1 + \\
        2
    def method(self):
        s = 'it''s \\
class Continued:'
        return \"\"\"
def also_not():\"\"\"

    def second(self): pass
";
        assert_eq!(
            names(source),
            owned(&[
                (1, "Real", "Real"),
                (15, "method", "Real.method"),
                (21, "second", "Real.second"),
            ])
        );
    }

    #[test]
    fn tabs_and_spaces_indent_alike() {
        // A tab is up to the next multiple of 8 columns, as CPython's tokenizer counts.
        let source = concat!(
            "class T:\n",
            "\tdef a(self):\n",
            "\t\tpass\n",
            "\tclass U:\n",
            "\t        def b(self):\n",
            "\t        \tpass\n",
            "\tdef c(self):\r\n",
            "\t\tpass\r\n",
        );
        assert_eq!(
            names(source),
            owned(&[
                (1, "T", "T"),
                (2, "a", "T.a"),
                (4, "U", "T.U"),
                (5, "b", "T.U.b"),
                (7, "c", "T.c"),
            ])
        );
    }

    #[test]
    fn a_line_that_is_not_the_named_definition_names_nothing() {
        let source = "\
x = 1
class A:
    def m(self):
        f = lambda: 0
        return [y for y in range(3)]
define = 2
classy = 3
";
        assert_eq!(qualname_at(source, 1, "x"), None);
        // A stale file: another name at that line.
        assert_eq!(qualname_at(source, 3, "train_step"), None);
        assert_eq!(qualname_at(source, 4, "<lambda>"), None);
        assert_eq!(qualname_at(source, 6, "define"), None);
        assert_eq!(qualname_at(source, 7, "classy"), None);
        assert_eq!(qualname_at(source, 99, "m"), None);
        assert_eq!(qualname_at("", 1, "m"), None);
    }

    #[test]
    fn a_file_whose_names_outgrow_the_budget_names_nothing() {
        // Nested definitions: each name carries every enclosing one.
        let mut source = String::new();
        for depth in 0..90 {
            source.push_str(&" ".repeat(depth * 4));
            source.push_str(&format!("def level_{depth}_with_a_long_name():\n"));
        }
        let (all, used) = definitions_within(&source, usize::MAX).unwrap();
        assert_eq!(all.len(), 90);
        let names: usize = all.iter().map(|d| d.qualname.len()).sum();
        assert!(names > 100_000, "{names}");
        assert!(used >= names, "{used} < {names}");
        // Under a budget smaller than that: nothing, rather than all of it in memory.
        assert!(definitions_within(&source, 100_000).is_none());
        assert!(definitions_within(&source, 10 * used).is_some());
    }

    #[test]
    fn files_are_read_through_the_process_root() {
        let dir = std::env::temp_dir().join(format!("lens-source-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("trainer.py");
        std::fs::write(&file, "class Trainer:\n    def step(self):\n        pass\n").unwrap();
        let link = dir.join("escape.py");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/proc/self/root/etc/hostname", &link).unwrap();
        let mut names = SourceNames::new(std::process::id());
        let path = file.to_str().unwrap();
        assert_eq!(names.qualname(path, 2, "step"), Some("Trainer.step"));
        assert_eq!(names.qualname(path, 1, "step"), None);
        // Magic links, FIFOs, directories and missing files are refused.
        let pid = std::process::id();
        assert!(read_source(pid, link.to_str().unwrap()).is_err());
        // A FIFO would block a plain open: refused without waiting.
        let fifo = dir.join("fifo.py");
        let _ = std::fs::remove_file(&fifo);
        let fifo_path = CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo_path.as_ptr(), 0o600) }, 0);
        assert!(read_source(pid, fifo.to_str().unwrap()).is_err());
        assert!(read_source(pid, dir.to_str().unwrap()).is_err());
        assert!(read_source(pid, "/nonexistent/x.py").is_err());
        // A relative name is beneath the working directory (the package's, under cargo).
        assert!(read_source(pid, "src/python/source.rs").is_ok());
        assert!(read_source(pid, "../../../../../../etc/hostname").is_err());
        assert_eq!(names.qualname("/nonexistent/x.py", 1, "step"), None);
        assert_eq!(
            names.qualname("<frozen importlib._bootstrap>", 1, "f"),
            None
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
