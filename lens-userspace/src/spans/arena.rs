//! Open spans of one process, and the group gate at export: a span of a disabled group is
//! tracked (its children need a place in time) but not exported, and its children hang
//! on the nearest enabled ancestor instead.
use std::collections::HashMap;

use super::{
    AttrValue, Attributes, SpanEvent, SpanExporter, SpanId, SpanRecord, SpanStatus,
    launches::LaunchLedger, names,
};

/// `cuda.kernel.top` events on a step, at most.
pub const TOP_KERNELS_PER_STEP: usize = 10;
use crate::{
    semconv,
    settings::groups::{SpanGroup, SpanGroups},
};

/// Span ids: a random base per lens-probe run plus a counter, so ids of two runs (or of
/// two processes in one trace) do not collide.
#[derive(Debug)]
pub struct IdSource {
    next: u64,
}

impl IdSource {
    pub fn new() -> IdSource {
        use std::hash::{BuildHasher, Hasher};
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(super::monotonic_now_ns());
        // Keep room below the top so the counter never wraps to 0 (invalid in OTel).
        IdSource {
            next: (hasher.finish() >> 1) | 1,
        }
    }

    pub fn next(&mut self) -> SpanId {
        let id = SpanId(self.next);
        self.next = self.next.wrapping_add(1).max(1);
        id
    }
}

#[derive(Debug)]
struct OpenSpan {
    record: SpanRecord,
    enabled: bool,
    /// The latest end among the calls made inside it so far.
    calls_end: u64,
}

#[derive(Debug)]
pub struct SpanArena {
    pid: u32,
    groups: SpanGroups,
    open: HashMap<SpanId, OpenSpan>,
    /// A training phase or a call has been seen (not just the job and its start-up).
    training_seen: bool,
    /// The process's launch totals at its phase marks: launches per span.
    launches: LaunchLedger,
}

impl SpanArena {
    pub fn new(pid: u32, groups: SpanGroups) -> SpanArena {
        SpanArena {
            pid,
            groups,
            open: HashMap::new(),
            training_seen: false,
            launches: LaunchLedger::default(),
        }
    }

    pub fn launches_mut(&mut self) -> &mut LaunchLedger {
        &mut self.launches
    }

    /// Whether the process did anything a training job does (a step, an evaluation, a
    /// checkpoint, a collective...): launchers, shells and helpers never do.
    pub fn training_seen(&self) -> bool {
        self.training_seen
    }

    /// The exported span that children of `parent` hang on.
    fn export_parent(&self, parent: Option<SpanId>) -> Option<SpanId> {
        let open = self.open.get(&parent?)?;
        if open.enabled {
            Some(open.record.id)
        } else {
            open.record.parent
        }
    }

    /// Where a call made inside open span `parent` is shown: the exported span it hangs
    /// on and the group it takes (see [`Self::call_record`]).
    pub fn placement_in(&self, parent: SpanId) -> Placement {
        Placement {
            parent: self.export_parent(Some(parent)),
            group: self.export_group(Some(parent)).unwrap_or(SpanGroup::Step),
        }
    }

    /// The group of the nearest enabled span at or above `parent` (detail spans take it).
    fn export_group(&self, parent: Option<SpanId>) -> Option<SpanGroup> {
        let id = self.export_parent(parent)?;
        self.open.get(&id).map(|o| o.record.group)
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        id: SpanId,
        name: &'static str,
        group: SpanGroup,
        parent: Option<SpanId>,
        tid: u32,
        start_ns: u64,
        end_ns: u64,
    ) -> SpanRecord {
        SpanRecord {
            id,
            parent: self.export_parent(parent),
            name,
            group,
            pid: self.pid,
            tid,
            start_ns,
            end_ns,
            attributes: vec![(semconv::NEMO_SPAN_GROUP, group.name().into())],
            events: Vec::new(),
            status: SpanStatus::Unset,
        }
    }

    pub fn open(
        &mut self,
        ids: &mut IdSource,
        name: &'static str,
        group: SpanGroup,
        parent: Option<SpanId>,
        tid: u32,
        start_ns: u64,
    ) -> SpanId {
        let id = ids.next();
        self.training_seen |= !matches!(group, SpanGroup::Job | SpanGroup::ModelInit);
        let record = self.record(id, name, group, parent, tid, start_ns, start_ns);
        let enabled = self.groups.contains(group);
        self.open.insert(
            id,
            OpenSpan {
                record,
                enabled,
                calls_end: 0,
            },
        );
        id
    }

    /// Moves open span `id`'s start back to `start_ns` if that is earlier: a span whose
    /// first signal came late (a sampled Python call). Returns whether it moved.
    pub fn move_start(&mut self, id: SpanId, start_ns: u64) -> bool {
        match self.open.get_mut(&id) {
            Some(open) if start_ns < open.record.start_ns => {
                open.record.start_ns = start_ns;
                true
            }
            _ => false,
        }
    }

    /// Open span `id`'s group and start.
    pub fn open_span(&self, id: SpanId) -> Option<(SpanGroup, u64)> {
        self.open
            .get(&id)
            .map(|open| (open.record.group, open.record.start_ns))
    }

    /// The latest end among the calls made inside open span `id` (0: none yet).
    pub fn calls_end(&self, id: SpanId) -> u64 {
        self.open.get(&id).map_or(0, |open| open.calls_end)
    }

    pub fn set_attr(&mut self, id: SpanId, key: &'static str, value: impl Into<AttrValue>) {
        if let Some(open) = self.open.get_mut(&id) {
            open.record.set_attr(key, value);
        }
    }

    pub fn add_event(&mut self, id: SpanId, event: SpanEvent) {
        if let Some(open) = self.open.get_mut(&id) {
            open.record.events.push(event);
        }
    }

    pub fn set_error(&mut self, id: SpanId, message: String) {
        if let Some(open) = self.open.get_mut(&id) {
            open.record.status = SpanStatus::Error(message);
        }
    }

    /// Ends span `id` at `end_ns` (never before its start) and exports it if its group is
    /// enabled. `truncated`: it did not end by itself (process exit, tracing stopped).
    pub fn close(&mut self, id: SpanId, end_ns: u64, truncated: bool, out: &mut dyn SpanExporter) {
        let Some(OpenSpan {
            mut record,
            enabled,
            ..
        }) = self.open.remove(&id)
        else {
            return;
        };
        record.end_ns = end_ns.max(record.start_ns);
        if let Some(launches) = self.launches.between(record.start_ns, record.end_ns) {
            record.set_attr(semconv::CUDA_LAUNCH_COUNT, launches);
            if self.launches.sampled() {
                record.set_attr(semconv::CUDA_LAUNCH_SAMPLED, true);
            }
        }
        if record.name == names::STEP
            && let Some(top) =
                self.launches
                    .top_kernels(record.start_ns, record.end_ns, TOP_KERNELS_PER_STEP)
        {
            for (name, launches) in top {
                record.events.push(SpanEvent {
                    name: names::KERNEL_TOP_EVENT,
                    at_ns: record.end_ns,
                    attributes: vec![
                        (semconv::CUDA_KERNEL_NAME, name.as_ref().into()),
                        (semconv::CUDA_KERNEL_LAUNCHES, launches.into()),
                    ],
                });
            }
        }
        if truncated {
            record.set_attr(semconv::NEMO_SPAN_TRUNCATED, true);
        }
        if enabled {
            out.export(record);
        }
    }

    /// Forgets open span `id` unexported: it turned out to be nothing (a framework load
    /// call that loaded nothing). The caller knows no span was exported under it.
    pub fn discard(&mut self, id: SpanId) {
        self.open.remove(&id);
    }

    /// A finished call (collective, sync wait) as a child of `parent`. Its probes are
    /// only attached when a group wants it, so it is always exported; it carries the
    /// group of the span it is shown under.
    #[allow(clippy::too_many_arguments)]
    /// A finished call's span, child of `parent`, for the caller to send or hold.
    pub fn call_record(
        &mut self,
        ids: &mut IdSource,
        name: &'static str,
        parent: Option<SpanId>,
        tid: u32,
        start_ns: u64,
        end_ns: u64,
        attributes: Attributes,
        error: Option<String>,
    ) -> SpanRecord {
        self.training_seen = true;
        if let Some(open) = parent.and_then(|parent| self.open.get_mut(&parent)) {
            open.calls_end = open.calls_end.max(end_ns);
        }
        let group = self.export_group(parent).unwrap_or(SpanGroup::Step);
        let mut record = self.record(ids.next(), name, group, parent, tid, start_ns, end_ns);
        // One allocation for the call's attributes and the few a collective's completion
        // and rank match add later (growing it step by step was a tenth of the consumer's
        // time at a million collectives a second).
        record.attributes.reserve_exact(attributes.len() + 8);
        record.attributes.extend(attributes);
        if let Some(message) = error {
            record.status = SpanStatus::Error(message);
        }
        record
    }
}

/// Where a call's span is shown: its exported parent and the group it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub parent: Option<SpanId>,
    pub group: SpanGroup,
}

impl Placement {
    /// Moves `record` (a call's span) there.
    pub fn apply(self, record: &mut SpanRecord) {
        record.parent = self.parent;
        record.group = self.group;
        record.set_attr(semconv::NEMO_SPAN_GROUP, self.group.name());
    }
}
