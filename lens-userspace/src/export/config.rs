//! Export settings: which backend, which file, which ranks, read from the command line and
//! lens-probe's own environment with NeMo Lens' variable names and rules
//! (`nemo.lens.config.NemoLensConfig.from_env`), so one job configuration drives both.
//!
//! | setting | flag | variable | default |
//! | --- | --- | --- | --- |
//! | exporter | `--exporter` | `NEMO_LENS_EXPORTER` | `otlp` if `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, else `console` |
//! | file | `--export-file` | `LENS_PROBE_EXPORT_FILE` | required by `file` |
//! | strategy | `--export-strategy` | `NEMO_LENS_EXPORT_STRATEGY` | `single_rank` |
//! | rank | `--export-rank` | `NEMO_LENS_EXPORT_RANK` | -1 (last rank) |
//! | sample rate | `--export-sample-rate` | `NEMO_LENS_EXPORT_SAMPLE_RATE` | 1.0, within [0, 1] |
//! | service name | | `OTEL_SERVICE_NAME` | the target's own, else `nemo` |
//!
//! `NEMO_LENS_ENABLED` is checked as Lens checks it (`1/0`, `true/false`, `yes/no`,
//! `on/off`, any case; anything else is an error) but otherwise ignored: lens-probe is
//! enabled by running it, and the variable is usually set for the job's own Lens.
//!
//! As in Lens, a variable that is empty or blank counts as unset. Every bad value is one
//! [`LensError::InvalidSetting`] line naming the flag or variable it came from, exit
//! status 2.
use std::{fmt, path::PathBuf};

use super::strategy::ExportStrategy;
use crate::{
    cli::Cli,
    error::{LensError, Result},
};

/// Where finished spans go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExporterKind {
    /// OTLP to the collector the standard `OTEL_EXPORTER_OTLP_*` variables name.
    Otlp,
    /// Readable output on stderr.
    Console,
    /// Written to [`ExportSettings::export_file`].
    File,
}

impl ExporterKind {
    pub const NAMES: [&'static str; 3] = ["otlp", "console", "file"];

    pub fn name(self) -> &'static str {
        match self {
            ExporterKind::Otlp => "otlp",
            ExporterKind::Console => "console",
            ExporterKind::File => "file",
        }
    }
}

impl fmt::Display for ExporterKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The export settings of one lens-probe run.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportSettings {
    pub exporter: ExporterKind,
    /// `--export-file` / `LENS_PROBE_EXPORT_FILE`, as given (always set for
    /// [`ExporterKind::File`]).
    pub export_file: Option<PathBuf>,
    /// With the configured rank or sample rate in it.
    pub strategy: ExportStrategy,
    /// `OTEL_SERVICE_NAME` of lens-probe's environment: the service name of targets that
    /// do not set their own (see [`super::resource::detect`]).
    pub service_name: Option<String>,
}

// Variables, as NeMo Lens and the OpenTelemetry SDK name them.
pub const ENV_EXPORTER: &str = "NEMO_LENS_EXPORTER";
pub const ENV_EXPORT_FILE: &str = "LENS_PROBE_EXPORT_FILE";
pub const ENV_EXPORT_STRATEGY: &str = "NEMO_LENS_EXPORT_STRATEGY";
pub const ENV_EXPORT_RANK: &str = "NEMO_LENS_EXPORT_RANK";
pub const ENV_EXPORT_SAMPLE_RATE: &str = "NEMO_LENS_EXPORT_SAMPLE_RATE";
pub const ENV_ENABLED: &str = "NEMO_LENS_ENABLED";
pub const ENV_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
pub const ENV_OTLP_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
pub const ENV_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";

/// One setting with a flag and a variable.
struct Setting {
    flag: &'static str,
    variable: &'static str,
}

const EXPORTER: Setting = Setting {
    flag: "--exporter",
    variable: ENV_EXPORTER,
};
const EXPORT_STRATEGY: Setting = Setting {
    flag: "--export-strategy",
    variable: ENV_EXPORT_STRATEGY,
};
const EXPORT_RANK: Setting = Setting {
    flag: "--export-rank",
    variable: ENV_EXPORT_RANK,
};
const EXPORT_SAMPLE_RATE: Setting = Setting {
    flag: "--export-sample-rate",
    variable: ENV_EXPORT_SAMPLE_RATE,
};

/// A value and the name it is reported under: the variable when it came from there, else
/// the flag.
struct Given {
    value: String,
    key: &'static str,
}

impl Given {
    fn invalid(&self, reason: impl Into<String>) -> LensError {
        LensError::InvalidSetting {
            key: self.key.into(),
            value: self.value.clone(),
            reason: reason.into(),
        }
    }
}

/// Lens' `_env`: trimmed, and empty means unset.
fn non_empty(value: Option<String>) -> Option<String> {
    value
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

impl Setting {
    /// The flag's value (clap has already put the variable's there when the flag was not
    /// given), else the variable's.
    fn get(&self, flag: Option<&str>, env: &dyn Fn(&str) -> Option<String>) -> Option<Given> {
        let from_env = non_empty(env(self.variable));
        match non_empty(flag.map(str::to_string)) {
            Some(value) => {
                let key = if from_env.as_deref() == Some(value.as_str()) {
                    self.variable
                } else {
                    self.flag
                };
                Some(Given { value, key })
            }
            None => from_env.map(|value| Given {
                value,
                key: self.variable,
            }),
        }
    }
}

impl ExportSettings {
    /// The settings of this run: the command line, and lens-probe's environment for what
    /// has no flag.
    pub fn from_cli(cli: &Cli) -> Result<ExportSettings> {
        ExportSettings::from_cli_and_env(cli, |key| std::env::var(key).ok())
    }

    /// [`ExportSettings::from_cli`] with the environment given as a lookup, for tests.
    pub fn from_cli_and_env(
        cli: &Cli,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<ExportSettings> {
        let env: &dyn Fn(&str) -> Option<String> = &env;

        check_enabled(env)?;

        let exporter_given = EXPORTER.get(cli.exporter.as_deref(), env);
        let exporter = match &exporter_given {
            Some(given) => parse_exporter(given)?,
            None => default_exporter(env),
        };
        let export_file = cli
            .export_file
            .clone()
            .filter(|path| !path.as_os_str().is_empty())
            .or_else(|| non_empty(env(ENV_EXPORT_FILE)).map(PathBuf::from));
        if let (Some(given), None) = (&exporter_given, &export_file)
            && exporter == ExporterKind::File
        {
            return Err(given.invalid(format!("needs --export-file PATH (or {ENV_EXPORT_FILE})")));
        }

        // As Lens, the rank and the rate are checked whichever the strategy.
        let export_rank = match EXPORT_RANK.get(cli.export_rank.as_deref(), env) {
            Some(given) => given
                .value
                .parse::<i64>()
                .map_err(|_| given.invalid("must be an integer (-1: the last rank)"))?,
            None => -1,
        };
        let sample_rate = match EXPORT_SAMPLE_RATE.get(cli.export_sample_rate.as_deref(), env) {
            Some(given) => parse_sample_rate(&given)?,
            None => 1.0,
        };
        let strategy = match EXPORT_STRATEGY.get(cli.export_strategy.as_deref(), env) {
            Some(given) => given
                .value
                .parse::<ExportStrategy>()
                .map_err(|error| match error {
                    LensError::InvalidSetting { reason, .. } => given.invalid(reason),
                    other => other,
                })?,
            None => ExportStrategy::SingleRank { rank: -1 },
        };
        let strategy = match strategy {
            ExportStrategy::SingleRank { .. } => ExportStrategy::SingleRank { rank: export_rank },
            ExportStrategy::Sampled { .. } => ExportStrategy::Sampled { rate: sample_rate },
            other => other,
        };

        Ok(ExportSettings {
            exporter,
            export_file,
            strategy,
            service_name: non_empty(env(ENV_SERVICE_NAME)),
        })
    }
}

/// Lens' `_bool("ENABLED")`: validated, not used.
fn check_enabled(env: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    let Some(value) = non_empty(env(ENV_ENABLED)) else {
        return Ok(());
    };
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" | "0" | "false" | "no" | "off" => Ok(()),
        _ => Err(LensError::InvalidSetting {
            key: ENV_ENABLED.into(),
            value,
            reason: "expected 1/0, true/false, yes/no or on/off".into(),
        }),
    }
}

fn parse_exporter(given: &Given) -> Result<ExporterKind> {
    match given.value.to_ascii_lowercase().as_str() {
        "otlp" => Ok(ExporterKind::Otlp),
        "console" => Ok(ExporterKind::Console),
        "file" => Ok(ExporterKind::File),
        _ => Err(given.invalid(format!(
            "expected one of {}",
            ExporterKind::NAMES.join(", ")
        ))),
    }
}

/// OTLP when the standard variables name a collector, else the console.
fn default_exporter(env: &dyn Fn(&str) -> Option<String>) -> ExporterKind {
    let has_endpoint = [ENV_OTLP_ENDPOINT, ENV_OTLP_TRACES_ENDPOINT]
        .iter()
        .any(|key| non_empty(env(key)).is_some());
    if has_endpoint {
        ExporterKind::Otlp
    } else {
        ExporterKind::Console
    }
}

/// Lens' `float()` then `0.0 <= rate <= 1.0` (NaN fails it too).
fn parse_sample_rate(given: &Given) -> Result<f64> {
    let rate = given
        .value
        .parse::<f64>()
        .map_err(|_| given.invalid("must be a number between 0 and 1"))?;
    if (0.0..=1.0).contains(&rate) {
        Ok(rate)
    } else {
        Err(given.invalid("must be between 0 and 1"))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn cli(flags: &[&str]) -> Cli {
        let args = ["lens-probe", "--pid", "1"]
            .into_iter()
            .chain(flags.iter().copied());
        Cli::try_parse_from(args).unwrap()
    }

    /// Settings from these flags and this environment (nothing else of the process's).
    fn settings(flags: &[&str], env: &[(&str, &str)]) -> Result<ExportSettings> {
        let mut cli = cli(flags);
        // Drop what clap may have taken from the test process's own environment.
        let given = |flag: &str| flags.contains(&flag);
        if !given("--exporter") {
            cli.exporter = None;
        }
        if !given("--export-file") {
            cli.export_file = None;
        }
        if !given("--export-strategy") {
            cli.export_strategy = None;
        }
        if !given("--export-rank") {
            cli.export_rank = None;
        }
        if !given("--export-sample-rate") {
            cli.export_sample_rate = None;
        }
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ExportSettings::from_cli_and_env(&cli, move |key| {
            env.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
        })
    }

    fn error(flags: &[&str], env: &[(&str, &str)]) -> String {
        let error = settings(flags, env).unwrap_err();
        assert_eq!(error.exit_code(), 2, "{error}");
        error.to_string()
    }

    #[test]
    fn defaults_are_lens_defaults() {
        let s = settings(&[], &[]).unwrap();
        assert_eq!(
            s,
            ExportSettings {
                exporter: ExporterKind::Console,
                export_file: None,
                strategy: ExportStrategy::SingleRank { rank: -1 },
                service_name: None,
            }
        );
    }

    #[test]
    fn an_otlp_endpoint_makes_otlp_the_default() {
        let s = settings(&[], &[(ENV_OTLP_ENDPOINT, "http://collector:4317")]).unwrap();
        assert_eq!(s.exporter, ExporterKind::Otlp);
        let s = settings(
            &[],
            &[(ENV_OTLP_TRACES_ENDPOINT, "http://c:4318/v1/traces")],
        )
        .unwrap();
        assert_eq!(s.exporter, ExporterKind::Otlp);
        let s = settings(&[], &[(ENV_OTLP_ENDPOINT, " ")]).unwrap();
        assert_eq!(s.exporter, ExporterKind::Console);
        // Asked for explicitly, console wins over an endpoint.
        let s = settings(
            &["--exporter", "console"],
            &[(ENV_OTLP_ENDPOINT, "http://collector:4317")],
        )
        .unwrap();
        assert_eq!(s.exporter, ExporterKind::Console);
    }

    #[test]
    fn exporters_from_the_flag_or_the_variable() {
        let s = settings(&["--exporter", "OTLP"], &[]).unwrap();
        assert_eq!(s.exporter, ExporterKind::Otlp);
        let s = settings(&[], &[(ENV_EXPORTER, " console ")]).unwrap();
        assert_eq!(s.exporter, ExporterKind::Console);
        // Empty is unset, as in Lens.
        let s = settings(&[], &[(ENV_EXPORTER, "")]).unwrap();
        assert_eq!(s.exporter, ExporterKind::Console);
    }

    #[test]
    fn an_unknown_exporter_names_the_valid_ones() {
        assert_eq!(
            error(&["--exporter", "jaeger"], &[]),
            "invalid value \"jaeger\" for --exporter: expected one of otlp, console, file"
        );
        assert_eq!(
            error(&[], &[(ENV_EXPORTER, "jaeger")]),
            "invalid value \"jaeger\" for NEMO_LENS_EXPORTER: expected one of otlp, console, file"
        );
    }

    #[test]
    fn the_file_exporter_needs_a_file() {
        assert_eq!(
            error(&["--exporter", "file"], &[]),
            "invalid value \"file\" for --exporter: needs --export-file PATH \
             (or LENS_PROBE_EXPORT_FILE)"
        );
        let s = settings(&["--exporter", "file", "--export-file", "/tmp/s.json"], &[]).unwrap();
        assert_eq!(s.exporter, ExporterKind::File);
        assert_eq!(s.export_file, Some(PathBuf::from("/tmp/s.json")));
        let s = settings(
            &[],
            &[(ENV_EXPORTER, "file"), (ENV_EXPORT_FILE, "/tmp/t.json")],
        )
        .unwrap();
        assert_eq!(s.export_file, Some(PathBuf::from("/tmp/t.json")));
    }

    #[test]
    fn strategies_take_their_parameters() {
        let s = settings(&["--export-rank", "3"], &[]).unwrap();
        assert_eq!(s.strategy, ExportStrategy::SingleRank { rank: 3 });
        let s = settings(
            &[],
            &[
                (ENV_EXPORT_STRATEGY, "Sampled"),
                (ENV_EXPORT_SAMPLE_RATE, "0.25"),
            ],
        )
        .unwrap();
        assert_eq!(s.strategy, ExportStrategy::Sampled { rate: 0.25 });
        let s = settings(&["--export-strategy", "sampled"], &[]).unwrap();
        assert_eq!(s.strategy, ExportStrategy::Sampled { rate: 1.0 });
        let s = settings(
            &["--export-strategy", "all_ranks", "--export-rank", "2"],
            &[],
        )
        .unwrap();
        assert_eq!(s.strategy, ExportStrategy::AllRanks);
        let s = settings(&[], &[(ENV_EXPORT_STRATEGY, "first_rank_per_node")]).unwrap();
        assert_eq!(s.strategy, ExportStrategy::FirstRankPerNode);
        let s = settings(&["--export-rank", "-1"], &[(ENV_EXPORT_RANK, "5")]).unwrap();
        assert_eq!(s.strategy, ExportStrategy::SingleRank { rank: -1 });
    }

    #[test]
    fn bad_strategy_values_are_one_line_each() {
        assert_eq!(
            error(&[], &[(ENV_EXPORT_STRATEGY, "round_robin")]),
            "invalid value \"round_robin\" for NEMO_LENS_EXPORT_STRATEGY: expected one of \
             single_rank, all_ranks, sampled, first_rank_per_node"
        );
        assert_eq!(
            error(&[], &[(ENV_EXPORT_SAMPLE_RATE, "2")]),
            "invalid value \"2\" for NEMO_LENS_EXPORT_SAMPLE_RATE: must be between 0 and 1"
        );
        assert_eq!(
            error(&["--export-sample-rate", "-0.5"], &[]),
            "invalid value \"-0.5\" for --export-sample-rate: must be between 0 and 1"
        );
        assert_eq!(
            error(&[], &[(ENV_EXPORT_SAMPLE_RATE, "NaN")]),
            "invalid value \"NaN\" for NEMO_LENS_EXPORT_SAMPLE_RATE: must be between 0 and 1"
        );
        assert_eq!(
            error(&[], &[(ENV_EXPORT_SAMPLE_RATE, "half")]),
            "invalid value \"half\" for NEMO_LENS_EXPORT_SAMPLE_RATE: \
             must be a number between 0 and 1"
        );
        assert_eq!(
            error(&["--export-rank", "last"], &[]),
            "invalid value \"last\" for --export-rank: must be an integer (-1: the last rank)"
        );
        // Checked whichever the strategy, as Lens does.
        assert!(
            settings(
                &["--export-strategy", "all_ranks"],
                &[(ENV_EXPORT_RANK, "x")]
            )
            .is_err()
        );
        // The bounds themselves are valid.
        assert!(settings(&[], &[(ENV_EXPORT_SAMPLE_RATE, "0")]).is_ok());
        assert!(settings(&[], &[(ENV_EXPORT_SAMPLE_RATE, "1.0")]).is_ok());
    }

    #[test]
    fn enabled_is_checked_but_ignored() {
        for value in ["1", "0", "TRUE", "false", "Yes", "no", "on", "OFF", "", " "] {
            assert!(settings(&[], &[(ENV_ENABLED, value)]).is_ok(), "{value:?}");
        }
        assert_eq!(
            error(&[], &[(ENV_ENABLED, "maybe")]),
            "invalid value \"maybe\" for NEMO_LENS_ENABLED: \
             expected 1/0, true/false, yes/no or on/off"
        );
    }

    #[test]
    fn the_service_name_comes_from_otel_service_name() {
        let s = settings(&[], &[(ENV_SERVICE_NAME, " trainer ")]).unwrap();
        assert_eq!(s.service_name.as_deref(), Some("trainer"));
        let s = settings(&[], &[(ENV_SERVICE_NAME, "")]).unwrap();
        assert_eq!(s.service_name, None);
    }
}
