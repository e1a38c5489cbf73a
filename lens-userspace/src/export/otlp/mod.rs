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
    collections::HashMap,
    path::PathBuf,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc::{self, Sender},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use log::warn;
use opentelemetry::{InstrumentationScope, KeyValue, trace::TraceId};
use opentelemetry_otlp::Protocol;
use opentelemetry_sdk::{Resource, trace::SpanData};

use super::{
    metrics::{ProbeMetrics, ProcessMetrics, SharedReader},
    resource,
    spool::Spool,
};
use crate::{
    error::{LensError, Result},
    spans::{SpanExporter, SpanId, SpanRecord, WallClock},
    sys::{target::ProcessInfo, usage::OwnCpu},
};

mod export_thread;
mod senders;
mod span_data;

use export_thread::export_thread;
use span_data::{otel_value, probe_resource};

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
    fn record_export(&self, spans: u64, result: std::result::Result<(), senders::ExportFailed>) {
        match result {
            Ok(()) => {
                self.exported.fetch_add(spans, Ordering::Relaxed);
            }
            Err(error) => {
                self.failed.fetch_add(spans, Ordering::Relaxed);
                if !self.failure_warned.swap(true, Ordering::Relaxed) {
                    warn!(
                        "span export failed ({}); spans are counted as lost",
                        crate::sys::target::redact_url_userinfo(&error)
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
    /// Kernel timestamps to wall-clock time.
    clock: WallClock,
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
        Ok(OtelPipeline {
            queue: Some(queue),
            worker: Some(worker),
            counters,
            spool,
            processes: HashMap::new(),
            clock: WallClock::now(),
            fallback_run_id: resource::random_run_id(),
            service_name,
            scope: InstrumentationScope::builder("lens-probe")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
        })
    }

    /// Sends what is queued and lens-probe's own health (`events_lost`: kernel events by
    /// cause; its CPU time so far), waits for the export thread (at most ~10 s), and says
    /// what happened to the spans.
    pub fn finish(
        &mut self,
        events_lost: &[(&'static str, u64)],
        cpu: Option<&OwnCpu>,
    ) -> ExportStats {
        let probe = ProbeMetrics::new(probe_resource(self.service_name.as_deref()));
        for (cause, count) in events_lost {
            probe.record_events_lost(cause, *count);
        }
        probe.record_spans_lost(
            "queue_full",
            self.counters.dropped_queue_full.load(Ordering::Relaxed),
        );
        if let Some(cpu) = cpu {
            probe.record_cpu_time(cpu);
        }
        self.close(Some(probe))
    }

    /// Sends what is queued, with `probe` (lens-probe's own health, when it is known),
    /// and waits for the export thread.
    fn close(&mut self, probe: Option<ProbeMetrics>) -> ExportStats {
        let _ = self
            .counters
            .flush_deadline
            .set(Instant::now() + FLUSH_BUDGET);
        if let Some(queue) = self.queue.take() {
            for (pid, process) in self.processes.drain() {
                let _ = queue.send(Message::ProcessEnded(pid, Some(process.metrics)));
            }
            if let Some(probe) = probe {
                let _ = queue.send(Message::ProbeMetrics(Box::new(probe)));
            }
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
                trace_id: TraceId::from_bytes(resource::trace_id_for_run(&detected.attempt_id)),
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

    fn process_probe_cost(&mut self, pid: u32, cost: crate::sink::ProbeCost) {
        if let Some(process) = self.processes.get_mut(&pid) {
            process.metrics.record_probe_cost(cost);
        }
    }

    fn launches_sampled(&mut self, pid: u32) {
        if let Some(process) = self.processes.get_mut(&pid) {
            process.metrics.launches_sampled = true;
        }
    }

    fn process_memory(&mut self, pid: u32, _at_ns: u64, change: &crate::gpu_memory::MemoryChange) {
        if let Some(process) = self.processes.get_mut(&pid) {
            process.metrics.record_memory(change);
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
    /// A run that ended in an error (or never started) sends what it traced, but no
    /// health of its own: what it lost is not known, and a run that failed at start
    /// leaves an earlier `--export-file` as it was.
    fn drop(&mut self) {
        self.close(None);
    }
}
