//! The real NVIDIA libraries from PyPI wheels (usable without a GPU), installed by
//! `cargo xtask setup` into a cache directory with `pip install --target`.

use std::path::{Path, PathBuf};

/// Overrides the cache directory.
pub const CACHE_ENV: &str = "LENS_PYPI_CACHE";

/// The pinned wheels (`pip` requirement specifiers).
pub const REQUIREMENTS: &[&str] = &[
    "nvidia-nccl-cu12==2.32.3",
    "nvidia-cuda-runtime-cu12==12.9.79",
];

/// libnccl, relative to the cache directory.
pub const NCCL_LIB: &str = "nvidia/nccl/lib/libnccl.so.2";
/// libcudart 12, relative to the cache directory.
pub const CUDART_LIB: &str = "nvidia/cuda_runtime/lib/libcudart.so.12";

/// `$LENS_PYPI_CACHE`, else `$HOME/.cache/lens-probe/pypi`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(CACHE_ENV).filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    crate::toolchain::home_dir()
        .unwrap_or_else(|| PathBuf::from("/root"))
        .join(".cache")
        .join("lens-probe")
        .join("pypi")
}

/// The library files the wheels provide, in `dir`.
pub fn libraries(dir: &Path) -> [PathBuf; 2] {
    [dir.join(NCCL_LIB), dir.join(CUDART_LIB)]
}

/// Whether both libraries are already in `dir`.
pub fn installed(dir: &Path) -> bool {
    libraries(dir).iter().all(|p| p.is_file())
}
