//! Node-wide discovery: which processes on this host are training processes to trace.
//! A candidate maps a training library (libtorch_cpu, libnccl or libcudart) and passes
//! the user's filter (command line, cgroup, environment).

use crate::sys::{
    library::{LibraryKind, MappedLibrary},
    target::{self, ProcessInfo},
};

crate::error::reason_error! {
    /// A `--match-env` filter that is not `KEY=VALUE`.
    pub struct BadFilter;
}

/// The libraries that make a process a training process.
pub fn is_training_library(kind: LibraryKind) -> bool {
    matches!(
        kind,
        LibraryKind::TorchCpu | LibraryKind::Nccl | LibraryKind::CudaRuntime
    )
}

pub fn maps_training_library(libraries: &[MappedLibrary]) -> bool {
    libraries.iter().any(|l| is_training_library(l.kind))
}

/// `--match`, `--match-cgroup`, `--match-env`: all given must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFilter {
    /// A substring of the command line (arguments joined by spaces).
    pub command_line: Option<String>,
    /// A substring of `/proc/PID/cgroup` (e.g. a SLURM job's `job_1234`, a pod UID).
    pub cgroup: Option<String>,
    /// Variables the process's environment must have, with these values.
    pub environment: Vec<(String, String)>,
}

impl NodeFilter {
    /// Parses `KEY=VALUE` filters for `--match-env`.
    pub fn parse_env(text: &str) -> Result<(String, String), BadFilter> {
        match text.split_once('=') {
            Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
            _ => Err(format!("expected KEY=VALUE, got {text:?}").into()),
        }
    }

    pub fn matches(&self, info: &ProcessInfo) -> bool {
        let command_line = info.command_line.join(" ");
        self.command_line
            .as_deref()
            .is_none_or(|needle| command_line.contains(needle))
            && self
                .cgroup
                .as_deref()
                .is_none_or(|needle| info.view.cgroup.contains(needle))
            && self.environment.iter().all(|(key, value)| {
                // A variable off the allow-list is not in the view: read for this
                // comparison only.
                let kept = info.view.environment.iter().find(|(k, _)| k == key);
                match kept {
                    Some((_, v)) => v == value,
                    None => target::read_variable(info.pid, key).as_ref() == Some(value),
                }
            })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::sys::target::TargetView;

    fn info(command_line: &str, cgroup: &str, env: &[(&str, &str)]) -> ProcessInfo {
        ProcessInfo {
            pid: 7,
            name: "python".into(),
            command_line: command_line.split(' ').map(str::to_string).collect(),
            traced_from_start: true,
            rank: None,
            view: Arc::new(TargetView {
                environment: env
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                cgroup: cgroup.into(),
                ..TargetView::default()
            }),
        }
    }

    #[test]
    fn every_given_filter_must_hold() {
        let p = info(
            "python train.py --lr 1",
            "0::/system.slice/slurmstepd.scope/job_42/step_0",
            &[("SLURM_JOB_ID", "42")],
        );
        assert!(NodeFilter::default().matches(&p));
        let job = NodeFilter {
            environment: vec![("SLURM_JOB_ID".into(), "42".into())],
            ..NodeFilter::default()
        };
        assert!(job.matches(&p));
        let other_job = NodeFilter {
            environment: vec![("SLURM_JOB_ID".into(), "43".into())],
            ..NodeFilter::default()
        };
        assert!(!other_job.matches(&p));
        let both = NodeFilter {
            command_line: Some("train.py".into()),
            cgroup: Some("job_42".into()),
            ..NodeFilter::default()
        };
        assert!(both.matches(&p));
        let wrong_cgroup = NodeFilter {
            cgroup: Some("job_7".into()),
            ..both
        };
        assert!(!wrong_cgroup.matches(&p));
        assert_eq!(
            NodeFilter::parse_env("A=b=c"),
            Ok(("A".into(), "b=c".into()))
        );
        assert!(NodeFilter::parse_env("=x").is_err());
        assert!(NodeFilter::parse_env("novalue").is_err());
    }
}
