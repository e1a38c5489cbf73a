//! A finished span as OpenTelemetry's `SpanData`: times on the wall clock, attributes
//! and events converted, the resource of lens-probe's own metrics.
use std::{
    borrow::Cow,
    time::{Duration, SystemTime},
};

use opentelemetry::{
    KeyValue, Value,
    trace::{SpanContext, SpanKind, Status, TraceFlags, TraceId, TraceState},
};
use opentelemetry_sdk::{
    Resource,
    trace::{SpanData, SpanEvents, SpanLinks},
};

use super::OtelPipeline;
use crate::export::resource;
use crate::spans::{AttrValue, SpanId, SpanRecord, SpanStatus};

impl OtelPipeline {
    pub(super) fn time(&self, monotonic_ns: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_nanos(self.clock.unix_ns(monotonic_ns))
    }

    pub(super) fn span_data(&self, span: SpanRecord, trace_id: TraceId) -> SpanData {
        let span_id = |id: SpanId| opentelemetry::trace::SpanId::from_bytes(id.0.to_be_bytes());
        let events = span
            .events
            .into_iter()
            .map(|event| {
                opentelemetry::trace::Event::new(
                    event.name,
                    self.time(event.at_ns),
                    attributes(event.attributes),
                    0,
                )
            })
            .collect();
        SpanData {
            span_context: SpanContext::new(
                trace_id,
                span_id(span.id),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: span
                .parent
                .map_or(opentelemetry::trace::SpanId::INVALID, span_id),
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: Cow::Borrowed(span.name),
            start_time: self.time(span.start_ns),
            end_time: self.time(span.end_ns),
            attributes: attributes(span.attributes),
            dropped_attributes_count: 0,
            events: span_events(events),
            links: SpanLinks::default(),
            status: match span.status {
                SpanStatus::Unset => Status::Unset,
                SpanStatus::Error(message) => Status::error(message),
            },
            instrumentation_scope: self.scope.clone(),
        }
    }
}

/// The resource of lens-probe's own health metrics.
pub(super) fn probe_resource(service_name: Option<&str>) -> Resource {
    let _ = service_name;
    Resource::builder_empty()
        .with_attributes([
            KeyValue::new(crate::semconv::SERVICE_NAME, "lens-probe"),
            KeyValue::new(crate::semconv::SERVICE_VERSION, env!("CARGO_PKG_VERSION")),
            KeyValue::new(crate::semconv::HOST_NAME, resource::own_host_name()),
        ])
        .build()
}

pub(super) fn span_events(events: Vec<opentelemetry::trace::Event>) -> SpanEvents {
    let mut span_events = SpanEvents::default();
    span_events.events = events;
    span_events
}

pub(super) fn attributes(attributes: Vec<(&'static str, AttrValue)>) -> Vec<KeyValue> {
    attributes
        .into_iter()
        .map(|(key, value)| KeyValue::new(key, otel_value(value)))
        .collect()
}

pub(super) fn otel_value(value: AttrValue) -> Value {
    match value {
        AttrValue::Bool(v) => Value::Bool(v),
        AttrValue::Int(v) => Value::I64(v),
        AttrValue::Str(v) => Value::String(v.into()),
    }
}
