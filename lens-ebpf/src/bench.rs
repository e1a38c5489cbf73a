//! The bench generator's BPF object (`lens-ebpf-bench`): `bench_gen.rs` and the ring
//! buffer it writes into, nothing else. Kept out of lens-probe's object so that what
//! lens-probe loads on a node carries no test program.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod bench_gen;
#[cfg(target_arch = "bpf")]
mod ring;

#[cfg(target_arch = "bpf")]
mod runtime;

/// Built for the host only so that `cargo clippy --workspace` and `cargo check` work; the
/// real object is built for `bpfel-unknown-none` by `cargo xtask build-ebpf`.
#[cfg(not(target_arch = "bpf"))]
fn main() {}
