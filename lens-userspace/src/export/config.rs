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
//!
//! The exporter in use also has its files and variables checked here, before anything
//! starts: `--export-file` must be a file lens-probe can write; for `otlp`, the standard
//! `OTEL_EXPORTER_OTLP_*` variables opentelemetry-otlp reads (endpoint, protocol,
//! timeout, headers, compression; generic and per signal), which it would otherwise
//! ignore when malformed (a bad timeout or header is dropped, a bad HTTP endpoint falls
//! back to localhost) or fail on with a message that does not name them; for `otlp` and
//! `file`, `OTEL_METRIC_EXPORT_INTERVAL`. A bad header list is reported without its value
//! (it usually holds a token).
use std::{fmt, path::PathBuf};

use opentelemetry_otlp::Protocol;

use super::{
    spool::{DEFAULT_MAX_BYTES, SpoolConfig},
    strategy::ExportStrategy,
};
use crate::settings::{BadValue, parse_size};
use crate::{
    error::{LensError, Result},
    settings::cli::{self, Cli},
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
    /// `--spool-dir` / `--spool-max` (OTLP only).
    pub spool: Option<SpoolConfig>,
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
pub const ENV_OTLP_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
pub const ENV_OTLP_TRACES_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL";
pub const ENV_METRIC_EXPORT_INTERVAL: &str = "OTEL_METRIC_EXPORT_INTERVAL";

/// The OTLP variables opentelemetry-otlp reads for traces and metrics, generic first.
const OTLP_SIGNALS: [&str; 3] = ["", "TRACES_", "METRICS_"];
fn otlp_variable(signal: &str, name: &str) -> String {
    format!("OTEL_EXPORTER_OTLP_{signal}{name}")
}

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
const EXPORT_FILE: Setting = Setting {
    flag: "--export-file",
    variable: ENV_EXPORT_FILE,
};
const SPOOL_DIR: Setting = Setting {
    flag: "--spool-dir",
    variable: "LENS_PROBE_SPOOL_DIR",
};
const SPOOL_MAX: Setting = Setting {
    flag: "--spool-max",
    variable: "LENS_PROBE_SPOOL_MAX",
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
        // Bytes that are not UTF-8 are kept (replaced), so that they are reported.
        ExportSettings::from_cli_and_env(cli, |key| {
            std::env::var_os(key).map(|value| value.to_string_lossy().into_owned())
        })
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
        if exporter == ExporterKind::File
            && let Some(path) = &export_file
        {
            let flag = cli.export_file.as_ref().map(|p| p.to_string_lossy());
            let given = EXPORT_FILE.get(flag.as_deref(), env).unwrap_or(Given {
                value: path.to_string_lossy().into_owned(),
                key: EXPORT_FILE.flag,
            });
            cli::check_output_file(path).map_err(|reason| given.invalid(reason.to_string()))?;
        }
        if exporter == ExporterKind::Otlp {
            check_otlp_env(env)?;
        }
        if exporter != ExporterKind::Console
            && let Some(value) = non_empty(env(ENV_METRIC_EXPORT_INTERVAL))
        {
            parse_metric_interval(&value).map_err(|reason| LensError::InvalidSetting {
                key: ENV_METRIC_EXPORT_INTERVAL.into(),
                value,
                reason: reason.to_string(),
            })?;
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

        let spool_dir = cli.spool_dir.as_ref().map(|p| p.to_string_lossy());
        let spool_dir = SPOOL_DIR.get(spool_dir.as_deref(), env);
        let spool_max = SPOOL_MAX.get(cli.spool_max.as_deref(), env);
        let max_bytes = match &spool_max {
            Some(given) => {
                parse_size(&given.value).map_err(|reason| given.invalid(reason.to_string()))?
            }
            None => DEFAULT_MAX_BYTES,
        };
        let spool = match (spool_dir, spool_max) {
            (Some(dir), _) if exporter != ExporterKind::Otlp => {
                return Err(dir.invalid(
                    "a spool keeps what an OTLP collector could not take: \
                                        it needs the otlp exporter",
                ));
            }
            (None, Some(max)) => {
                return Err(max.invalid("needs --spool-dir DIR (or LENS_PROBE_SPOOL_DIR)"));
            }
            (Some(dir), _) => Some(SpoolConfig {
                dir: PathBuf::from(dir.value),
                max_bytes,
            }),
            (None, None) => None,
        };

        Ok(ExportSettings {
            exporter,
            export_file,
            strategy,
            service_name: non_empty(env(ENV_SERVICE_NAME)),
            spool,
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

/// The OTLP protocol: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else
/// `OTEL_EXPORTER_OTLP_PROTOCOL`, else `grpc` (as the OpenTelemetry SDKs default); one
/// protocol for spans and metrics.
pub fn otlp_protocol(env: &dyn Fn(&str) -> Option<String>) -> Result<Protocol> {
    let Some((key, value)) = [ENV_OTLP_TRACES_PROTOCOL, ENV_OTLP_PROTOCOL]
        .into_iter()
        .find_map(|key| non_empty(env(key)).map(|value| (key, value)))
    else {
        return Ok(Protocol::Grpc);
    };
    match value.as_str() {
        "grpc" => Ok(Protocol::Grpc),
        "http/protobuf" => Ok(Protocol::HttpBinary),
        "http/json" => Ok(Protocol::HttpJson),
        _ => Err(LensError::InvalidSetting {
            key: key.into(),
            value,
            reason: "expected grpc, http/protobuf or http/json".into(),
        }),
    }
}

/// The variables opentelemetry-otlp reads when it builds the exporters (see the module
/// doc); a blank one counts as unset where opentelemetry-otlp also ignores it (timeout,
/// headers), and is an error where it would fail on it (endpoint, compression).
fn check_otlp_env(env: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    otlp_protocol(env)?;
    for signal in OTLP_SIGNALS {
        let endpoint = otlp_variable(signal, "ENDPOINT");
        if let Some(value) = env(&endpoint) {
            check_otlp_endpoint(&value).map_err(|reason| LensError::InvalidSetting {
                key: endpoint,
                value: crate::sys::target::redact_url_userinfo(&value),
                reason: reason.to_string(),
            })?;
        }
        // opentelemetry-otlp parses it untrimmed; a blank one it ignores, as we do.
        let timeout = otlp_variable(signal, "TIMEOUT");
        if let Some(value) = env(&timeout)
            && !value.trim().is_empty()
            && value.parse::<u64>().is_err()
        {
            return Err(LensError::InvalidSetting {
                key: timeout,
                value,
                reason: "expected a whole number of milliseconds, such as 10000".into(),
            });
        }
        let headers = otlp_variable(signal, "HEADERS");
        if let Some(value) = env(&headers) {
            check_otlp_headers(&value).map_err(|reason| LensError::InvalidSecretSetting {
                key: headers,
                reason: reason.to_string(),
            })?;
        }
        let compression = otlp_variable(signal, "COMPRESSION");
        if let Some(value) = env(&compression).filter(|value| value != "gzip") {
            return Err(LensError::InvalidSetting {
                key: compression,
                value,
                reason: "this lens-probe compresses OTLP with gzip only (its exporter has no \
                         zstd, and takes no \"none\"): set gzip, or unset it to send \
                         uncompressed"
                    .into(),
            });
        }
    }
    Ok(())
}

/// An OTLP endpoint as the OTLP exporter specification has it, and as both of
/// opentelemetry-otlp's transports can use it: `http` or `https`, a host, an optional
/// port, an optional path.
pub fn check_otlp_endpoint(value: &str) -> std::result::Result<(), BadValue> {
    const EXPECTED: &str = "expected a URL such as http://collector:4317 (http or https)";
    if value.trim().is_empty() {
        return Err(format!("empty; {EXPECTED}, or unset it").into());
    }
    if value.trim() != value {
        return Err(format!("blanks around it; {EXPECTED}").into());
    }
    let Some((scheme, rest)) = value.split_once("://") else {
        return Err(format!("no scheme; {EXPECTED}").into());
    };
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return Err(format!("scheme {scheme:?} is not http or https; {EXPECTED}").into());
    }
    let (authority, path) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
    let (userinfo, host_port) = match authority.rsplit_once('@') {
        Some((userinfo, host_port)) => (userinfo, host_port),
        None => ("", authority),
    };
    let port = if let Some(bracketed) = host_port.strip_prefix('[') {
        // An IPv6 literal.
        let Some((address, after)) = bracketed.split_once(']') else {
            return Err(format!("unclosed [ in the host; {EXPECTED}").into());
        };
        let ipv6_char = |c: char| c.is_ascii_hexdigit() || c == ':' || c == '.';
        if !address.contains(':') || !address.chars().all(ipv6_char) {
            return Err(format!("bad IPv6 address; {EXPECTED}").into());
        }
        match after.strip_prefix(':') {
            Some(port) => Some(port),
            None if after.is_empty() => None,
            None => return Err(format!("text after the IPv6 address; {EXPECTED}").into()),
        }
    } else {
        let (host, port) = match host_port.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (host_port, None),
        };
        let host_char = |c: char| c.is_ascii_alphanumeric() || "-._~%!$&'()*+,;=".contains(c);
        if host.is_empty() {
            return Err(format!("no host; {EXPECTED}").into());
        }
        if !host.chars().all(host_char) {
            return Err(format!("bad character in the host; {EXPECTED}").into());
        }
        port
    };
    if let Some(port) = port
        && !(port.bytes().all(|b| b.is_ascii_digit())
            && port.parse::<u16>().is_ok_and(|port| port > 0))
    {
        return Err(format!("the port must be a number from 1 to 65535; {EXPECTED}").into());
    }
    let url_char = |c: char| c.is_ascii_graphic() && !"\"<>\\^`{|}".contains(c);
    if !userinfo.chars().all(url_char) || !path.chars().all(url_char) {
        return Err(format!("a blank or a character URLs do not take; {EXPECTED}").into());
    }
    Ok(())
}

/// `OTEL_EXPORTER_OTLP_HEADERS`: comma-separated `key=value` pairs (values
/// percent-encoded), as opentelemetry-otlp parses them; it drops a pair it cannot use
/// without a word, so here each must be usable: an HTTP header name, a non-empty value of
/// visible ASCII once decoded. Empty items (a trailing comma) are allowed. The reason
/// never quotes a value.
pub fn check_otlp_headers(value: &str) -> std::result::Result<(), BadValue> {
    const EXPECTED: &str = "expected comma-separated key=value pairs, values percent-encoded, such as \
         api-key=abc,tenant=t1";
    let tchar = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    for (index, item) in value.split(',').map(str::trim).enumerate() {
        let n = index + 1;
        if item.is_empty() {
            continue;
        }
        let Some((key, raw)) = item.split_once('=') else {
            return Err(format!("item {n} has no '='; {EXPECTED}").into());
        };
        let key = key.trim();
        if key.is_empty() {
            return Err(format!("item {n} has no key; {EXPECTED}").into());
        }
        if !key.chars().all(tchar) {
            // Not quoted: a malformed item may be a token.
            return Err(format!("item {n}: the key is not an HTTP header name; {EXPECTED}").into());
        }
        let decoded = percent_decode(raw.trim())
            .ok_or_else(|| format!("item {n} ({key}): bad percent-encoding; {EXPECTED}"))?;
        if decoded.is_empty() {
            return Err(format!("item {n} ({key}) has an empty value; {EXPECTED}").into());
        }
        if !decoded
            .iter()
            .all(|&b| b == b' ' || b == b'\t' || b.is_ascii_graphic())
        {
            return Err(format!(
                "item {n} ({key}): the value is not visible ASCII once decoded; {EXPECTED}"
            )
            .into());
        }
    }
    Ok(())
}

/// `%XX` escapes decoded; `None` for a `%` not followed by two hex digits (a header
/// value is refused rather than sent with a broken escape left in it).
fn percent_decode(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    let escapes_whole = bytes.iter().enumerate().all(|(i, &b)| {
        b != b'%'
            || bytes
                .get(i + 1..i + 3)
                .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    });
    escapes_whole.then(|| percent_encoding::percent_decode(bytes).collect())
}

/// `OTEL_METRIC_EXPORT_INTERVAL`: a positive whole number of milliseconds (as
/// [`super::metrics::export_interval`] reads it).
pub fn parse_metric_interval(value: &str) -> std::result::Result<std::time::Duration, BadValue> {
    match value.trim().parse::<u64>() {
        Ok(ms) if ms > 0 => Ok(std::time::Duration::from_millis(ms)),
        _ => Err("expected a positive whole number of milliseconds, such as 60000".into()),
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
                spool: None,
            }
        );
    }

    #[test]
    fn a_spool_is_for_otlp_and_its_size_reads_as_people_write_it() {
        let otlp = (ENV_OTLP_ENDPOINT, "http://collector:4317");
        let s = settings(&["--spool-dir", "/var/spool/lens"], &[otlp]).unwrap();
        assert_eq!(
            s.spool,
            Some(SpoolConfig {
                dir: PathBuf::from("/var/spool/lens"),
                max_bytes: 1 << 30
            })
        );
        let s = settings(
            &[],
            &[
                otlp,
                ("LENS_PROBE_SPOOL_DIR", "/s"),
                ("LENS_PROBE_SPOOL_MAX", "200MiB"),
            ],
        )
        .unwrap();
        assert_eq!(s.spool.map(|s| s.max_bytes), Some(200 << 20));
        let message = error(&["--spool-dir", "/s"], &[]);
        assert!(
            message.contains("--spool-dir") && message.contains("otlp exporter"),
            "{message}"
        );
        let message = error(&["--spool-max", "1GiB"], &[otlp]);
        assert!(message.contains("needs --spool-dir"), "{message}");
        let message = error(&["--spool-dir", "/s", "--spool-max", "huge"], &[otlp]);
        assert!(
            message.contains("--spool-max") && message.contains("1GiB"),
            "{message}"
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

    const ENDPOINT: (&str, &str) = (ENV_OTLP_ENDPOINT, "http://collector:4317");

    #[test]
    fn the_export_file_must_be_writable() {
        assert_eq!(
            error(&["--exporter", "file", "--export-file", "/"], &[]),
            "invalid value \"/\" for --export-file: is a directory; expected a file lens-probe \
             can create or overwrite"
        );
        assert!(
            error(
                &[],
                &[(ENV_EXPORTER, "file"), (ENV_EXPORT_FILE, "/nonexistent/x")]
            )
            .starts_with("invalid value \"/nonexistent/x\" for LENS_PROBE_EXPORT_FILE: directory")
        );
        // Only the file exporter writes it.
        assert!(settings(&["--export-file", "/"], &[]).is_ok());
    }

    #[test]
    fn otlp_variables_are_checked_for_the_otlp_exporter_only() {
        let bad = [
            (ENV_OTLP_ENDPOINT, "collector:4317"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "10s"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "token"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd"),
            (ENV_OTLP_PROTOCOL, "thrift"),
        ];
        for (key, value) in bad {
            assert!(
                settings(&["--exporter", "console"], &[(key, value)]).is_ok(),
                "{key}"
            );
            let message = error(&["--exporter", "otlp"], &[(key, value)]);
            assert!(message.contains(&format!("for {key}")), "{message}");
        }
        let good = [
            ENDPOINT,
            (ENV_OTLP_TRACES_ENDPOINT, "https://[::1]:4318/v1/traces"),
            ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "2500"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", " "),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "api-key=abc%20def, tenant=t1,",
            ),
            (ENV_OTLP_TRACES_PROTOCOL, "http/json"),
            (ENV_METRIC_EXPORT_INTERVAL, "15000"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
        ];
        assert!(settings(&[], &good).is_ok());
    }

    #[test]
    fn bad_otlp_values_say_what_is_expected() {
        assert_eq!(
            error(&[], &[(ENV_OTLP_ENDPOINT, "collector:4317")]),
            "invalid value \"collector:4317\" for OTEL_EXPORTER_OTLP_ENDPOINT: no scheme; \
             expected a URL such as http://collector:4317 (http or https)"
        );
        assert_eq!(
            error(
                &[],
                &[ENDPOINT, ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1.5")]
            ),
            "invalid value \"1.5\" for OTEL_EXPORTER_OTLP_TRACES_TIMEOUT: expected a whole \
             number of milliseconds, such as 10000"
        );
        assert_eq!(
            error(
                &[],
                &[
                    ENDPOINT,
                    ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "a=1,Bearer xyz")
                ]
            ),
            "invalid value for OTEL_EXPORTER_OTLP_METRICS_HEADERS (not shown: it may hold \
             credentials): item 2 has no '='; expected comma-separated key=value pairs, values \
             percent-encoded, such as api-key=abc,tenant=t1"
        );
        assert_eq!(
            error(&[], &[ENDPOINT, (ENV_METRIC_EXPORT_INTERVAL, "0")]),
            "invalid value \"0\" for OTEL_METRIC_EXPORT_INTERVAL: expected a positive whole \
             number of milliseconds, such as 60000"
        );
        // The file exporter writes metrics at that interval too.
        assert!(
            error(
                &["--exporter", "file", "--export-file", "/dev/null"],
                &[(ENV_METRIC_EXPORT_INTERVAL, "1m")]
            )
            .contains("for OTEL_METRIC_EXPORT_INTERVAL")
        );
        // A password in the URL is not printed.
        let message = error(&[], &[(ENV_OTLP_ENDPOINT, "https://me:pw@collector:0")]);
        assert!(
            message.starts_with("invalid value \"https://…@collector:0\""),
            "{message}"
        );
    }

    #[test]
    fn endpoints_follow_the_otlp_exporter_specification() {
        for good in [
            "http://collector:4317",
            "https://otlp.example.com",
            "HTTPS://otlp.example.com:443/v1/traces",
            "http://10.0.0.1:4318/",
            "http://[fe80::1]:4317",
            "http://user:pass@collector:4317",
        ] {
            assert_eq!(check_otlp_endpoint(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            " ",
            "collector:4317",
            "grpc://collector:4317",
            "http://",
            "http://:4317",
            "http://collector:",
            "http://collector:65536",
            "http://collector:4317/a b",
            "http://[::1",
            "http://[]:4317",
            "http://col lector",
        ] {
            assert!(check_otlp_endpoint(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn headers_are_key_value_pairs_opentelemetry_can_send() {
        for good in [
            "",
            "a=b",
            "a=b,c=d",
            " a = b , c=d%2C%20e ,",
            "X-Scope-OrgID=tenant-1",
        ] {
            assert_eq!(check_otlp_headers(good), Ok(()), "{good:?}");
        }
        for bad in ["a", "=b", "a=", "a b=c", "a=%2", "a=%zz", "a=%0A", "a=é"] {
            assert!(check_otlp_headers(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_service_name_comes_from_otel_service_name() {
        let s = settings(&[], &[(ENV_SERVICE_NAME, " trainer ")]).unwrap();
        assert_eq!(s.service_name.as_deref(), Some("trainer"));
        let s = settings(&[], &[(ENV_SERVICE_NAME, "")]).unwrap();
        assert_eq!(s.service_name, None);
    }
}
