//! Builds the C fixtures (fake libcudart.so.12 / libnccl.so.2, `trainer`,
//! `real_libs_caller`) with `fixtures/build.sh` into `$OUT_DIR/fixtures` and exports
//! that directory to the crate as `LENS_FIXTURES_DIR`.

use std::path::PathBuf;
use std::process::Command;

const FIXTURE_FILES: &[&str] = &[
    "fixtures/build.sh",
    "fixtures/fake_cudart.c",
    "fixtures/fake_cuda.c",
    "fixtures/fake_nccl.c",
    "fixtures/trainer.c",
    "fixtures/real_libs_caller.c",
    "fixtures/fake_torch.c",
    "fixtures/fake_torch_cuda.c",
    "fixtures/fake_c10.c",
    "fixtures/fake_torch_symbols.h",
    "fixtures/trainer_torch.c",
    "fixtures/variety_caller.c",
    "fixtures/hammer.c",
    "fixtures/collective_rank.c",
    "fixtures/threads_dlopen.c",
    "fixtures/memory_user.c",
    "fixtures/fake_nccl.map",
    "fixtures/configured_lib.c",
    "fixtures/configured_trainer.c",
    "fixtures/fake_torch_python.c",
    "fixtures/throwing_libs.cpp",
    "fixtures/throwing_trainer.cpp",
];

fn main() {
    let manifest_dir =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("fixtures");

    for file in FIXTURE_FILES {
        println!(
            "cargo::rerun-if-changed={}",
            manifest_dir.join(file).display()
        );
    }
    println!("cargo::rerun-if-env-changed=LENS_FIXTURES_CC");

    let script = manifest_dir.join("fixtures/build.sh");
    let output = Command::new("bash").arg(&script).arg(&out_dir).output();
    match output {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let stdout = String::from_utf8_lossy(&out.stdout);
            // Make the script's own words visible, one `cargo::error` per line.
            println!(
                "cargo::error=lens-tests: building the C test fixtures failed ({} {} exited with {}); \
                 gcc is needed to build them",
                script.display(),
                out_dir.display(),
                out.status
            );
            for line in stdout
                .lines()
                .chain(stderr.lines())
                .filter(|l| !l.trim().is_empty())
            {
                println!("cargo::error=  {line}");
            }
            return;
        }
        Err(e) => {
            println!(
                "cargo::error=lens-tests: could not run `bash {}`: {e} (bash and gcc are needed to build the C test fixtures)",
                script.display()
            );
            return;
        }
    }

    println!("cargo::rustc-env=LENS_FIXTURES_DIR={}", out_dir.display());
}
