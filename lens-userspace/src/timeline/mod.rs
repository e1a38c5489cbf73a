//! The run as a picture (`--perfetto FILE`): every span lens-probe makes, written as it
//! ends into a Perfetto trace (TrackEvent protobuf) that ui.perfetto.dev and Perfetto's
//! `trace_processor` open, every traced rank side by side.
//!
//! - A track per traced process, `rank R · host · pid P`, holding its `train.job`; under
//!   it a track per thread that has spans, holding its phases (steps, evaluations,
//!   checkpoints…), with the step's parts and the calls on tracks of their own under the
//!   thread (`tracks`: why parents and children never share a track).
//! - Each slice carries its span's attributes as annotations. A collective's slices on
//!   every rank share one flow (communicator id and sequence number), drawn as arrows in
//!   the order the ranks arrived: the last arrow points into the rank the others waited
//!   for. Straggler verdicts and hang reports are instants on the process's `reports`
//!   track, with their text and the ranks' Python stacks.
//! - Counters per process: kernel launches and collective bytes, per step.
//!
//! Tracks are plain named tracks, not Perfetto's pid-keyed process and thread tracks:
//! files from several nodes, concatenated, open as one trace (ids unique per writer, see
//! `tracks::Ids`), and two nodes' processes that share a pid stay apart. Timestamps are
//! wall-clock (`CLOCK_REALTIME`) ns, the clock nodes share.
mod encoder;
mod file;
#[allow(clippy::all, clippy::pedantic)]
mod proto {
    include!(concat!(env!("OUT_DIR"), "/perfetto.protos.rs"));
}
pub mod replay;
mod tracks;

use std::{
    path::PathBuf,
    sync::{
        Arc, Mutex,
        mpsc::{self, SyncSender, TrySendError},
    },
    thread::JoinHandle,
};

use log::warn;
use serde::Serialize;

use crate::{
    error::LensError,
    export::resource::own_host_name,
    settings::format_size,
    spans::{SpanExporter, SpanId, SpanRecord, WallClock},
    sys::{output::OutputFile, target::ProcessInfo},
};
use encoder::Encoder;

/// The default size cap (`--perfetto-max-size`).
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

/// Where the timeline goes and how large it may grow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimelineSettings {
    pub path: PathBuf,
    pub max_bytes: u64,
}

/// What the timeline holds at the end, for the exit summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TimelineReport {
    pub path: PathBuf,
    /// Slices written: one per span.
    pub slices: u64,
    pub bytes: u64,
    pub max_bytes: u64,
    /// Spans not written because the file reached its cap.
    pub spans_past_cap: u64,
    /// Spans not written because the writer thread was behind (its queue full).
    pub spans_dropped: u64,
}

impl TimelineReport {
    /// The summary's lines about the timeline.
    pub fn render(&self) -> String {
        let mut text = format!(
            "lens-probe: timeline {}: {} slices, {} (open it at ui.perfetto.dev)\n",
            self.path.display(),
            self.slices,
            format_size(self.bytes)
        );
        if self.spans_past_cap > 0 {
            text.push_str(&format!(
                "lens-probe: timeline {} reached its size cap ({}, --perfetto-max-size): {} \
                 spans after it are not in it\n",
                self.path.display(),
                format_size(self.max_bytes),
                self.spans_past_cap
            ));
        }
        if self.spans_dropped > 0 {
            text.push_str(&format!(
                "lens-probe: timeline {}: {} spans not in it (its writer was behind)\n",
                self.path.display(),
                self.spans_dropped
            ));
        }
        text
    }
}

/// What the writer thread is told, in the order the span builder said it.
enum Message {
    ProcessStarted(Box<ProcessInfo>),
    Span(Box<SpanRecord>),
    ProcessEnded(u32),
}

/// Spans waiting for the writer thread; past this they are not written, and counted
/// (`TimelineReport::spans_dropped`): the event loop never waits for the timeline.
const QUEUE_SPANS: usize = 65_536;

/// The timeline, as one of the span builder's exporters: it hands each span to the
/// writer thread (`file.rs`), which places, encodes and writes it.
pub struct Timeline {
    queue: Option<SyncSender<Message>>,
    writer: Option<JoinHandle<()>>,
    report: Arc<Mutex<TimelineReport>>,
}

impl Timeline {
    /// Creates the file (failing at start where lens-probe may not write) and starts the
    /// writer thread.
    pub fn create(settings: &TimelineSettings) -> Result<Timeline, LensError> {
        let output = OutputFile::create_streamed("--perfetto", &settings.path)?;
        let host = own_host_name();
        let clock = WallClock::now();
        let writer_key = format!(
            "{host} {} {} {}",
            crate::sys::kernel::boot_id().unwrap_or_default(),
            std::process::id(),
            clock.unix_ns(crate::spans::monotonic_now_ns())
        );
        let encoder = Encoder::new(&writer_key, clock, host);
        let report = Arc::new(Mutex::new(TimelineReport {
            path: settings.path.clone(),
            max_bytes: settings.max_bytes,
            ..TimelineReport::default()
        }));
        let (queue, messages) = mpsc::sync_channel(QUEUE_SPANS);
        let writer_report = Arc::clone(&report);
        let writer = std::thread::Builder::new()
            .name("lens-timeline".into())
            .spawn(move || file::write(messages, encoder, output, &writer_report))
            .map_err(|error| LensError::Output {
                flag: "--perfetto",
                path: settings.path.clone(),
                reason: error.to_string(),
            })?;
        Ok(Timeline {
            queue: Some(queue),
            writer: Some(writer),
            report,
        })
    }

    /// What the timeline holds so far, filled as the run goes (whole once it is closed).
    pub fn report(&self) -> Arc<Mutex<TimelineReport>> {
        Arc::clone(&self.report)
    }

    fn send(&mut self, message: Message) {
        let Some(queue) = &self.queue else {
            return;
        };
        let is_span = matches!(message, Message::Span(_));
        match queue.try_send(message) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) if is_span => {
                let mut report = self.report.lock().unwrap_or_else(|e| e.into_inner());
                if report.spans_dropped == 0 {
                    warn!(
                        "timeline {}: its writer is behind; spans it cannot take are not in it \
                         (counted)",
                        report.path.display()
                    );
                }
                report.spans_dropped += 1;
            }
            // A process start or end: these are few, wait for room.
            Err(TrySendError::Full(message)) => {
                let _ = queue.send(message);
            }
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    /// Writes what is queued and closes the file: whole after this.
    pub fn close(&mut self) {
        drop(self.queue.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl SpanExporter for Timeline {
    fn process_started(&mut self, info: &ProcessInfo, _job: Option<SpanId>, _start_ns: u64) {
        self.send(Message::ProcessStarted(Box::new(info.clone())));
    }

    fn export(&mut self, span: SpanRecord) {
        self.send(Message::Span(Box::new(span)));
    }

    fn process_ended(&mut self, pid: u32) {
        self.send(Message::ProcessEnded(pid));
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests;
