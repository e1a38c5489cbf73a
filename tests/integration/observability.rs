//! Offline check of `observability/`: the Grafana dashboard only queries Prometheus names
//! that the collector's prometheus exporter makes from lens-probe's metrics
//! (`export::metrics::metric_names`, with their units and kinds), and only labels that
//! exist; the collector configuration has the receivers, exporters and pipelines the
//! README describes. Renaming a metric (or changing its unit or kind) without updating
//! the dashboard fails here.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

use lens_probe::export::metrics::metric_names;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Monotonic sum: `_total`.
    Counter,
    /// `_bucket`, `_sum`, `_count`.
    Histogram,
    /// The name alone.
    Gauge,
}

struct MetricDef {
    /// The constant's identifier in `metric_names`.
    ident: &'static str,
    /// Its value: the OpenTelemetry metric name.
    name: &'static str,
    /// The unit given to the instrument in `metrics.rs`.
    unit: &'static str,
    kind: Kind,
}

macro_rules! metric {
    ($ident:ident, $unit:literal, $kind:ident) => {
        MetricDef {
            ident: stringify!($ident),
            name: metric_names::$ident,
            unit: $unit,
            kind: Kind::$kind,
        }
    };
}

/// Every metric lens-probe exports, as `lens-userspace/src/export/metrics.rs` builds it.
const METRICS: &[MetricDef] = &[
    metric!(COLLECTIVE_CALLS, "{call}", Counter),
    metric!(COLLECTIVE_BYTES, "By", Counter),
    metric!(COLLECTIVE_DURATION, "s", Histogram),
    metric!(COLLECTIVE_ARRIVAL_SKEW, "s", Histogram),
    metric!(COLLECTIVE_LAST_SEQ, "{collective}", Gauge),
    metric!(HANGS, "{hang}", Counter),
    metric!(SYNC_DURATION, "s", Histogram),
    metric!(KERNEL_LAUNCHES, "{launch}", Counter),
    metric!(STEP_DURATION, "s", Histogram),
    metric!(PHASE_DURATION, "s", Histogram),
    metric!(EVENTS_LOST, "{event}", Counter),
    metric!(SPANS_LOST, "{span}", Counter),
    metric!(OVERHEAD, "1", Gauge),
    metric!(CPU_TIME, "s", Counter),
    metric!(GPU_MEMORY_USAGE, "By", Gauge),
    metric!(GPU_MEMORY_PEAK, "By", Gauge),
    metric!(GPU_MEMORY_CALLS, "{call}", Counter),
    metric!(GPU_OUT_OF_MEMORY, "{call}", Counter),
];

/// Labels the dashboard may use: metric attributes and resource attributes (semconv
/// names, dots → underscores, as the prometheus exporter writes them), plus `le`, which
/// Prometheus histograms add.
const LABELS: &[&str] = &[
    "dl_collective_op",
    "dl_collective_backend",
    "dl_collective_dtype",
    "dl_collective_comm_id",
    "lens_probe_hang_kind",
    "dl_collective_straggler_cause",
    "cuda_sync_kind",
    "cuda_launch_kind",
    "dl_gpu_memory_op",
    "nemo_span_group",
    "lens_probe_loss_cause",
    "cpu_mode",
    "dl_rank",
    "nemo_run_id",
    "host_name",
    "le",
];

/// PromQL functions and aggregations the dashboard may call (never metric names).
const FUNCTIONS: &[&str] = &[
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "group",
    "topk",
    "bottomk",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "max_over_time",
    "last_over_time",
    "clamp_min",
    "changes",
];

/// PromQL keywords followed by a label list.
const LABEL_LIST_KEYWORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// Other PromQL keywords (binary set operators, modifiers).
const KEYWORDS: &[&str] = &["and", "or", "unless", "bool", "offset"];

fn repo_file(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

fn read(path: &str) -> String {
    let file = repo_file(path);
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

// ---- OpenTelemetry → Prometheus names --------------------------------------------------

/// The unit word the prometheus exporter appends (`{…}` annotations add nothing).
fn unit_suffix(unit: &str) -> &'static str {
    match unit {
        "s" => "seconds",
        "ms" => "milliseconds",
        "By" => "bytes",
        // A share: the exporter names gauges in unit 1 `_ratio`.
        "1" => "ratio",
        u if u.starts_with('{') && u.ends_with('}') => "",
        u => panic!("unit {u:?}: teach unit_suffix its Prometheus word"),
    }
}

/// The collector's normalisation (`otlptranslator`, suffixes on, UTF-8 escaped): split
/// the name on anything but `[A-Za-z0-9:]`, append the unit word unless the name already
/// has it, then `total` for monotonic counters (moved to the end if already there).
fn prometheus_base_name(metric: &MetricDef) -> String {
    let mut tokens: Vec<&str> = metric
        .name
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == ':'))
        .filter(|t| !t.is_empty())
        .collect();
    let unit = unit_suffix(metric.unit);
    if !unit.is_empty() && !tokens.contains(&unit) {
        tokens.push(unit);
    }
    if metric.kind == Kind::Counter {
        tokens.retain(|t| *t != "total");
        tokens.push("total");
    }
    tokens.join("_")
}

/// Prometheus series name → the OpenTelemetry metric it comes from.
fn prometheus_names() -> BTreeMap<String, &'static str> {
    let mut names = BTreeMap::new();
    for metric in METRICS {
        let base = prometheus_base_name(metric);
        match metric.kind {
            Kind::Counter | Kind::Gauge => {
                names.insert(base, metric.name);
            }
            Kind::Histogram => {
                for suffix in ["bucket", "sum", "count"] {
                    names.insert(format!("{base}_{suffix}"), metric.name);
                }
            }
        }
    }
    names
}

#[test]
fn prometheus_names_follow_the_collector_rules() {
    let names = prometheus_names();
    for expected in [
        "dl_step_duration_seconds_bucket",
        "dl_collective_bytes_total",
        "dl_collective_calls_total",
        "dl_collective_duration_seconds_bucket",
        "cuda_sync_duration_seconds_bucket",
        "cuda_kernel_launches_total",
        "dl_phase_duration_seconds_sum",
        "lens_probe_events_lost_total",
        "lens_probe_spans_lost_total",
        "lens_probe_cpu_time_seconds_total",
    ] {
        assert!(
            names.contains_key(expected),
            "{expected} not derived: {names:?}"
        );
    }
}

// ---- The table above against metrics.rs ------------------------------------------------

/// `(identifier, value)` of every `pub const` inside `mod metric_names` of metrics.rs.
fn metric_name_constants(source: &str) -> Vec<(String, String)> {
    let start = source
        .find("pub mod metric_names {")
        .expect("metrics.rs has no `pub mod metric_names {`");
    let body = &source[start..];
    let end = body.find("\n}").expect("unterminated mod metric_names");
    body[..end]
        .lines()
        .map(str::trim)
        .filter(|line| line.starts_with("pub const "))
        .map(|line| {
            let rest = &line["pub const ".len()..];
            let (ident, rest) = rest.split_once(':').expect("pub const IDENT: …");
            let value = rest
                .split('"')
                .nth(1)
                .unwrap_or_else(|| panic!("not a string constant: {line}"));
            (ident.trim().to_string(), value.to_string())
        })
        .collect()
}

#[test]
fn the_metric_table_covers_every_metric_name_with_its_unit_and_kind() {
    let source = read("lens-userspace/src/export/metrics.rs");
    let constants = metric_name_constants(&source);
    assert!(!constants.is_empty());
    let table: BTreeSet<(String, String)> = METRICS
        .iter()
        .map(|m| (m.ident.to_string(), m.name.to_string()))
        .collect();
    let declared: BTreeSet<(String, String)> = constants.into_iter().collect();
    assert_eq!(
        table, declared,
        "METRICS in tests/integration/observability.rs must list every constant of \
         metric_names (then update the dashboard and observability/README.md)"
    );

    // Units and kinds as metrics.rs builds the instruments (whitespace ignored, so
    // rustfmt's line breaks don't matter). Histograms in seconds go through the
    // `seconds(name, description)` helper, which must itself be an f64 histogram in s.
    let compact: String = source.chars().filter(|c| !c.is_whitespace()).collect();
    let seconds_helper = compact.contains(".f64_histogram(name).with_unit(\"s\")");
    for metric in METRICS {
        let constant = format!("metric_names::{}", metric.ident);
        let built_as = match metric.kind {
            Kind::Counter => {
                compact.contains(&format!(
                    "u64_counter({constant}).with_unit(\"{}\")",
                    metric.unit
                )) || compact.contains(&format!(
                    "f64_counter({constant}).with_unit(\"{}\")",
                    metric.unit
                ))
            }
            Kind::Gauge => ["u64_gauge", "f64_gauge"].iter().any(|instrument| {
                compact.contains(&format!(
                    "{instrument}({constant}).with_unit(\"{}\")",
                    metric.unit
                ))
            }),
            Kind::Histogram => {
                compact.contains(&format!(
                    "f64_histogram({constant}).with_unit(\"{}\")",
                    metric.unit
                )) || (metric.unit == "s"
                    && seconds_helper
                    && compact.contains(&format!("seconds({constant},")))
            }
        };
        assert!(
            built_as,
            "metrics.rs does not build {} as a {:?} in {:?}: update METRICS (and the \
             dashboard) in tests/integration/observability.rs",
            metric.name, metric.kind, metric.unit
        );
    }
}

// ---- PromQL scanning -------------------------------------------------------------------

#[derive(Debug, Default)]
struct Usage {
    metrics: Vec<String>,
    labels: Vec<String>,
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Index just past the string literal starting at `i`.
fn skip_string(chars: &[char], i: usize) -> Result<usize, String> {
    let quote = chars[i];
    let mut j = i + 1;
    while j < chars.len() {
        match chars[j] {
            '\\' => j += 2,
            c if c == quote => return Ok(j + 1),
            _ => j += 1,
        }
    }
    Err("unterminated string".into())
}

fn skip_spaces(chars: &[char], mut i: usize) -> usize {
    while i < chars.len() && chars[i].is_whitespace() {
        i += 1;
    }
    i
}

fn read_ident(chars: &[char], mut i: usize) -> (String, usize) {
    let start = i;
    while i < chars.len() && is_ident(chars[i]) {
        i += 1;
    }
    (chars[start..i].iter().collect(), i)
}

/// The metric names and label names an expression uses. Grafana variables (`$run`,
/// `${…}`), strings, numbers and range selectors (`[5m]`) are skipped; an unknown
/// function is an error.
fn scan_promql(expr: &str) -> Result<Usage, String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut usage = Usage::default();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i)?;
        } else if c == '$' {
            i += 1;
            if chars.get(i) == Some(&'{') {
                while i < chars.len() && chars[i] != '}' {
                    i += 1;
                }
                i += 1;
            } else {
                i = read_ident(&chars, i).1;
            }
        } else if c == '[' {
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '{' {
            // Label matchers: `name op "value"`, comma separated.
            i += 1;
            loop {
                i = skip_spaces(&chars, i);
                match chars.get(i) {
                    None => return Err("unterminated label matchers".into()),
                    Some('}') => {
                        i += 1;
                        break;
                    }
                    Some(',') => i += 1,
                    Some(&c) if is_ident_start(c) => {
                        let (label, next) = read_ident(&chars, i);
                        usage.labels.push(label);
                        i = skip_spaces(&chars, next);
                        while i < chars.len() && matches!(chars[i], '=' | '!' | '~') {
                            i += 1;
                        }
                        i = skip_spaces(&chars, i);
                        match chars.get(i) {
                            Some('"' | '\'' | '`') => i = skip_string(&chars, i)?,
                            _ => return Err(format!("matcher without a string value in {expr}")),
                        }
                    }
                    Some(c) => return Err(format!("unexpected {c:?} in label matchers")),
                }
            }
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if is_ident_start(c) {
            let (word, next) = read_ident(&chars, i);
            i = next;
            let after = skip_spaces(&chars, i);
            let followed_by_paren = chars.get(after) == Some(&'(');
            if LABEL_LIST_KEYWORDS.contains(&word.as_str()) {
                if followed_by_paren {
                    let close = chars[after..]
                        .iter()
                        .position(|&c| c == ')')
                        .ok_or("unterminated label list")?;
                    let list: String = chars[after + 1..after + close].iter().collect();
                    usage.labels.extend(
                        list.split(',')
                            .map(str::trim)
                            .filter(|l| !l.is_empty())
                            .map(str::to_string),
                    );
                    i = after + close + 1;
                }
            } else if KEYWORDS.contains(&word.as_str()) || FUNCTIONS.contains(&word.as_str()) {
                // Aggregations may be followed by `by (…)` before their `(`.
            } else if followed_by_paren {
                return Err(format!("unknown function {word} in {expr}"));
            } else {
                usage.metrics.push(word);
            }
        } else {
            i += 1;
        }
    }
    Ok(usage)
}

#[test]
fn the_promql_scanner_separates_metrics_labels_and_functions() {
    let usage = scan_promql(
        r#"histogram_quantile(0.95, sum by (le, dl_rank) (rate(a_b_bucket{nemo_run_id="$run", dl_rank=~"$rank"}[$__rate_interval]))) / on (dl_rank) group_left sum by (dl_rank) (c_total{x!="}"})"#,
    )
    .unwrap();
    assert_eq!(usage.metrics, ["a_b_bucket", "c_total"]);
    assert_eq!(
        usage.labels,
        [
            "le",
            "dl_rank",
            "nemo_run_id",
            "dl_rank",
            "dl_rank",
            "dl_rank",
            "x"
        ]
    );
    assert!(scan_promql("frobnicate(x)").is_err());
}

// ---- The dashboard ---------------------------------------------------------------------

fn dashboard() -> Value {
    serde_json::from_str(&read("observability/grafana/lens-probe-dashboard.json"))
        .expect("the dashboard is not valid JSON")
}

/// Every `"expr"` string anywhere in the JSON.
fn exprs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr", Value::String(expr)) => out.push(expr.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

/// `label_values(EXPR, LABEL)` of a query variable → (EXPR, LABEL).
fn label_values(query: &str) -> (&str, &str) {
    let inner = query
        .trim()
        .strip_prefix("label_values(")
        .and_then(|q| q.strip_suffix(')'))
        .unwrap_or_else(|| panic!("variable query is not label_values(…): {query}"));
    let (expr, label) = inner.rsplit_once(',').expect("label_values(EXPR, LABEL)");
    (expr.trim(), label.trim())
}

fn variables(dashboard: &Value) -> BTreeMap<String, Value> {
    dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .map(|v| {
            (
                v["name"].as_str().expect("variable name").to_string(),
                v.clone(),
            )
        })
        .collect()
}

fn variable_query(variable: &Value) -> String {
    match &variable["query"] {
        Value::String(q) => q.clone(),
        Value::Object(o) => o["query"].as_str().expect("query.query").to_string(),
        other => panic!("variable query {other}"),
    }
}

#[test]
fn the_dashboard_queries_only_metrics_and_labels_lens_probe_exports() {
    let dashboard = dashboard();
    let names = prometheus_names();
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    assert!(!all.is_empty(), "no expr in the dashboard");
    for (_, variable) in variables(&dashboard) {
        if variable["type"] == "query" {
            let query = variable_query(&variable);
            let (expr, label) = label_values(&query);
            all.push(expr.to_string());
            assert!(LABELS.contains(&label), "unknown label {label} in {query}");
        }
    }

    let mut used_metrics = BTreeSet::new();
    for expr in &all {
        let usage = scan_promql(expr).unwrap_or_else(|e| panic!("{e}"));
        assert!(!usage.metrics.is_empty(), "no metric in {expr}");
        for metric in usage.metrics {
            let Some(otel) = names.get(&metric) else {
                panic!(
                    "{metric} (in {expr}) is not a Prometheus name of any lens-probe metric; \
                     known: {:?}",
                    names.keys().collect::<Vec<_>>()
                );
            };
            used_metrics.insert(*otel);
        }
        for label in usage.labels {
            assert!(
                LABELS.contains(&label.as_str()),
                "unknown label {label} in {expr}"
            );
        }
    }
    // Every metric has a panel: a new metric needs one (or a reason here).
    let unused: Vec<_> = METRICS
        .iter()
        .map(|m| m.name)
        .filter(|name| !used_metrics.contains(name))
        .collect();
    assert!(unused.is_empty(), "metrics without a panel: {unused:?}");
}

#[test]
fn the_dashboard_is_importable_with_its_variables() {
    let dashboard = dashboard();
    assert_eq!(dashboard["schemaVersion"], 39);
    let inputs = dashboard["__inputs"].as_array().expect("__inputs");
    assert!(
        inputs
            .iter()
            .any(|i| i["name"] == "DS_PROMETHEUS" && i["pluginId"] == "prometheus"),
        "no DS_PROMETHEUS datasource input"
    );

    let variables = variables(&dashboard);
    let run = &variables["run"];
    assert_eq!(run["type"], "query");
    assert_eq!(label_values(&variable_query(run)).1, "nemo_run_id");
    let rank = &variables["rank"];
    assert_eq!(rank["type"], "query");
    assert_eq!(label_values(&variable_query(rank)).1, "dl_rank");
    assert_eq!(rank["multi"], true);
    assert_eq!(rank["includeAll"], true);

    // Legend templates name labels too.
    let text = dashboard.to_string();
    for piece in text.split("{{").skip(1) {
        let label = piece.split("}}").next().unwrap().trim();
        assert!(
            LABELS.contains(&label),
            "unknown label {{{{{label}}}}} in a legend"
        );
    }

    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    for panel in panels {
        let title = panel["title"].as_str().expect("panel title");
        assert!(
            ids.insert(panel["id"].as_u64().expect("panel id")),
            "duplicate id: {title}"
        );
        assert!(
            panel["gridPos"]["w"].as_u64().is_some(),
            "no gridPos: {title}"
        );
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "no target: {title}");
        let mut refs = BTreeSet::new();
        for target in targets {
            assert_eq!(target["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
            assert!(
                target["expr"].as_str().is_some(),
                "target without expr: {title}"
            );
            assert!(
                refs.insert(target["refId"].as_str().expect("refId")),
                "{title}"
            );
        }
    }
}

// ---- The collector configuration -------------------------------------------------------

/// The collector configuration flattened for lookups: every mapping key gets its path of
/// parent keys, with its scalar value (or "" for a block); every sequence its items
/// (parsed with serde_yaml_ng).
#[derive(Debug, Default)]
struct Yaml {
    /// Every key path, with its scalar value or "" for a block.
    keys: BTreeMap<Vec<String>, String>,
    lists: BTreeMap<Vec<String>, Vec<String>>,
}

fn scalar_text(value: &serde_yaml_ng::Value) -> String {
    use serde_yaml_ng::Value as Y;
    match value {
        Y::String(s) => s.clone(),
        Y::Bool(b) => b.to_string(),
        Y::Number(n) => n.to_string(),
        _ => String::new(),
    }
}

fn flatten(value: &serde_yaml_ng::Value, path: &mut Vec<String>, yaml: &mut Yaml) {
    use serde_yaml_ng::Value as Y;
    match value {
        Y::Mapping(map) => {
            for (key, child) in map {
                path.push(scalar_text(key));
                yaml.keys.insert(path.clone(), scalar_text(child));
                flatten(child, path, yaml);
                path.pop();
            }
        }
        Y::Sequence(items) => {
            yaml.lists
                .insert(path.clone(), items.iter().map(scalar_text).collect());
        }
        _ => {}
    }
}

fn parse_yaml(text: &str) -> Yaml {
    let value: serde_yaml_ng::Value = serde_yaml_ng::from_str(text).expect("valid YAML");
    let mut yaml = Yaml::default();
    flatten(&value, &mut Vec::new(), &mut yaml);
    yaml
}

fn path(keys: &str) -> Vec<String> {
    keys.split(" > ").map(str::to_string).collect()
}

impl Yaml {
    fn has(&self, keys: &str) -> bool {
        self.keys.contains_key(&path(keys))
    }

    fn value(&self, keys: &str) -> &str {
        self.keys
            .get(&path(keys))
            .unwrap_or_else(|| panic!("collector config has no {keys}"))
    }

    fn list(&self, keys: &str) -> Vec<&str> {
        self.lists
            .get(&path(keys))
            .unwrap_or_else(|| panic!("collector config has no list {keys}"))
            .iter()
            .map(String::as_str)
            .collect()
    }

    /// The components defined in a top-level section (`receivers`, `exporters`, …).
    fn components(&self, section: &str) -> BTreeSet<&str> {
        self.keys
            .keys()
            .filter(|p| p.len() == 2 && p[0] == section)
            .map(|p| p[1].as_str())
            .collect()
    }
}

#[test]
fn the_yaml_reader_follows_indentation() {
    let yaml = parse_yaml("a:\n  b/c:\n    d: 1 # note\n  e: [x, y]\n# top\nf:\n  - g\n  - h\n");
    assert_eq!(yaml.value("a > b/c > d"), "1");
    assert_eq!(yaml.list("a > e"), ["x", "y"]);
    assert_eq!(yaml.list("f"), ["g", "h"]);
    assert!(!yaml.has("a > d"));
    assert_eq!(yaml.components("a"), BTreeSet::from(["b/c", "e"]));
}

#[test]
fn the_collector_receives_otlp_and_fans_out_to_tempo_jaeger_and_prometheus() {
    let yaml = parse_yaml(&read("observability/otel-collector.yaml"));

    assert!(
        yaml.value("receivers > otlp > protocols > grpc > endpoint")
            .ends_with(":4317"),
        "OTLP gRPC must listen on 4317"
    );
    assert!(
        yaml.value("receivers > otlp > protocols > http > endpoint")
            .ends_with(":4318"),
        "OTLP HTTP must listen on 4318"
    );
    assert!(yaml.has("processors > memory_limiter"));
    assert!(yaml.has("processors > batch"));

    assert_eq!(
        yaml.value("exporters > otlp/tempo > endpoint"),
        "tempo:4317"
    );
    assert_eq!(
        yaml.value("exporters > otlp/tempo > tls > insecure"),
        "true"
    );
    assert_eq!(
        yaml.value("exporters > otlp/jaeger > endpoint"),
        "jaeger:4317"
    );
    assert_eq!(
        yaml.value("exporters > otlp/jaeger > tls > insecure"),
        "true"
    );
    assert_eq!(
        yaml.value("exporters > prometheus > endpoint"),
        "0.0.0.0:8889"
    );
    assert_eq!(
        yaml.value("exporters > prometheus > resource_to_telemetry_conversion > enabled"),
        "true",
        "resource attributes (dl.rank, nemo.run.id, host.name) must become labels"
    );

    let pipelines = "service > pipelines";
    let traces = |k: &str| yaml.list(&format!("{pipelines} > traces > {k}"));
    let metrics = |k: &str| yaml.list(&format!("{pipelines} > metrics > {k}"));
    assert_eq!(traces("receivers"), ["otlp"]);
    assert_eq!(metrics("receivers"), ["otlp"]);
    assert_eq!(
        traces("exporters").into_iter().collect::<BTreeSet<_>>(),
        BTreeSet::from(["otlp/tempo", "otlp/jaeger"])
    );
    assert_eq!(metrics("exporters"), ["prometheus"]);
    for processors in [traces("processors"), metrics("processors")] {
        assert_eq!(
            processors.first(),
            Some(&"memory_limiter"),
            "memory_limiter goes first"
        );
        assert_eq!(processors.last(), Some(&"batch"), "batch goes last");
    }

    // Everything a pipeline names is defined (the collector refuses to start otherwise).
    for pipeline in ["traces", "metrics"] {
        for section in ["receivers", "processors", "exporters"] {
            let defined = yaml.components(section);
            for component in yaml.list(&format!("{pipelines} > {pipeline} > {section}")) {
                assert!(
                    defined.contains(component),
                    "pipeline {pipeline} uses {component}, not defined under {section}"
                );
            }
        }
    }
    if yaml.has("service > extensions") {
        let defined = yaml.components("extensions");
        for extension in yaml.list("service > extensions") {
            assert!(
                defined.contains(extension),
                "extension {extension} not defined"
            );
        }
    }
}

// ---- Alert rules -----------------------------------------------------------------------

/// `promtool`: on PATH, or where `cargo xtask setup` unpacks it.
fn promtool() -> Option<PathBuf> {
    let unpacked = std::env::var_os("HOME")
        .map(|home| PathBuf::from(home).join(".cache/lens-probe/prometheus/usr/bin/promtool"))
        .filter(|path| path.is_file());
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("promtool"))
            .find(|path| path.is_file())
    });
    let found = on_path.or(unpacked);
    if found.is_none() {
        lens_tests::skip(
            "the_alert_rules_pass_their_promtool_tests",
            "promtool",
            "promtool is not installed; run `cargo xtask setup`",
        );
    }
    found
}

#[test]
fn the_alert_rules_pass_their_promtool_tests() {
    let Some(promtool) = promtool() else {
        return;
    };
    let output = std::process::Command::new(promtool)
        .args(["test", "rules"])
        .arg(repo_file(
            "observability/prometheus/lens-probe-alerts.test.yaml",
        ))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{text}");
    assert!(text.contains("SUCCESS"), "{text}");
}

#[test]
fn the_alert_rules_query_only_metrics_and_labels_lens_probe_exports() {
    let rules = read("observability/prometheus/lens-probe-alerts.yaml");
    let names = prometheus_names();
    // Each rule's `expr: |` block: the indented lines after it.
    let mut exprs = Vec::new();
    let mut lines = rules.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "expr: |" {
            let indent = line.len() - line.trim_start().len();
            let mut expr = String::new();
            while let Some(next) = lines.peek() {
                if !next.trim().is_empty() && next.len() - next.trim_start().len() <= indent {
                    break;
                }
                expr.push_str(lines.next().unwrap());
                expr.push('\n');
            }
            exprs.push(expr);
        }
    }
    assert_eq!(exprs.len(), 2, "{rules}");
    for expr in exprs {
        let usage = scan_promql(&expr).unwrap_or_else(|e| panic!("{e}"));
        for metric in usage.metrics {
            assert!(names.contains_key(&metric), "{metric} in {expr}");
        }
        for label in usage.labels {
            assert!(
                LABELS.contains(&label.as_str()),
                "unknown label {label} in {expr}"
            );
        }
    }
}
