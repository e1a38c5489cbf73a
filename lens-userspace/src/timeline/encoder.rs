//! Spans into Perfetto's TrackEvent packets, on the writer thread: the tracks, slices,
//! flows, instants and counters `docs/timeline.md` describes.
use foldhash::{HashMap, HashMapExt};

use prost::Message;

use super::{
    proto::{
        CounterDescriptor, DebugAnnotation, DebugAnnotationName, EventName, InternedData, Trace,
        TracePacket, TrackDescriptor, TrackEvent, counter_descriptor::Unit, debug_annotation,
        trace_packet, track_descriptor, track_event,
    },
    tracks::{self, Ids, Lane, Level},
};
use crate::{
    names, semconv,
    spans::{AttrValue, SpanId, SpanRecord, SpanStatus, WallClock},
    sys::{
        process::Process,
        target::{ProcessInfo, RankInfo},
    },
};

/// The tracks of one traced process.
struct ProcessTracks {
    uuid: u64,
    /// What its track ids are made from: its pid and which process of this writer it
    /// is, so that a later process with the same pid gets tracks of its own.
    key: u64,
    /// Job lanes: the first is the process's own track.
    jobs: Vec<Lane>,
    threads: HashMap<u32, ThreadTracks>,
    reports: Option<u64>,
    launches_per_step: Option<u64>,
    bytes_per_step: Option<u64>,
    /// Collective bytes under spans not yet written (children arrive before parents),
    /// summed up to their step.
    bytes_under: HashMap<SpanId, u64>,
}

struct ThreadTracks {
    uuid: u64,
    lanes: HashMap<Level, Vec<Lane>>,
}

/// Spans into Perfetto packets: which track each goes on (made when first needed), and
/// what its slice, flows, instants and counters are. Runs on the writer thread.
pub struct Encoder {
    ids: Ids,
    sequence: u32,
    first_packet: bool,
    clock: WallClock,
    host: String,
    /// The live processes' tracks, by pid (forgotten when the process ends).
    processes: HashMap<u32, ProcessTracks>,
    /// Processes given tracks so far.
    processes_made: u64,
    interned: Interned,
    /// Packets not yet taken ([`Encoder::take_bytes`]).
    packets: Vec<TracePacket>,
}

impl Encoder {
    /// `writer_key` tells this writer's tracks apart from every other's (see `Ids`).
    pub fn new(writer_key: &str, clock: WallClock, host: String) -> Encoder {
        let ids = Ids::new(writer_key);
        Encoder {
            sequence: ids.sequence(),
            ids,
            first_packet: true,
            clock,
            host,
            processes: HashMap::new(),
            processes_made: 0,
            interned: Interned::default(),
            packets: Vec::new(),
        }
    }

    /// Whether any process has had tracks.
    pub fn has_processes(&self) -> bool {
        self.processes_made > 0
    }

    /// The packets made since the last call, encoded as a trace (`Trace.packet`s: files
    /// and chunks concatenate).
    pub fn take_bytes(&mut self) -> Vec<u8> {
        if self.packets.is_empty() {
            return Vec::new();
        }
        Trace {
            packet: std::mem::take(&mut self.packets),
        }
        .encode_to_vec()
    }

    /// Forgets the packets made since the last [`Encoder::take_bytes`].
    pub fn discard(&mut self) {
        self.packets.clear();
    }

    pub fn process_started(&mut self, info: &ProcessInfo) {
        self.process(info.pid, Some(info));
    }

    /// Its tracks are done: a later process with its pid (the pid reused, or a program
    /// it execs) gets tracks of its own, and a run over many processes (`--node`, for
    /// days) keeps only the live ones'.
    pub fn process_ended(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    fn packet(&mut self, timestamp: Option<u64>, data: trace_packet::Data) {
        let mut flags = 0;
        if std::mem::take(&mut self.first_packet) {
            flags |= trace_packet::SequenceFlags::SeqIncrementalStateCleared as u32;
        }
        let interned = self.interned.take_new();
        if matches!(data, trace_packet::Data::TrackEvent(_)) {
            // Its names may be iids of this sequence's interned data.
            flags |= trace_packet::SequenceFlags::SeqNeedsIncrementalState as u32;
        }
        self.packets.push(TracePacket {
            timestamp,
            data: Some(data),
            interned_data: interned,
            optional_trusted_packet_sequence_id: Some(
                trace_packet::OptionalTrustedPacketSequenceId::TrustedPacketSequenceId(
                    self.sequence,
                ),
            ),
            sequence_flags: (flags != 0).then_some(flags),
        });
    }

    fn describe(&mut self, track: TrackDescriptor) {
        self.packet(None, trace_packet::Data::TrackDescriptor(track));
    }

    fn event(&mut self, at_ns: u64, event: TrackEvent) {
        let at = self.clock.unix_ns(at_ns);
        self.packet(Some(at), trace_packet::Data::TrackEvent(event));
    }

    /// The tracks of `pid`, described when first used.
    fn process(&mut self, pid: u32, info: Option<&ProcessInfo>) -> &mut ProcessTracks {
        if !self.processes.contains_key(&pid) {
            let key = (self.processes_made << 32) | u64::from(pid);
            self.processes_made += 1;
            let uuid = self.ids.track(&[key]);
            let rank = info
                .and_then(|info| RankInfo::from_environment(&info.view.environment).or(info.rank))
                .map_or(0, |rank| rank.rank);
            let command_line = info.map(|info| info.command_line.join(" "));
            self.describe(TrackDescriptor {
                uuid: Some(uuid),
                static_or_dynamic_name: Some(track_descriptor::StaticOrDynamicName::Name(format!(
                    "rank {rank} · {} · pid {pid}",
                    self.host
                ))),
                description: command_line,
                child_ordering: Some(track_descriptor::ChildTracksOrdering::Explicit as i32),
                ..TrackDescriptor::default()
            });
            self.processes.insert(
                pid,
                ProcessTracks {
                    uuid,
                    key,
                    jobs: vec![Lane::new(uuid)],
                    threads: HashMap::new(),
                    reports: None,
                    launches_per_step: None,
                    bytes_per_step: None,
                    bytes_under: HashMap::new(),
                },
            );
        }
        self.processes.get_mut(&pid).expect("just made")
    }

    /// A track of its own under `parent`, described now.
    fn child_track(&mut self, parent: u64, parts: &[u64], name: String, order: i32) -> u64 {
        let uuid = self.ids.track(parts);
        self.describe(TrackDescriptor {
            uuid: Some(uuid),
            parent_uuid: Some(parent),
            static_or_dynamic_name: Some(track_descriptor::StaticOrDynamicName::Name(name)),
            child_ordering: Some(track_descriptor::ChildTracksOrdering::Explicit as i32),
            sibling_order_rank: Some(order),
            ..TrackDescriptor::default()
        });
        uuid
    }

    /// The track `span` is drawn on: a lane of its level on its thread (or process).
    fn track_for(&mut self, span: &SpanRecord) -> u64 {
        let (pid, tid) = (span.pid, span.tid);
        let level = Level::of(span);
        let process = self.process(pid, None);
        let (process_uuid, key) = (process.uuid, process.key);
        if level == Level::Job {
            if let Some(lane) = process
                .jobs
                .iter_mut()
                .find(|l| l.fits(span.start_ns, span.end_ns))
            {
                lane.take(span.start_ns, span.end_ns);
                return lane.uuid;
            }
            let index = process.jobs.len() as u64;
            let uuid = self.child_track(
                process_uuid,
                &[key, u64::MAX, index],
                format!("{} {}", names::JOB, index + 1),
                -1,
            );
            let mut lane = Lane::new(uuid);
            lane.take(span.start_ns, span.end_ns);
            self.process(pid, None).jobs.push(lane);
            return uuid;
        }
        if !self.processes[&pid].threads.contains_key(&tid) {
            let name = if tid == pid {
                format!("main thread {tid}")
            } else {
                let thread = Process::new(pid).thread_name(tid).unwrap_or_default();
                format!("{thread} {tid}").trim_start().to_string()
            };
            let order = i32::try_from(tid).unwrap_or(i32::MAX);
            let uuid = self.child_track(process_uuid, &[key, u64::from(tid)], name, order);
            self.process(pid, None).threads.insert(
                tid,
                ThreadTracks {
                    uuid,
                    lanes: HashMap::new(),
                },
            );
        }
        let thread = &self.processes[&pid].threads[&tid];
        let thread_uuid = thread.uuid;
        let lanes = thread.lanes.get(&level).map_or(&[][..], Vec::as_slice);
        if let Some(index) = lanes
            .iter()
            .position(|l| l.fits(span.start_ns, span.end_ns))
        {
            let lanes = self.thread_lanes(pid, tid, level);
            lanes[index].take(span.start_ns, span.end_ns);
            return lanes[index].uuid;
        }
        let index = lanes.len();
        // The phases' first lane is the thread's own track.
        let uuid = if level == Level::Phase && index == 0 {
            thread_uuid
        } else {
            let name = match index {
                0 => level.track_name().to_string(),
                _ => format!("{} {}", level.track_name(), index + 1),
            };
            self.child_track(
                thread_uuid,
                &[key, u64::from(tid), level as u64, index as u64],
                name,
                (level as i32) * 1000 + index as i32,
            )
        };
        let mut lane = Lane::new(uuid);
        lane.take(span.start_ns, span.end_ns);
        self.thread_lanes(pid, tid, level).push(lane);
        uuid
    }

    fn thread_lanes(&mut self, pid: u32, tid: u32, level: Level) -> &mut Vec<Lane> {
        let thread = self
            .processes
            .get_mut(&pid)
            .and_then(|p| p.threads.get_mut(&tid))
            .expect("made by track_for");
        thread.lanes.entry(level).or_default()
    }

    /// A track of `pid`'s made on first use (`slot`: which one), under the process.
    fn process_child(
        &mut self,
        pid: u32,
        slot: fn(&mut ProcessTracks) -> &mut Option<u64>,
        name: &str,
        order: i32,
        counter: Option<Unit>,
    ) -> u64 {
        let process = self.process(pid, None);
        if let Some(uuid) = *slot(process) {
            return uuid;
        }
        let (parent, key) = (process.uuid, process.key);
        let uuid = self.ids.track(&[key, u64::MAX - 1, order as u64]);
        self.describe(TrackDescriptor {
            uuid: Some(uuid),
            parent_uuid: Some(parent),
            static_or_dynamic_name: Some(track_descriptor::StaticOrDynamicName::Name(
                name.to_string(),
            )),
            counter: counter.map(|unit| CounterDescriptor {
                unit: Some(unit as i32),
                unit_name: None,
            }),
            sibling_order_rank: Some(order),
            ..TrackDescriptor::default()
        });
        *slot(self.process(pid, None)) = Some(uuid);
        uuid
    }

    fn instant(&mut self, pid: u32, at_ns: u64, name: String, annotations: Vec<DebugAnnotation>) {
        let track = self.process_child(pid, |p| &mut p.reports, "reports", -3, None);
        self.event(
            at_ns,
            TrackEvent {
                name_field: Some(track_event::NameField::Name(name)),
                r#type: Some(track_event::Type::Instant as i32),
                track_uuid: Some(track),
                debug_annotations: annotations,
                ..TrackEvent::default()
            },
        );
    }

    fn counter(&mut self, pid: u32, bytes: bool, at_ns: u64, value: i64) {
        let track = if bytes {
            self.process_child(
                pid,
                |p| &mut p.bytes_per_step,
                "collective bytes per step",
                -4,
                Some(Unit::SizeBytes),
            )
        } else {
            self.process_child(
                pid,
                |p| &mut p.launches_per_step,
                "kernel launches per step",
                -5,
                Some(Unit::Count),
            )
        };
        self.event(
            at_ns,
            TrackEvent {
                r#type: Some(track_event::Type::Counter as i32),
                track_uuid: Some(track),
                counter_value_field: Some(track_event::CounterValueField::CounterValue(value)),
                ..TrackEvent::default()
            },
        );
    }

    /// The straggler verdict, the hang report and the out-of-memory failure a span
    /// carries, as instants.
    fn reports(&mut self, span: &SpanRecord) {
        // The allocation's own span (the span it ran in carries the event too).
        let allocation = span.attr(semconv::DL_GPU_MEMORY_HELD).is_some();
        let failures = span
            .events
            .iter()
            .filter(|e| e.name == names::OUT_OF_MEMORY_EVENT);
        for event in failures.filter(|_| allocation) {
            let annotations = self.attribute_annotations(&event.attributes);
            let asked = event
                .attributes
                .iter()
                .find(|(key, _)| *key == semconv::DL_GPU_MEMORY_BYTES)
                .map_or_else(String::new, |(_, value)| format!(": {value} bytes asked"));
            self.instant(
                span.pid,
                event.at_ns,
                format!("out of GPU memory{asked}"),
                annotations,
            );
        }
        if span.name == names::HANG {
            let mut annotations = self.annotations(span);
            if let SpanStatus::Error(summary) = &span.status {
                annotations.insert(0, self.text_annotation("report", summary));
            }
            let name = match &span.status {
                SpanStatus::Error(summary) => format!("hang: {summary}"),
                SpanStatus::Unset => "hang".to_string(),
            };
            self.instant(span.pid, span.end_ns, name, annotations);
            return;
        }
        let Some(AttrValue::Str(cause)) = span.attr(semconv::DL_COLLECTIVE_STRAGGLER_CAUSE) else {
            return;
        };
        let last = span.int_attr(semconv::DL_COLLECTIVE_LAST_RANK);
        if last.is_none() || last != span.int_attr(semconv::DL_RANK) {
            return;
        }
        let skew_ms = span
            .int_attr(semconv::DL_COLLECTIVE_ARRIVAL_SKEW_NS)
            .unwrap_or(0) as f64
            / 1e6;
        let name = format!(
            "straggler: rank {} arrived last at {} by {skew_ms:.2} ms ({cause})",
            last.unwrap_or_default(),
            span.name
        );
        let annotations = self.annotations(span);
        self.instant(span.pid, span.start_ns, name, annotations);
    }

    /// Collective bytes summed up the tree to their step; a step's launches and bytes
    /// become its counters.
    fn step_counters(&mut self, span: &SpanRecord) {
        let Some(process) = self.processes.get_mut(&span.pid) else {
            return;
        };
        let mut bytes = process.bytes_under.remove(&span.id).unwrap_or(0);
        if let Some(own) = span.int_attr(semconv::DL_COLLECTIVE_BYTES) {
            bytes += own.max(0) as u64;
        }
        if span.name == names::STEP {
            self.counter(span.pid, true, span.start_ns, bytes as i64);
            if let Some(launches) = span.int_attr(semconv::CUDA_LAUNCH_COUNT) {
                self.counter(span.pid, false, span.start_ns, launches);
            }
        } else if let Some(parent) = span.parent
            && bytes > 0
        {
            *process.bytes_under.entry(parent).or_default() += bytes;
        }
    }

    /// `span`'s slice on its track, with its flow, and the instants and counters it
    /// makes.
    pub fn span(&mut self, span: &SpanRecord) {
        let track = self.track_for(span);
        let flow_ids = match (
            span.attr(semconv::DL_COLLECTIVE_COMM_ID),
            span.int_attr(semconv::DL_COLLECTIVE_SEQ),
        ) {
            (Some(AttrValue::Str(comm)), Some(seq)) => vec![tracks::collective_flow(comm, seq)],
            _ => Vec::new(),
        };
        let mut annotations = self.annotations(span);
        if let SpanStatus::Error(message) = &span.status {
            annotations.push(self.text_annotation("status.error", message));
        }
        let name = self.interned.event_name(span.name);
        self.event(
            span.start_ns,
            TrackEvent {
                name_field: Some(track_event::NameField::NameIid(name)),
                r#type: Some(track_event::Type::SliceBegin as i32),
                track_uuid: Some(track),
                flow_ids,
                debug_annotations: annotations,
                ..TrackEvent::default()
            },
        );
        self.event(
            span.end_ns,
            TrackEvent {
                r#type: Some(track_event::Type::SliceEnd as i32),
                track_uuid: Some(track),
                ..TrackEvent::default()
            },
        );
        self.reports(span);
        self.step_counters(span);
    }

    fn annotations(&mut self, span: &SpanRecord) -> Vec<DebugAnnotation> {
        self.attribute_annotations(&span.attributes)
    }

    fn attribute_annotations(
        &mut self,
        attributes: &crate::spans::Attributes,
    ) -> Vec<DebugAnnotation> {
        attributes
            .iter()
            .map(|(key, value)| DebugAnnotation {
                name_field: Some(debug_annotation::NameField::NameIid(
                    self.interned.annotation_name(key),
                )),
                value: Some(match value {
                    AttrValue::Bool(v) => debug_annotation::Value::BoolValue(*v),
                    AttrValue::Int(v) => debug_annotation::Value::IntValue(*v),
                    AttrValue::Str(v) => debug_annotation::Value::StringValue(v.clone()),
                }),
            })
            .collect()
    }

    fn text_annotation(&mut self, name: &'static str, text: &str) -> DebugAnnotation {
        DebugAnnotation {
            name_field: Some(debug_annotation::NameField::NameIid(
                self.interned.annotation_name(name),
            )),
            value: Some(debug_annotation::Value::StringValue(text.to_string())),
        }
    }
}

/// Span and annotation names, sent once per sequence and referred to by number after:
/// they are most of a span's bytes otherwise (a collective's ~20 attribute keys).
#[derive(Default)]
struct Interned {
    event_names: HashMap<&'static str, u64>,
    annotation_names: HashMap<&'static str, u64>,
    /// Names made since the last packet: they go out with the next one.
    new: InternedData,
}

impl Interned {
    fn event_name(&mut self, name: &'static str) -> u64 {
        let next = self.event_names.len() as u64 + 1;
        *self.event_names.entry(name).or_insert_with(|| {
            self.new.event_names.push(EventName {
                iid: Some(next),
                name: Some(name.to_string()),
            });
            next
        })
    }

    fn annotation_name(&mut self, name: &'static str) -> u64 {
        let next = self.annotation_names.len() as u64 + 1;
        *self.annotation_names.entry(name).or_insert_with(|| {
            self.new.debug_annotation_names.push(DebugAnnotationName {
                iid: Some(next),
                name: Some(name.to_string()),
            });
            next
        })
    }

    fn take_new(&mut self) -> Option<InternedData> {
        let new = std::mem::take(&mut self.new);
        (!new.event_names.is_empty() || !new.debug_annotation_names.is_empty()).then_some(new)
    }
}
