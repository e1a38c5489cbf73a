//! The one error type of the loader: a variant per failure a user can act on.
use std::{io, path::PathBuf};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum LensError {
    #[error("no process with pid {0}")]
    NoSuchProcess(u32),

    #[error("pid {pid} ({name}) is a kernel thread: it runs no program to trace")]
    KernelThread { pid: u32, name: String },

    #[error(
        "process {pid} ({name}) maps none of {wanted}: nothing to probe \
         (use --exec to also catch libraries it loads later)"
    )]
    NoTracedLibraries {
        pid: u32,
        name: String,
        wanted: String,
    },

    #[error(
        "missing {missing}: lens-probe needs root, or the capabilities CAP_BPF, CAP_PERFMON, \
         CAP_SYS_ADMIN (see docs/security.md)"
    )]
    MissingPrivileges { missing: String },

    #[error(
        "cannot read {path} ({missing}): tracing pid {pid}, a process of another user or with \
         capabilities lens-probe lacks, needs CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH"
    )]
    TargetNotReadable {
        pid: u32,
        path: PathBuf,
        missing: String,
    },

    /// The kernel refused although lens-probe holds CAP_SYS_PTRACE and
    /// CAP_DAC_READ_SEARCH: the target is beyond them (another user namespace, a
    /// capability lens-probe lacks, a security module).
    #[error(
        "cannot read {path} ({reason}): lens-probe holds CAP_SYS_PTRACE and \
         CAP_DAC_READ_SEARCH, but the kernel does not let it read pid {pid} (another user \
         namespace, a capability lens-probe lacks, or a security module)"
    )]
    TargetRefused {
        pid: u32,
        path: PathBuf,
        reason: String,
    },

    #[error("cannot drop the capabilities lens-probe no longer needs: {reason}")]
    CapabilityDrop { reason: String },

    #[error("this kernel has no uprobe support ({0} is missing): CONFIG_UPROBE_EVENTS is required")]
    NoUprobeSupport(PathBuf),

    #[error(
        "this kernel has no uprobe_multi links (Linux 6.6+) that --uprobe-links multi asks \
         for; use auto or perf"
    )]
    NoUprobeMulti,

    #[error("cannot run {command}: {source}")]
    Spawn {
        command: String,
        #[source]
        source: io::Error,
    },

    #[error("cannot read {path}: {source}")]
    ReadProc {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("cannot read the ELF symbols of {path}: {reason}")]
    Elf { path: PathBuf, reason: String },

    #[error("invalid value {value:?} for {key}: {reason}")]
    InvalidSetting {
        key: String,
        value: String,
        reason: String,
    },

    /// A file lens-probe was told to write (`--pid-file`, `--summary-json`,
    /// `--export-file`) cannot be created or written.
    #[error("{flag} {path}: {reason}")]
    Output {
        flag: &'static str,
        path: PathBuf,
        reason: String,
    },

    /// A bad `--config` file (or a built-in profile): the rule, the field and what it takes.
    #[error("invalid config {path}: {reason}")]
    InvalidConfig { path: PathBuf, reason: String },

    /// A bad value that may hold credentials (OTLP headers): not shown.
    #[error("invalid value for {key} (not shown: it may hold credentials): {reason}")]
    InvalidSecretSetting { key: String, reason: String },

    #[error("cannot load the BPF programs: {}", error_chain(.0))]
    Load(#[from] aya::EbpfError),

    #[error(
        "the kernel's verifier rejected BPF program {program}: {reason} (run with -vv for its log)"
    )]
    VerifierRejected {
        program: &'static str,
        reason: String,
    },

    #[error("BPF program {program}: {}", error_chain(source))]
    Program {
        program: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },

    #[error("BPF map {map}: {}", error_chain(source))]
    Map {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },

    #[error("BPF object has no {kind} named {name}")]
    MissingInObject {
        kind: &'static str,
        name: &'static str,
    },

    #[error(
        "cannot read the kernel's BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF): {reason}"
    )]
    KernelBtf { reason: String },

    #[error("telemetry export: {0}")]
    Export(String),

    #[error(transparent)]
    Io(#[from] io::Error),
}

impl LensError {
    /// Exit status for this error: 2 for bad input (as clap does), 1 for everything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            LensError::InvalidSetting { .. }
            | LensError::InvalidSecretSetting { .. }
            | LensError::InvalidConfig { .. }
            | LensError::Output { .. } => 2,
            _ => 1,
        }
    }
}

pub type Result<T, E = LensError> = std::result::Result<T, E>;

/// An error with its causes: aya says "`perf_event_open` failed" and keeps the errno
/// (what a user needs to know) in its source.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Declares an error that is one sentence for the user and nothing more: what a value
/// parser, a config field or a file check found wrong. clap prints it after the flag,
/// and a `LensError` variant carries it as its reason, so its text is the whole of it.
macro_rules! reason_error {
    ($(#[$doc:meta])* $vis:vis struct $name:ident;) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        $vis struct $name(String);

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::error::Error for $name {}

        // Read as its text where it is compared or passed on as one (a test, a warning).
        impl std::ops::Deref for $name {
            type Target = str;

            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl From<String> for $name {
            fn from(reason: String) -> Self {
                $name(reason)
            }
        }

        impl From<&str> for $name {
            fn from(reason: &str) -> Self {
                $name(reason.to_string())
            }
        }
    };
}
pub(crate) use reason_error;
