//! The OpenTelemetry pipeline: finished spans become OTLP `SpanData` (with the resource
//! of the process they came from and the trace id of its run) and go through a bounded
//! queue to one export thread, which batches them per process and sends them with
//! opentelemetry-otlp (gRPC or HTTP, configured by the standard `OTEL_EXPORTER_OTLP_*`
//! variables) or writes them as OTLP JSON lines to a file.
//!
//! The probe never waits for the backend: when the queue is full a span is dropped and
//! counted, and a failed export counts its spans; both are reported at exit. A slow
//! backend is not a lost one: up to [`IN_FLIGHT`] exports run at once, each retried
//! with backoff by opentelemetry-otlp when the answer says to (gRPC `UNAVAILABLE` or
//! `RESOURCE_EXHAUSTED`, HTTP 429/502/503/504, `Retry-After` honoured) within its timeout.
use std::{
    borrow::Cow,
    collections::HashMap,
    fs::File,
    io::{BufWriter, Write},
    path::PathBuf,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc::{self, Receiver, Sender, TryRecvError},
    },
    thread::JoinHandle,
    time::{Duration, Instant, SystemTime},
};

use log::warn;
use opentelemetry::{
    InstrumentationScope, KeyValue, Value,
    trace::{SpanContext, SpanKind, Status, TraceFlags, TraceId, TraceState},
};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::{
    Resource,
    trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks},
};

use super::{
    metrics::{self, ProbeMetrics, ProcessMetrics, SharedReader},
    resource,
    spool::Spool,
};
use crate::{
    error::{LensError, Result},
    spans::{AttrValue, SpanExporter, SpanId, SpanRecord, SpanStatus, monotonic_now_ns},
    target::ProcessInfo,
};

/// Spans waiting for the export thread; beyond this they are dropped (and counted).
const QUEUE_SPANS: usize = 16_384;
/// Spans per export call.
const BATCH_SPANS: usize = 512;
/// A process's spans wait at most this long before they are sent.
const BATCH_DELAY: Duration = Duration::from_secs(1);
/// How long the export thread sleeps when nobody wakes it.
const IDLE_WAKE: Duration = Duration::from_millis(250);
/// The longest one export call may take, its retries included.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Span exports running at once against an OTLP endpoint: a collector that takes 3 s
/// to answer still takes 8 batches (4096 spans) every 3 s, more than a training job
/// makes; beyond this the queue fills and spans are dropped, counted.
const IN_FLIGHT: usize = 8;
/// How long everything still to send may take once lens-probe is finishing; what is
/// left after that is counted as lost.
const FLUSH_BUDGET: Duration = Duration::from_secs(10);

/// Where spans go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    /// An OTLP endpoint, with the protocol `OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL` names.
    Otlp(Protocol),
    /// OTLP JSON, one `ExportTraceServiceRequest` per line.
    File(PathBuf),
}

impl Destination {
    /// OTLP with the protocol from the standard variables of lens-probe's environment
    /// (`grpc` when unset, as the OpenTelemetry SDKs default).
    pub fn otlp_from_env() -> Result<Destination> {
        super::config::otlp_protocol(&|key| std::env::var(key).ok()).map(Destination::Otlp)
    }
}

/// What happened to the spans handed to the pipeline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExportStats {
    /// Accepted by the backend (or written to the file), spooled ones sent again included.
    pub exported: u64,
    /// Dropped because the queue was full (the backend could not keep up).
    pub dropped_queue_full: u64,
    /// In an export that failed (backend unreachable, rejected, timed out) and could
    /// not be spooled.
    pub failed: u64,
    /// Written to the spool when their export failed (`--spool-dir`).
    pub spooled: u64,
    /// Sent from the spool, this run's or an earlier one's.
    pub replayed: u64,
    /// Pushed out of a full spool, or unreadable there: lost.
    pub spool_dropped: u64,
    /// Still in the spool at exit, for the next lens-probe that uses it.
    pub left_in_spool: u64,
}

impl ExportStats {
    pub fn lost(&self) -> u64 {
        self.dropped_queue_full + self.failed + self.spool_dropped
    }
}

#[derive(Debug, Default)]
struct Counters {
    exported: AtomicU64,
    dropped_queue_full: AtomicU64,
    failed: AtomicU64,
    spooled: AtomicU64,
    replayed: AtomicU64,
    spool_dropped: AtomicU64,
    /// The first failed span export was said (once per run).
    failure_warned: std::sync::atomic::AtomicBool,
    /// Spans sent to the export thread and not yet taken by it (the queue's bound).
    queued: AtomicUsize,
    /// Set when lens-probe finishes: the flush must be done by then.
    flush_deadline: OnceLock<Instant>,
}

impl Counters {
    /// Counts what became of a batch of `spans`; the first failure is said once.
    fn record_export(&self, spans: u64, result: std::result::Result<(), String>) {
        match result {
            Ok(()) => {
                self.exported.fetch_add(spans, Ordering::Relaxed);
            }
            Err(error) => {
                self.failed.fetch_add(spans, Ordering::Relaxed);
                if !self.failure_warned.swap(true, Ordering::Relaxed) {
                    warn!(
                        "span export failed ({}); spans are counted as lost",
                        crate::target::redact_url_userinfo(&error)
                    );
                }
            }
        }
    }

    /// How long the next export may take: [`EXPORT_TIMEOUT`], less once finishing.
    fn export_timeout(&self) -> Duration {
        self.flush_deadline
            .get()
            .map_or(EXPORT_TIMEOUT, |deadline| {
                deadline
                    .saturating_duration_since(Instant::now())
                    .min(EXPORT_TIMEOUT)
            })
    }
}

enum Message {
    Span(u32, Arc<Resource>, Box<SpanData>),
    /// Collect this reader every metric interval.
    MetricsStarted(u32, SharedReader),
    /// Send the process's spans and a last collection of its metrics.
    ProcessEnded(u32, Option<Box<ProcessMetrics>>),
    /// lens-probe's own metrics, collected and sent once, at the end.
    ProbeMetrics(Box<ProbeMetrics>),
}

/// Per traced process: what its spans are sent with.
struct ProcessExport {
    resource: Arc<Resource>,
    trace_id: TraceId,
    metrics: Box<ProcessMetrics>,
}

/// The pipeline, as the span builder's [`SpanExporter`].
pub struct OtelPipeline {
    /// Unbounded as a channel; spans are bounded by `Counters::queued`, so that process
    /// ends and metrics always get through and the probe never blocks.
    queue: Option<Sender<Message>>,
    worker: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
    /// Where failed span batches wait (`--spool-dir`, OTLP only).
    spool: Option<Arc<Spool>>,
    processes: HashMap<u32, ProcessExport>,
    /// `CLOCK_REALTIME - CLOCK_MONOTONIC`: kernel timestamps to wall-clock time.
    realtime_offset_ns: i128,
    /// The run id of processes whose environment names none: one per lens-probe run, so
    /// everything it traces shares a trace.
    fallback_run_id: String,
    service_name: Option<String>,
    scope: InstrumentationScope,
}

impl OtelPipeline {
    /// Starts the export thread; fails (before anything is traced) if the exporter
    /// cannot be built, e.g. a malformed endpoint.
    /// `spool`: where batches an OTLP endpoint could not take wait (ignored for a file).
    pub fn start(
        destination: Destination,
        service_name: Option<String>,
        spool: Option<Spool>,
    ) -> Result<OtelPipeline> {
        let (queue, receiver) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let worker_counters = Arc::clone(&counters);
        let spool = spool
            .filter(|_| matches!(destination, Destination::Otlp(_)))
            .map(Arc::new);
        let worker_spool = spool.clone();
        let worker = std::thread::Builder::new()
            .name("lens-export".into())
            .spawn(move || {
                export_thread(
                    destination,
                    worker_spool,
                    receiver,
                    worker_counters,
                    ready_tx,
                )
            })?;
        ready_rx
            .recv()
            .unwrap_or_else(|_| Err(LensError::Export("export thread failed to start".into())))?;
        let realtime_ns = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i128)
            .unwrap_or_default();
        Ok(OtelPipeline {
            queue: Some(queue),
            worker: Some(worker),
            counters,
            spool,
            processes: HashMap::new(),
            realtime_offset_ns: realtime_ns - monotonic_now_ns() as i128,
            fallback_run_id: resource::random_run_id(),
            service_name,
            scope: InstrumentationScope::builder("lens-probe")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
        })
    }

    /// Sends what is queued and lens-probe's own loss counters (`events_lost`: kernel
    /// events by cause), waits for the export thread (at most ~10 s), and says what
    /// happened to the spans.
    pub fn finish(&mut self, events_lost: &[(&'static str, u64)]) -> ExportStats {
        let _ = self
            .counters
            .flush_deadline
            .set(Instant::now() + FLUSH_BUDGET);
        if let Some(queue) = self.queue.take() {
            let probe = ProbeMetrics::new(probe_resource(self.service_name.as_deref()));
            for (cause, count) in events_lost {
                probe.record_events_lost(cause, *count);
            }
            probe.record_spans_lost(
                "queue_full",
                self.counters.dropped_queue_full.load(Ordering::Relaxed),
            );
            for (pid, process) in self.processes.drain() {
                let _ = queue.send(Message::ProcessEnded(pid, Some(process.metrics)));
            }
            let _ = queue.send(Message::ProbeMetrics(Box::new(probe)));
        }
        if let Some(worker) = self.worker.take() {
            // The queue is closed: the thread sends what is left and ends.
            worker.thread().unpark();
            let _ = worker.join();
        }
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        ExportStats {
            exported: load(&self.counters.exported),
            dropped_queue_full: load(&self.counters.dropped_queue_full),
            failed: load(&self.counters.failed),
            spooled: load(&self.counters.spooled),
            replayed: load(&self.counters.replayed),
            spool_dropped: load(&self.counters.spool_dropped),
            left_in_spool: self.spool.as_ref().map_or(0, |spool| spool.spans()),
        }
    }

    /// The export thread sleeps between batches rather than waking for every span
    /// queued (a futex wake and a context switch per span was a quarter of lens-probe's
    /// CPU on a fast PyTorch loop): senders wake it for a full batch or a control message.
    fn wake_export_thread(&self) {
        if let Some(worker) = &self.worker {
            worker.thread().unpark();
        }
    }

    fn time(&self, monotonic_ns: u64) -> SystemTime {
        let ns = (monotonic_ns as i128 + self.realtime_offset_ns).max(0) as u64;
        SystemTime::UNIX_EPOCH + Duration::from_nanos(ns)
    }

    fn span_data(&self, span: SpanRecord, trace_id: TraceId) -> SpanData {
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
fn probe_resource(service_name: Option<&str>) -> Resource {
    let _ = service_name;
    Resource::builder_empty()
        .with_attributes([
            KeyValue::new(crate::semconv::SERVICE_NAME, "lens-probe"),
            KeyValue::new(crate::semconv::SERVICE_VERSION, env!("CARGO_PKG_VERSION")),
            KeyValue::new(crate::semconv::HOST_NAME, resource::own_host_name()),
        ])
        .build()
}

fn span_events(events: Vec<opentelemetry::trace::Event>) -> SpanEvents {
    let mut span_events = SpanEvents::default();
    span_events.events = events;
    span_events
}

fn attributes(attributes: Vec<(&'static str, AttrValue)>) -> Vec<KeyValue> {
    attributes
        .into_iter()
        .map(|(key, value)| KeyValue::new(key, otel_value(value)))
        .collect()
}

fn otel_value(value: AttrValue) -> Value {
    match value {
        AttrValue::Bool(v) => Value::Bool(v),
        AttrValue::Int(v) => Value::I64(v),
        AttrValue::Str(v) => Value::String(v.into()),
    }
}

impl SpanExporter for OtelPipeline {
    fn process_started(&mut self, info: &ProcessInfo, _job: Option<SpanId>, _start_ns: u64) {
        let detected =
            resource::detect_pid(info, &self.fallback_run_id, self.service_name.as_deref());
        let resource = Resource::builder_empty()
            .with_attributes(
                detected
                    .attributes
                    .into_iter()
                    .map(|(key, value)| KeyValue::new(key, otel_value(value))),
            )
            .with_attributes(
                detected
                    .user_attributes
                    .into_iter()
                    .map(|(key, value)| KeyValue::new(key, value)),
            )
            .build();
        let metrics = Box::new(ProcessMetrics::new(resource.clone()));
        if let Some(queue) = &self.queue {
            let _ = queue.send(Message::MetricsStarted(info.pid, metrics.reader.clone()));
            self.wake_export_thread();
        }
        self.processes.insert(
            info.pid,
            ProcessExport {
                resource: Arc::new(resource),
                trace_id: TraceId::from_bytes(resource::trace_id_for_run(&detected.run_id)),
                metrics,
            },
        );
    }

    fn export(&mut self, span: SpanRecord) {
        let Some(process) = self.processes.get_mut(&span.pid) else {
            return;
        };
        process.metrics.record_span(&span);
        let (pid, resource, trace_id) = (span.pid, Arc::clone(&process.resource), process.trace_id);
        let data = self.span_data(span, trace_id);
        let Some(queue) = &self.queue else {
            return;
        };
        // The bound: spans waiting for the export thread.
        if self.counters.queued.load(Ordering::Relaxed) >= QUEUE_SPANS {
            self.counters
                .dropped_queue_full
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        let queued = self.counters.queued.fetch_add(1, Ordering::Relaxed) + 1;
        if queue
            .send(Message::Span(pid, resource, Box::new(data)))
            .is_err()
        {
            self.counters
                .dropped_queue_full
                .fetch_add(1, Ordering::Relaxed);
        }
        // A batch's worth waiting: send it now (else the thread wakes on its own timer).
        if queued >= BATCH_SPANS {
            self.wake_export_thread();
        }
    }

    fn process_calls(
        &mut self,
        pid: u32,
        calls: &std::collections::BTreeMap<lens_common::ProbeId, u64>,
    ) {
        if let Some(process) = self.processes.get_mut(&pid) {
            process.metrics.record_calls(calls);
        }
    }

    fn launches_sampled(&mut self, pid: u32) {
        if let Some(process) = self.processes.get_mut(&pid) {
            process.metrics.launches_sampled = true;
        }
    }

    fn process_ended(&mut self, pid: u32) {
        let metrics = self.processes.remove(&pid).map(|p| p.metrics);
        if let Some(queue) = &self.queue {
            let _ = queue.send(Message::ProcessEnded(pid, metrics));
        }
        self.wake_export_thread();
    }
}

impl Drop for OtelPipeline {
    fn drop(&mut self) {
        self.finish(&[]);
    }
}

/// Keeps a batch whose export failed (`error`) in `spool`, counted; the first time,
/// says where spans now wait.
fn spool_batch(
    spool: &Spool,
    resource: &Resource,
    batch: &[SpanData],
    error: &str,
    counters: &Counters,
) -> std::result::Result<(), String> {
    let evicted = spool.keep(resource, batch)?;
    counters
        .spooled
        .fetch_add(batch.len() as u64, Ordering::Relaxed);
    if evicted > 0 {
        counters.spool_dropped.fetch_add(evicted, Ordering::Relaxed);
        warn!(
            "the spool {} is full: its oldest {evicted} spans were dropped",
            spool.dir().display()
        );
    }
    if !counters.failure_warned.swap(true, Ordering::Relaxed) {
        warn!(
            "span export failed ({}); spans wait in the spool {} and are sent when the \
             collector answers",
            crate::target::redact_url_userinfo(error),
            spool.dir().display()
        );
    }
    Ok(())
}

/// The backend, as the export thread drives it.
enum Sink {
    Otlp {
        spans: SpanExporters,
        metrics: Box<opentelemetry_otlp::MetricExporter>,
    },
    File(BufWriter<File>),
}

/// [`IN_FLIGHT`] OTLP span exporters, one per export running: each takes the resource
/// of the process whose batch it sends, so they are not shared between exports.
struct SpanExporters {
    idle: Arc<std::sync::Mutex<Vec<opentelemetry_otlp::SpanExporter>>>,
    /// One permit per idle exporter.
    permits: Arc<tokio::sync::Semaphore>,
    spool: Option<Arc<Spool>>,
    /// A task is sending the spool's batches (one at a time, oldest first).
    replaying: Arc<std::sync::atomic::AtomicBool>,
    /// When the spool's last batch failed again: the next try waits [`REPLAY_AFTER`].
    replay_failed_at: Arc<std::sync::Mutex<Option<Instant>>>,
}

/// How long sending from the spool waits after the collector refused one of its batches.
const REPLAY_AFTER: Duration = Duration::from_secs(2);

/// Exports `batch` with one of the pool's exporters, within the export timeout.
async fn export_batch(
    exporter: &mut opentelemetry_otlp::SpanExporter,
    resource: &Resource,
    batch: Vec<SpanData>,
    counters: &Counters,
) -> std::result::Result<(), String> {
    exporter.set_resource(resource);
    let timeout = counters.export_timeout();
    if timeout.is_zero() {
        return Err("no time left to send at exit".to_string());
    }
    match tokio::time::timeout(timeout, exporter.export(batch)).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err("timed out".to_string()),
    }
}

impl SpanExporters {
    fn build(
        build: impl Fn() -> std::result::Result<
            opentelemetry_otlp::SpanExporter,
            opentelemetry_otlp::ExporterBuildError,
        >,
        spool: Option<Arc<Spool>>,
    ) -> std::result::Result<SpanExporters, opentelemetry_otlp::ExporterBuildError> {
        let exporters = (0..IN_FLIGHT)
            .map(|_| build())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(SpanExporters {
            idle: Arc::new(std::sync::Mutex::new(exporters)),
            permits: Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT)),
            spool,
            replaying: Arc::default(),
            replay_failed_at: Arc::default(),
        })
    }

    /// Takes an idle exporter and its permit, waiting only while [`IN_FLIGHT`] exports
    /// already run (`wait` false: not at all).
    fn take(
        &self,
        runtime: &tokio::runtime::Runtime,
        wait: bool,
    ) -> Option<(
        opentelemetry_otlp::SpanExporter,
        tokio::sync::OwnedSemaphorePermit,
    )> {
        let permits = Arc::clone(&self.permits);
        let permit = if wait {
            runtime.block_on(permits.acquire_owned()).ok()?
        } else {
            permits.try_acquire_owned().ok()?
        };
        let exporter = self.idle.lock().ok()?.pop()?;
        Some((exporter, permit))
    }

    /// Starts exporting `batch` on `runtime`, waiting only while [`IN_FLIGHT`] exports
    /// already run; `counters` learn the outcome when it ends. A batch that fails is
    /// spooled, if there is a spool.
    fn spawn(
        &self,
        runtime: &tokio::runtime::Runtime,
        resource: &Arc<Resource>,
        batch: Vec<SpanData>,
        counters: &Arc<Counters>,
    ) {
        let Some((mut exporter, permit)) = self.take(runtime, true) else {
            return;
        };
        let (idle, counters) = (Arc::clone(&self.idle), Arc::clone(counters));
        let (resource, spool) = (Arc::clone(resource), self.spool.clone());
        runtime.spawn(async move {
            let spans = batch.len() as u64;
            // Kept for the spool in case the export fails.
            let copy = spool.as_ref().map(|_| batch.clone());
            let result = match export_batch(&mut exporter, &resource, batch, &counters).await {
                Err(error) if let (Some(spool), Some(copy)) = (&spool, copy) => {
                    spool_batch(spool, &resource, &copy, &error, &counters)
                        .map(|()| None)
                        .map_err(|why| format!("{error}; not spooled: {why}"))
                }
                result => result.map(|()| Some(spans)),
            };
            match result {
                Ok(Some(exported)) => counters.record_export(exported, Ok(())),
                // Spooled: not exported yet, not lost.
                Ok(None) => {}
                Err(error) => counters.record_export(spans, Err(error)),
            }
            if let Ok(mut idle) = idle.lock() {
                idle.push(exporter);
            }
            drop(permit);
        });
    }

    /// Sends the spool's batches, oldest first, one at a time on a task of its own, if
    /// none is running, an exporter is free, and the collector did not refuse the last
    /// one less than [`REPLAY_AFTER`] ago. The task goes on until the spool is empty or
    /// a batch fails (it stays, for the next try).
    fn replay(&self, runtime: &tokio::runtime::Runtime, counters: &Arc<Counters>) {
        let Some(spool) = self.spool.clone() else {
            return;
        };
        let recently_failed = self
            .replay_failed_at
            .lock()
            .ok()
            .and_then(|at| *at)
            .is_some_and(|at| at.elapsed() < REPLAY_AFTER);
        if recently_failed || spool.spans() == 0 || counters.flush_deadline.get().is_some() {
            return;
        }
        if self.replaying.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some((mut exporter, permit)) = self.take(runtime, false) else {
            self.replaying.store(false, Ordering::Release);
            return;
        };
        let (idle, counters) = (Arc::clone(&self.idle), Arc::clone(counters));
        let replaying = Arc::clone(&self.replaying);
        let failed_at = Arc::clone(&self.replay_failed_at);
        runtime.spawn(async move {
            while let Some(next) = spool.oldest() {
                let batch = match next {
                    Ok(batch) => batch,
                    Err((spans, error)) => {
                        counters.spool_dropped.fetch_add(spans, Ordering::Relaxed);
                        warn!("a spooled batch could not be read ({error}): its {spans} spans are lost");
                        continue;
                    }
                };
                let spans = batch.spans.len() as u64;
                let sent =
                    export_batch(&mut exporter, &batch.resource, batch.spans, &counters).await;
                if sent.is_err() {
                    if let Ok(mut at) = failed_at.lock() {
                        *at = Some(Instant::now());
                    }
                    break;
                }
                spool.sent(batch.sequence);
                counters.exported.fetch_add(spans, Ordering::Relaxed);
                counters.replayed.fetch_add(spans, Ordering::Relaxed);
            }
            if let Ok(mut idle) = idle.lock() {
                idle.push(exporter);
            }
            drop(permit);
            replaying.store(false, Ordering::Release);
        });
    }

    /// Waits until every export started has ended (each is bounded by its timeout,
    /// which the flush deadline shortens), then shuts the exporters down.
    fn finish(&self, runtime: &tokio::runtime::Runtime, timeout: Duration) {
        let _ = runtime.block_on(self.permits.acquire_many(IN_FLIGHT as u32));
        if let Ok(mut idle) = self.idle.lock() {
            for exporter in idle.iter_mut() {
                let _ = exporter.shutdown_with_timeout(timeout);
            }
        }
    }
}

impl Sink {
    fn build(destination: &Destination, spool: Option<Arc<Spool>>) -> Result<Sink> {
        let build_error =
            |e: opentelemetry_otlp::ExporterBuildError| LensError::Export(e.to_string());
        Ok(match destination {
            Destination::Otlp(Protocol::Grpc) => Sink::Otlp {
                spans: SpanExporters::build(
                    || {
                        opentelemetry_otlp::SpanExporter::builder()
                            .with_tonic()
                            .build()
                    },
                    spool,
                )
                .map_err(build_error)?,
                metrics: Box::new(
                    opentelemetry_otlp::MetricExporter::builder()
                        .with_tonic()
                        .build()
                        .map_err(build_error)?,
                ),
            },
            Destination::Otlp(protocol) => Sink::Otlp {
                spans: SpanExporters::build(
                    || {
                        opentelemetry_otlp::SpanExporter::builder()
                            .with_http()
                            .with_protocol(*protocol)
                            .build()
                    },
                    spool,
                )
                .map_err(build_error)?,
                metrics: Box::new(
                    opentelemetry_otlp::MetricExporter::builder()
                        .with_http()
                        .with_protocol(*protocol)
                        .build()
                        .map_err(build_error)?,
                ),
            },
            Destination::File(path) => Sink::File(BufWriter::new(
                crate::output::OutputFile::create("--export-file", path)?.into_file(),
            )),
        })
    }

    /// Sends `batch` (to an endpoint: starts sending it) and counts the outcome.
    fn export(
        &mut self,
        runtime: &tokio::runtime::Runtime,
        resource: &Arc<Resource>,
        batch: Vec<SpanData>,
        counters: &Arc<Counters>,
    ) {
        match self {
            Sink::Otlp { spans, .. } => spans.spawn(runtime, resource, batch, counters),
            Sink::File(out) => {
                let spans = batch.len() as u64;
                let result = if counters.export_timeout().is_zero() {
                    Err("no time left to send at exit".to_string())
                } else {
                    Self::write_spans(out, resource, batch)
                };
                counters.record_export(spans, result);
            }
        }
    }

    fn write_spans(
        out: &mut BufWriter<File>,
        resource: &Resource,
        batch: Vec<SpanData>,
    ) -> std::result::Result<(), String> {
        use opentelemetry_proto::{
            tonic::collector::trace::v1::ExportTraceServiceRequest,
            transform::{
                common::tonic::ResourceAttributesWithSchema,
                trace::tonic::group_spans_by_resource_and_scope,
            },
        };
        let request = ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(
                batch,
                &ResourceAttributesWithSchema::from(resource),
            ),
        };
        write_json_line(out, &request)
    }

    fn export_metrics(
        &mut self,
        runtime: &tokio::runtime::Runtime,
        metrics: &opentelemetry_sdk::metrics::data::ResourceMetrics,
        timeout: Duration,
    ) -> std::result::Result<(), String> {
        use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
        match self {
            Sink::Otlp {
                metrics: exporter, ..
            } => runtime
                .block_on(async { tokio::time::timeout(timeout, exporter.export(metrics)).await })
                .map_err(|_| "timed out".to_string())?
                .map_err(|e| e.to_string()),
            Sink::File(out) => {
                use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
                write_json_line(out, &ExportMetricsServiceRequest::from(metrics))
            }
        }
    }
}

fn write_json_line(
    out: &mut BufWriter<File>,
    request: &impl serde::Serialize,
) -> std::result::Result<(), String> {
    let line = serde_json::to_string(request).map_err(|e| e.to_string())?;
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| e.to_string())
}

/// The export thread: owns the backend and a tokio runtime to drive it.
fn export_thread(
    destination: Destination,
    spool: Option<Arc<Spool>>,
    queue: Receiver<Message>,
    counters: Arc<Counters>,
    ready: mpsc::Sender<Result<()>>,
) {
    // One worker thread: the exports it runs go on while this thread waits for spans.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("lens-export-io")
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            let _ = ready.send(Err(error.into()));
            return;
        }
    };
    // Built inside the runtime: the gRPC channel spawns its connection task there.
    let sink = {
        let _guard = runtime.enter();
        Sink::build(&destination, spool)
    };
    let mut sink = match sink {
        Ok(sink) => {
            let _ = ready.send(Ok(()));
            sink
        }
        Err(error) => {
            let _ = ready.send(Err(error));
            return;
        }
    };
    let mut batches: HashMap<u32, (Arc<Resource>, Vec<SpanData>, Instant)> = HashMap::new();
    let mut readers: HashMap<u32, SharedReader> = HashMap::new();
    let metric_interval = metrics::export_interval();
    let mut last_metrics = Instant::now();
    let mut metrics_warned = false;
    let mut send_metrics = |reader: &SharedReader, sink: &mut Sink| {
        let Some(collected) = reader.collect() else {
            return;
        };
        let timeout = counters.export_timeout();
        if timeout.is_zero() {
            return;
        }
        if let Err(error) = sink.export_metrics(&runtime, &collected, timeout)
            && !metrics_warned
        {
            warn!(
                "metric export failed ({})",
                crate::target::redact_url_userinfo(&error.to_string())
            );
            metrics_warned = true;
        }
    };
    let send = |batch: Vec<SpanData>, resource: &Arc<Resource>, sink: &mut Sink| {
        sink.export(&runtime, resource, batch, &counters);
    };
    loop {
        let message = match queue.try_recv() {
            Ok(message) => Ok(message),
            Err(TryRecvError::Empty) => {
                // Woken for a full batch, a control message or the end (see
                // `OtelPipeline::wake_export_thread`), else on this timer.
                std::thread::park_timeout(IDLE_WAKE);
                Err(TryRecvError::Empty)
            }
            Err(TryRecvError::Disconnected) => Err(TryRecvError::Disconnected),
        };
        match message {
            Ok(Message::Span(pid, resource, data)) => {
                counters.queued.fetch_sub(1, Ordering::Relaxed);
                let entry = batches
                    .entry(pid)
                    .or_insert_with(|| (resource, Vec::new(), Instant::now()));
                entry.1.push(*data);
                if entry.1.len() >= BATCH_SPANS {
                    let (resource, batch, _) = batches.remove(&pid).expect("just inserted");
                    send(batch, &resource, &mut sink);
                }
            }
            Ok(Message::MetricsStarted(pid, reader)) => {
                readers.insert(pid, reader);
            }
            Ok(Message::ProcessEnded(pid, metrics)) => {
                if let Some((resource, batch, _)) = batches.remove(&pid) {
                    send(batch, &resource, &mut sink);
                }
                readers.remove(&pid);
                if let Some(metrics) = metrics {
                    send_metrics(&metrics.reader, &mut sink);
                }
            }
            Ok(Message::ProbeMetrics(probe)) => send_metrics(&probe.reader, &mut sink),
            // Nothing queued: a moment to send what the spool holds.
            Err(TryRecvError::Empty) => {
                if let Sink::Otlp { spans, .. } = &sink {
                    spans.replay(&runtime, &counters);
                }
            }
            Err(TryRecvError::Disconnected) => {
                for (_, (resource, batch, _)) in batches.drain() {
                    send(batch, &resource, &mut sink);
                }
                if let Sink::Otlp { spans, .. } = &sink {
                    spans.finish(&runtime, counters.export_timeout());
                }
                return;
            }
        }
        if last_metrics.elapsed() >= metric_interval {
            last_metrics = Instant::now();
            for reader in readers.values() {
                send_metrics(reader, &mut sink);
            }
        }
        let due: Vec<u32> = batches
            .iter()
            .filter(|(_, (_, _, since))| since.elapsed() >= BATCH_DELAY)
            .map(|(pid, _)| *pid)
            .collect();
        for pid in due {
            if let Some((resource, batch, _)) = batches.remove(&pid) {
                send(batch, &resource, &mut sink);
            }
        }
    }
}
