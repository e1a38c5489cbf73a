//! Command line: what to trace, which span groups, how to report.
use std::{ffi::OsString, path::PathBuf, time::Duration};

use clap::{ArgAction, Parser};

use crate::{budget::OverheadBudget, groups::SpanGroups};

/// Zero-code observability for distributed ML training: attaches eBPF uprobes to a job's
/// NCCL collectives and CUDA launch/sync calls.
#[derive(Debug, Parser)]
#[command(name = "lens-probe", version, about, long_about = None)]
#[command(group = clap::ArgGroup::new("what").required(true).args(["pid", "exec", "node"]))]
pub struct Cli {
    /// Trace this running process (repeatable).
    #[arg(short, long, value_name = "PID", action = ArgAction::Append)]
    pub pid: Vec<u32>,

    /// Start the command given after `--` and trace it from its first instruction; exit
    /// with its exit code.
    #[arg(long, requires = "command", conflicts_with = "pid")]
    pub exec: bool,

    /// The command for --exec.
    #[arg(last = true, value_name = "CMD", requires = "exec")]
    pub command: Vec<OsString>,

    /// Node-wide: trace every training process on this host (one that maps libtorch_cpu,
    /// libnccl or libcudart), those running now and those that start, until stopped.
    #[arg(long, conflicts_with_all = ["pid", "exec"])]
    pub node: bool,

    /// With --node: only processes whose command line contains this text.
    #[arg(long = "match", value_name = "TEXT", requires = "node")]
    pub match_command_line: Option<String>,

    /// With --node: only processes whose cgroup path contains this text (a SLURM job's
    /// `job_1234`, a pod UID).
    #[arg(long, value_name = "TEXT", requires = "node")]
    pub match_cgroup: Option<String>,

    /// With --node: only processes with this variable set to this value in their
    /// environment (repeatable), e.g. SLURM_JOB_ID=1234.
    #[arg(long, value_name = "KEY=VALUE", requires = "node", action = ArgAction::Append,
          value_parser = crate::discovery::NodeFilter::parse_env)]
    pub match_env: Vec<(String, String)>,

    /// Write lens-probe's pid to this file (for scripts that stop it with SIGTERM).
    #[arg(long, value_name = "PATH")]
    pub pid_file: Option<PathBuf>,

    /// Span groups to enable: comma-separated groups and presets (default, per_step, all),
    /// case-insensitive. A disabled group's probes are not attached.
    #[arg(
        long,
        value_name = "SPEC",
        env = "NEMO_LENS_SPAN_GROUPS",
        default_value = "default",
        value_parser = parse_span_groups
    )]
    pub span_groups: SpanGroups,

    // The export settings are plain strings, checked by `ExportSettings::from_cli`, so a
    // bad value (from the flag or its variable) is one line of ours with exit status 2.
    /// Where spans go: otlp (to OTEL_EXPORTER_OTLP_ENDPOINT), console (stderr) or file
    /// (to --export-file). Default: otlp when OTEL_EXPORTER_OTLP_ENDPOINT or
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set, else console.
    #[arg(long, value_name = "EXPORTER", env = "NEMO_LENS_EXPORTER")]
    pub exporter: Option<String>,

    /// The file for --exporter file.
    #[arg(long, value_name = "PATH", env = "LENS_PROBE_EXPORT_FILE")]
    pub export_file: Option<PathBuf>,

    /// Which ranks export, as NeMo Lens: single_rank, all_ranks, sampled,
    /// first_rank_per_node. Default: single_rank.
    #[arg(long, value_name = "STRATEGY", env = "NEMO_LENS_EXPORT_STRATEGY")]
    pub export_strategy: Option<String>,

    /// For single_rank: the rank that exports; -1 (default) is the last rank.
    #[arg(
        long,
        value_name = "RANK",
        env = "NEMO_LENS_EXPORT_RANK",
        allow_negative_numbers = true
    )]
    pub export_rank: Option<String>,

    /// For sampled: the share of ranks that export, 0 to 1 (default 1).
    #[arg(
        long,
        value_name = "RATE",
        env = "NEMO_LENS_EXPORT_SAMPLE_RATE",
        allow_negative_numbers = true
    )]
    pub export_sample_rate: Option<String>,

    /// Stop tracing after this long (e.g. 30s, 5m).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// Keep the kernel-launch probes within this share of the job's time (e.g. 1%): above
    /// it they are in only for sampled windows; spans inside one carry exact launch counts
    /// (`cuda.launch.sampled`), metrics scale the counts up.
    #[arg(long, value_name = "PERCENT", env = "LENS_PROBE_OVERHEAD_BUDGET")]
    pub overhead_budget: Option<OverheadBudget>,

    /// Also write the exit summary as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub summary_json: Option<PathBuf>,

    /// -v: print events as they come and each attached probe; -vv: debug logs and the
    /// kernel-side diagnostics.
    #[arg(short, long, action = ArgAction::Count)]
    pub verbose: u8,
}

fn parse_span_groups(spec: &str) -> Result<SpanGroups, String> {
    spec.parse::<SpanGroups>().map_err(|error| match error {
        crate::error::LensError::InvalidSetting { reason, .. } => reason,
        other => other.to_string(),
    })
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    // A bare number means seconds.
    if let Ok(seconds) = text.parse::<f64>() {
        return if seconds.is_finite() && seconds > 0.0 {
            Ok(Duration::from_secs_f64(seconds))
        } else {
            Err("must be a positive duration such as 30s or 5m".into())
        };
    }
    match humantime::parse_duration(text) {
        Ok(duration) if !duration.is_zero() => Ok(duration),
        Ok(_) => Err("must be a positive duration such as 30s or 5m".into()),
        Err(error) => Err(format!("{error} (expected e.g. 30s, 5m, 1h)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("lens-probe").chain(args.iter().copied()))
    }

    #[test]
    fn exec_takes_everything_after_the_double_dash() {
        let cli = parse(&[
            "--exec",
            "--",
            "torchrun",
            "--nproc-per-node",
            "8",
            "train.py",
        ])
        .unwrap();
        assert!(cli.exec);
        assert_eq!(
            cli.command,
            ["torchrun", "--nproc-per-node", "8", "train.py"]
        );
    }

    #[test]
    fn pids_repeat() {
        let cli = parse(&["--pid", "10", "-p", "11"]).unwrap();
        assert_eq!(cli.pid, [10, 11]);
    }

    #[test]
    fn a_target_is_required_and_exclusive() {
        assert!(parse(&[]).is_err());
        assert!(parse(&["--pid", "1", "--exec", "--", "true"]).is_err());
        assert!(parse(&["--exec"]).is_err());
    }

    #[test]
    fn bad_values_are_rejected() {
        assert!(parse(&["--pid", "x"]).is_err());
        assert!(parse(&["--pid", "1", "--span-groups", "steps"]).is_err());
        assert!(parse(&["--pid", "1", "--duration", "0"]).is_err());
        assert!(parse(&["--pid", "1", "--duration", "soon"]).is_err());
        assert!(parse(&["--pid", "1", "--frobnicate"]).is_err());
    }

    #[test]
    fn export_settings_are_taken_as_given() {
        // Checked later, by `ExportSettings::from_cli`, so clap accepts any string.
        let cli = parse(&[
            "--pid",
            "1",
            "--exporter",
            "foo",
            "--export-rank",
            "-1",
            "--export-sample-rate",
            "2",
            "--export-strategy",
            "sampled",
            "--export-file",
            "/tmp/spans.jsonl",
        ])
        .unwrap();
        assert_eq!(cli.exporter.as_deref(), Some("foo"));
        assert_eq!(cli.export_rank.as_deref(), Some("-1"));
        assert_eq!(cli.export_sample_rate.as_deref(), Some("2"));
        assert_eq!(cli.export_strategy.as_deref(), Some("sampled"));
        assert_eq!(cli.export_file, Some(PathBuf::from("/tmp/spans.jsonl")));
    }

    #[test]
    fn durations_accept_units_and_bare_seconds() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
    }
}
