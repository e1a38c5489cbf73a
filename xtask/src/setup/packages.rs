//! Steps 3, 4, 6 and 7: what comes as packages. The NVIDIA libraries from PyPI wheels,
//! gcc and g++, SLURM and munge from apt, and promtool unpacked from Debian's prometheus
//! package.

use std::path::Path;
use std::process::Command;

use xtask::error::{self, Context, Error, Result};
use xtask::{pypi, toolchain};

use super::{first_line, run_streaming, step};

/// An optional local wheel directory, used (as an optimisation only) when it exists.
const LOCAL_WHEELS: &str = "/tmp/wheels";

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

pub(super) fn pypi_wheels(dry_run: bool) -> Result<()> {
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

pub(super) fn gcc(dry_run: bool) -> Result<()> {
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

pub(super) fn slurm(dry_run: bool) -> Result<()> {
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
pub(super) fn promtool(dry_run: bool) -> Result<()> {
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
