//! Configured probes: the `--config` file (TOML, `NEMO_LENS_CONFIG`) read and checked,
//! with the built-in rules (`profiles`) added first. Each `[[probe]]` rule names a function, native (`library` +
//! `symbol`) or Python (`python = "module:qualname"`), and the span group its calls
//! become; `docs/probes.md` ("Configured probes") has the format.
//!
//! Everything is checked before anything is loaded: a bad file is one line naming the
//! file, the rule (its number and line) and the field, with the values it takes (exit
//! status 2, [`LensError::InvalidConfig`]).
use super::BadValue;
use std::path::{Path, PathBuf};

use lens_common::{MAX_RULES, RULE_ARGS};

use super::profiles::FRAMEWORK_SAVE_RULES;
pub use super::profiles::{DCP_ASYNC_SAVE, DCP_GET_STATE_DICT, Profile};
use crate::{
    error::LensError,
    names,
    patterns::{LibraryPattern, SymbolPattern},
    semconv,
    settings::groups::{SpanGroup, SpanGroups},
};

/// How many functions one native rule may probe in one library unless its
/// `max_matches` says otherwise (a glob can match thousands).
pub const DEFAULT_MAX_MATCHES: u32 = 64;

/// The fields a `[[probe]]` rule may have.
const RULE_FIELDS: &[&str] = &[
    "args",
    "group",
    "library",
    "max_matches",
    "name",
    "noexcept",
    "python",
    "symbol",
];
const ARG_FIELDS: &[&str] = &["attribute", "index", "type"];

/// How a rule reads one argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgType {
    /// C `int` (the low 32 bits, signed).
    Int,
    /// C `unsigned int`.
    Uint,
    /// 64-bit signed (`long`, `int64_t`, `ssize_t`).
    Long,
    /// 64-bit unsigned (`unsigned long`, `size_t`).
    Ulong,
    /// C++ `bool` / C `_Bool` (the low byte).
    Bool,
    /// A pointer, shown in hex.
    Ptr,
    /// A NUL-terminated C string (`const char *`), first 63 bytes.
    Str,
    /// A libstdc++ `std::string` passed by reference or pointer, first 63 bytes.
    StdString,
}

impl ArgType {
    const ALL: [(&'static str, ArgType); 8] = [
        ("bool", ArgType::Bool),
        ("int", ArgType::Int),
        ("long", ArgType::Long),
        ("ptr", ArgType::Ptr),
        ("std::string", ArgType::StdString),
        ("str", ArgType::Str),
        ("uint", ArgType::Uint),
        ("ulong", ArgType::Ulong),
    ];

    pub const fn is_string(self) -> bool {
        matches!(self, ArgType::Str | ArgType::StdString)
    }
}

/// One argument a rule records as a span attribute.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleArg {
    /// 0-based position among the integer arguments (0..=5: the argument registers).
    pub index: u32,
    pub kind: ArgType,
    pub attribute: &'static str,
}

/// A native rule: calls of the functions `symbol` names in the libraries `library`
/// names become spans of `group`.
#[derive(Clone, Debug)]
pub struct NativeRule {
    /// Its number among all rules: its attach cookie is `RULE_COOKIE_BASE + index`.
    pub index: u32,
    /// Where it came from, for messages: `FILE rule 2 (line 7)`.
    pub origin: String,
    pub library: LibraryPattern,
    pub symbol: SymbolPattern,
    pub group: SpanGroup,
    /// The span name (`train.<group>` unless the rule names one).
    pub name: &'static str,
    pub args: Vec<RuleArg>,
    pub max_matches: u32,
    /// The rule says no exception can leave the functions it names (`noexcept = true`):
    /// C++ ones get their return probe. Without it only C functions do (see
    /// [`crate::patterns::may_unwind`]).
    pub noexcept: bool,
}

impl NativeRule {
    /// The argument read as a string, if any (at most one).
    pub fn string_arg(&self) -> Option<&RuleArg> {
        self.args.iter().find(|arg| arg.kind.is_string())
    }
}

/// A Python rule: calls of `module:qualname` become spans of `group` (sampled:
/// docs/python.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PythonRule {
    /// Its number among all rules (what its calls' `RuleCall::rule` is).
    pub index: u32,
    pub origin: String,
    pub module: String,
    pub qualname: String,
    pub group: SpanGroup,
    pub name: &'static str,
    /// One of the framework rules ([`super::profiles`]): the call bounds the checkpoint (load) span the
    /// file signals make, it takes no group over, and it is never reported unmatched.
    pub framework: bool,
}

/// Every configured rule of a run: the profile's, then the file's.
#[derive(Clone, Debug, Default)]
pub struct ProbeRules {
    pub native: Vec<NativeRule>,
    pub python: Vec<PythonRule>,
    /// The config file's `[timeline]` table: not rules, but set in the same file.
    pub timeline: TimelineConfig,
}

/// `[timeline]` in a config file: `perfetto = "FILE"`, `max_size = "1GiB"`, as
/// `--perfetto` and `--perfetto-max-size` (which win over them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TimelineConfig {
    pub perfetto: Option<PathBuf>,
    pub max_size: Option<u64>,
}

impl TimelineConfig {
    const KEYS: &str = "perfetto, max_size";

    fn parse(table: &toml::Table) -> Result<TimelineConfig, BadValue> {
        let mut config = TimelineConfig::default();
        for (key, value) in table {
            match (key.as_str(), value) {
                ("perfetto", toml::Value::String(path)) => {
                    let path = PathBuf::from(path);
                    super::cli::check_output_file(&path)
                        .map_err(|reason| format!("[timeline] perfetto: {reason}"))?;
                    config.perfetto = Some(path);
                }
                ("max_size", toml::Value::String(size)) => {
                    config.max_size = Some(
                        super::parse_size(size)
                            .map_err(|reason| format!("[timeline] max_size: {reason}"))?,
                    );
                }
                ("perfetto" | "max_size", _) => {
                    return Err(format!(
                        "[timeline] {key} must be a string (a path; a size such as \"1GiB\")"
                    )
                    .into());
                }
                _ => {
                    return Err(
                        format!("[timeline]: unknown key {key:?}; valid: {}", Self::KEYS).into(),
                    );
                }
            }
        }
        Ok(config)
    }
}

/// The largest config file read: thousands of rules fit in far less, and a bound keeps a
/// wrong path (`/dev/zero`, a huge log) from filling memory before it is parsed.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The contents of a config file: a regular file (a FIFO or a device is never opened
/// for reading in a way that could block or run forever) of at most
/// [`MAX_CONFIG_BYTES`], UTF-8.
fn read_config_file(path: &Path) -> Result<String, BadValue> {
    use std::{io::Read, os::unix::fs::OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        // Opening a FIFO for reading would wait for a writer.
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|error| format!("cannot read it: {error}"))?;
    let meta = file
        .metadata()
        .map_err(|error| format!("cannot read it: {error}"))?;
    if !meta.is_file() {
        return Err("not a regular file; expected a TOML file".into());
    }
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(format!(
            "{} bytes, over the {} KiB limit of a config file",
            meta.len(),
            MAX_CONFIG_BYTES >> 10
        )
        .into());
    }
    let mut bytes = Vec::new();
    // A file that grows while it is read is still cut at the limit.
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| format!("cannot read it: {error}"))?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(format!(
            "over the {} KiB limit of a config file",
            MAX_CONFIG_BYTES >> 10
        )
        .into());
    }
    String::from_utf8(bytes).map_err(|_| "not UTF-8 text; expected a TOML file".into())
}

impl ProbeRules {
    /// The rules of `profile` and of the config file at `path`, if any.
    pub fn load(path: Option<&Path>, profile: Profile) -> Result<ProbeRules, LensError> {
        let mut rules = ProbeRules::default();
        let profile_origin = format!("profile {profile}");
        rules.add_toml(profile.rules(), &profile_origin)?;
        if let Some(path) = path {
            let invalid = |reason: String| LensError::InvalidConfig {
                path: path.to_path_buf(),
                reason,
            };
            let text = read_config_file(path).map_err(|error| invalid(error.to_string()))?;
            rules
                .add_toml(&text, &path.display().to_string())
                .map_err(|error| match error {
                    LensError::InvalidConfig { reason, .. } => invalid(reason),
                    other => other,
                })?;
        }
        // Last, so the user's rules keep their numbers.
        let first = rules.python.len();
        rules.add_toml(FRAMEWORK_SAVE_RULES, "built-in framework rules")?;
        for rule in &mut rules.python[first..] {
            rule.framework = true;
        }
        Ok(rules)
    }

    /// Whether any rule was written by the user or a profile (not built in).
    pub fn has_configured(&self) -> bool {
        !self.native.is_empty() || self.python.iter().any(|rule| !rule.framework)
    }

    /// Parses `text` (a config file's contents, or a profile's) and adds its rules.
    pub fn parse(text: &str) -> Result<ProbeRules, LensError> {
        let mut rules = ProbeRules::default();
        rules.add_toml(text, "config")?;
        Ok(rules)
    }

    pub fn is_empty(&self) -> bool {
        self.native.is_empty() && self.python.is_empty()
    }

    pub fn native_rule(&self, index: u32) -> Option<&NativeRule> {
        self.native.iter().find(|rule| rule.index == index)
    }

    pub fn python_rule(&self, index: u32) -> Option<&PythonRule> {
        self.python.iter().find(|rule| rule.index == index)
    }

    /// Warnings to give before tracing: rules whose group is off (their probes are not
    /// attached).
    pub fn warnings(&self, groups: &SpanGroups) -> Vec<String> {
        let mut warnings = Vec::new();
        let groups_off = self
            .native
            .iter()
            .map(|rule| (&rule.origin, rule.group))
            .chain(
                self.python
                    .iter()
                    .filter(|rule| !rule.framework)
                    .map(|rule| (&rule.origin, rule.group)),
            )
            .filter(|(_, group)| !groups.contains(*group));
        for (origin, group) in groups_off {
            warnings.push(format!(
                "{origin}: group {group} is not enabled (--span-groups), its probe is not attached",
            ));
        }
        warnings
    }

    fn add_toml(&mut self, text: &str, origin: &str) -> Result<(), LensError> {
        let invalid = |reason: String| LensError::InvalidConfig {
            path: PathBuf::from(origin),
            reason,
        };
        let document: toml::Table = toml::from_str(text).map_err(|error| {
            let at = error
                .span()
                .map(|span| format!("line {}: ", line_of(text, span.start)))
                .unwrap_or_default();
            invalid(format!("not valid TOML: {at}{}", one_line(error.message())))
        })?;
        for key in document.keys() {
            if key != "probe" && key != "timeline" {
                return Err(invalid(format!(
                    "unknown key {key:?}; valid: probe, timeline"
                )));
            }
        }
        match document.get("timeline") {
            Some(toml::Value::Table(table)) => {
                self.timeline = TimelineConfig::parse(table).map_err(|e| invalid(e.to_string()))?;
            }
            Some(_) => return Err(invalid("timeline must be a table ([timeline])".into())),
            None => {}
        }
        let Some(probes) = document.get("probe") else {
            return Ok(());
        };
        let toml::Value::Array(probes) = probes else {
            return Err(invalid(
                "probe must be an array of tables ([[probe]] sections)".into(),
            ));
        };
        let lines = rule_lines(text);
        for (number, probe) in probes.iter().enumerate() {
            let line = lines
                .get(number)
                .map(|line| format!(" (line {line})"))
                .unwrap_or_default();
            let here = format!("rule {}{line}", number + 1);
            let toml::Value::Table(table) = probe else {
                return Err(invalid(format!(
                    "{here}: a rule must be a table ([[probe]])"
                )));
            };
            let index = (self.native.len() + self.python.len()) as u32;
            if index >= MAX_RULES {
                return Err(invalid(format!(
                    "{here}: too many rules; at most {MAX_RULES}"
                )));
            }
            let origin = format!("{origin} {here}");
            match parse_rule(table, index, &origin) {
                Ok(Rule::Native(rule)) => self.native.push(rule),
                Ok(Rule::Python(rule)) => self.python.push(rule),
                Err(reason) => return Err(invalid(format!("{here}: {reason}"))),
            }
        }
        Ok(())
    }
}

enum Rule {
    Native(NativeRule),
    Python(PythonRule),
}

/// The groups a rule may name: every Lens group but `job` (the process itself).
fn rule_groups() -> Vec<&'static str> {
    let mut names: Vec<&str> = SpanGroup::ALL
        .iter()
        .filter(|g| **g != SpanGroup::Job)
        .map(|g| g.name())
        .collect();
    names.sort_unstable();
    names
}

/// `train.<group>`: NeMo Lens' span name for the group.
pub fn default_span_name(group: SpanGroup) -> &'static str {
    match group {
        SpanGroup::Job => names::JOB,
        SpanGroup::Checkpoint => names::CHECKPOINT,
        SpanGroup::Evaluate => names::EVALUATE,
        SpanGroup::ModelInit => names::MODEL_INIT,
        SpanGroup::LoadCheckpoint => names::LOAD_CHECKPOINT,
        SpanGroup::Step => names::STEP,
        SpanGroup::ForwardBackward => names::FORWARD_BACKWARD,
        SpanGroup::Optimizer => names::OPTIMIZER,
    }
}

/// Names from the config live as long as the run (spans carry `&'static str`).
fn leak(text: &str) -> &'static str {
    Box::leak(text.to_string().into_boxed_str())
}

fn string_field<'a>(table: &'a toml::Table, key: &str) -> Result<Option<&'a str>, BadValue> {
    match table.get(key) {
        None => Ok(None),
        Some(toml::Value::String(text)) if text.trim().is_empty() => {
            Err(format!("{key}: empty; expected a non-empty string").into())
        }
        Some(toml::Value::String(text)) => Ok(Some(text)),
        Some(other) => Err(format!("{key}: expected a string, got {}", other.type_str()).into()),
    }
}

fn parse_rule(table: &toml::Table, index: u32, origin: &str) -> Result<Rule, BadValue> {
    for key in table.keys() {
        if !RULE_FIELDS.contains(&key.as_str()) {
            return Err(format!("unknown field {key:?}; valid: {}", RULE_FIELDS.join(", ")).into());
        }
    }
    let group = parse_group(table)?;
    let name = match string_field(table, "name")? {
        // Printed on the console and in logs as it is: no control characters.
        Some(name) if name.chars().any(char::is_control) => {
            return Err(format!(
                "name: {} holds control characters (a newline, an escape): a span name \
                 is one printable line",
                crate::sys::text::printable(name)
            )
            .into());
        }
        Some(name) => leak(name.trim()),
        None => default_span_name(group),
    };
    let symbol = string_field(table, "symbol")?;
    let python = string_field(table, "python")?;
    let library = string_field(table, "library")?;
    match (symbol, python) {
        (None, None) => Err(
            "names no function: give symbol (with library) for a native function, or \
             python = \"module:function\" for a Python one"
                .into(),
        ),
        (Some(_), Some(_)) => {
            Err("has both symbol and python; a rule names one function or the other".into())
        }
        (None, Some(python)) => {
            for key in ["library", "args", "max_matches", "noexcept"] {
                if table.contains_key(key) {
                    return Err(format!("{key}: only for native rules (symbol = ...)").into());
                }
            }
            let (module, qualname) = parse_python(python)?;
            Ok(Rule::Python(PythonRule {
                index,
                origin: origin.to_string(),
                module,
                qualname,
                group,
                name,
                framework: false,
            }))
        }
        (Some(symbol), None) => {
            let Some(library) = library else {
                return Err(
                    "library: missing; a native rule names the file that defines the symbol, \
                     e.g. library = \"libtorch_cpu.so\" (any version suffix) or a glob"
                        .into(),
                );
            };
            let (max_matches, args, noexcept) = native_options(table)?;
            let symbol = SymbolPattern::new(symbol.trim());
            if symbol.names_cpp() && !noexcept {
                return Err(format!(
                    "symbol {:?} names a C++ function: a C++ exception that leaves it would \
                     cross the return probe lens-probe puts on it and abort the traced \
                     process (std::terminate) where the program would have caught it; \
                     probe a C function or one that catches every exception (a Python \
                     binding), or add noexcept = true if no exception can leave it",
                    symbol.text()
                )
                .into());
            }
            Ok(Rule::Native(NativeRule {
                index,
                origin: origin.to_string(),
                library: LibraryPattern::new(library.trim()),
                symbol,
                group,
                name,
                args,
                max_matches,
                noexcept,
            }))
        }
    }
}

/// The rule's span group: any but `job`, named in any case.
fn parse_group(table: &toml::Table) -> Result<SpanGroup, BadValue> {
    let group_names = rule_groups();
    Ok(match string_field(table, "group")? {
        None => {
            return Err(format!("group: missing; valid: {}", group_names.join(", ")).into());
        }
        Some(name) => {
            let lower = name.trim().to_ascii_lowercase();
            SpanGroup::ALL
                .into_iter()
                .filter(|g| *g != SpanGroup::Job)
                .find(|g| g.name() == lower)
                .ok_or_else(|| {
                    format!(
                        "group: unknown group {name:?}; valid: {}",
                        group_names.join(", ")
                    )
                })?
        }
    })
}

/// A native rule's `max_matches`, `args` and `noexcept`, defaults where not given.
fn native_options(table: &toml::Table) -> Result<(u32, Vec<RuleArg>, bool), BadValue> {
    let max_matches = match table.get("max_matches") {
        None => DEFAULT_MAX_MATCHES,
        Some(toml::Value::Integer(n)) if (1..=4096).contains(n) => *n as u32,
        Some(other) => {
            return Err(format!("max_matches: {other}; expected an integer from 1 to 4096").into());
        }
    };
    let args = match table.get("args") {
        None => Vec::new(),
        Some(toml::Value::Array(args)) => parse_args(args)?,
        Some(other) => {
            return Err(format!(
                "args: expected an array of tables such as [{{ index = 0, type = \
                 \"int\" }}], got {}",
                other.type_str()
            )
            .into());
        }
    };
    let noexcept = match table.get("noexcept") {
        None => false,
        Some(toml::Value::Boolean(value)) => *value,
        Some(other) => {
            return Err(format!("noexcept: {other}; expected true or false").into());
        }
    };
    Ok((max_matches, args, noexcept))
}

fn parse_args(args: &[toml::Value]) -> Result<Vec<RuleArg>, BadValue> {
    let types: Vec<&str> = ArgType::ALL.iter().map(|(name, _)| *name).collect();
    let mut parsed: Vec<RuleArg> = Vec::new();
    for (n, arg) in args.iter().enumerate() {
        let here = format!("args[{n}]");
        let toml::Value::Table(arg) = arg else {
            return Err(format!(
                "{here}: expected a table such as {{ index = 0, type = \"int\" }}"
            )
            .into());
        };
        for key in arg.keys() {
            if !ARG_FIELDS.contains(&key.as_str()) {
                return Err(format!(
                    "{here}: unknown field {key:?}; valid: {}",
                    ARG_FIELDS.join(", ")
                )
                .into());
            }
        }
        let index = match arg.get("index") {
            Some(toml::Value::Integer(i)) if (0..RULE_ARGS as i64).contains(i) => *i as u32,
            Some(other) => {
                return Err(format!(
                    "{here}.index: {other}; expected 0 to {} (the argument registers)",
                    RULE_ARGS - 1
                )
                .into());
            }
            None => {
                return Err(
                    format!("{here}.index: missing; expected 0 to {}", RULE_ARGS - 1).into(),
                );
            }
        };
        let kind = match string_field(arg, "type").map_err(|e| format!("{here}.{e}"))? {
            None => {
                return Err(format!("{here}.type: missing; valid: {}", types.join(", ")).into());
            }
            Some(name) => ArgType::ALL
                .iter()
                .find(|(known, _)| *known == name.trim())
                .map(|(_, kind)| *kind)
                .ok_or_else(|| {
                    format!(
                        "{here}.type: unknown type {name:?}; valid: {}",
                        types.join(", ")
                    )
                })?,
        };
        let attribute = match string_field(arg, "attribute").map_err(|e| format!("{here}.{e}"))? {
            Some(name) => leak(name.trim()),
            None => leak(&format!("{}{index}", semconv::LENS_PROBE_ARG_PREFIX)),
        };
        if kind.is_string() && parsed.iter().any(|a| a.kind.is_string()) {
            return Err(
                format!("{here}: a second string argument; a rule reads at most one").into(),
            );
        }
        if parsed.iter().any(|a| a.attribute == attribute) {
            return Err(format!("{here}.attribute: {attribute:?} given twice").into());
        }
        parsed.push(RuleArg {
            index,
            kind,
            attribute,
        });
    }
    Ok(parsed)
}

/// `package.module:Class.method` → (module, qualified name).
fn parse_python(text: &str) -> Result<(String, String), BadValue> {
    const EXPECTED: &str = "expected \"module.path:function\" or \"module.path:Class.method\"";
    let Some((module, qualname)) = text.trim().split_once(':') else {
        return Err(format!("python: {text:?}; {EXPECTED}").into());
    };
    let dotted = |part: &str| {
        !part.is_empty()
            && part.split('.').all(|name| {
                let mut chars = name.chars();
                chars.next().is_some_and(|c| c == '_' || c.is_alphabetic())
                    && chars.all(|c| c == '_' || c.is_alphanumeric())
            })
    };
    if !dotted(module) || !dotted(qualname) {
        return Err(format!("python: {text:?}; {EXPECTED}").into());
    }
    Ok((module.to_string(), qualname.to_string()))
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(0, |head| head.matches('\n').count())
        + 1
}

/// The line of each `[[probe]]` header, in order (for messages; a rule written another
/// way, such as `probe = [...]`, has none).
fn rule_lines(text: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| {
            let line = line.trim_start();
            line.starts_with("[[")
                && line[2..].trim_start().starts_with("probe")
                && line[2..].trim_start()["probe".len()..]
                    .trim_start()
                    .starts_with("]]")
        })
        .map(|(n, _)| n + 1)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejected(text: &str) -> String {
        match ProbeRules::parse(text) {
            Err(error) => {
                let line = error.to_string();
                assert_eq!(line.lines().count(), 1, "{line}");
                line
            }
            Ok(rules) => panic!("accepted: {rules:?}"),
        }
    }

    #[test]
    fn native_and_python_rules_parse() {
        let rules = ProbeRules::parse(
            r#"
            [[probe]]
            library = "libtrain.so"
            symbol = "my_train_step"
            group = "step"
            args = [{ index = 0, type = "int", attribute = "my.step" }]

            [[probe]]
            library = "libtrain.so*"
            symbol = "my_save_*"
            group = "Checkpoint"
            name = "my.save"
            args = [{ index = 0, type = "str" }]

            [[probe]]
            python = "megatron.training.training:train_step"
            group = "step"
            "#,
        )
        .unwrap();
        assert_eq!(rules.native.len(), 2);
        let step = &rules.native[0];
        assert_eq!(
            (step.index, step.group, step.name),
            (0, SpanGroup::Step, "train.step")
        );
        assert_eq!(step.args[0].attribute, "my.step");
        let save = &rules.native[1];
        assert_eq!((save.group, save.name), (SpanGroup::Checkpoint, "my.save"));
        assert_eq!(save.string_arg().unwrap().attribute, "lens_probe.arg.0");
        assert_eq!(save.max_matches, DEFAULT_MAX_MATCHES);
        assert_eq!(rules.python[0].module, "megatron.training.training");
        assert_eq!(rules.python[0].qualname, "train_step");
        assert!(rules.warnings(&"all".parse().unwrap()).is_empty());
        assert_eq!(
            rules.warnings(&"default".parse().unwrap()),
            [
                "config rule 1 (line 2): group step is not enabled (--span-groups), its probe is not attached",
                "config rule 3 (line 15): group step is not enabled (--span-groups), its probe is not attached",
            ]
        );
    }

    #[test]
    fn bad_files_are_one_line_naming_the_rule_and_field() {
        let cases: &[(&str, &[&str])] = &[
            ("[[probe]\n", &["not valid TOML", "line 1"]),
            ("probes = 1\n", &["unknown key \"probes\"", "valid: probe"]),
            (
                "[[probe]]\nlibrary = \"a.so\"\nsymbol = \"f\"\ngroup = \"steps\"\n",
                &[
                    "rule 1 (line 1)",
                    "group: unknown group \"steps\"",
                    "valid: checkpoint",
                ],
            ),
            (
                "[[probe]]\ngroup = \"step\"\n\n[[probe]]\ngroup = \"step\"\nlibrary = \"a\"\nsymbl = \"f\"\n",
                &["rule 1 (line 1)", "names no function"],
            ),
            (
                "[[probe]]\npython = \"m:f\"\ngroup = \"step\"\n[[probe]]\ngroup = \"step\"\nlibrary = \"a\"\nsymbl = \"f\"\n",
                &[
                    "rule 2 (line 4)",
                    "unknown field \"symbl\"",
                    "valid: args, group",
                ],
            ),
            (
                "[[probe]]\nsymbol = \"f\"\ngroup = \"step\"\n",
                &["library: missing"],
            ),
            (
                "[[probe]]\nsymbol = \"f\"\npython = \"m:f\"\ngroup = \"step\"\n",
                &["both symbol and python"],
            ),
            (
                "[[probe]]\npython = \"m.f\"\ngroup = \"step\"\n",
                &["python: \"m.f\"", "module.path:function"],
            ),
            (
                "[[probe]]\nlibrary = \"a\"\nsymbol = \"f\"\n",
                &["group: missing", "valid: "],
            ),
            (
                "[[probe]]\nlibrary = \"a\"\nsymbol = \"f\"\ngroup = \"job\"\n",
                &["unknown group \"job\""],
            ),
            (
                "[[probe]]\nlibrary = \"a\"\nsymbol = \"f\"\ngroup = \"step\"\nargs = [{ index = 6, type = \"int\" }]\n",
                &["args[0].index: 6", "expected 0 to 5"],
            ),
            (
                "[[probe]]\nlibrary = \"a\"\nsymbol = \"f\"\ngroup = \"step\"\nargs = [{ index = 0, type = \"float\" }]\n",
                &["args[0].type: unknown type \"float\"", "valid: bool, int"],
            ),
            (
                "[[probe]]\nlibrary = \"a\"\nsymbol = \"f\"\ngroup = \"step\"\nargs = [{ index = 0, type = \"str\" }, { index = 1, type = \"str\" }]\n",
                &["args[1]: a second string argument"],
            ),
            (
                "[[probe]]\nlibrary = 3\nsymbol = \"f\"\ngroup = \"step\"\n",
                &["library: expected a string, got integer"],
            ),
            (
                "[[probe]]\nlibrary = \"\"\nsymbol = \"f\"\ngroup = \"step\"\n",
                &["library: empty"],
            ),
            ("probe = 3\n", &["probe must be an array of tables"]),
            (
                "[[probe]]\nlibrary = \"a\"\nsymbol = \"ns::f\"\ngroup = \"step\"\nnoexcept = 1\n",
                &["noexcept: 1", "expected true or false"],
            ),
        ];
        for (text, needles) in cases {
            let line = rejected(text);
            for needle in *needles {
                assert!(
                    line.contains(needle),
                    "{needle:?} not in {line:?} for {text:?}"
                );
            }
        }
    }

    #[test]
    fn a_cpp_function_needs_the_rule_to_say_no_exception_leaves_it() {
        // Demangled, mangled (C++ and Rust v0), a C++ glob, a glob over mangled names.
        for symbol in [
            "torch::autograd::Engine::execute",
            "_ZN2my7Trainer7forwardEi",
            "_RNvCs1234_5crate4step",
            "c10d::ProcessGroupGloo::allreduce*",
            "_ZN4c10d*",
        ] {
            let rule = format!(
                "[[probe]]\nlibrary = \"libtorch_cpu.so\"\nsymbol = \"{symbol}\"\ngroup = \"step\"\n"
            );
            let line = rejected(&rule);
            for needle in [
                "rule 1 (line 1)",
                "names a C++ function",
                "abort",
                "noexcept = true",
            ] {
                assert!(line.contains(needle), "{needle:?} not in {line:?}");
            }
            let asserted = ProbeRules::parse(&format!("{rule}noexcept = true\n")).unwrap();
            assert!(asserted.native[0].noexcept, "{symbol}");
        }
        // C names and globs over them need no word.
        for symbol in ["my_train_step", "my_optimizer_*", "ncclAllReduce"] {
            let rule = format!(
                "[[probe]]\nlibrary = \"libtrain.so\"\nsymbol = \"{symbol}\"\ngroup = \"step\"\n"
            );
            assert!(!ProbeRules::parse(&rule).unwrap().native[0].noexcept);
        }
    }

    #[test]
    fn a_span_name_with_control_characters_is_refused() {
        // TOML's escapes make them: a newline would forge a console line, ESC drive the
        // terminal.
        for name in [
            "train.step\\nlens-probe: hang resolved",
            "\\u001b]0;x\\u0007step",
        ] {
            let rule = format!(
                "[[probe]]\npython = \"train:step\"\ngroup = \"step\"\nname = \"{name}\"\n"
            );
            let line = rejected(&rule);
            assert!(line.contains("control characters"), "{line}");
            assert!(!line.chars().any(char::is_control), "{line:?}");
        }
    }

    #[test]
    fn profiles_parse_and_name_only_python_functions() {
        for profile in Profile::ALL {
            let rules = ProbeRules::load(None, profile).unwrap();
            assert!(rules.native.is_empty(), "{profile}");
            assert_eq!(rules.has_configured(), profile != Profile::Pytorch);
            assert!(rules.python.iter().any(|rule| rule.framework));
        }
        assert_eq!("nemo_rl".parse::<Profile>(), Ok(Profile::NemoRl));
        assert_eq!("Megatron".parse::<Profile>(), Ok(Profile::Megatron));
        assert_eq!(
            "torch".parse::<Profile>(),
            Err("unknown profile; valid: pytorch, megatron, nemo-rl".into())
        );
    }
}
