//! The timeline's file, written by a thread of its own: the event loop only appends
//! encoded packets to a buffer; the thread writes what is there at least every
//! [`FLUSH_EVERY`], so a lens-probe killed with SIGKILL leaves a trace that opens up to
//! its last flush, and a slow disk never holds up the event loop.
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use log::warn;

use crate::sys::output::StreamedFile;

/// How long written packets may wait in memory before they are in the file.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// What the writer thread and the event loop share.
#[derive(Default)]
struct Shared {
    /// Encoded packets not yet written.
    pending: Mutex<Vec<u8>>,
    closing: AtomicBool,
    /// At close, put the file in place even when nothing was written (an empty trace).
    keep_empty: AtomicBool,
    /// Bytes in the file.
    written: AtomicU64,
    /// The first write error, said once; nothing more is written after it.
    failed: AtomicBool,
}

/// The streamed trace file.
pub struct TimelineFile {
    shared: Arc<Shared>,
    writer: Option<JoinHandle<()>>,
}

impl TimelineFile {
    /// Starts the writer thread on `file` (already created, so that a path lens-probe
    /// may not write fails at start); `shown` names it in messages.
    pub fn start(file: StreamedFile, shown: String) -> std::io::Result<TimelineFile> {
        let shared = Arc::new(Shared::default());
        let thread_shared = Arc::clone(&shared);
        let writer = std::thread::Builder::new()
            .name("lens-timeline".into())
            .spawn(move || write_until_closed(file, &thread_shared, &shown))?;
        Ok(TimelineFile {
            shared,
            writer: Some(writer),
        })
    }

    /// Queues `bytes` (whole packets) for the file.
    pub fn append(&self, bytes: &[u8]) {
        if self.shared.failed.load(Ordering::Relaxed) {
            return;
        }
        let mut pending = self
            .shared
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        pending.extend_from_slice(bytes);
    }

    /// Bytes in the file so far.
    pub fn written(&self) -> u64 {
        self.shared.written.load(Ordering::Relaxed)
    }

    /// Writes what is queued and stops the thread; the file is whole after it. With
    /// nothing written, `keep_empty` puts an empty trace in place; without it an earlier
    /// file at the path stays as it was (a run that failed at start).
    pub fn close(&mut self, keep_empty: bool) {
        self.shared.keep_empty.store(keep_empty, Ordering::Relaxed);
        self.shared.closing.store(true, Ordering::Relaxed);
        if let Some(writer) = self.writer.take() {
            writer.thread().unpark();
            let _ = writer.join();
        }
    }
}

impl Drop for TimelineFile {
    fn drop(&mut self) {
        self.close(false);
    }
}

fn write_until_closed(mut file: StreamedFile, shared: &Shared, shown: &str) {
    let mut in_place = false;
    loop {
        let deadline = Instant::now() + FLUSH_EVERY;
        while !shared.closing.load(Ordering::Relaxed) {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            std::thread::park_timeout(deadline - now);
        }
        let closing = shared.closing.load(Ordering::Relaxed);
        let chunk = std::mem::take(&mut *shared.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let put_empty_in_place = closing && !in_place && shared.keep_empty.load(Ordering::Relaxed);
        if (!chunk.is_empty() || put_empty_in_place) && !shared.failed.load(Ordering::Relaxed) {
            match file.write_chunk(&chunk) {
                Ok(()) => {
                    in_place = true;
                    shared
                        .written
                        .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
                Err(error) => {
                    shared.failed.store(true, Ordering::Relaxed);
                    warn!("timeline {shown}: cannot write ({error}); it ends here");
                }
            }
        }
        if closing {
            return;
        }
    }
}
