//! Spans: what the event stream means for the training loop. The [`builder`] turns each
//! traced process's events into a span tree (`train.job` → `train.step` → phases →
//! collective calls), following the rules of `docs/spans.md`; finished spans go to a
//! [`SpanExporter`] such as the [`console`] tree.
//!
//! A span not ready to go out waits: a collective for its completion and the other ranks
//! (`collectives`), any other for its placement or its process's training activity
//! (`pending`), all under the one rule written in `pending` (bounded in age and number;
//! what is known goes out when a process exits).
mod arena;
pub mod builder;
mod collectives;
pub mod console;
mod launches;
mod memory_peaks;
mod pending;
mod phases;
pub mod straggler_cause;
pub mod stragglers;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use lens_common::ProbeId;
use serde::Serialize;

use crate::{semconv, settings::groups::SpanGroup, sys::target::ProcessInfo};

pub use builder::SpanBuilder;

pub use crate::names;

/// Unique within one lens-probe run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SpanId(pub u64);

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum AttrValue {
    Bool(bool),
    Int(i64),
    Str(String),
}

impl From<bool> for AttrValue {
    fn from(value: bool) -> Self {
        AttrValue::Bool(value)
    }
}
impl From<i64> for AttrValue {
    fn from(value: i64) -> Self {
        AttrValue::Int(value)
    }
}
impl From<i32> for AttrValue {
    fn from(value: i32) -> Self {
        AttrValue::Int(value.into())
    }
}
impl From<u32> for AttrValue {
    fn from(value: u32) -> Self {
        AttrValue::Int(value.into())
    }
}
impl From<u64> for AttrValue {
    fn from(value: u64) -> Self {
        AttrValue::Int(i64::try_from(value).unwrap_or(i64::MAX))
    }
}
impl From<&str> for AttrValue {
    fn from(value: &str) -> Self {
        AttrValue::Str(value.to_string())
    }
}
impl From<String> for AttrValue {
    fn from(value: String) -> Self {
        AttrValue::Str(value)
    }
}

impl std::fmt::Display for AttrValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AttrValue::Bool(v) => write!(f, "{v}"),
            AttrValue::Int(v) => write!(f, "{v}"),
            AttrValue::Str(v) => write!(f, "{v}"),
        }
    }
}

pub type Attributes = Vec<(&'static str, AttrValue)>;

/// A timestamped point inside a span (OpenTelemetry span event).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SpanEvent {
    pub name: &'static str,
    pub at_ns: u64,
    pub attributes: Attributes,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum SpanStatus {
    Unset,
    Error(String),
}

/// A finished span. Times are `CLOCK_MONOTONIC` ns, the kernel's clock.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SpanRecord {
    pub id: SpanId,
    /// The nearest enclosing span of an enabled group; `None` for a root.
    pub parent: Option<SpanId>,
    pub name: &'static str,
    pub group: SpanGroup,
    pub pid: u32,
    pub tid: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Includes [`semconv::NEMO_SPAN_GROUP`].
    pub attributes: Attributes,
    pub events: Vec<SpanEvent>,
    pub status: SpanStatus,
}

impl SpanRecord {
    pub fn attr(&self, key: &str) -> Option<&AttrValue> {
        self.attributes
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }

    pub fn int_attr(&self, key: &str) -> Option<i64> {
        match self.attr(key)? {
            AttrValue::Int(v) => Some(*v),
            _ => None,
        }
    }

    pub fn truncated(&self) -> bool {
        self.attr(semconv::NEMO_SPAN_TRUNCATED) == Some(&AttrValue::Bool(true))
    }

    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }

    fn set_attr(&mut self, key: &'static str, value: impl Into<AttrValue>) {
        let value = value.into();
        match self.attributes.iter_mut().find(|(k, _)| *k == key) {
            Some((_, slot)) => *slot = value,
            None => self.attributes.push((key, value)),
        }
    }
}

/// Where finished spans go. Spans arrive as they end: children before their parents.
pub trait SpanExporter {
    /// A process's job begins at `start_ns`; `job` is its root span when the `job` group
    /// is enabled.
    fn process_started(&mut self, _info: &ProcessInfo, _job: Option<SpanId>, _start_ns: u64) {}
    fn export(&mut self, span: SpanRecord);
    /// The kernel's call counters of `pid` (launches...), read when it ended.
    fn process_calls(&mut self, _pid: u32, _calls: &BTreeMap<ProbeId, u64>) {}
    /// What `pid`'s probes have cost it so far, estimated.
    fn process_probe_cost(&mut self, _pid: u32, _cost: crate::sink::ProbeCost) {}
    /// `pid`'s launch counters are an overhead budget's estimates from sampled windows.
    fn launches_sampled(&mut self, _pid: u32) {}
    /// A GPU memory call of `pid` returned: what it did, at `at_ns`.
    fn process_memory(
        &mut self,
        _pid: u32,
        _at_ns: u64,
        _change: &crate::gpu_memory::MemoryChange,
    ) {
    }
    /// Every span of `pid` has been exported.
    fn process_ended(&mut self, _pid: u32) {}
}

impl<E: SpanExporter + ?Sized> SpanExporter for &mut E {
    fn process_started(&mut self, info: &ProcessInfo, job: Option<SpanId>, start_ns: u64) {
        (**self).process_started(info, job, start_ns);
    }
    fn export(&mut self, span: SpanRecord) {
        (**self).export(span);
    }
    fn process_calls(&mut self, pid: u32, calls: &BTreeMap<ProbeId, u64>) {
        (**self).process_calls(pid, calls);
    }
    fn process_probe_cost(&mut self, pid: u32, cost: crate::sink::ProbeCost) {
        (**self).process_probe_cost(pid, cost);
    }
    fn launches_sampled(&mut self, pid: u32) {
        (**self).launches_sampled(pid);
    }
    fn process_memory(&mut self, pid: u32, at_ns: u64, change: &crate::gpu_memory::MemoryChange) {
        (**self).process_memory(pid, at_ns, change);
    }
    fn process_ended(&mut self, pid: u32) {
        (**self).process_ended(pid);
    }
}

impl<E: SpanExporter + ?Sized> SpanExporter for Box<E> {
    fn process_started(&mut self, info: &ProcessInfo, job: Option<SpanId>, start_ns: u64) {
        (**self).process_started(info, job, start_ns);
    }
    fn export(&mut self, span: SpanRecord) {
        (**self).export(span);
    }
    fn process_calls(&mut self, pid: u32, calls: &BTreeMap<ProbeId, u64>) {
        (**self).process_calls(pid, calls);
    }
    fn process_probe_cost(&mut self, pid: u32, cost: crate::sink::ProbeCost) {
        (**self).process_probe_cost(pid, cost);
    }
    fn launches_sampled(&mut self, pid: u32) {
        (**self).launches_sampled(pid);
    }
    fn process_memory(&mut self, pid: u32, at_ns: u64, change: &crate::gpu_memory::MemoryChange) {
        (**self).process_memory(pid, at_ns, change);
    }
    fn process_ended(&mut self, pid: u32) {
        (**self).process_ended(pid);
    }
}

/// Two exporters fed the same spans: the OTLP pipeline (or the console) and the timeline.
impl<A: SpanExporter, B: SpanExporter> SpanExporter for (A, B) {
    fn process_started(&mut self, info: &ProcessInfo, job: Option<SpanId>, start_ns: u64) {
        self.0.process_started(info, job, start_ns);
        self.1.process_started(info, job, start_ns);
    }
    fn export(&mut self, span: SpanRecord) {
        self.0.export(span.clone());
        self.1.export(span);
    }
    fn process_calls(&mut self, pid: u32, calls: &BTreeMap<ProbeId, u64>) {
        self.0.process_calls(pid, calls);
        self.1.process_calls(pid, calls);
    }
    fn process_probe_cost(&mut self, pid: u32, cost: crate::sink::ProbeCost) {
        self.0.process_probe_cost(pid, cost);
        self.1.process_probe_cost(pid, cost);
    }
    fn launches_sampled(&mut self, pid: u32) {
        self.0.launches_sampled(pid);
        self.1.launches_sampled(pid);
    }
    fn process_memory(&mut self, pid: u32, at_ns: u64, change: &crate::gpu_memory::MemoryChange) {
        self.0.process_memory(pid, at_ns, change);
        self.1.process_memory(pid, at_ns, change);
    }
    fn process_ended(&mut self, pid: u32) {
        self.0.process_ended(pid);
        self.1.process_ended(pid);
    }
}

/// Keeps every span (tests, and tools built on the library).
#[derive(Debug, Default)]
pub struct SpanLog {
    pub spans: Vec<SpanRecord>,
}

impl SpanExporter for SpanLog {
    fn export(&mut self, span: SpanRecord) {
        self.spans.push(span);
    }
}

impl SpanLog {
    pub fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a SpanRecord> + 'a {
        self.spans.iter().filter(move |s| s.name == name)
    }

    pub fn children<'a>(&'a self, parent: &'a SpanRecord) -> Vec<&'a SpanRecord> {
        let mut children: Vec<&SpanRecord> = self
            .spans
            .iter()
            .filter(|s| s.parent == Some(parent.id))
            .collect();
        children.sort_by_key(|s| (s.start_ns, s.id));
        children
    }

    /// Spans that do not lie within their parent in time, with that parent (a user would
    /// see a child sticking out of its phase).
    pub fn misnested(&self) -> Vec<(&SpanRecord, &SpanRecord)> {
        self.spans
            .iter()
            .filter_map(|child| {
                let parent = self.spans.iter().find(|s| Some(s.id) == child.parent)?;
                (child.start_ns < parent.start_ns || child.end_ns > parent.end_ns)
                    .then_some((child, parent))
            })
            .collect()
    }

    /// The tree as indented `name key=value` lines, children in start order; attribute
    /// keys listed in `keys` only. For exact assertions on whole trees.
    pub fn outline(&self, keys: &[&str]) -> String {
        let mut roots: Vec<&SpanRecord> =
            self.spans.iter().filter(|s| s.parent.is_none()).collect();
        roots.sort_by_key(|s| (s.pid, s.start_ns, s.id));
        let mut out = String::new();
        for root in roots {
            self.outline_into(root, 0, keys, &mut out);
        }
        out
    }

    fn outline_into(&self, span: &SpanRecord, depth: usize, keys: &[&str], out: &mut String) {
        out.push_str(&"  ".repeat(depth));
        out.push_str(span.name);
        for key in keys {
            if let Some(value) = span.attr(key) {
                out.push_str(&format!(" {key}={value}"));
            }
        }
        out.push('\n');
        for child in self.children(span) {
            self.outline_into(child, depth + 1, keys, out);
        }
    }
}

/// Kernel timestamps (`CLOCK_MONOTONIC`) as wall-clock time (`CLOCK_REALTIME`), the clock
/// that nodes share: the offset between the two, read once, when made.
#[derive(Clone, Copy, Debug)]
pub struct WallClock {
    realtime_minus_monotonic_ns: i128,
}

impl WallClock {
    pub fn now() -> WallClock {
        let realtime_ns = std::time::SystemTime::now()
            .duration_since(std::time::SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i128)
            .unwrap_or_default();
        WallClock {
            realtime_minus_monotonic_ns: realtime_ns - monotonic_now_ns() as i128,
        }
    }

    /// `monotonic_ns` in ns since the Unix epoch.
    pub fn unix_ns(&self, monotonic_ns: u64) -> u64 {
        (monotonic_ns as i128 + self.realtime_minus_monotonic_ns).max(0) as u64
    }
}

/// `CLOCK_MONOTONIC` now, in ns: the clock of the kernel's timestamps.
pub fn monotonic_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
