//! The writer thread: takes the span builder's messages, has the encoder place and
//! encode them, and writes whole spans to the file at least every [`FLUSH_EVERY`], so a
//! lens-probe killed with SIGKILL leaves a trace that opens up to its last flush. The
//! event loop never waits for it: it only queues (`Timeline::send`).
use std::{
    sync::{
        Mutex,
        mpsc::{Receiver, RecvTimeoutError},
    },
    time::{Duration, Instant},
};

use log::warn;

use super::{Message, TimelineReport, encoder::Encoder};
use crate::{settings::format_size, sys::output::StreamedFile};

/// How long written spans may wait in memory before they are in the file.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// Runs until the queue closes (the [`super::Timeline`] is closed), then writes what is
/// left. The report is kept up to date as spans are written.
pub(super) fn write(
    messages: Receiver<Message>,
    mut encoder: Encoder,
    mut file: StreamedFile,
    report: &Mutex<TimelineReport>,
) {
    let (shown, max_bytes) = {
        let report = report.lock().unwrap_or_else(|e| e.into_inner());
        (report.path.display().to_string(), report.max_bytes)
    };
    let mut output = Output {
        file: &mut file,
        shown: &shown,
        pending: Vec::new(),
        in_place: false,
        failed: false,
    };
    let mut queued: u64 = 0;
    let mut capped = false;
    let mut next_flush = Instant::now() + FLUSH_EVERY;
    loop {
        let wait = next_flush.saturating_duration_since(Instant::now());
        match messages.recv_timeout(wait) {
            Ok(Message::ProcessStarted(info)) => encoder.process_started(&info),
            Ok(Message::ProcessEnded(pid)) => encoder.process_ended(pid),
            Ok(Message::Span(_)) if capped => {
                // Past the cap nothing is written: nothing to place or encode either.
                report
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .spans_past_cap += 1;
            }
            Ok(Message::Span(span)) => {
                encoder.span(&span);
                let bytes = encoder.take_bytes();
                let mut report = report.lock().unwrap_or_else(|e| e.into_inner());
                if queued + bytes.len() as u64 > max_bytes {
                    warn!(
                        "timeline {shown} reached its size cap ({}, --perfetto-max-size): \
                         nothing more is written to it",
                        format_size(max_bytes)
                    );
                    capped = true;
                    encoder.discard();
                    report.spans_past_cap += 1;
                } else {
                    queued += bytes.len() as u64;
                    report.slices += 1;
                    report.bytes = queued;
                    output.pending.extend_from_slice(&bytes);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                // A run that traced a process leaves a trace, empty or not; one that failed
                // before leaves an earlier file at the path as it was.
                output.flush(encoder.has_processes());
                return;
            }
        }
        if Instant::now() >= next_flush {
            output.flush(false);
            next_flush = Instant::now() + FLUSH_EVERY;
        }
    }
}

/// The file and what waits to go into it.
struct Output<'a> {
    file: &'a mut StreamedFile,
    shown: &'a str,
    pending: Vec<u8>,
    /// The file has replaced whatever was at its path.
    in_place: bool,
    /// A write failed (said once): nothing more is written.
    failed: bool,
}

impl Output<'_> {
    /// Writes what is pending; `empty_too`: puts the file in place even with nothing.
    fn flush(&mut self, empty_too: bool) {
        if self.failed || (self.pending.is_empty() && (self.in_place || !empty_too)) {
            return;
        }
        match self.file.write_chunk(&self.pending) {
            Ok(()) => {
                self.in_place = true;
                self.pending.clear();
            }
            Err(error) => {
                self.failed = true;
                warn!(
                    "timeline {}: cannot write ({error}); it ends here",
                    self.shown
                );
            }
        }
    }
}
