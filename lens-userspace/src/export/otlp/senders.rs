//! Where batches go: an OTLP exporter (gRPC or HTTP) or a JSON-lines file, several
//! requests in flight at once, and the spool that keeps what the collector could not
//! take and replays it.
use std::{
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use log::warn;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::{
    Resource,
    trace::{SpanData, SpanExporter as _},
};

use super::{Counters, Destination, IN_FLIGHT};
use crate::error::{LensError, Result};
use crate::export::spool::Spool;

crate::error::reason_error! {
    /// Why a batch was not exported (nor kept in the spool).
    pub(super) struct ExportFailed;
}

/// Keeps a batch whose export failed (`error`) in `spool`, counted; the first time,
/// says where spans now wait.
pub(super) fn spool_batch(
    spool: &Spool,
    resource: &Resource,
    batch: &[SpanData],
    error: &str,
    counters: &Counters,
) -> std::result::Result<(), ExportFailed> {
    let evicted = spool.keep(resource, batch).map_err(|e| e.to_string())?;
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
            crate::sys::target::redact_url_userinfo(error),
            spool.dir().display()
        );
    }
    Ok(())
}

/// The backend, as the export thread drives it.
pub(super) enum Sink {
    Otlp {
        spans: SpanExporters,
        metrics: Box<opentelemetry_otlp::MetricExporter>,
    },
    File(crate::sys::output::StreamedFile),
}

/// [`IN_FLIGHT`] OTLP span exporters, one per export running: each takes the resource
/// of the process whose batch it sends, so they are not shared between exports.
pub(super) struct SpanExporters {
    pub(super) idle: Arc<std::sync::Mutex<Vec<opentelemetry_otlp::SpanExporter>>>,
    /// One permit per idle exporter.
    pub(super) permits: Arc<tokio::sync::Semaphore>,
    pub(super) spool: Option<Arc<Spool>>,
    /// A task is sending the spool's batches (one at a time, oldest first).
    pub(super) replaying: Arc<std::sync::atomic::AtomicBool>,
    /// When the spool's last batch failed again: the next try waits [`REPLAY_AFTER`].
    pub(super) replay_failed_at: Arc<std::sync::Mutex<Option<Instant>>>,
}

/// How long sending from the spool waits after the collector refused one of its batches.
pub(super) const REPLAY_AFTER: Duration = Duration::from_secs(2);

/// Whether the collector refused a batch as malformed (OTLP/HTTP 400 Bad Request or 413
/// Content Too Large, gRPC `InvalidArgument`): a batch it will refuse at every try, unlike
/// a collector that is down, busy or refusing everything (401, 403, 503: the spool waits
/// those out).
fn refused_as_malformed(error: &str) -> bool {
    let http = error
        .split("status code: ")
        .nth(1)
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse::<u16>().ok());
    matches!(http, Some(400 | 413)) || error.contains("gRPC code: InvalidArgument")
}

/// Exports `batch` with one of the pool's exporters, within the export timeout.
async fn export_batch(
    exporter: &mut opentelemetry_otlp::SpanExporter,
    resource: &Resource,
    batch: Vec<SpanData>,
    counters: &Counters,
) -> std::result::Result<(), ExportFailed> {
    exporter.set_resource(resource);
    let timeout = counters.export_timeout();
    if timeout.is_zero() {
        return Err("no time left to send at exit".into());
    }
    match tokio::time::timeout(timeout, exporter.export(batch)).await {
        Ok(result) => result.map_err(|e| e.to_string().into()),
        Err(_) => Err("timed out".into()),
    }
}

impl SpanExporters {
    pub(super) fn build(
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
    pub(super) fn take(
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
    pub(super) fn spawn(
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
                // Sent again it would be refused again: lost, not spooled.
                Err(error) if refused_as_malformed(&error) => Err(error),
                Err(error) if let (Some(spool), Some(copy)) = (&spool, copy) => {
                    spool_batch(spool, &resource, &copy, &error, &counters)
                        .map(|()| None)
                        .map_err(|why| format!("{error}; not spooled: {why}").into())
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
    /// a batch fails (it stays, for the next try). Once lens-probe is finishing, only
    /// `at_exit` starts one, unless this run spooled: the last chance of a run too short
    /// to have had an idle moment (a SLURM prolog's short jobs), inside the flush budget.
    pub(super) fn replay(
        &self,
        runtime: &tokio::runtime::Runtime,
        counters: &Arc<Counters>,
        at_exit: bool,
    ) {
        let Some(spool) = self.spool.clone() else {
            return;
        };
        let recently_failed = self
            .replay_failed_at
            .lock()
            .ok()
            .and_then(|at| *at)
            .is_some_and(|at| at.elapsed() < REPLAY_AFTER);
        let finishing = counters.flush_deadline.get().is_some();
        // At exit, not after this run had to spool: the collector is not taking batches.
        let collector_down = at_exit && counters.spooled.load(Ordering::Relaxed) > 0;
        if recently_failed || spool.spans() == 0 || (finishing && !at_exit) || collector_down {
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
                match sent {
                    Ok(()) => {}
                    // Refused again at every try: it would hold up every batch behind it.
                    Err(error) if refused_as_malformed(&error) => {
                        spool.sent(batch.sequence);
                        counters.spool_dropped.fetch_add(spans, Ordering::Relaxed);
                        warn!(
                            "the collector refused a spooled batch as malformed ({error}): its \
                             {spans} spans are dropped and counted lost; the spool goes on"
                        );
                        continue;
                    }
                    Err(_) => {
                        if let Ok(mut at) = failed_at.lock() {
                            *at = Some(Instant::now());
                        }
                        break;
                    }
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
    pub(super) fn finish(&self, runtime: &tokio::runtime::Runtime, timeout: Duration) {
        let _ = runtime.block_on(self.permits.acquire_many(IN_FLIGHT as u32));
        if let Ok(mut idle) = self.idle.lock() {
            for exporter in idle.iter_mut() {
                let _ = exporter.shutdown_with_timeout(timeout);
            }
        }
    }
}

impl Sink {
    pub(super) fn build(destination: &Destination, spool: Option<Arc<Spool>>) -> Result<Sink> {
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
            Destination::File(path) => Sink::File(crate::sys::output::OutputFile::create_streamed(
                "--export-file",
                path,
            )?),
        })
    }

    /// Sends `batch` (to an endpoint: starts sending it) and counts the outcome.
    pub(super) fn export(
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
                    Err(ExportFailed::from("no time left to send at exit"))
                } else {
                    Self::write_spans(out, resource, batch)
                };
                counters.record_export(spans, result);
            }
        }
    }

    pub(super) fn write_spans(
        out: &mut crate::sys::output::StreamedFile,
        resource: &Resource,
        batch: Vec<SpanData>,
    ) -> std::result::Result<(), ExportFailed> {
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

    pub(super) fn export_metrics(
        &mut self,
        runtime: &tokio::runtime::Runtime,
        metrics: &opentelemetry_sdk::metrics::data::ResourceMetrics,
        timeout: Duration,
    ) -> std::result::Result<(), ExportFailed> {
        use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
        match self {
            Sink::Otlp {
                metrics: exporter, ..
            } => runtime
                .block_on(async { tokio::time::timeout(timeout, exporter.export(metrics)).await })
                .map_err(|_| ExportFailed::from("timed out"))?
                .map_err(|e| e.to_string().into()),
            Sink::File(out) => {
                use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
                write_json_line(out, &ExportMetricsServiceRequest::from(metrics))
            }
        }
    }
}

pub(super) fn write_json_line(
    out: &mut crate::sys::output::StreamedFile,
    request: &impl serde::Serialize,
) -> std::result::Result<(), ExportFailed> {
    let line = serde_json::to_string(request).map_err(|e| e.to_string())?;
    out.write_line(&line).map_err(|e| e.to_string().into())
}

#[cfg(test)]
mod tests {
    use super::refused_as_malformed;

    #[test]
    fn only_what_the_collector_will_always_refuse_is_malformed() {
        for refused in [
            "Operation failed: HTTP export failed with status code: 400",
            "HTTP export failed with status code: 413",
            "Tonic export failed with gRPC code: InvalidArgument",
        ] {
            assert!(refused_as_malformed(refused), "{refused}");
        }
        for waited_out in [
            "HTTP export failed with status code: 503",
            "HTTP export failed with status code: 401",
            "HTTP export failed with status code: 429",
            "Tonic export failed with gRPC code: Unavailable",
            "timed out",
            "tcp connect error: Connection refused (os error 111)",
        ] {
            assert!(!refused_as_malformed(waited_out), "{waited_out}");
        }
    }
}
