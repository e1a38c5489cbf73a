//! The eBPF builder, std-only: lens-userspace's build script and `cargo xtask` both
//! build the BPF object with it, so a plain `cargo build` never ships a stale one.
//!
//! - [`ebpf`]: compiles the `lens-ebpf` crate for `bpfel-unknown-none` with the nightly
//!   toolchain ([`ebpf::build`], [`ebpf::inputs`], [`ebpf::check_toolchain`]).
//! - [`toolchain`]: locating rustup, cargo and bpf-linker, and the pure parsing helpers
//!   behind `cargo xtask setup` (LLVM major, the nightly's libLLVM name).

pub mod ebpf;
pub mod toolchain;

pub use ebpf::BuildError;
