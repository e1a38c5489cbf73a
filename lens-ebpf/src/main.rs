//! lens-probe's BPF programs: uprobes on the CUDA runtime, NCCL and the dynamic loader.
//!
//! Each program is attached to one or more functions; the attach cookie is the
//! [`ProbeId`] of the function, so one program serves every function of the same shape.
//! Calls that need a duration (collectives, sync waits, communicator init) keep their
//! entry record in an `INFLIGHT_*` map until the return probe pairs it and sends one
//! record ([`lens_common::record`]).
//! Launches are only counted, in their process's `TARGETS` entry.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// An atomic add on shared counters (a target's launches): the BPF target has no
// `AtomicU64::fetch_add`, but the intrinsic lowers to BPF's atomic add.
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

// First: the macros that declare a program and its uprobe_multi twin.
#[cfg(target_arch = "bpf")]
#[macro_use]
mod twins;

// One module per concern; the programs are the `pub fn`s with a program attribute (or
// declared by `uprobe_and_multi!`).
#[cfg(target_arch = "bpf")]
mod api_calls;
#[cfg(target_arch = "bpf")]
mod ctx;
#[cfg(target_arch = "bpf")]
mod cuda;
#[cfg(target_arch = "bpf")]
mod grad_mode;
#[cfg(target_arch = "bpf")]
mod launches;
#[cfg(target_arch = "bpf")]
mod loader;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod nccl;
#[cfg(target_arch = "bpf")]
mod phases;
#[cfg(target_arch = "bpf")]
mod python;
#[cfg(target_arch = "bpf")]
mod returns;
#[cfg(target_arch = "bpf")]
mod ring;
#[cfg(target_arch = "bpf")]
mod rules;
#[cfg(target_arch = "bpf")]
mod sched;
#[cfg(target_arch = "bpf")]
mod task;

#[cfg(target_arch = "bpf")]
mod runtime;

/// Built for the host only so that `cargo clippy --workspace` and `cargo check` work; the
/// real object is built for `bpfel-unknown-none` by `cargo xtask build-ebpf`.
#[cfg(not(target_arch = "bpf"))]
fn main() {}
