//! `cargo xtask setup`: installs what the build and the tests need. Idempotent: every step
//! checks first and is skipped when already done. Errors are one line.

mod packages;
mod toolchains;
mod venv;

use std::process::{Command, Stdio};
use std::time::Instant;

use xtask::error::{Error, Result};
use xtask::toolchain;

use packages::{gcc, promtool, pypi_wheels, slurm};
use toolchains::{bpf_linker, nightly, stable};
use venv::torch_venv_step;

pub fn run(dry_run: bool) -> Result<()> {
    let start = Instant::now();
    println!(
        "xtask setup{}",
        if dry_run {
            " (dry run: nothing is changed)"
        } else {
            ""
        }
    );
    stable(dry_run)?;
    nightly(dry_run)?;
    bpf_linker(dry_run)?;
    pypi_wheels(dry_run)?;
    gcc(dry_run)?;
    torch_venv_step(dry_run)?;
    slurm(dry_run)?;
    promtool(dry_run)?;
    println!("xtask setup: done in {:.1}s", start.elapsed().as_secs_f64());
    Ok(())
}

/// The number of steps, for the `[n/STEPS]` prefix.
const STEPS: u32 = 7;

pub(super) fn step(n: u32, what: &str, msg: impl AsRef<str>) {
    println!("  [{n}/{STEPS}] {what}: {}", msg.as_ref());
}

/// Runs `cmd` with inherited stdout/stderr; `Err` is one line naming the command.
pub(super) fn run_streaming(cmd: &mut Command) -> Result<()> {
    let shown = toolchain::display_command(cmd);
    run_streaming_shown(cmd, &shown)
}

/// [`run_streaming`], naming the command as `shown`.
pub(super) fn run_streaming_shown(cmd: &mut Command, shown: &str) -> Result<()> {
    match cmd.stdin(Stdio::null()).status() {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(Error::Failed {
            command: shown.to_owned(),
            status,
        }),
        Err(source) => Err(Error::Spawn {
            command: shown.to_owned(),
            source,
        }),
    }
}

pub(super) fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("").trim()
}
