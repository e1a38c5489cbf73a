//! Project automation for lens-probe (`cargo xtask`). The eBPF builder it shares with
//! lens-userspace's build script is the std-only crate `lens-ebpf-builder`
//! (`xtask/ebpf-builder`), re-exported here as [`ebpf`] and [`toolchain`].
//!
//! - [`error`]: the one error type of every command, printed as one line.
//! - [`pypi`]: where `cargo xtask setup` puts the real NVIDIA libraries (PyPI wheels).
//! - [`torch_venv`]: the cached Python 3.13 venv with PyPI PyTorch and NeMo Lens that
//!   `cargo xtask setup` creates for the real-PyTorch integration tests.

pub use error::{Context, Error, Result};
pub use lens_ebpf_builder::{BuildError, ebpf, toolchain};

pub mod error;
pub mod pypi;
pub mod torch_venv;
