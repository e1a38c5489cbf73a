//! Steps 1 and 2: the pinned toolchains (stable from rust-toolchain.toml, nightly with
//! rust-src) and bpf-linker built against the nightly's LLVM.

use std::fs;

use xtask::error::{Context, Error, Result};
use xtask::toolchain::{self, BPF_LINKER_VERSION, BpfLinkerInstall, LinkerLlvm, NIGHTLY};

use super::{first_line, run_streaming, step};

/// The workspace's `rust-toolchain.toml`: its `channel` is the pinned user-space toolchain.
const TOOLCHAIN_FILE: &str = include_str!("../../../rust-toolchain.toml");

const NO_RUSTUP: &str = "rustup not found on PATH or in ~/.cargo/bin: install rustup from https://rustup.rs, \
                         then rerun `cargo xtask setup`";

fn toolchain_version(name: &str) -> String {
    toolchain::capture(toolchain::proxy_command("rustc").args([&format!("+{name}"), "--version"]))
        .map(|v| first_line(&v).to_owned())
        .unwrap_or_else(|| "version unknown".into())
}

/// The user-space toolchain `rust-toolchain.toml` pins, with clippy and rustfmt (rustup may
/// already have installed it to run xtask itself; then this only reports it).
pub(super) fn stable(dry_run: bool) -> Result<()> {
    let what = "pinned toolchain (rust-toolchain.toml)";
    let channel = toolchain::toolchain_file_channel(TOOLCHAIN_FILE)
        .ok_or("rust-toolchain.toml has no `channel = \"...\"` line")?;
    if toolchain::toolchain_installed(&channel).ok_or(NO_RUSTUP)? {
        step(
            1,
            what,
            format!("already installed ({})", toolchain_version(&channel)),
        );
        return Ok(());
    }
    let mut cmd = toolchain::proxy_command("rustup");
    cmd.args(["toolchain", "install", &channel, "--profile", "minimal"])
        .args(["--component", "clippy", "--component", "rustfmt"]);
    step(
        1,
        what,
        format!(
            "not installed; running `{}`",
            toolchain::display_command(&cmd)
        ),
    );
    if dry_run {
        return Ok(());
    }
    run_streaming(&mut cmd).hint(format!("the workspace is built with {channel}"))
}

pub(super) fn nightly(dry_run: bool) -> Result<()> {
    let installed = toolchain::nightly_installed().ok_or(NO_RUSTUP)?;
    if installed {
        step(
            1,
            "nightly toolchain",
            format!("already installed ({})", toolchain_version(NIGHTLY)),
        );
    } else {
        // Pinned by date: bpf-linker is built against this nightly's LLVM.
        let mut cmd = toolchain::proxy_command("rustup");
        cmd.args(["toolchain", "install", NIGHTLY, "--profile", "minimal"])
            .args(["--component", "rust-src"]);
        step(
            1,
            "nightly toolchain",
            format!(
                "not installed; running `{}`",
                toolchain::display_command(&cmd)
            ),
        );
        if dry_run {
            step(1, "rust-src", "would be checked after installing nightly");
            return Ok(());
        }
        run_streaming(&mut cmd).hint(format!("the eBPF build needs the {NIGHTLY} toolchain"))?;
    }

    let sysroot = match toolchain::nightly_sysroot() {
        Some(s) => s,
        None if dry_run => return Ok(()),
        None => {
            return Err(format!(
                "`rustc +{NIGHTLY} --print sysroot` failed right after installing it: check `rustup toolchain list`"
            )
            .into());
        }
    };
    if toolchain::rust_src_installed(&sysroot) {
        step(
            1,
            "rust-src",
            format!(
                "already installed ({})",
                toolchain::rust_src_dir(&sysroot).display()
            ),
        );
        return Ok(());
    }
    let mut cmd = toolchain::proxy_command("rustup");
    cmd.args(["component", "add", "rust-src", "--toolchain", NIGHTLY]);
    step(
        1,
        "rust-src",
        format!("missing; running `{}`", toolchain::display_command(&cmd)),
    );
    if dry_run {
        return Ok(());
    }
    run_streaming(&mut cmd).hint(
        "rust-src is needed for `-Z build-std=core` (check network access to static.rust-lang.org)",
    )?;
    if !toolchain::rust_src_installed(&sysroot) {
        return Err(format!(
            "rust-src still missing after `rustup component add`: no {}",
            toolchain::rust_src_dir(&sysroot).display()
        )
        .into());
    }
    Ok(())
}

/// Derives the bpf-linker install command from the installed nightly.
fn bpf_linker_plan() -> Result<BpfLinkerInstall> {
    let vv =
        toolchain::capture(toolchain::proxy_command("rustc").args([&format!("+{NIGHTLY}"), "-vV"]))
            .ok_or_else(|| {
                format!(
                    "`rustc +{NIGHTLY} -vV` failed: is the {NIGHTLY} toolchain installed? (step 1)"
                )
            })?;
    let sysroot = toolchain::nightly_sysroot()
        .ok_or_else(|| format!("`rustc +{NIGHTLY} --print sysroot` failed"))?;
    let lib = sysroot.join("lib");
    let names: Vec<String> = fs::read_dir(&lib)
        .map_err(|e| Error::io("list", &lib, e))?
        .filter_map(|e| e.ok().and_then(|e| e.file_name().into_string().ok()))
        .collect();
    let root = toolchain::bpf_linker_root();
    Ok(BpfLinkerInstall::derive(
        &vv,
        &sysroot,
        names,
        root.as_deref(),
    )?)
}

pub(super) fn bpf_linker(dry_run: bool) -> Result<()> {
    let what = "bpf-linker";
    let found = toolchain::find_bpf_linker().map(|p| {
        let version = toolchain::bpf_linker_version(&p);
        (p, version)
    });
    let reason = match &found {
        Some((path, Some(v))) if toolchain::is_wanted_bpf_linker(v) => {
            match toolchain::bpf_linker_llvm(path) {
                Some(LinkerLlvm::Nightly) => {
                    step(
                        2,
                        what,
                        format!(
                            "already installed ({}: {v}, on {NIGHTLY}'s LLVM)",
                            path.display()
                        ),
                    );
                    if dry_run {
                        match bpf_linker_plan() {
                            Ok(plan) => {
                                step(2, what, format!("a rebuild would run: {}", plan.display()))
                            }
                            Err(e) => step(2, what, format!("a rebuild could not be derived: {e}")),
                        }
                    }
                    return Ok(());
                }
                Some(LinkerLlvm::Other(llvm)) => format!(
                    "{} is built on another LLVM ({llvm}) than {NIGHTLY}'s",
                    path.display()
                ),
                Some(LinkerLlvm::Static) => format!(
                    "{} links LLVM statically (which version is unknown)",
                    path.display()
                ),
                None => format!("cannot read {} or {NIGHTLY}'s sysroot", path.display()),
            }
        }
        Some((path, Some(v))) => format!("{} is `{v}`, not {BPF_LINKER_VERSION}", path.display()),
        Some((path, None)) => format!(
            "{} does not run (built against another LLVM?)",
            path.display()
        ),
        None => match toolchain::bpf_linker_root() {
            Some(root) => format!(
                "not found in {}/bin (${})",
                root.display(),
                toolchain::BPF_LINKER_ROOT_ENV
            ),
            None => "not found on PATH or in ~/.cargo/bin".to_owned(),
        },
    };
    let plan = bpf_linker_plan().context("cannot build bpf-linker")?;
    step(
        2,
        what,
        format!("{reason}; building {BPF_LINKER_VERSION} against {NIGHTLY}'s libLLVM (~2 min):"),
    );
    step(2, what, plan.display());
    if dry_run {
        return Ok(());
    }
    let mut cmd = toolchain::proxy_command("cargo");
    cmd.args(&plan.cargo_args)
        .env("CARGO_ENCODED_RUSTFLAGS", plan.encoded_rustflags());
    run_streaming(&mut cmd).hint(format!("could not build bpf-linker {BPF_LINKER_VERSION}"))?;
    let found = toolchain::find_bpf_linker();
    let version = found.as_deref().and_then(toolchain::bpf_linker_version);
    let llvm = found.as_deref().and_then(toolchain::bpf_linker_llvm);
    match (found, version, llvm) {
        (Some(path), Some(v), Some(LinkerLlvm::Nightly)) if toolchain::is_wanted_bpf_linker(&v) => {
            step(2, what, format!("installed ({}: {v})", path.display()));
            Ok(())
        }
        (path, version, llvm) => Err(format!(
            "bpf-linker was built but the one found ({path:?}) says {version:?}, LLVM {llvm:?}: \
             is another bpf-linker earlier on PATH? (or set ${})",
            toolchain::BPF_LINKER_ROOT_ENV
        )
        .into()),
    }
}
