//! Embeds the current BPF objects (the programs', and the bench generator's for
//! `throughput`): builds `lens-ebpf` with the same builder as
//! `cargo xtask build-ebpf`, so a plain `cargo build` never ships a stale object.
use std::{env, path::PathBuf};

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let workspace_root = manifest_dir
        .parent()
        .expect("lens-userspace sits in the workspace");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));

    for input in lens_ebpf_builder::ebpf::inputs(workspace_root) {
        println!("cargo::rerun-if-changed={}", input.display());
    }
    println!(
        "cargo::rerun-if-env-changed={}",
        lens_ebpf_builder::toolchain::BPF_LINKER_ROOT_ENV
    );
    let target_dir = workspace_root.join("target").join("bpf");
    match lens_ebpf_builder::ebpf::build(workspace_root, &target_dir, true) {
        Ok(object) => {
            let bench = lens_ebpf_builder::ebpf::bench_object_path(&target_dir, true);
            for (built, embedded) in [(object, "lens-ebpf.o"), (bench, "lens-ebpf-bench.o")] {
                if let Err(error) = std::fs::copy(&built, out_dir.join(embedded)) {
                    println!(
                        "cargo::error=cannot copy the BPF object {}: {error}",
                        built.display()
                    );
                }
            }
        }
        Err(error) => println!("cargo::error={error}"),
    }
}
