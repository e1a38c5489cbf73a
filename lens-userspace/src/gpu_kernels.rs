//! GPU kernel names: the launches the (OS) kernel counts per (process, phase epoch, kernel), read
//! back by the session and named here. A runtime launch's kernel argument is the host
//! stub, a function whose ELF symbol is the kernel's mangled C++ name; a driver launch's
//! is a `CUfunction` handle, driver heap memory that no symbol names. Libraries shipped
//! without the stubs' symbols (PyTorch's `libtorch_cuda.so`) are named from the kernel
//! registry: nvcc's module constructors pass each stub with its mangled name to
//! `__cudaRegisterFunction`, which a probe records (stub → address of the name in the
//! process), and the name is read from the process's memory. Names are remembered per
//! library build-id and per process, so each stub is looked up once.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::PathBuf,
    sync::Arc,
};

use crate::sys::{library::FileId, process::Process, symbols};

/// Launches of one kernel by one process in one phase epoch (the epoch a phase mark
/// opens: see `lens_common::Event::epoch`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelLaunches {
    pub epoch: u64,
    /// Demangled when the symbol is a C++ name; see [`KernelNames`] for the others.
    pub name: Arc<str>,
    pub launches: u64,
}

/// What a library's names are remembered under: its build-id, or the file itself.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum LibraryKey {
    BuildId(Vec<u8>),
    File(FileId),
}

/// A mapped file to look stubs up in: a path to read it, its name for people, and the
/// wanted (function, file offset) pairs.
struct FileLookup {
    path: PathBuf,
    name: String,
    wanted: Vec<(u64, u64)>,
}

/// Libraries whose lookups are remembered before the memo starts over.
const LIBRARIES_KEPT: usize = 64;

/// Names kernel arguments, with caches per process and per library.
#[derive(Debug, Default)]
pub struct KernelNames {
    /// (function, driver) → name, per process.
    by_process: HashMap<u32, HashMap<(u64, bool), Arc<str>>>,
    /// Names by file offset, per library (`None`: no function there).
    by_library: HashMap<LibraryKey, HashMap<u64, Option<Arc<str>>>>,
}

impl KernelNames {
    /// The name of each of `pid`'s kernel arguments (`(function, driver)`), looked up now
    /// for those not seen before; `registered` gives the address of the name a stub was
    /// registered with in `pid` (`__cudaRegisterFunction`), if it was.
    pub fn resolve(
        &mut self,
        pid: u32,
        functions: &[(u64, bool)],
        registered: &dyn Fn(u64) -> Option<u64>,
    ) -> Vec<Arc<str>> {
        let known = self.by_process.entry(pid).or_default();
        let missing: Vec<u64> = functions
            .iter()
            .filter(|(function, driver)| !driver && !known.contains_key(&(*function, false)))
            .map(|(function, _)| *function)
            .collect::<HashSet<u64>>()
            .into_iter()
            .collect();
        if !missing.is_empty() {
            let found = self.look_up(pid, &missing, registered);
            let known = self.by_process.entry(pid).or_default();
            for function in missing {
                let name = found
                    .get(&function)
                    .cloned()
                    .unwrap_or_else(|| Arc::from(format!("{function:#x}")));
                known.insert((function, false), name);
            }
        }
        let known = self.by_process.entry(pid).or_default();
        functions
            .iter()
            .map(|&(function, driver)| {
                known
                    .entry((function, driver))
                    .or_insert_with(|| Arc::from(format!("CUfunction {function:#x}")))
                    .clone()
            })
            .collect()
    }

    /// `pid` ended: its addresses mean nothing any more.
    pub fn forget(&mut self, pid: u32) {
        self.by_process.remove(&pid);
    }

    /// Host stubs → names through `pid`'s mappings: the library mapped there, the file
    /// offset, its symbols, else the name the stub was registered with. A stub named by
    /// neither is `library+0xOFFSET`; one outside any file (JIT code) keeps its address.
    fn look_up(
        &mut self,
        pid: u32,
        functions: &[u64],
        registered: &dyn Fn(u64) -> Option<u64>,
    ) -> HashMap<u64, Arc<str>> {
        let mut names = HashMap::new();
        let registered_name = |function: u64| {
            let address = registered(function)?;
            let raw = read_c_string(pid, address)?;
            Some(Arc::<str>::from(demangle(&raw)))
        };
        let process = Process::new(pid);
        let Ok(entries) = process.mappings() else {
            return names;
        };
        // Per mapped file: its path to read, and (function, file offset) pairs.
        let mut per_file: BTreeMap<FileId, FileLookup> = BTreeMap::new();
        for &function in functions {
            let Some(entry) = entries
                .iter()
                .find(|e| function >= e.start && function < e.end)
            else {
                if let Some(name) = registered_name(function) {
                    names.insert(function, name);
                }
                continue;
            };
            let file_name = std::path::Path::new(&entry.path)
                .file_name()
                .map_or_else(|| entry.path.clone(), |n| n.to_string_lossy().into_owned());
            per_file
                .entry(entry.file)
                .or_insert_with(|| FileLookup {
                    path: process.mapped_file(entry),
                    name: file_name,
                    wanted: Vec::new(),
                })
                .wanted
                .push((function, function - entry.start + entry.offset));
        }
        for (file, lookup) in per_file {
            let FileLookup {
                path,
                name: file_name,
                wanted,
            } = lookup;
            let key = match symbols::build_id(&path) {
                Ok(Some(id)) => LibraryKey::BuildId(id),
                Ok(None) => LibraryKey::File(file),
                Err(error) => {
                    log::debug!("kernel names: {error}");
                    continue;
                }
            };
            if !self.by_library.contains_key(&key) && self.by_library.len() >= LIBRARIES_KEPT {
                self.by_library.clear();
            }
            let memo = self.by_library.entry(key).or_default();
            let unknown: Vec<u64> = wanted
                .iter()
                .map(|(_, offset)| *offset)
                .filter(|offset| !memo.contains_key(offset))
                .collect();
            if !unknown.is_empty() {
                match symbols::functions_at(&path, &unknown) {
                    Ok(found) => {
                        for offset in unknown {
                            let name = found.get(&offset).map(|raw| Arc::from(demangle(raw)));
                            memo.insert(offset, name);
                        }
                    }
                    Err(error) => log::debug!("kernel names: {error}"),
                }
            }
            for (function, offset) in wanted {
                let name = match memo.get(&offset) {
                    Some(Some(name)) => name.clone(),
                    _ => match registered_name(function) {
                        // Remembered for the library: other ranks map it too.
                        Some(name) => {
                            memo.insert(offset, Some(name.clone()));
                            name
                        }
                        None => Arc::from(format!("{file_name}+{offset:#x}")),
                    },
                };
                names.insert(function, name);
            }
        }
        names
    }
}

/// The longest kernel name read from a process (mangled template names run long).
const MAX_NAME_BYTES: usize = 4096;

/// The NUL-terminated string at `address` in `pid`'s memory, if readable and UTF-8.
fn read_c_string(pid: u32, address: u64) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let mem = Process::new(pid).memory().ok()?;
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 256];
    while bytes.len() < MAX_NAME_BYTES {
        let read = mem
            .read_at(&mut chunk, address.checked_add(bytes.len() as u64)?)
            .ok()?;
        if read == 0 {
            return None;
        }
        if let Some(end) = chunk[..read].iter().position(|b| *b == 0) {
            bytes.extend_from_slice(&chunk[..end]);
            return String::from_utf8(bytes).ok().filter(|s| !s.is_empty());
        }
        bytes.extend_from_slice(&chunk[..read]);
    }
    None
}

/// A C++ symbol demangled (`_ZN2at6native…` → `void at::native::…(…)`); any other
/// name as it is.
pub fn demangle(raw: &str) -> String {
    cpp_demangle::Symbol::new(raw)
        .ok()
        .and_then(|symbol| {
            symbol
                .demangle(&cpp_demangle::DemangleOptions::default())
                .ok()
        })
        .unwrap_or_else(|| raw.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpp_names_are_demangled_and_c_names_kept() {
        assert_eq!(
            demangle("_ZN6fakenn11gemm_kernelIfLi128EEEvPKT_S3_PS1_i"),
            "void fakenn::gemm_kernel<float, 128>(float const*, float const*, float*, int)"
        );
        assert_eq!(demangle("kernel_stub"), "kernel_stub");
    }

    /// Naming functions of the real libtorch_cpu.so (~450 MB, 546 k static symbols): the
    /// time one look-up takes (a whole scan of its symbol tables), printed.
    /// `cargo test -p lens-userspace --lib kernels -- --ignored --nocapture`
    #[test]
    #[ignore = "needs libtorch_cpu.so; measures time"]
    fn libtorch_functions_are_named_in_one_scan() {
        use lens_common::ProbeId;
        let library = std::env::var_os("LENS_LIBTORCH_CPU")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let home = PathBuf::from(std::env::var_os("HOME").unwrap());
                home.join(
                    ".cache/lens-probe/torch-venv/lib/python3.13/site-packages/torch/lib/\
                     libtorch_cpu.so",
                )
            });
        let wanted = [
            crate::probes::catalog::symbol(ProbeId::TorchBackward),
            crate::probes::catalog::symbol(ProbeId::TorchScopeEnter),
            crate::probes::catalog::symbol(ProbeId::CheckpointWriterClose),
        ];
        let offsets = symbols::resolve_file_offsets(&library, &wanted).unwrap();
        let at: Vec<u64> = wanted.iter().map(|name| offsets[*name]).collect();
        let start = std::time::Instant::now();
        let names = symbols::functions_at(&library, &at).unwrap();
        println!(
            "{} of {} functions named in {:?}",
            names.len(),
            at.len(),
            start.elapsed()
        );
        for (name, offset) in wanted.iter().zip(&at) {
            assert_eq!(names.get(offset).map(String::as_str), Some(*name));
        }
        assert!(demangle(&names[&at[0]]).starts_with("torch::autograd::Engine::execute("));
    }

    #[test]
    fn driver_handles_are_named_as_handles() {
        let mut names = KernelNames::default();
        let got = names.resolve(std::process::id(), &[(0x1234, true)], &|_| None);
        assert_eq!(&*got[0], "CUfunction 0x1234");
    }

    #[test]
    fn a_function_of_this_process_is_named_by_its_symbol() {
        let mut names = KernelNames::default();
        let function = demangle as fn(&str) -> String as usize as u64;
        let got = names.resolve(std::process::id(), &[(function, false)], &|_| None);
        assert!(
            got[0].contains("demangle"),
            "{} (test binaries keep their .symtab)",
            got[0]
        );
        let anonymous = names.resolve(std::process::id(), &[(0x10, false)], &|_| None);
        assert_eq!(&*anonymous[0], "0x10");
    }

    #[test]
    fn a_stub_without_a_symbol_is_named_as_it_was_registered() {
        // As nvcc's module constructor passes it: the mangled name, in the process.
        static NAME: &[u8] = b"_ZN6fakenn17layer_norm_kernelIfEEvPKT_Pfi\0";
        let mut names = KernelNames::default();
        let registered = |function: u64| (function == 0x10).then_some(NAME.as_ptr() as u64);
        let got = names.resolve(
            std::process::id(),
            &[(0x10, false), (0x20, false)],
            &registered,
        );
        assert_eq!(
            &*got[0],
            "void fakenn::layer_norm_kernel<float>(float const*, float*, int)"
        );
        assert_eq!(&*got[1], "0x20", "not registered: its address");
    }
}
