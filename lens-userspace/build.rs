//! Embeds the current BPF objects (the programs', and the bench generator's for
//! `throughput`): builds `lens-ebpf` with the same builder as
//! `cargo xtask build-ebpf`, so a plain `cargo build` never ships a stale object.
//! Also generates the timeline's protobuf types from Perfetto's trimmed protos
//! (`proto/perfetto`).
use std::{env, path::PathBuf};

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let workspace_root = manifest_dir
        .parent()
        .expect("lens-userspace sits in the workspace");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));
    generate_perfetto_types(&manifest_dir.join("proto").join("perfetto"));

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

/// `perfetto.protos.rs` in `OUT_DIR`, from the trace protos under `root`.
fn generate_perfetto_types(root: &std::path::Path) {
    println!("cargo::rerun-if-changed={}", root.display());
    let trace = root.join("protos/perfetto/trace/trace.proto");
    let descriptors = match protox::compile([&trace], [root]) {
        Ok(descriptors) => descriptors,
        Err(error) => {
            println!("cargo::error=cannot compile Perfetto's protos: {error}");
            return;
        }
    };
    if let Err(error) = prost_build::Config::new().compile_fds(descriptors) {
        println!("cargo::error=cannot generate Perfetto's protobuf types: {error}");
    }
}
