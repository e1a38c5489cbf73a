//! Reads a timeline back as Perfetto's trace processor would: packets ordered by
//! timestamp, then by their place in the file; on each track a slice's end closes the
//! slice opened last. What a user would see (tracks, slices, flows, instants, counters)
//! and anything the trace processor would complain of, for the tests and for checking a
//! file by hand.
use std::collections::BTreeMap;

use prost::{
    Message,
    encoding::{WireType, decode_key, decode_varint},
};

use super::proto::{
    TracePacket, TrackEvent, debug_annotation, trace_packet, track_descriptor, track_event,
};

/// A track as described.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Track {
    pub name: String,
    pub parent: Option<u64>,
    pub description: Option<String>,
    pub counter: bool,
}

/// A balanced slice.
#[derive(Clone, Debug, PartialEq)]
pub struct Slice {
    pub track: u64,
    pub name: String,
    /// Wall-clock ns.
    pub start_ns: u64,
    pub end_ns: u64,
    /// Slices open on its track when it began.
    pub depth: usize,
    /// Annotations, their values as text.
    pub annotations: BTreeMap<String, String>,
    pub flow_ids: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Instant {
    pub track: u64,
    pub name: String,
    pub at_ns: u64,
    pub annotations: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CounterPoint {
    pub track: u64,
    pub at_ns: u64,
    pub value: i64,
}

/// A timeline as read back.
#[derive(Clone, Debug, Default)]
pub struct Replayed {
    pub tracks: BTreeMap<u64, Track>,
    pub slices: Vec<Slice>,
    pub instants: Vec<Instant>,
    pub counters: Vec<CounterPoint>,
    /// What the trace processor would find wrong: an end with nothing open, a slice
    /// still open at the end, an event on a track never described, two descriptions
    /// of one track that differ.
    pub problems: Vec<String>,
    /// The file ended inside a packet (a writer killed mid-write).
    pub truncated: bool,
    /// Packet sequences seen.
    pub sequences: Vec<u32>,
}

impl Replayed {
    /// The tracks named so.
    pub fn tracks_named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = u64> + 'a {
        self.tracks
            .iter()
            .filter(move |(_, t)| t.name == name)
            .map(|(uuid, _)| *uuid)
    }

    /// The top-level track `uuid` is under (itself when it has no parent).
    pub fn root_of(&self, mut uuid: u64) -> u64 {
        while let Some(parent) = self.tracks.get(&uuid).and_then(|t| t.parent) {
            uuid = parent;
        }
        uuid
    }
}

/// Reads `bytes`, a trace (one file, or several concatenated).
pub fn replay(bytes: &[u8]) -> Replayed {
    let mut out = Replayed::default();
    let mut events = read_packets(bytes, &mut out);
    events.sort_by_key(|event| (event.at, event.index));
    draw(events, &mut out);
    out
}

/// The packets of `bytes` in file order: tracks described into `out`, track events with
/// their interned names resolved (interning follows file order, not time).
fn read_packets(bytes: &[u8], out: &mut Replayed) -> Vec<Event> {
    let mut events: Vec<Event> = Vec::new();
    let mut interned: BTreeMap<u32, Names> = BTreeMap::new();
    let mut rest = bytes;
    let mut index = 0;
    while !rest.is_empty() {
        let Some(packet) = next_packet(&mut rest) else {
            out.truncated = true;
            break;
        };
        index += 1;
        let sequence = match packet.optional_trusted_packet_sequence_id {
            Some(trace_packet::OptionalTrustedPacketSequenceId::TrustedPacketSequenceId(id)) => id,
            None => 0,
        };
        if !out.sequences.contains(&sequence) {
            out.sequences.push(sequence);
        }
        // Interned names are per sequence, in file order, until the sequence clears them.
        let names = interned.entry(sequence).or_default();
        if packet.sequence_flags.unwrap_or(0)
            & trace_packet::SequenceFlags::SeqIncrementalStateCleared as u32
            != 0
        {
            *names = Names::default();
        }
        if let Some(data) = &packet.interned_data {
            for name in &data.event_names {
                names.events.insert(name.iid(), name.name().to_string());
            }
            for name in &data.debug_annotation_names {
                names
                    .annotations
                    .insert(name.iid(), name.name().to_string());
            }
        }
        match &packet.data {
            Some(trace_packet::Data::TrackDescriptor(track)) => {
                let uuid = track.uuid.unwrap_or_default();
                let described = Track {
                    name: match &track.static_or_dynamic_name {
                        Some(track_descriptor::StaticOrDynamicName::Name(name)) => name.clone(),
                        None => String::new(),
                    },
                    parent: track.parent_uuid,
                    description: track.description.clone(),
                    counter: track.counter.is_some(),
                };
                if let Some(earlier) = out.tracks.insert(uuid, described.clone())
                    && earlier != described
                {
                    out.problems.push(format!(
                        "track {uuid:x} described twice: {earlier:?}, {described:?}"
                    ));
                }
            }
            Some(trace_packet::Data::TrackEvent(event)) => {
                let at = packet.timestamp.unwrap_or_default();
                let (name, annotations) = names.resolve(event, &mut out.problems, at);
                events.push(Event {
                    at,
                    index,
                    track: event.track_uuid.unwrap_or_default(),
                    kind: event.r#type(),
                    name,
                    annotations,
                    flow_ids: event.flow_ids.clone(),
                    counter: match event.counter_value_field {
                        Some(track_event::CounterValueField::CounterValue(v)) => v,
                        Some(track_event::CounterValueField::DoubleCounterValue(v)) => v as i64,
                        None => 0,
                    },
                });
            }
            None => {}
        }
    }
    events
}

/// The events in trace-processor order onto their tracks: slices opened and closed as a
/// stack per track, instants and counter points.
fn draw(events: Vec<Event>, out: &mut Replayed) {
    let mut open: BTreeMap<u64, Vec<Slice>> = BTreeMap::new();
    for event in events {
        let Event {
            at,
            track,
            kind,
            name,
            annotations,
            flow_ids,
            counter,
            ..
        } = event;
        if !out.tracks.contains_key(&track) {
            out.problems
                .push(format!("event at {at} on track {track:x}, never described"));
        }
        match kind {
            track_event::Type::SliceBegin => {
                let stack = open.entry(track).or_default();
                stack.push(Slice {
                    track,
                    name,
                    start_ns: at,
                    end_ns: at,
                    depth: stack.len(),
                    annotations,
                    flow_ids,
                });
            }
            track_event::Type::SliceEnd => match open.entry(track).or_default().pop() {
                Some(mut slice) => {
                    slice.end_ns = at;
                    out.slices.push(slice);
                }
                None => out.problems.push(format!(
                    "slice end at {at} on track {track:x} with none open"
                )),
            },
            track_event::Type::Instant => out.instants.push(Instant {
                track,
                name,
                at_ns: at,
                annotations,
            }),
            track_event::Type::Counter => out.counters.push(CounterPoint {
                track,
                at_ns: at,
                value: counter,
            }),
            track_event::Type::Unspecified => {}
        }
    }
    for (track, stack) in open {
        for slice in stack {
            out.problems.push(format!(
                "slice {} on track {track:x} begun at {} never ends",
                slice.name, slice.start_ns
            ));
        }
    }
}

/// A track event with its names resolved.
struct Event {
    at: u64,
    /// Its packet's place in the file.
    index: usize,
    track: u64,
    kind: track_event::Type,
    name: String,
    annotations: BTreeMap<String, String>,
    flow_ids: Vec<u64>,
    counter: i64,
}

/// One sequence's interned names.
#[derive(Default)]
struct Names {
    events: BTreeMap<u64, String>,
    annotations: BTreeMap<u64, String>,
}

impl Names {
    /// `event`'s name and annotations, names looked up where interned.
    fn resolve(
        &self,
        event: &TrackEvent,
        problems: &mut Vec<String>,
        at: u64,
    ) -> (String, BTreeMap<String, String>) {
        let mut lookup = |table: &BTreeMap<u64, String>, iid: u64, what: &str| {
            table.get(&iid).cloned().unwrap_or_else(|| {
                problems.push(format!("{what} iid {iid} at {at} was never interned"));
                String::new()
            })
        };
        let name = match &event.name_field {
            Some(track_event::NameField::Name(name)) => name.clone(),
            Some(track_event::NameField::NameIid(iid)) => lookup(&self.events, *iid, "event name"),
            None => String::new(),
        };
        let annotations = event
            .debug_annotations
            .iter()
            .map(|a| {
                let key = match &a.name_field {
                    Some(debug_annotation::NameField::Name(name)) => name.clone(),
                    Some(debug_annotation::NameField::NameIid(iid)) => {
                        lookup(&self.annotations, *iid, "annotation name")
                    }
                    None => String::new(),
                };
                let value = match &a.value {
                    Some(debug_annotation::Value::BoolValue(v)) => v.to_string(),
                    Some(debug_annotation::Value::UintValue(v)) => v.to_string(),
                    Some(debug_annotation::Value::IntValue(v)) => v.to_string(),
                    Some(debug_annotation::Value::DoubleValue(v)) => v.to_string(),
                    Some(debug_annotation::Value::StringValue(v)) => v.clone(),
                    None => String::new(),
                };
                (key, value)
            })
            .collect();
        (name, annotations)
    }
}

/// The next `Trace.packet` (field 1) of `rest`; `None` when the bytes end inside one.
fn next_packet(rest: &mut &[u8]) -> Option<TracePacket> {
    let (field, wire_type) = decode_key(rest).ok()?;
    if field != 1 || wire_type != WireType::LengthDelimited {
        return None;
    }
    let length = usize::try_from(decode_varint(rest).ok()?).ok()?;
    if rest.len() < length {
        return None;
    }
    let (packet, after) = rest.split_at(length);
    *rest = after;
    TracePacket::decode(packet).ok()
}
