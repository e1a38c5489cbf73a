//! Step 5: the Python 3.13 venv with PyPI PyTorch and NeMo Lens.

use std::path::{Path, PathBuf};
use std::time::Instant;

use xtask::error::{self, Context, Result};
use xtask::torch_venv;

use super::{run_streaming_shown, step};

const WHAT: &str = "PyTorch venv";

/// What the step has to do, from what is there already.
enum Todo {
    /// Nothing: the venv is ready (or, in a dry run, could not be made).
    Nothing,
    /// pip in the venv that is there.
    Install,
    /// `python -m venv` with this Python, then pip.
    Create(PathBuf),
}

pub(super) fn torch_venv_step(dry_run: bool) -> Result<()> {
    let dir = torch_venv::venv_dir();
    let python = torch_venv::venv_python(&dir);
    let reqs = torch_venv::REQUIREMENTS.join(", ");
    // `symlink_metadata`: a dangling `bin/python` (its base Python removed) counts as there,
    // since `python -m venv` would leave it dangling.
    let todo = if python.symlink_metadata().is_ok() {
        in_place(&dir, &python, &reqs)?
    } else {
        to_create(&dir, &reqs, dry_run)?
    };
    match todo {
        Todo::Nothing => Ok(()),
        Todo::Install => install(&dir, &python, None, dry_run),
        Todo::Create(base) => install(&dir, &python, Some(&base), dry_run),
    }
}

/// The venv in `dir` is there: whether it is ready, or pip must run in it.
fn in_place(dir: &Path, python: &Path, reqs: &str) -> Result<Todo> {
    let version = torch_venv::python_version(python).ok_or_else(|| {
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
    let reason = match torch_venv::read_stamp(dir) {
        Some(true) => match torch_venv::import_check(python) {
            Ok(()) => {
                step(
                    5,
                    WHAT,
                    format!("already in {} (Python {version}; {reqs})", dir.display()),
                );
                return Ok(Todo::Nothing);
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
        WHAT,
        format!(
            "{} exists (Python {version}) but {reason}; installing in place: {reqs}",
            dir.display()
        ),
    );
    Ok(Todo::Install)
}

/// No venv in `dir`: the Python 3.13 to make it with.
fn to_create(dir: &Path, reqs: &str, dry_run: bool) -> Result<Todo> {
    let found = match torch_venv::find_python313() {
        Ok(found) => found,
        Err(e) if dry_run => {
            step(
                5,
                WHAT,
                format!("no venv at {}; the real run would fail: {e}", dir.display()),
            );
            return Ok(Todo::Nothing);
        }
        Err(e) => return Err(e),
    };
    step(
        5,
        WHAT,
        format!(
            "creating {} with Python {} ({}: {}), then installing {reqs} ({}):",
            dir.display(),
            found.version,
            found.source,
            found.path.display(),
            torch_venv::FIRST_INSTALL_COST
        ),
    );
    Ok(Todo::Create(found.path))
}

/// Makes the venv with `base` when given, then installs the requirements into it.
fn install(dir: &Path, python: &Path, base: Option<&Path>, dry_run: bool) -> Result<()> {
    let mut pip = torch_venv::pip_command(dir);
    let pip_shown = torch_venv::display(&pip);
    let mut venv = base.map(|py| torch_venv::venv_command(py, dir));
    if dry_run {
        if let Some(venv) = &venv {
            step(
                5,
                WHAT,
                format!("would run `{}`", torch_venv::display(venv)),
            );
        }
        step(5, WHAT, format!("would run `{pip_shown}`"));
        return Ok(());
    }

    let start = Instant::now();
    if let Some(venv) = &mut venv {
        if let Some(parent) = dir.parent() {
            error::create_dir_all(parent)?;
        }
        let shown = torch_venv::display(venv);
        step(5, WHAT, format!("running `{shown}`"));
        run_streaming_shown(venv, &shown)?;
    }
    step(5, WHAT, format!("running `{pip_shown}`"));
    run_streaming_shown(&mut pip, &pip_shown).hint(format!(
        "pip needs access to pypi.org (and ~5.8 GB of disk in {})",
        dir.display()
    ))?;
    torch_venv::import_check(python).context(format!(
        "pip finished but `{} -c \"{}\"` fails",
        python.display(),
        torch_venv::IMPORT_CHECK
    ))?;
    torch_venv::write_stamp(dir)?;
    step(
        5,
        WHAT,
        format!(
            "installed in {} in {:.1}s (stamp {})",
            dir.display(),
            start.elapsed().as_secs_f64(),
            torch_venv::stamp_path(dir).display()
        ),
    );
    Ok(())
}
