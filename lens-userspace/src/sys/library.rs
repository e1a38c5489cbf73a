//! The libraries lens-probe attaches to, and finding them in a process's mappings.
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use crate::error::{LensError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LibraryKind {
    /// `libcudart.so.*` (CUDA 12 and 13 runtimes, e.g. from pip's nvidia-cuda-runtime).
    CudaRuntime,
    /// The CUDA driver's user-space library `libcuda.so.1` (installed with the GPU
    /// driver, not by pip): what libcudart, cuBLAS, cuDNN and NCCL launch through.
    CudaDriver,
    /// `libnccl.so.*`.
    Nccl,
    /// The dynamic loader (`ld-linux-x86-64.so.2`), for `_dl_debug_state`.
    DynamicLoader,
    /// PyTorch's CPU library `libtorch_cpu.so`: autograd, scopes, serialization, gloo.
    TorchCpu,
    /// PyTorch's core `libc10.so`: grad mode.
    C10,
    /// PyTorch's Python bindings `libtorch_python.so`: the inference-mode guard.
    TorchPython,
    /// safetensors' extension module `_safetensors_rust.abi3.so`: checkpoint files.
    Safetensors,
    /// The C library `libc.so.6`: file creation. Every process maps it, so its probes
    /// go on each traced process alone (`probes::files`), never through `ALL`.
    Libc,
    /// Any other file (library or program) a configured probe rule names
    /// (`crate::settings::probe_rules`): only the rules' probes go there.
    Configured,
}

impl LibraryKind {
    pub const ALL: [LibraryKind; 8] = [
        LibraryKind::CudaRuntime,
        LibraryKind::CudaDriver,
        LibraryKind::Nccl,
        LibraryKind::DynamicLoader,
        LibraryKind::TorchCpu,
        LibraryKind::C10,
        LibraryKind::TorchPython,
        LibraryKind::Safetensors,
    ];

    /// Recognises a library by its file name (any version suffix).
    pub fn from_file_name(name: &str) -> Option<LibraryKind> {
        if name.starts_with("libcudart.so") {
            Some(LibraryKind::CudaRuntime)
        } else if name.starts_with("libcuda.so") {
            Some(LibraryKind::CudaDriver)
        } else if name.starts_with("libnccl.so") {
            Some(LibraryKind::Nccl)
        } else if name == "libtorch_cpu.so" {
            Some(LibraryKind::TorchCpu)
        } else if name == "libc10.so" {
            Some(LibraryKind::C10)
        } else if name == "libtorch_python.so" {
            Some(LibraryKind::TorchPython)
        } else if name.starts_with("_safetensors_rust.") && name.ends_with(".so") {
            Some(LibraryKind::Safetensors)
        } else if name.starts_with("ld-linux") && name.contains(".so") {
            Some(LibraryKind::DynamicLoader)
        } else {
            None
        }
    }

    pub const fn display_name(self) -> &'static str {
        match self {
            LibraryKind::CudaRuntime => "libcudart",
            LibraryKind::CudaDriver => "libcuda",
            LibraryKind::Nccl => "libnccl",
            LibraryKind::DynamicLoader => "ld.so",
            LibraryKind::TorchCpu => "libtorch_cpu",
            LibraryKind::C10 => "libc10",
            LibraryKind::TorchPython => "libtorch_python",
            LibraryKind::Safetensors => "safetensors",
            LibraryKind::Libc => "libc",
            LibraryKind::Configured => "the library",
        }
    }
}

/// Identity of a mapped file: uprobes are keyed by inode, so this is what is attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

/// A library as one process mapped it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappedLibrary {
    pub kind: LibraryKind,
    pub file: FileId,
    /// The path the process's maps show (for people; never trusted for attaching).
    pub shown_path: PathBuf,
    /// A path that resolves to exactly the mapped file: `/proc/PID/map_files/START-END`.
    pub open_path: PathBuf,
}

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapsEntry {
    pub start: u64,
    pub end: u64,
    /// Where in the file the mapping starts.
    pub offset: u64,
    /// Mapped executable (`r-xp`): code.
    pub executable: bool,
    pub file: FileId,
    pub path: String,
}

/// Parses the file-backed lines of `/proc/PID/maps`.
pub fn parse_maps(text: &str) -> Vec<MapsEntry> {
    text.lines().filter_map(parse_maps_line).collect()
}

fn parse_maps_line(line: &str) -> Option<MapsEntry> {
    // start-end perms offset major:minor inode path (path may contain spaces)
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let offset = fields.next()?;
    let dev = fields.next()?;
    let ino: u64 = fields.next()?.parse().ok()?;
    let path = fields.next()?.trim_start();
    if ino == 0 || !path.starts_with('/') {
        return None;
    }
    let (start, end) = range.split_once('-')?;
    let (major, minor) = dev.split_once(':')?;
    let major = u64::from_str_radix(major, 16).ok()?;
    let minor = u64::from_str_radix(minor, 16).ok()?;
    Some(MapsEntry {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        offset: u64::from_str_radix(offset, 16).ok()?,
        executable: perms.as_bytes().get(2) == Some(&b'x'),
        // The kernel's new_encode_dev layout, as stat() reports st_dev.
        file: FileId {
            dev: (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12),
            ino,
        },
        path: path.strip_suffix(" (deleted)").unwrap_or(path).to_string(),
    })
}

/// The libraries of interest that process `pid` maps, one per file.
pub fn find_libraries(pid: u32) -> Result<Vec<MappedLibrary>> {
    find_libraries_with(pid, &|_| false)
}

/// [`find_libraries`], and the other files `pid` maps that `configured` says a
/// configured probe rule names ([`LibraryKind::Configured`]).
pub fn find_libraries_with(
    pid: u32,
    configured: &dyn Fn(&Path) -> bool,
) -> Result<Vec<MappedLibrary>> {
    let maps_path = PathBuf::from(format!("/proc/{pid}/maps"));
    let text = fs::read_to_string(&maps_path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            LensError::NoSuchProcess(pid)
        } else {
            LensError::ReadProc {
                path: maps_path.clone(),
                source,
            }
        }
    })?;
    Ok(libraries_in_with(pid, &parse_maps(&text), configured))
}

/// The C library `pid` maps (`libc.so.6`), if any.
pub fn find_libc(pid: u32) -> Result<Option<MappedLibrary>> {
    let maps_path = PathBuf::from(format!("/proc/{pid}/maps"));
    let text = fs::read_to_string(&maps_path).map_err(|source| LensError::ReadProc {
        path: maps_path.clone(),
        source,
    })?;
    Ok(parse_maps(&text)
        .into_iter()
        .find(|entry| {
            Path::new(&entry.path)
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|name| name.starts_with("libc.so") || name.starts_with("libc-2."))
        })
        .map(|entry| MappedLibrary {
            kind: LibraryKind::Libc,
            file: entry.file,
            shown_path: PathBuf::from(&entry.path),
            open_path: PathBuf::from(format!(
                "/proc/{pid}/map_files/{:x}-{:x}",
                entry.start, entry.end
            )),
        }))
}

pub fn libraries_in(pid: u32, entries: &[MapsEntry]) -> Vec<MappedLibrary> {
    libraries_in_with(pid, entries, &|_| false)
}

fn libraries_in_with(
    pid: u32,
    entries: &[MapsEntry],
    configured: &dyn Fn(&Path) -> bool,
) -> Vec<MappedLibrary> {
    let mut by_file: BTreeMap<FileId, MappedLibrary> = BTreeMap::new();
    for entry in entries {
        let Some(name) = Path::new(&entry.path).file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(kind) = LibraryKind::from_file_name(name)
            .or_else(|| configured(Path::new(&entry.path)).then_some(LibraryKind::Configured))
        else {
            continue;
        };
        by_file.entry(entry.file).or_insert_with(|| MappedLibrary {
            kind,
            file: entry.file,
            shown_path: PathBuf::from(&entry.path),
            open_path: PathBuf::from(format!(
                "/proc/{pid}/map_files/{:x}-{:x}",
                entry.start, entry.end
            )),
        });
    }
    by_file.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 1311 /work/trainer
7f1000000000-7f1000100000 r-xp 00002000 fd:01 2222 /venv/nvidia/cuda_runtime/lib/libcudart.so.12
7f1000200000-7f1000300000 r--p 00000000 fd:01 2222 /venv/nvidia/cuda_runtime/lib/libcudart.so.12
7f1000400000-7f1000500000 r-xp 00000000 103:02 3333 /opt/my libs/libnccl.so.2 (deleted)
7f1000600000-7f1000601000 rw-p 00000000 00:00 0 
7f1000700000-7f1000729000 r-xp 00001000 fd:01 4444 /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
7f1000800000-7f1000900000 r-xp 00000000 fd:01 5555 /usr/lib/libcudnn.so.9
";

    #[test]
    fn finds_each_library_once_with_an_exact_open_path() {
        let libraries = libraries_in(42, &parse_maps(MAPS));
        let kinds: Vec<LibraryKind> = libraries.iter().map(|l| l.kind).collect();
        assert_eq!(
            kinds,
            [
                LibraryKind::CudaRuntime,
                LibraryKind::DynamicLoader,
                LibraryKind::Nccl
            ]
        );
        let cudart = &libraries[0];
        assert_eq!(
            cudart.open_path,
            Path::new("/proc/42/map_files/7f1000000000-7f1000100000")
        );
        assert_eq!(
            cudart.file,
            FileId {
                dev: 0xfd01,
                ino: 2222
            }
        );
    }

    #[test]
    fn paths_with_spaces_and_deleted_files_are_kept_whole() {
        let libraries = libraries_in(1, &parse_maps(MAPS));
        let nccl = libraries
            .iter()
            .find(|l| l.kind == LibraryKind::Nccl)
            .unwrap();
        assert_eq!(nccl.shown_path, Path::new("/opt/my libs/libnccl.so.2"));
        assert_eq!(nccl.file.dev, (0x103 << 8) | 0x02);
    }

    #[test]
    fn library_names_are_recognised_with_any_version_suffix() {
        assert_eq!(
            LibraryKind::from_file_name("libcudart.so.13"),
            Some(LibraryKind::CudaRuntime)
        );
        assert_eq!(
            LibraryKind::from_file_name("libcudart.so.12.9.79"),
            Some(LibraryKind::CudaRuntime)
        );
        assert_eq!(
            LibraryKind::from_file_name("libnccl.so"),
            Some(LibraryKind::Nccl)
        );
        assert_eq!(LibraryKind::from_file_name("libnccl-net.so"), None);
        assert_eq!(
            LibraryKind::from_file_name("libcuda.so.1"),
            Some(LibraryKind::CudaDriver)
        );
        assert_eq!(
            LibraryKind::from_file_name("libcuda.so.580.95.05"),
            Some(LibraryKind::CudaDriver)
        );
        assert_eq!(LibraryKind::from_file_name("libcudart_static.a"), None);
    }
}
