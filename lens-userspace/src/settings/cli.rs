//! Command line: what to trace, which span groups, how to report.
//!
//! [`parse`] reads it (and the variables some flags have), so that every bad value is
//! one line naming the flag, or the variable when the value came from there, and the
//! values it takes: exit status 2, before anything is loaded. As in NeMo Lens, a variable
//! that is empty or blank counts as unset.
use super::{BadValue, parse_size};
use std::{
    ffi::OsString,
    io,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
    time::Duration,
};

use clap::{
    ArgAction, CommandFactory, FromArgMatches, Parser,
    builder::{PathBufValueParser, Resettable, TypedValueParser, ValueParser},
    error::{ContextKind, ContextValue, ErrorKind},
};

use crate::{
    budget::OverheadBudget,
    settings::{groups::SpanGroups, links::UprobeLinks, probe_rules::Profile},
};

/// Zero-code observability for distributed ML training: attaches eBPF uprobes to a job's
/// NCCL collectives and CUDA launch/sync calls.
#[derive(Debug, Parser)]
#[command(name = "lens-probe", version, about, long_about = None)]
#[command(group = clap::ArgGroup::new("what").required(true).args(["pid", "exec", "node"]))]
pub struct Cli {
    /// Trace these running processes: several after one --pid (space- or
    /// comma-separated, as `$(pgrep python)` gives them) and repeatable. One that does
    /// not train is a warning and skipped; a launcher's training descendants are traced.
    #[arg(short, long, value_name = "PID", action = ArgAction::Append, num_args = 1..,
          value_delimiter = ',', allow_negative_numbers = true, value_parser = parse_pid)]
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
    #[arg(long = "match", value_name = "TEXT", requires = "node",
          value_parser = parse_match_text)]
    pub match_command_line: Option<String>,

    /// With --node: only processes whose cgroup path contains this text (a SLURM job's
    /// `job_1234`, a pod UID).
    #[arg(long, value_name = "TEXT", requires = "node", value_parser = parse_match_text)]
    pub match_cgroup: Option<String>,

    /// With --node: only processes with this variable set to this value in their
    /// environment (repeatable), e.g. SLURM_JOB_ID=1234.
    #[arg(long, value_name = "KEY=VALUE", requires = "node", action = ArgAction::Append,
          value_parser = crate::discovery::NodeFilter::parse_env)]
    pub match_env: Vec<(String, String)>,

    /// Write lens-probe's pid to this file (for scripts that stop it with SIGTERM).
    #[arg(long, value_name = "PATH", value_parser = output_file())]
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

    /// Configured probes: a TOML file of rules naming native or Python functions and the
    /// span group their calls become (docs/probes.md, "Configured probes").
    #[arg(long, value_name = "FILE", env = "NEMO_LENS_CONFIG")]
    pub config: Option<PathBuf>,

    /// Built-in rules for a framework: pytorch (lens-probe's built-in probes only, the
    /// default), megatron, nemo-rl. Added to the built-in probes and to --config's rules.
    #[arg(
        long,
        value_name = "NAME",
        env = "LENS_PROBE_PROFILE",
        default_value = "pytorch",
        value_parser = parse_profile
    )]
    pub profile: Profile,

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

    /// Keep span batches the OTLP collector could not take in this directory (created,
    /// mode 0700) and send them, oldest first, when it answers again, in this run or the
    /// next one that uses the directory.
    #[arg(long, value_name = "DIR", env = "LENS_PROBE_SPOOL_DIR")]
    pub spool_dir: Option<PathBuf>,

    /// The spool's size bound (default 1GiB): past it the oldest batches are dropped,
    /// counted as lost.
    #[arg(long, value_name = "SIZE", env = "LENS_PROBE_SPOOL_MAX")]
    pub spool_max: Option<String>,

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
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true,
          value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// With --exec: after SIGINT, SIGTERM or SIGHUP (passed on to the command), trace the
    /// command on for this long; then stop tracing, flush, and wait for it untraced (further
    /// signals passed on too), ending with its exit code
    #[arg(
        long,
        value_name = "DURATION",
        env = "LENS_PROBE_STOP_GRACE",
        default_value = "5s",
        value_parser = parse_duration
    )]
    pub stop_grace: Duration,

    /// Report a collective some traced ranks entered and others did not (or that none
    /// finished) for this long, with where each rank is; 0 turns it off.
    #[arg(
        long,
        value_name = "DURATION",
        env = "LENS_PROBE_HANG_TIMEOUT",
        default_value = "5m",
        allow_hyphen_values = true,
        value_parser = parse_hang_timeout
    )]
    pub hang_timeout: HangTimeout,

    /// Keep the kernel-launch probes within this share of the job's time (e.g. 1%): above
    /// it they are in only for sampled windows; spans inside one carry exact launch counts
    /// (`cuda.launch.sampled`), metrics scale the counts up.
    #[arg(
        long,
        value_name = "PERCENT",
        env = "LENS_PROBE_OVERHEAD_BUDGET",
        allow_hyphen_values = true
    )]
    pub overhead_budget: Option<OverheadBudget>,

    /// How uprobes go into the kernel: auto (one uprobe_multi link per program and library
    /// where the kernel has them, else one perf link per point, said once), multi (refuse
    /// to start without them), perf (one perf link per point).
    #[arg(
        long,
        value_name = "KIND",
        env = "LENS_PROBE_UPROBE_LINKS",
        default_value = "auto",
        value_parser = parse_uprobe_links
    )]
    pub uprobe_links: UprobeLinks,

    /// Also write the exit summary as JSON to this file.
    #[arg(long, value_name = "FILE", value_parser = output_file())]
    pub summary_json: Option<PathBuf>,

    /// Write the run as a Perfetto timeline to this file while it goes (open it at
    /// ui.perfetto.dev): every traced rank side by side, a collective joined across its
    /// ranks. Also `[timeline] perfetto` in the config file.
    #[arg(long, value_name = "FILE", env = "LENS_PROBE_PERFETTO", value_parser = output_file())]
    pub perfetto: Option<PathBuf>,

    /// The timeline's size cap (default 1GiB): past it nothing more is written, said once
    /// and in the summary. Also `[timeline] max_size` in the config file.
    #[arg(long, value_name = "SIZE", env = "LENS_PROBE_PERFETTO_MAX_SIZE",
          value_parser = parse_size)]
    pub perfetto_max_size: Option<u64>,

    /// -v: print events as they come and each attached probe; -vv: debug logs and the
    /// kernel-side diagnostics.
    #[arg(short, long, action = ArgAction::Count)]
    pub verbose: u8,
}

/// Why the command line gave no [`Cli`].
#[derive(Debug)]
pub enum Rejected {
    /// `--help` or `--version`: print clap's text, exit status 0.
    Info(clap::Error),
    /// Bad arguments or a bad value: this one line (without the program name), exit
    /// status 2.
    Invalid(String),
}

/// The command line of this process, with the variables its flags read.
pub fn parse() -> Result<Cli, Rejected> {
    parse_from(std::env::args_os())
}

/// [`parse`] with these arguments (the first is the program name).
pub fn parse_from<I, T>(args: I) -> Result<Cli, Rejected>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    // Lens' rule: a blank variable is unset (clap would parse the empty value).
    let mut command = Cli::command().mut_args(|arg| {
        let blank = arg
            .get_env()
            .and_then(std::env::var_os)
            .is_some_and(|value| value.as_bytes().trim_ascii().is_empty());
        if blank {
            arg.env(Resettable::Reset)
        } else {
            arg
        }
    });
    // clap says only "invalid UTF-8 was detected" for a variable's bytes: name it.
    for arg in command.get_arguments() {
        let Some(variable) = arg.get_env() else {
            continue;
        };
        let takes_text = arg.get_value_parser().type_id() != ValueParser::path_buf().type_id();
        if let Some(value) = std::env::var_os(variable)
            && value.to_str().is_none()
            && takes_text
            && !given(arg, &args)
        {
            return Err(Rejected::Invalid(format!(
                "invalid value {:?} for {}: not valid UTF-8",
                value.to_string_lossy(),
                variable.to_string_lossy()
            )));
        }
    }
    let matches = command
        .try_get_matches_from_mut(&args)
        .map_err(|error| rejected(&command, &args, error))?;
    Cli::from_arg_matches(&matches).map_err(|error| rejected(&command, &args, error))
}

fn rejected(command: &clap::Command, args: &[OsString], error: clap::Error) -> Rejected {
    match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => Rejected::Info(error),
        _ => Rejected::Invalid(error_line(command, args, &error)),
    }
}

/// One line for a clap error. A rejected value reads as lens-probe's other bad settings
/// do, `invalid value "V" for KEY: what it takes`, where KEY is the variable when the
/// value came from there (the flag is not on the command line); anything else is clap's
/// first line.
fn error_line(command: &clap::Command, args: &[OsString], error: &clap::Error) -> String {
    let context = |kind| match error.get(kind) {
        Some(ContextValue::String(text)) => Some(text.as_str()),
        _ => None,
    };
    let reason = std::error::Error::source(error).map(|source| source.to_string());
    if error.kind() == ErrorKind::ValueValidation
        && let (Some(shown), Some(value), Some(reason)) = (
            context(ContextKind::InvalidArg),
            context(ContextKind::InvalidValue),
            reason,
        )
        && let Some(arg) = command.get_arguments().find(|arg| {
            arg.get_long()
                .is_some_and(|long| shown.split(' ').next() == Some(&format!("--{long}")))
        })
    {
        let key = match arg.get_env() {
            Some(variable) if !given(arg, args) => variable.to_string_lossy().into_owned(),
            _ => format!("--{}", arg.get_long().unwrap_or_default()),
        };
        return format!("invalid value {value:?} for {key}: {reason}");
    }
    let rendered = error.render().to_string();
    let first = rendered.lines().next().unwrap_or("invalid arguments");
    first.trim_start_matches("error: ").to_string()
}

/// Whether the flag of `arg` is on the command line (before a `--`).
fn given(arg: &clap::Arg, args: &[OsString]) -> bool {
    let long = arg.get_long().map(|long| format!("--{long}"));
    let short = arg.get_short().map(|short| format!("-{short}"));
    args.iter()
        .skip(1)
        .map(|arg| arg.as_bytes())
        .take_while(|arg| *arg != b"--")
        .any(|text| {
            let is = |flag: &Option<String>| {
                flag.as_deref().is_some_and(|flag| {
                    text.strip_prefix(flag.as_bytes()).is_some_and(|rest| {
                        rest.is_empty() || rest.starts_with(b"=") || !flag.starts_with("--")
                    })
                })
            };
            is(&long) || is(&short)
        })
}

fn parse_pid(text: &str) -> Result<u32, BadValue> {
    match text.trim().parse::<u32>() {
        Ok(pid) if pid > 0 && pid <= i32::MAX as u32 => Ok(pid),
        _ => Err("expected a process id, a positive integer such as 4242".into()),
    }
}

fn parse_match_text(text: &str) -> Result<String, BadValue> {
    if text.is_empty() {
        Err("expected some text: an empty one would match every process".into())
    } else {
        Ok(text.to_string())
    }
}

/// A path (any bytes) that [`check_output_file`] accepts.
fn output_file() -> impl TypedValueParser<Value = PathBuf> {
    PathBufValueParser::new().try_map(|path| check_output_file(&path).map(|()| path))
}

/// Whether lens-probe can create or overwrite `path` (checked before anything runs, so
/// that a file written at the end does not fail after the whole trace). Says what is
/// wrong and what is expected.
pub fn check_output_file(path: &Path) -> Result<(), BadValue> {
    const EXPECTED: &str = "expected a file lens-probe can create or overwrite";
    if path.as_os_str().is_empty() {
        return Err(format!("empty path; {EXPECTED}").into());
    }
    if crate::sys::output::is_standard_stream(path) {
        return Ok(());
    }
    if std::fs::symlink_metadata(path).is_ok_and(|meta| meta.file_type().is_symlink()) {
        // Root writing through a link in a shared directory could overwrite any file.
        return Err(format!(
            "is a symbolic link, which lens-probe never writes through; {EXPECTED}"
        )
        .into());
    }
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => Err(format!("is a directory; {EXPECTED}").into()),
        Ok(_) => writable(path)
            .map_err(|error| format!("cannot be written ({error}); {EXPECTED}").into()),
        Err(error)
            if matches!(
                error.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
            ) =>
        {
            let parent = path
                .parent()
                .filter(|parent| !parent.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            match std::fs::metadata(parent) {
                Ok(meta) if meta.is_dir() => writable(parent).map_err(|error| {
                    format!(
                        "cannot create a file in {} ({error}); {EXPECTED}",
                        parent.display()
                    )
                    .into()
                }),
                Ok(_) => Err(format!("{} is not a directory; {EXPECTED}", parent.display()).into()),
                Err(error) if error.kind() == io::ErrorKind::NotFound => {
                    Err(format!("directory {} does not exist; {EXPECTED}", parent.display()).into())
                }
                Err(error) => Err(format!("{}: {error}; {EXPECTED}", parent.display()).into()),
            }
        }
        Err(error) => Err(format!("{error}; {EXPECTED}").into()),
    }
}

/// `access(path, W_OK)`: the kernel's answer for this process's credentials (root
/// included, read-only mounts too), without creating anything.
fn writable(path: &Path) -> io::Result<()> {
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a NUL-terminated path that outlives the call.
    if unsafe { libc::access(path.as_ptr(), libc::W_OK) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn parse_uprobe_links(text: &str) -> Result<UprobeLinks, BadValue> {
    text.parse()
}

fn parse_profile(text: &str) -> Result<Profile, BadValue> {
    text.parse()
}

fn parse_span_groups(spec: &str) -> Result<SpanGroups, BadValue> {
    spec.parse::<SpanGroups>().map_err(|error| match error {
        crate::error::LensError::InvalidSetting { reason, .. } => reason.into(),
        other => other.to_string().into(),
    })
}

/// `--duration`: a positive duration with a unit (`30s`, `5m`, `1h 30m`), or a number of
/// seconds.
pub fn parse_duration(text: &str) -> Result<Duration, BadValue> {
    const EXPECTED: &str = "expected a positive duration such as 30s, 5m or 1h";
    let text = text.trim();
    // A bare number means seconds.
    let duration = if let Ok(seconds) = text.parse::<f64>() {
        match Duration::try_from_secs_f64(seconds) {
            Ok(duration) if !duration.is_zero() => duration,
            Err(_) if seconds > 0.0 => return Err(format!("too long; {EXPECTED}").into()),
            _ => return Err(EXPECTED.into()),
        }
    } else {
        match humantime::parse_duration(text) {
            Ok(duration) if !duration.is_zero() => duration,
            Ok(_) => return Err(EXPECTED.into()),
            Err(error) => return Err(format!("{error}; {EXPECTED}").into()),
        }
    };
    // Deadlines are the clock now plus this: beyond what the clock can hold, a run would
    // panic after its command started.
    if duration > MAX_DURATION {
        return Err(format!(
            "longer than {} days; {EXPECTED}",
            MAX_DURATION.as_secs() / 86_400
        )
        .into());
    }
    Ok(duration)
}

/// The longest duration an option takes: ten years.
pub const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 86_400);

/// `--hang-timeout`: a duration, or 0 for off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HangTimeout(pub Option<Duration>);

fn parse_hang_timeout(text: &str) -> Result<HangTimeout, BadValue> {
    if matches!(text.trim(), "0" | "0s" | "off") {
        return Ok(HangTimeout(None));
    }
    parse_duration(text)
        .map(|duration| HangTimeout(Some(duration)))
        .map_err(|error| format!("{error} (or 0 for off)").into())
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

    /// The line [`parse_from`] gives for these arguments (flags only: the variables are
    /// the binary's tests, `tests/integration/bad_input.rs`).
    fn rejected(args: &[&str]) -> String {
        match parse_from(std::iter::once("lens-probe").chain(args.iter().copied())) {
            Err(Rejected::Invalid(line)) => line,
            Err(Rejected::Info(info)) => panic!("{args:?}: help, not an error: {info}"),
            Ok(cli) => panic!("{args:?} accepted: {cli:?}"),
        }
    }

    #[test]
    fn a_bad_value_is_one_line_naming_the_flag_and_what_it_takes() {
        assert_eq!(
            rejected(&["--pid", "x"]),
            "invalid value \"x\" for --pid: expected a process id, a positive integer such as 4242"
        );
        assert_eq!(
            rejected(&["--pid", "-3"]),
            "invalid value \"-3\" for --pid: expected a process id, a positive integer such as 4242"
        );
        assert_eq!(
            rejected(&["--pid", "1", "--duration", "-5"]),
            "invalid value \"-5\" for --duration: expected a positive duration such as 30s, 5m or 1h"
        );
        assert!(
            rejected(&["--pid", "1", "--span-groups", "steps"]).starts_with(
                "invalid value \"steps\" for --span-groups: unknown span group \"steps\"; valid: "
            )
        );
        assert_eq!(
            rejected(&["--node", "--match", ""]),
            "invalid value \"\" for --match: expected some text: an empty one would match every \
             process"
        );
        // Errors that are not about one value keep clap's line.
        assert_eq!(
            rejected(&["--pid"]),
            "a value is required for '--pid <PID>...' but none was supplied"
        );
        assert!(rejected(&["--frobnicate"]).contains("'--frobnicate'"));
    }

    #[test]
    fn several_pids_follow_one_flag_as_pgrep_prints_them() {
        let pids = |args: &[&str]| {
            let mut argv = vec!["lens-probe"];
            argv.extend(args);
            Cli::try_parse_from(argv).unwrap().pid
        };
        assert_eq!(pids(&["--pid", "12", "34", "56"]), [12, 34, 56]);
        assert_eq!(pids(&["--pid", "12,34"]), [12, 34]);
        assert_eq!(
            pids(&["-p", "12", "-p", "34", "--duration", "5s"]),
            [12, 34]
        );
    }

    #[test]
    fn help_and_version_are_not_errors() {
        for flag in ["--help", "--version"] {
            let parsed = parse_from(["lens-probe", flag]);
            assert!(matches!(parsed, Err(Rejected::Info(_))), "{flag}");
        }
    }

    #[test]
    fn a_flag_is_given_when_it_is_before_the_double_dash() {
        let command = Cli::command();
        let arg = |id: &str| command.get_arguments().find(|a| a.get_id() == id).unwrap();
        let args = |list: &[&str]| -> Vec<OsString> { list.iter().map(Into::into).collect() };
        let groups = arg("span_groups");
        assert!(given(
            groups,
            &args(&["lens-probe", "--span-groups", "all"])
        ));
        assert!(given(groups, &args(&["lens-probe", "--span-groups=all"])));
        assert!(!given(groups, &args(&["lens-probe", "--span-groupsx"])));
        assert!(!given(
            groups,
            &args(&["lens-probe", "--exec", "--", "x", "--span-groups", "all"])
        ));
        // The program name is not an argument.
        assert!(!given(groups, &args(&["--span-groups"])));
        let pid = arg("pid");
        assert!(given(pid, &args(&["lens-probe", "-p", "1"])));
        assert!(given(pid, &args(&["lens-probe", "-p1"])));
    }

    #[test]
    fn output_files_must_be_writable_files() {
        let dir = std::env::temp_dir().join(format!("lens-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("summary.json");
        assert_eq!(
            check_output_file(&file),
            Ok(()),
            "a new file in a directory"
        );
        std::fs::write(&file, "{}").unwrap();
        assert_eq!(check_output_file(&file), Ok(()), "an existing file");
        assert!(
            check_output_file(&dir)
                .unwrap_err()
                .to_string()
                .starts_with("is a directory")
        );
        let under_file = file.join("x");
        assert!(
            check_output_file(&under_file)
                .unwrap_err()
                .to_string()
                .contains("summary.json is not a directory")
        );
        let missing = dir.join("missing").join("x");
        assert!(
            check_output_file(&missing)
                .unwrap_err()
                .to_string()
                .starts_with("directory ")
        );
        assert!(check_output_file(Path::new("")).is_err());
        // Nothing was created by the checks.
        assert!(!dir.join("missing").exists() && !under_file.exists());
        std::fs::remove_dir_all(&dir).unwrap();
        let cli = parse(&["--pid", "1", "--summary-json", "/"]);
        assert!(cli.is_err());
    }

    #[test]
    fn pids_are_positive_process_ids() {
        assert_eq!(parse_pid("4242"), Ok(4242));
        assert_eq!(parse_pid(" 7 "), Ok(7));
        for bad in ["0", "-1", "x", "", "2147483648", "99999999999"] {
            assert!(parse_pid(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_are_positive_and_fit() {
        for bad in ["0", "-5", "0s", "1e30", "inf", "NaN", "1e-12", "", "soon"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_duration("1e30"),
            Err("too long; expected a positive duration such as 30s, 5m or 1h".into())
        );
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        // Fits a Duration but not the clock plus it: refused here, not a panic later.
        for huge in ["9223372036854775807s", "9223372036854775807", "400000d"] {
            let error = parse_duration(huge).unwrap_err().to_string();
            assert!(
                error.starts_with("longer than 3650 days"),
                "{huge}: {error}"
            );
        }
        assert!(parse_duration("3650d").is_ok());
    }

    #[test]
    fn the_hang_timeout_is_5_minutes_unless_set_and_0_turns_it_off() {
        let timeout = |args: &[&str]| parse(args).map(|cli| cli.hang_timeout);
        assert_eq!(
            timeout(&["--pid", "1"]).unwrap(),
            HangTimeout(Some(Duration::from_secs(300)))
        );
        assert_eq!(
            timeout(&["--pid", "1", "--hang-timeout", "3s"]).unwrap(),
            HangTimeout(Some(Duration::from_secs(3)))
        );
        assert_eq!(
            timeout(&["--pid", "1", "--hang-timeout", "0"]).unwrap(),
            HangTimeout(None)
        );
        assert_eq!(
            rejected(&["--pid", "1", "--hang-timeout", "soon"]),
            "invalid value \"soon\" for --hang-timeout: expected number at 0; expected a \
             positive duration such as 30s, 5m or 1h (or 0 for off)"
        );
    }

    #[test]
    fn durations_accept_units_and_bare_seconds() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
    }
}
