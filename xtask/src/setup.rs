//! `cargo xtask setup`: installs what the build and the tests need. Idempotent: every step
//! checks first and is skipped when already done. Errors are one line.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use xtask::error::{self, Context, Error, Result};
use xtask::pypi;
use xtask::torch_venv;

use xtask::toolchain::{self, BPF_LINKER_VERSION, BpfLinkerInstall, LinkerLlvm, NIGHTLY};

/// The workspace's `rust-toolchain.toml`: its `channel` is the pinned user-space toolchain.
const TOOLCHAIN_FILE: &str = include_str!("../../rust-toolchain.toml");

/// An optional local wheel directory, used (as an optimisation only) when it exists.
const LOCAL_WHEELS: &str = "/tmp/wheels";

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

fn step(n: u32, what: &str, msg: impl AsRef<str>) {
    println!("  [{n}/{STEPS}] {what}: {}", msg.as_ref());
}

/// Runs `cmd` with inherited stdout/stderr; `Err` is one line naming the command.
fn run_streaming(cmd: &mut Command) -> Result<()> {
    let shown = toolchain::display_command(cmd);
    run_streaming_shown(cmd, &shown)
}

/// [`run_streaming`], naming the command as `shown`.
fn run_streaming_shown(cmd: &mut Command, shown: &str) -> Result<()> {
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

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("").trim()
}

// ---- 1. the pinned toolchains: stable (rust-toolchain.toml), nightly + rust-src --------

const NO_RUSTUP: &str = "rustup not found on PATH or in ~/.cargo/bin: install rustup from https://rustup.rs, \
                         then rerun `cargo xtask setup`";

fn toolchain_version(name: &str) -> String {
    toolchain::capture(toolchain::proxy_command("rustc").args([&format!("+{name}"), "--version"]))
        .map(|v| first_line(&v).to_owned())
        .unwrap_or_else(|| "version unknown".into())
}

/// The user-space toolchain `rust-toolchain.toml` pins, with clippy and rustfmt (rustup may
/// already have installed it to run xtask itself; then this only reports it).
fn stable(dry_run: bool) -> Result<()> {
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

fn nightly(dry_run: bool) -> Result<()> {
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

// ---- 2. bpf-linker ---------------------------------------------------------------------

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

fn bpf_linker(dry_run: bool) -> Result<()> {
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

// ---- 3. NVIDIA PyPI wheels -------------------------------------------------------------

fn pip_install(target: &Path, local_wheels: Option<&Path>) -> Command {
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-deps",
        "--upgrade",
        "--target",
    ])
    .arg(target);
    if let Some(dir) = local_wheels {
        cmd.args(["--no-index", "--find-links"]).arg(dir);
    }
    cmd.args(pypi::REQUIREMENTS);
    cmd
}

fn pypi_wheels(dry_run: bool) -> Result<()> {
    let what = "NVIDIA wheels";
    let dir = pypi::cache_dir();
    if pypi::installed(&dir) {
        step(
            3,
            what,
            format!(
                "already in {} ({}, {})",
                dir.display(),
                pypi::NCCL_LIB,
                pypi::CUDART_LIB
            ),
        );
        return Ok(());
    }
    // Both in one pip run: `--target` replaces the shared `nvidia/` directory as a whole.
    let local = Path::new(LOCAL_WHEELS);
    let local = local.is_dir().then_some(local);
    let index_cmd = pip_install(&dir, None);
    step(
        3,
        what,
        format!(
            "installing into {} ({}):",
            dir.display(),
            pypi::REQUIREMENTS.join(", ")
        ),
    );
    if dry_run {
        if let Some(local) = local {
            step(
                3,
                what,
                format!(
                    "would try `{}` first",
                    toolchain::display_command(&pip_install(&dir, Some(local)))
                ),
            );
        }
        step(
            3,
            what,
            format!("would run `{}`", toolchain::display_command(&index_cmd)),
        );
        return Ok(());
    }
    error::create_dir_all(&dir)?;
    let mut done = false;
    if let Some(local) = local {
        let mut cmd = pip_install(&dir, Some(local));
        step(
            3,
            what,
            format!(
                "trying the local wheels: {}",
                toolchain::display_command(&cmd)
            ),
        );
        match run_streaming(&mut cmd) {
            Ok(()) => done = pypi::installed(&dir),
            Err(e) => step(3, what, format!("{e}; falling back to the package index")),
        }
    }
    if !done {
        let mut cmd = index_cmd;
        step(
            3,
            what,
            format!("running `{}`", toolchain::display_command(&cmd)),
        );
        run_streaming(&mut cmd).hint(format!(
            "python3 with pip and access to pypi.org are needed (or set {} to a dir that has them)",
            pypi::CACHE_ENV
        ))?;
    }
    if !pypi::installed(&dir) {
        let missing: Vec<String> = pypi::libraries(&dir)
            .iter()
            .filter(|p| !p.is_file())
            .map(|p| p.display().to_string())
            .collect();
        return Err(format!("pip finished but {} is missing", missing.join(" and ")).into());
    }
    step(3, what, format!("installed in {}", dir.display()));
    Ok(())
}

// ---- 4. gcc and g++ ----------------------------------------------------------------------

/// The first line of `compiler --version` (`gcc`, or `g++` for the C++ fixtures that
/// throw through probed functions), if it runs.
fn compiler_version(compiler: &str) -> Option<String> {
    toolchain::capture(Command::new(compiler).arg("--version")).map(|v| first_line(&v).to_owned())
}

fn apt_get(args: &[&str]) -> Command {
    let mut cmd = Command::new("apt-get");
    cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
    cmd
}

fn gcc(dry_run: bool) -> Result<()> {
    let what = "gcc and g++ (C and C++ test fixtures)";
    let versions = || Some((compiler_version("gcc")?, compiler_version("g++")?));
    if let Some((c, cxx)) = versions() {
        step(4, what, format!("already installed ({c}; {cxx})"));
        return Ok(());
    }
    let packages = ["install", "-y", "gcc", "g++"];
    let mut install = apt_get(&packages);
    step(
        4,
        what,
        format!(
            "missing; running `{}`",
            toolchain::display_command(&install)
        ),
    );
    if dry_run {
        return Ok(());
    }
    let fail = || {
        Error::from(
            "gcc or g++ is missing and `apt-get install -y gcc g++` failed: install C and C++ \
             compilers named gcc and g++, then rerun `cargo xtask setup`",
        )
    };
    if toolchain::find_program("apt-get").is_none() {
        return Err(fail());
    }
    if run_streaming(&mut install).is_err() {
        step(4, what, "retrying after `apt-get update`");
        run_streaming(&mut apt_get(&["update"])).map_err(|_| fail())?;
        run_streaming(&mut apt_get(&packages)).map_err(|_| fail())?;
    }
    let (c, cxx) = versions().ok_or_else(fail)?;
    step(4, what, format!("installed ({c}; {cxx})"));
    Ok(())
}

// ---- 5. PyTorch venv -------------------------------------------------------------------

fn torch_venv_step(dry_run: bool) -> Result<()> {
    let what = "PyTorch venv";
    let dir = torch_venv::venv_dir();
    let python = torch_venv::venv_python(&dir);
    let reqs = torch_venv::REQUIREMENTS.join(", ");
    let pip = torch_venv::pip_command(&dir);
    let pip_shown = torch_venv::display(&pip);

    // What is there already: a usable venv (then only pip may be needed) or nothing.
    // `symlink_metadata`: a dangling `bin/python` (its base Python removed) counts as there,
    // since `python -m venv` would leave it dangling.
    let create_with = if python.symlink_metadata().is_ok() {
        let version = torch_venv::python_version(&python).ok_or_else(|| {
            format!(
                "{} does not run (was the Python it was made from removed?): delete {} and rerun \
                 `cargo xtask setup`",
                python.display(),
                dir.display()
            )
        })?;
        if torch_venv::parse_version(&version).is_none_or(|v| v < torch_venv::PYTHON_VERSION) {
            let (major, minor) = torch_venv::PYTHON_VERSION;
            return Err(format!(
                "{} is a Python {version} venv but NeMo Lens needs Python >= {major}.{minor}: \
                 delete it (or point {} elsewhere) and rerun `cargo xtask setup`",
                dir.display(),
                torch_venv::VENV_ENV
            )
            .into());
        }
        let reason = match torch_venv::read_stamp(&dir) {
            Some(true) => match torch_venv::import_check(&python) {
                Ok(()) => {
                    step(
                        5,
                        what,
                        format!("already in {} (Python {version}; {reqs})", dir.display()),
                    );
                    return Ok(());
                }
                Err(e) => format!(
                    "the stamp matches but `{}` fails: {e}",
                    torch_venv::IMPORT_CHECK
                ),
            },
            Some(false) => format!("{} lists other requirements", torch_venv::STAMP),
            None => format!("no {} stamp yet", torch_venv::STAMP),
        };
        step(
            5,
            what,
            format!(
                "{} exists (Python {version}) but {reason}; installing in place: {reqs}",
                dir.display()
            ),
        );
        None
    } else {
        let found = match torch_venv::find_python313() {
            Ok(found) => found,
            Err(e) if dry_run => {
                step(
                    5,
                    what,
                    format!("no venv at {}; the real run would fail: {e}", dir.display()),
                );
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        step(
            5,
            what,
            format!(
                "creating {} with Python {} ({}: {}), then installing {reqs} ({}):",
                dir.display(),
                found.version,
                found.source,
                found.path.display(),
                torch_venv::FIRST_INSTALL_COST
            ),
        );
        Some(found.path)
    };

    let mut venv = create_with.map(|py| torch_venv::venv_command(&py, &dir));
    if dry_run {
        if let Some(venv) = &venv {
            step(
                5,
                what,
                format!("would run `{}`", torch_venv::display(venv)),
            );
        }
        step(5, what, format!("would run `{pip_shown}`"));
        return Ok(());
    }

    let start = Instant::now();
    if let Some(venv) = &mut venv {
        if let Some(parent) = dir.parent() {
            error::create_dir_all(parent)?;
        }
        let shown = torch_venv::display(venv);
        step(5, what, format!("running `{shown}`"));
        run_streaming_shown(venv, &shown)?;
    }
    step(5, what, format!("running `{pip_shown}`"));
    let mut pip = pip;
    run_streaming_shown(&mut pip, &pip_shown).hint(format!(
        "pip needs access to pypi.org (and ~5.8 GB of disk in {})",
        dir.display()
    ))?;
    torch_venv::import_check(&python).context(format!(
        "pip finished but `{} -c \"{}\"` fails",
        python.display(),
        torch_venv::IMPORT_CHECK
    ))?;
    torch_venv::write_stamp(&dir)?;
    step(
        5,
        what,
        format!(
            "installed in {} in {:.1}s (stamp {})",
            dir.display(),
            start.elapsed().as_secs_f64(),
            torch_venv::stamp_path(&dir).display()
        ),
    );
    Ok(())
}

// ---- 6. SLURM ---------------------------------------------------------------------------

/// The daemons the real-SLURM test (`tests/integration/slurm.rs`) starts.
const SLURM_DAEMONS: [&str; 3] = ["slurmctld", "slurmd", "munged"];

/// Where Debian puts them (`find_program` follows PATH, which may lack the sbin ones).
fn find_daemon(name: &str) -> Option<std::path::PathBuf> {
    toolchain::find_program(name).or_else(|| {
        ["/usr/sbin", "/sbin"]
            .iter()
            .map(|dir| Path::new(dir).join(name))
            .find(|path| path.is_file())
    })
}

fn slurm(dry_run: bool) -> Result<()> {
    let what = "SLURM (slurm-wlm, munge: the prolog/epilog test)";
    let missing: Vec<&str> = SLURM_DAEMONS
        .into_iter()
        .filter(|name| find_daemon(name).is_none())
        .collect();
    if missing.is_empty() {
        step(6, what, "already installed");
        return Ok(());
    }
    let args = ["install", "-y", "slurm-wlm", "munge"];
    let install = apt_get(&args);
    step(
        6,
        what,
        format!(
            "{} missing; running `{}`",
            missing.join(", "),
            toolchain::display_command(&install)
        ),
    );
    if dry_run {
        return Ok(());
    }
    let fail = || {
        Error::from(
            "slurmctld, slurmd or munged is missing and `apt-get install -y slurm-wlm munge` \
             failed: install Debian's slurm-wlm and munge, then rerun `cargo xtask setup`",
        )
    };
    if toolchain::find_program("apt-get").is_none() {
        return Err(fail());
    }
    if run_streaming(&mut apt_get(&args)).is_err() {
        step(6, what, "retrying after `apt-get update`");
        run_streaming(&mut apt_get(&["update"])).map_err(|_| fail())?;
        run_streaming(&mut apt_get(&args)).map_err(|_| fail())?;
    }
    if SLURM_DAEMONS
        .into_iter()
        .any(|name| find_daemon(name).is_none())
    {
        return Err(fail());
    }
    step(6, what, "installed");
    Ok(())
}

// ---- 7. promtool ------------------------------------------------------------------------

/// Where `promtool` is unpacked from Debian's prometheus package: `$HOME/.cache/lens-probe/
/// prometheus` (only the file is taken: installing the package would start a Prometheus
/// server on the machine).
fn prometheus_dir() -> std::path::PathBuf {
    crate::toolchain::home_dir()
        .unwrap_or_else(|| std::path::PathBuf::from("/root"))
        .join(".cache/lens-probe/prometheus")
}

/// `promtool`, for `promtool test rules` on the shipped alert rules
/// (`tests/integration/observability.rs`): on PATH, or unpacked into the cache.
fn promtool(dry_run: bool) -> Result<()> {
    let what = "promtool (Debian's prometheus package: the alert rules' unit tests)";
    let dir = prometheus_dir();
    let unpacked = dir.join("usr/bin/promtool");
    if toolchain::find_program("promtool").is_some() || unpacked.is_file() {
        step(7, what, "already there");
        return Ok(());
    }
    step(
        7,
        what,
        format!(
            "missing; `apt-get download prometheus` and unpacking it into {}",
            dir.display()
        ),
    );
    if dry_run {
        return Ok(());
    }
    let fail = |why: &dyn std::fmt::Display| {
        Error::from(format!(
            "promtool is missing and could not be unpacked from Debian's prometheus package \
             ({why}): install promtool on PATH, then rerun `cargo xtask setup`"
        ))
    };
    std::fs::create_dir_all(&dir).map_err(|e| fail(&format!("{}: {e}", dir.display())))?;
    let download = |dir: &Path| {
        let mut cmd = apt_get(&["download", "prometheus"]);
        cmd.current_dir(dir);
        run_streaming(&mut cmd)
    };
    if download(&dir).is_err() {
        step(7, what, "retrying after `apt-get update`");
        run_streaming(&mut apt_get(&["update"])).map_err(|e| fail(&e))?;
        download(&dir).map_err(|e| fail(&e))?;
    }
    let package = std::fs::read_dir(&dir)
        .map_err(|e| fail(&e))?
        .flatten()
        .map(|entry| entry.path())
        .find(|path| path.extension().is_some_and(|e| e == "deb"))
        .ok_or_else(|| fail(&"no .deb downloaded"))?;
    run_streaming(Command::new("dpkg-deb").arg("-x").arg(&package).arg(&dir))
        .map_err(|e| fail(&e))?;
    let _ = std::fs::remove_file(&package);
    if !unpacked.is_file() {
        return Err(fail(&format!("no {} in the package", unpacked.display())));
    }
    step(7, what, format!("unpacked ({})", unpacked.display()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pip_commands() {
        let index = toolchain::display_command(&pip_install(Path::new("/c/pypi"), None));
        assert_eq!(
            index,
            "python3 -m pip install --disable-pip-version-check --no-deps --upgrade --target /c/pypi \
             nvidia-nccl-cu12==2.32.3 nvidia-cuda-runtime-cu12==12.9.79"
        );
        let local = toolchain::display_command(&pip_install(
            Path::new("/c"),
            Some(Path::new("/tmp/wheels")),
        ));
        assert!(
            local.contains("--no-index --find-links /tmp/wheels nvidia-nccl-cu12==2.32.3"),
            "{local}"
        );
    }
}
