//! Project automation for lens-probe.
//!
//! The library half is shared by `cargo xtask` and by lens-userspace's build script:
//! [`ebpf::build`] compiles the `lens-ebpf` crate for `bpfel-unknown-none` with the
//! nightly toolchain and returns the BPF object. It is std-only on purpose.
//!
//! - [`ebpf`]: the eBPF builder ([`ebpf::build`], [`ebpf::inputs`], [`ebpf::check_toolchain`]).
//! - [`toolchain`]: locating rustup/cargo/bpf-linker and the pure parsing helpers behind
//!   `cargo xtask setup` (LLVM major, the nightly's libLLVM name).
//! - [`pypi`]: where `cargo xtask setup` puts the real NVIDIA libraries (PyPI wheels).
//! - [`torch_venv`]: the cached Python 3.13 venv with PyPI PyTorch and NeMo Lens that
//!   `cargo xtask setup` creates for the real-PyTorch integration tests.

pub mod ebpf;
pub mod pypi;
pub mod toolchain;
pub mod torch_venv;

pub use ebpf::BuildError;
