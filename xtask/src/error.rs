//! The one error type of `cargo xtask`. Its `Display` is the whole message, causes
//! included, on one line: that line is all `cargo xtask` prints of a failure, so it must
//! name what failed and why without the chain being walked. `source()` still gives the
//! cause to code that wants it.

use std::fmt::Display;
use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file-system operation on `path` failed; `action` is its verb (`read`, `create`).
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// A JSON file did not hold what was expected.
    #[error("{}: {source}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// A command could not be started.
    #[error("cannot run `{command}`: {source}")]
    Spawn { command: String, source: io::Error },
    /// A command ran and failed.
    #[error("`{command}` failed ({status})")]
    Failed { command: String, status: ExitStatus },
    /// What was being done (a bench run's name, a setup step) when `source` happened.
    #[error("{context}: {source}")]
    Context { context: String, source: Box<Error> },
    /// What to do about `source`, or what it stops: `{source}: {hint}`.
    #[error("{source}: {hint}")]
    Hint { source: Box<Error>, hint: String },
    /// A failure no other variant describes, said in one line.
    #[error("{0}")]
    Msg(String),
}

impl Error {
    pub fn io(action: &'static str, path: &Path, source: io::Error) -> Error {
        Error::Io {
            action,
            path: path.to_owned(),
            source,
        }
    }

    pub fn json(path: &Path, source: serde_json::Error) -> Error {
        Error::Json {
            path: path.to_owned(),
            source,
        }
    }
}

impl From<String> for Error {
    fn from(message: String) -> Error {
        Error::Msg(message)
    }
}

impl From<&str> for Error {
    fn from(message: &str) -> Error {
        Error::Msg(message.to_owned())
    }
}

/// Says more about an error, in its one line.
pub trait Context<T> {
    /// What was being done, in front: `{context}: {error}`.
    fn context(self, context: impl Display) -> Result<T>;
    /// What to do about it, or what it stops, behind: `{error}: {hint}`.
    fn hint(self, hint: impl Display) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for Result<T, E> {
    fn context(self, context: impl Display) -> Result<T> {
        self.map_err(|error| Error::Context {
            context: context.to_string(),
            source: Box::new(error.into()),
        })
    }

    fn hint(self, hint: impl Display) -> Result<T> {
        self.map_err(|error| Error::Hint {
            source: Box::new(error.into()),
            hint: hint.to_string(),
        })
    }
}

/// `fs::read_to_string`, the error naming the file.
pub fn read_to_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))
}

/// `fs::write`, the error naming the file.
pub fn write(path: &Path, contents: impl AsRef<[u8]>) -> Result<()> {
    std::fs::write(path, contents).map_err(|e| Error::io("write", path, e))
}

/// `fs::create_dir_all`, the error naming the directory.
pub fn create_dir_all(path: &Path) -> Result<()> {
    std::fs::create_dir_all(path).map_err(|e| Error::io("create", path, e))
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    #[test]
    fn each_error_is_one_line() {
        let missing = read_to_string(Path::new("/nonexistent/x.json")).unwrap_err();
        assert_eq!(
            missing.to_string(),
            "cannot read /nonexistent/x.json: No such file or directory (os error 2)"
        );
        let json = serde_json::from_str::<u32>("\"x\"").unwrap_err();
        assert_eq!(
            Error::json(Path::new("/s.json"), json).to_string(),
            "/s.json: invalid type: string \"x\", expected u32 at line 1 column 3"
        );
        let failed: Result<()> = Err(Error::Failed {
            command: "sh -c 'exit 3'".into(),
            status: ExitStatus::from_raw(3 << 8),
        });
        let failed = failed.context("fake-none-r1").unwrap_err();
        assert_eq!(
            failed.to_string(),
            "fake-none-r1: `sh -c 'exit 3'` failed (exit status: 3)"
        );
        assert!(std::error::Error::source(&failed).is_some());
        let said: Result<()> = Err("no report".into());
        assert_eq!(
            said.context("x").hint("rerun").unwrap_err().to_string(),
            "x: no report: rerun"
        );
        for e in [missing, failed] {
            assert!(!e.to_string().contains('\n'));
        }
    }
}
