//! The export thread: spans from the queue batched per process, sent when a batch is
//! full or old enough, metrics collected, and everything flushed at the end.
use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::Ordering,
        mpsc::{self, Receiver, TryRecvError},
    },
    time::Instant,
};

use log::warn;
use opentelemetry_sdk::{Resource, trace::SpanData};

use super::senders::Sink;
use super::{BATCH_DELAY, BATCH_SPANS, Counters, Destination, IDLE_WAKE, Message};
use crate::error::Result;
use crate::export::{
    metrics::{self, SharedReader},
    spool::Spool,
};

/// The export thread: owns the backend and a tokio runtime to drive it.
pub(super) fn export_thread(
    destination: Destination,
    spool: Option<Arc<Spool>>,
    queue: Receiver<Message>,
    counters: Arc<Counters>,
    ready: mpsc::Sender<Result<()>>,
) {
    let Some((runtime, mut sink)) = start_backend(&destination, spool, &ready) else {
        return;
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
                crate::sys::target::redact_url_userinfo(&error.to_string())
            );
            metrics_warned = true;
        }
    };
    let send = |batch: Vec<SpanData>, resource: &Arc<Resource>, sink: &mut Sink| {
        sink.export(&runtime, resource, batch, &counters);
    };
    loop {
        let message = next_message(&queue);
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
                    spans.replay(&runtime, &counters, false);
                }
            }
            Err(TryRecvError::Disconnected) => {
                for (_, (resource, batch, _)) in batches.drain() {
                    send(batch, &resource, &mut sink);
                }
                if let Sink::Otlp { spans, .. } = &sink {
                    // What the spool holds goes now if it could not before (a short run
                    // is never idle); `finish` waits for it, within the flush budget.
                    spans.replay(&runtime, &counters, true);
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

/// The tokio runtime and the backend it drives, or `None` once the error went to `ready`.
fn start_backend(
    destination: &Destination,
    spool: Option<Arc<Spool>>,
    ready: &mpsc::Sender<Result<()>>,
) -> Option<(tokio::runtime::Runtime, Sink)> {
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
            return None;
        }
    };
    // Built inside the runtime: the gRPC channel spawns its connection task there.
    let sink = {
        let _guard = runtime.enter();
        Sink::build(destination, spool)
    };
    match sink {
        Ok(sink) => {
            let _ = ready.send(Ok(()));
            Some((runtime, sink))
        }
        Err(error) => {
            let _ = ready.send(Err(error));
            None
        }
    }
}

/// The next message, or `Empty` after a wait with none.
fn next_message(queue: &Receiver<Message>) -> std::result::Result<Message, TryRecvError> {
    match queue.try_recv() {
        Ok(message) => Ok(message),
        Err(TryRecvError::Empty) => {
            // Woken for a full batch, a control message or the end (see
            // `OtelPipeline::wake_export_thread`), else on this timer.
            std::thread::park_timeout(IDLE_WAKE);
            Err(TryRecvError::Empty)
        }
        Err(TryRecvError::Disconnected) => Err(TryRecvError::Disconnected),
    }
}
