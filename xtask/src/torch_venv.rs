//! The Python virtual environment with real PyPI PyTorch (CPU use, no GPU needed) and
//! NeMo Lens, which `cargo xtask setup` creates for the integration tests that run a real
//! PyTorch training script (`tests/fixtures/torch/train.py`).
//!
//! Idempotence: after a successful `pip install` the requirement list is written to a
//! stamp file inside the venv ([`STAMP`]). The venv counts as ready when the stamp lists
//! exactly [`REQUIREMENTS`] and [`IMPORT_CHECK`] runs; otherwise pip
//! is run again in place (it only fetches what is missing or different).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::{Error, Result};

/// Overrides the venv directory.
pub const VENV_ENV: &str = "LENS_TORCH_VENV";
/// A Python 3.13 interpreter to create the venv with (else one is searched for).
pub const PYTHON_ENV: &str = "LENS_PYTHON313";

/// The pinned requirements (`pip` specifiers). NeMo Lens needs Python >= 3.13; its `sdk`
/// extra brings opentelemetry-sdk and the OTLP exporters.
/// `rotel` is a Rust OTLP collector shipped as a wheel: the real collector of the export
/// tests (its `rotel-agent` binary needs the venv Python's `libpython3.13.so`).
/// `kubernetes-validate` checks `observability/k8s/` against the Kubernetes OpenAPI
/// schemas it ships (offline) in the deploy tests.
/// `transformers` (its `Trainer` needs `accelerate`), `lightning` and `safetensors` are the
/// training frameworks of the framework tests (`tests/fixtures/frameworks/`): tiny models
/// built from configs with random weights, nothing downloaded.
/// `perfetto` ships Perfetto's trace protos compiled for Python: the timeline tests
/// decode what `--perfetto` wrote with them.
pub const REQUIREMENTS: &[&str] = &[
    "torch==2.15.0",
    "numpy==2.5.5",
    "nemo-lens[sdk]==0.1.0",
    "rotel==0.0.1a15",
    "kubernetes-validate==1.37.0",
    "transformers==5.24.0",
    "accelerate==1.15.0",
    "lightning==2.6.6",
    "safetensors==0.8.0",
    "perfetto==0.59.1",
];

/// The stamp file, relative to the venv: the requirement list of the last successful
/// install, one per line. Written only after pip and the import check succeeded.
pub const STAMP: &str = ".lens-requirements";

/// What must import for the venv to count as ready.
pub const IMPORT_CHECK: &str = "import torch, nemo.lens, transformers, accelerate, lightning, safetensors, \
     perfetto.protos.perfetto.trace.perfetto_trace_pb2";

/// The Python the venv is made with (major, minor).
pub const PYTHON_VERSION: (u32, u32) = (3, 13);

/// Roughly what a first install costs (shown to the user).
pub const FIRST_INSTALL_COST: &str = "~5.8 GB, ~2.5 min";

/// `$LENS_TORCH_VENV`, else `$HOME/.cache/lens-probe/torch-venv`.
pub fn venv_dir() -> PathBuf {
    if let Some(dir) = env::var_os(VENV_ENV).filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    crate::toolchain::home_dir()
        .unwrap_or_else(|| PathBuf::from("/root"))
        .join(".cache")
        .join("lens-probe")
        .join("torch-venv")
}

/// The venv's interpreter, `DIR/bin/python`.
pub fn venv_python(dir: &Path) -> PathBuf {
    dir.join("bin").join("python")
}

/// The stamp file of the venv in `dir`.
pub fn stamp_path(dir: &Path) -> PathBuf {
    dir.join(STAMP)
}

/// What the stamp file holds after a successful install.
pub fn stamp_contents() -> String {
    let mut s = REQUIREMENTS.join("\n");
    s.push('\n');
    s
}

/// Whether a stamp file's text lists exactly [`REQUIREMENTS`], in order (blank lines and
/// surrounding whitespace ignored).
pub fn stamp_matches(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .eq(REQUIREMENTS.iter().copied())
}

/// The stamp of the venv in `dir`, compared with [`REQUIREMENTS`]: `None` when there is no
/// (readable) stamp file.
pub fn read_stamp(dir: &Path) -> Option<bool> {
    fs::read_to_string(stamp_path(dir))
        .ok()
        .map(|t| stamp_matches(&t))
}

/// Writes the stamp (through a temporary file and a rename, so it is never half-written).
pub fn write_stamp(dir: &Path) -> Result<()> {
    let stamp = stamp_path(dir);
    let tmp = dir.join(format!("{STAMP}.tmp"));
    fs::write(&tmp, stamp_contents())
        .and_then(|()| fs::rename(&tmp, &stamp))
        .map_err(|e| Error::io("write", &stamp, e))
}

/// A command running the Python at `python`, without the variables that would point a
/// venv's interpreter at another installation.
pub fn python_command(python: &Path) -> Command {
    let mut cmd = Command::new(python);
    cmd.env_remove("PYTHONHOME")
        .env_remove("PYTHONPATH")
        .stdin(Stdio::null());
    cmd
}

/// `PY -m venv DIR`.
pub fn venv_command(python: &Path, dir: &Path) -> Command {
    let mut cmd = python_command(python);
    cmd.args(["-m", "venv"]).arg(dir);
    cmd
}

/// `DIR/bin/python -m pip install --disable-pip-version-check <REQUIREMENTS>`.
pub fn pip_command(dir: &Path) -> Command {
    let mut cmd = python_command(&venv_python(dir));
    cmd.args(["-m", "pip", "install", "--disable-pip-version-check"])
        .args(REQUIREMENTS);
    cmd
}

/// A command line as the user would type it (full program path, arguments with spaces or
/// shell characters quoted).
pub fn display(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| shell_word(&a.to_string_lossy()))
        .collect::<Vec<_>>()
        .join(" ")
}

fn shell_word(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-=+:,@%".contains(c));
    if plain {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Parses `3.13.0` (what [`python_version`] prints) into (3, 13).
pub fn parse_version(text: &str) -> Option<(u32, u32)> {
    let mut parts = text.trim().split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// The full version (`3.13.0`) of the Python at `python`, `None` when it does not run.
pub fn python_version(python: &Path) -> Option<String> {
    let out = python_command(python)
        .args(["-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let v = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && parse_version(&v).is_some()).then_some(v)
}

/// Runs [`IMPORT_CHECK`] with `python`; `Err` is the last line of its stderr (the
/// exception), or why it could not run.
pub fn import_check(python: &Path) -> Result<()> {
    let out = python_command(python)
        .args(["-c", IMPORT_CHECK])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("no error output");
    Err(format!("{last} ({})", out.status).into())
}

/// The `3.13.N` names among pyenv's version directories, newest first (`3.13.0t`,
/// `3.13-dev` and other variants are left out).
pub fn pyenv_313_versions<I, S>(names: I) -> Vec<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let prefix = format!("{}.{}.", PYTHON_VERSION.0, PYTHON_VERSION.1);
    let mut found: Vec<(u32, String)> = names
        .into_iter()
        .filter_map(|n| {
            let n = n.as_ref();
            let patch = n.strip_prefix(&prefix)?.parse().ok()?;
            Some((patch, n.to_owned()))
        })
        .collect();
    found.sort_by_key(|(patch, _)| std::cmp::Reverse(*patch));
    found.into_iter().map(|(_, n)| n).collect()
}

/// `$PYENV_ROOT`, else `$HOME/.pyenv`.
pub fn pyenv_root() -> Option<PathBuf> {
    env::var_os("PYENV_ROOT")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| crate::toolchain::home_dir().map(|h| h.join(".pyenv")))
}

/// A Python 3.13 interpreter found by [`find_python313`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Python {
    pub path: PathBuf,
    /// `3.13.0`
    pub version: String,
    /// Where it was found: `$LENS_PYTHON313`, `PATH` or `pyenv`.
    pub source: &'static str,
}

/// `$LENS_PYTHON313` if set (it must run and be Python >= 3.13), else the first
/// `python3.13` on `PATH` that runs (a pyenv shim for a version that is not selected does
/// not), else the newest `$PYENV_ROOT/versions/3.13.*/bin/python3` (`$HOME/.pyenv` without
/// `PYENV_ROOT`). `Err` is one line saying how to provide one.
pub fn find_python313() -> Result<Python> {
    let wanted = PYTHON_VERSION;
    if let Some(p) = env::var_os(PYTHON_ENV).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(&p);
        let version = python_version(&path).ok_or_else(|| {
            format!(
                "{PYTHON_ENV}={} does not run as a Python interpreter",
                path.display()
            )
        })?;
        return match parse_version(&version) {
            Some(v) if v >= wanted => Ok(Python {
                path,
                version,
                source: "$LENS_PYTHON313",
            }),
            _ => Err(format!(
                "{PYTHON_ENV}={} is Python {version}; NeMo Lens needs Python >= {}.{}",
                path.display(),
                wanted.0,
                wanted.1
            )
            .into()),
        };
    }
    let is_wanted = |v: &str| parse_version(v) == Some(wanted);

    let name = format!("python{}.{}", wanted.0, wanted.1);
    let path_dirs: Vec<PathBuf> = env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect())
        .unwrap_or_default();
    for candidate in path_dirs.iter().map(|d| d.join(&name)) {
        if !candidate.is_file() {
            continue;
        }
        if let Some(version) = python_version(&candidate).filter(|v| is_wanted(v)) {
            return Ok(Python {
                path: candidate,
                version,
                source: "PATH",
            });
        }
    }

    let pyenv_versions = pyenv_root().map(|r| r.join("versions"));
    if let Some(versions) = &pyenv_versions {
        let names: Vec<String> = fs::read_dir(versions)
            .map(|rd| {
                rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        for v in pyenv_313_versions(names) {
            let candidate = versions.join(&v).join("bin").join("python3");
            if let Some(version) = python_version(&candidate).filter(|v| is_wanted(v)) {
                return Ok(Python {
                    path: candidate,
                    version,
                    source: "pyenv",
                });
            }
        }
    }

    let looked_in = pyenv_versions
        .map(|v| format!(", nor in {}/{}.{}.*", v.display(), wanted.0, wanted.1))
        .unwrap_or_default();
    Err(format!(
        "no Python {}.{} found ({PYTHON_ENV} unset, no working {name} on PATH{looked_in}): \
         install one (e.g. `pyenv install {}.{}`) or set {PYTHON_ENV} to its interpreter",
        wanted.0, wanted.1, wanted.0, wanted.1
    )
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamp_round_trip() {
        assert!(stamp_matches(&stamp_contents()));
        assert!(stamp_matches(
            "\n torch==2.15.0\nnumpy==2.5.5 \n\nnemo-lens[sdk]==0.1.0\nrotel==0.0.1a15\n\
             kubernetes-validate==1.37.0\ntransformers==5.24.0\n accelerate==1.15.0\n\n\
             lightning==2.6.6\nsafetensors==0.8.0\nperfetto==0.59.1 "
        ));
        // The list before the timeline's decoder was added: updated too.
        assert!(!stamp_matches(
            "torch==2.15.0\nnumpy==2.5.5\nnemo-lens[sdk]==0.1.0\nrotel==0.0.1a15\n\
             kubernetes-validate==1.37.0\ntransformers==5.24.0\naccelerate==1.15.0\n\
             lightning==2.6.6\nsafetensors==0.8.0\n"
        ));
        // The list before kubernetes-validate was added: a venv that must be updated.
        assert!(!stamp_matches(
            "torch==2.15.0\nnumpy==2.5.5\nnemo-lens[sdk]==0.1.0\nrotel==0.0.1a15\n"
        ));
        // The list before the training frameworks were added: updated too.
        assert!(!stamp_matches(
            "torch==2.15.0\nnumpy==2.5.5\nnemo-lens[sdk]==0.1.0\nrotel==0.0.1a15\n\
             kubernetes-validate==1.37.0\n"
        ));
        assert!(!stamp_matches(""));
        assert!(!stamp_matches(
            "torch==2.15.0\nnumpy==2.5.5\nnemo-lens==0.1.0\n"
        ));
        assert!(!stamp_matches(
            "torch==2.15.0\nnumpy==2.5.5\nnemo-lens[sdk]==0.1.0\nextra\n"
        ));
        assert!(!stamp_matches(
            "numpy==2.5.5\ntorch==2.15.0\nnemo-lens[sdk]==0.1.0\n"
        ));
    }

    #[test]
    fn stamp_file_in_a_dir() {
        let dir = env::temp_dir().join(format!("lens-torch-venv-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        assert_eq!(read_stamp(&dir), None);
        fs::write(stamp_path(&dir), "torch==2.0.0\n").unwrap();
        assert_eq!(read_stamp(&dir), Some(false));
        write_stamp(&dir).unwrap();
        assert_eq!(read_stamp(&dir), Some(true));
        assert!(!dir.join(format!("{STAMP}.tmp")).exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn commands() {
        let dir = Path::new("/c/torch-venv");
        assert_eq!(
            display(&venv_command(
                Path::new("/root/.pyenv/versions/3.13.0/bin/python3"),
                dir
            )),
            "/root/.pyenv/versions/3.13.0/bin/python3 -m venv /c/torch-venv"
        );
        assert_eq!(
            display(&pip_command(dir)),
            "/c/torch-venv/bin/python -m pip install --disable-pip-version-check \
             torch==2.15.0 numpy==2.5.5 'nemo-lens[sdk]==0.1.0' rotel==0.0.1a15 \
             kubernetes-validate==1.37.0 transformers==5.24.0 accelerate==1.15.0 \
             lightning==2.6.6 safetensors==0.8.0 perfetto==0.59.1"
        );
        assert_eq!(venv_python(dir), Path::new("/c/torch-venv/bin/python"));
        assert_eq!(
            stamp_path(dir),
            Path::new("/c/torch-venv/.lens-requirements")
        );
    }

    #[test]
    fn versions() {
        assert_eq!(parse_version("3.13.0\n"), Some((3, 13)));
        assert_eq!(parse_version("3.9.18"), Some((3, 9)));
        assert_eq!(parse_version("pyenv: python3.13: command not found"), None);
        assert!(parse_version("3.12.1") < Some(PYTHON_VERSION));
        assert!(parse_version("3.14.0") > Some(PYTHON_VERSION));
        assert_eq!(
            pyenv_313_versions([
                "2.7.18", "3.13.0", "3.12.1", "3.13.10", "3.13.2", "3.13.1t", "3.13-dev",
                "3.130.1",
            ]),
            vec!["3.13.10", "3.13.2", "3.13.0"]
        );
        assert!(pyenv_313_versions(["3.12.1", "3.11.7"]).is_empty());
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_word("a/b-c_d.e==1"), "a/b-c_d.e==1");
        assert_eq!(shell_word("x[y]"), "'x[y]'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
