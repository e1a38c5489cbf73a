//! The on-disk spool (`--spool-dir`): span batches an OTLP collector could not take (down,
//! refusing, timing out after the exporter's retries) wait there as files and are sent
//! again, oldest first, once it answers. At its size bound (`--spool-max`) the oldest
//! files go, their spans counted as lost. A later lens-probe with the same directory
//! sends what an earlier one left (killed, or stopped while the collector was down)
//! before anything else of its own spool.
//!
//! A file is one batch of one process: its resource and its spans, as JSON
//! (`SpooledBatch`), named `{sequence:020}-{spans}.json` so that the order and the span
//! count are read from the directory listing alone. Files are written to a temporary
//! name and renamed, so a crash leaves whole batches or none.
use std::{
    borrow::Cow,
    collections::BTreeMap,
    fs,
    io::Write,
    os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, SystemTime},
};

use opentelemetry::{
    InstrumentationScope, KeyValue, Value,
    trace::{Event, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState},
};
use opentelemetry_sdk::{
    Resource,
    trace::{SpanData, SpanEvents, SpanLinks},
};
use serde::{Deserialize, Serialize};

crate::error::reason_error! {
    /// Why the spool could not be opened, or a batch kept in or read from it.
    pub struct SpoolError;
}

/// `--spool-max` when not given.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

/// Where the spool is and how large it may grow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpoolConfig {
    pub dir: PathBuf,
    pub max_bytes: u64,
}

/// One spooled file, as the directory listing names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    bytes: u64,
    spans: u64,
}

#[derive(Debug, Default)]
struct Files {
    by_sequence: BTreeMap<u64, Entry>,
    bytes: u64,
    spans: u64,
    next_sequence: u64,
}

/// A batch taken out of the spool to be sent again: [`Spool::sent`] removes it.
pub struct Spooled {
    pub sequence: u64,
    pub resource: Resource,
    pub spans: Vec<SpanData>,
}

#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    files: Mutex<Files>,
    /// Holds the directory's lock (`flock` on [`LOCK_FILE`]) while the spool is open.
    _lock: fs::File,
    /// A write failed (a full filesystem, say) and that was said.
    write_failure_said: std::sync::atomic::AtomicBool,
}

/// The file whose lock says a lens-probe uses the directory: two sending the same batches
/// would send them twice, and each would count as lost what the other sent.
const LOCK_FILE: &str = ".lens-probe.lock";

/// The largest spool file read back. lens-probe writes one export batch per file (at most
/// a few MiB); anything larger is not one of its batches, and reading it whole could take
/// the memory a DaemonSet's limit allows.
const MAX_FILE_BYTES: u64 = 64 << 20;

fn euid() -> u32 {
    // SAFETY: plain geteuid.
    unsafe { libc::geteuid() }
}

impl Spool {
    /// Opens (creating it, mode 0700) the spool directory, locks it, and reads what an
    /// earlier run left there. Refused: a symbolic link, something that is not a directory,
    /// a directory of another user or one that group or others may use (mode other than
    /// 0700: another user's files there would be read and sent, and the spans there are
    /// the jobs'), a directory below one another user could rename it in, and one another
    /// lens-probe has locked.
    pub fn open(config: &SpoolConfig) -> Result<Spool, SpoolError> {
        let dir = &config.dir;
        match fs::symlink_metadata(dir) {
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                fs::create_dir_all(dir).map_err(|e| e.to_string())?;
                fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
                    .map_err(|e| e.to_string())?;
            }
            Err(error) => return Err(error.to_string().into()),
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err("is a symbolic link: lens-probe never writes through one".into());
            }
            Ok(meta) if !meta.is_dir() => return Err("not a directory".into()),
            Ok(meta) if meta.uid() != euid() => {
                return Err(format!(
                    "owned by uid {}, not by lens-probe's user: lens-probe writes there without \
                     the capability to override permissions",
                    meta.uid()
                )
                .into());
            }
            Ok(meta) if meta.mode() & 0o077 != 0 => {
                return Err(format!(
                    "mode {:04o}: a spool directory is lens-probe's alone (mode 0700), since \
                     what others put there would be read and sent; `chmod 700` it, or name a \
                     directory lens-probe creates",
                    meta.mode() & 0o7777
                )
                .into());
            }
            Ok(_) => {}
        }
        check_ancestors(dir)?;
        let lock = lock(dir)?;
        let mut files = Files::default();
        for entry in fs::read_dir(dir).map_err(|e| e.to_string())?.flatten() {
            let name = entry.file_name();
            let Some((sequence, spans)) = name.to_str().and_then(parse_name) else {
                continue;
            };
            // Not followed: a link, a directory or a FIFO named like a batch is not one.
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if !meta.is_file() || meta.uid() != euid() {
                log::warn!(
                    "{}: not a batch lens-probe wrote (not a regular file of its user): left \
                     as it is",
                    entry.path().display()
                );
                continue;
            }
            files.by_sequence.insert(
                sequence,
                Entry {
                    bytes: meta.len(),
                    spans,
                },
            );
            files.bytes += meta.len();
            files.spans += spans;
            files.next_sequence = files.next_sequence.max(sequence + 1);
        }
        Ok(Spool {
            dir: dir.clone(),
            max_bytes: config.max_bytes,
            files: Mutex::new(files),
            _lock: lock,
            write_failure_said: Default::default(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Spans waiting in the spool.
    pub fn spans(&self) -> u64 {
        self.files.lock().map_or(0, |files| files.spans)
    }

    /// Keeps `spans` of `resource` for later. Returns the spans of the oldest files that
    /// went to make room (lost); an error if the batch could not be written (lost too).
    pub fn keep(&self, resource: &Resource, spans: &[SpanData]) -> Result<u64, SpoolError> {
        let batch = SpooledBatch::new(resource, spans);
        let text = serde_json::to_vec(&batch).map_err(|e| e.to_string())?;
        let bytes = text.len() as u64;
        if bytes > self.max_bytes {
            return Err(format!("a batch of {bytes} bytes is larger than the spool").into());
        }
        let mut files = self.files.lock().map_err(|_| "spool lock poisoned")?;
        let mut evicted = 0;
        while files.bytes + bytes > self.max_bytes {
            let Some((sequence, entry)) = files.by_sequence.pop_first() else {
                break;
            };
            let _ = fs::remove_file(self.path(sequence, entry.spans));
            files.bytes -= entry.bytes;
            files.spans -= entry.spans;
            evicted += entry.spans;
        }
        let sequence = files.next_sequence;
        files.next_sequence += 1;
        let count = spans.len() as u64;
        let path = self.path(sequence, count);
        let partial = self.dir.join(format!(".{sequence:020}.partial"));
        let written = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&partial)
            .and_then(|mut file| file.write_all(&text))
            .and_then(|()| fs::rename(&partial, &path));
        if let Err(error) = written {
            let _ = fs::remove_file(&partial);
            let said = &self.write_failure_said;
            if !said.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log::warn!(
                    "the spool {} cannot take a batch ({error}): spans the collector does not \
                     take are lost (and counted) while it cannot",
                    self.dir.display()
                );
            }
            return Err(format!("{}: {error}", self.dir.display()).into());
        }
        files.by_sequence.insert(
            sequence,
            Entry {
                bytes,
                spans: count,
            },
        );
        files.bytes += bytes;
        files.spans += count;
        Ok(evicted)
    }

    /// The oldest batch, read back; a file that cannot be read is dropped (counted by the
    /// caller from the error's span count).
    pub fn oldest(&self) -> Option<Result<Spooled, (u64, String)>> {
        let (sequence, entry) = {
            let files = self.files.lock().ok()?;
            let (sequence, entry) = files.by_sequence.first_key_value()?;
            (*sequence, *entry)
        };
        let path = self.path(sequence, entry.spans);
        let read = read_batch_file(&path).and_then(|bytes| {
            serde_json::from_slice::<SpooledBatch>(&bytes)
                .map_err(|e| SpoolError::from(e.to_string()))
        });
        Some(match read {
            Ok(batch) => {
                let (resource, spans) = batch.into_parts();
                Ok(Spooled {
                    sequence,
                    resource,
                    spans,
                })
            }
            Err(error) => {
                self.sent(sequence);
                Err((entry.spans, format!("{}: {error}", path.display())))
            }
        })
    }

    /// Batch `sequence` was delivered (or is unreadable): its file goes.
    pub fn sent(&self, sequence: u64) {
        let Ok(mut files) = self.files.lock() else {
            return;
        };
        if let Some(entry) = files.by_sequence.remove(&sequence) {
            let _ = fs::remove_file(self.path(sequence, entry.spans));
            files.bytes -= entry.bytes;
            files.spans -= entry.spans;
        }
    }

    fn path(&self, sequence: u64, spans: u64) -> PathBuf {
        self.dir.join(format!("{sequence:020}-{spans}.json"))
    }
}

/// Refuses a directory whose ancestors another user could change: one of theirs, or one
/// they may write to without the sticky bit (they could rename the spool directory away
/// and put their own in its place). As `sshd`'s StrictModes does.
fn check_ancestors(dir: &Path) -> Result<(), SpoolError> {
    let dir = fs::canonicalize(dir).map_err(|e| e.to_string())?;
    for ancestor in dir.ancestors().skip(1) {
        let meta = fs::metadata(ancestor).map_err(|e| format!("{}: {e}", ancestor.display()))?;
        let mode = meta.mode();
        if meta.uid() != 0 && meta.uid() != euid() {
            return Err(format!(
                "{} above it is owned by uid {}: that user could put another directory in \
                 its place",
                ancestor.display(),
                meta.uid()
            )
            .into());
        }
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return Err(format!(
                "{} above it is writable by others (mode {:04o}, not sticky): they could put \
                 another directory in its place",
                ancestor.display(),
                mode & 0o7777
            )
            .into());
        }
    }
    Ok(())
}

/// Locks `dir` for this lens-probe (until the returned file is closed).
fn lock(dir: &Path) -> Result<fs::File, SpoolError> {
    let path = dir.join(LOCK_FILE);
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let error = std::io::Error::last_os_error();
        return Err(if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
            "in use by another lens-probe: two sharing one spool would send its batches \
             twice; give each its own --spool-dir"
                .to_string()
        } else {
            format!("{}: cannot lock: {error}", path.display())
        }
        .into());
    }
    Ok(file)
}

/// A spool file's bytes: not through a link, not blocking on a FIFO, only a regular file
/// of lens-probe's user, at most [`MAX_FILE_BYTES`].
fn read_batch_file(path: &Path) -> Result<Vec<u8>, SpoolError> {
    use std::io::Read;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() || meta.uid() != euid() {
        return Err("not a regular file of lens-probe's user".into());
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!(
            "{} bytes, more than a batch lens-probe writes ({MAX_FILE_BYTES})",
            meta.len()
        )
        .into());
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!("grew past {MAX_FILE_BYTES} bytes while read").into());
    }
    Ok(bytes)
}

/// `{sequence:020}-{spans}.json` → (sequence, spans).
fn parse_name(name: &str) -> Option<(u64, u64)> {
    let (sequence, rest) = name.strip_suffix(".json")?.split_once('-')?;
    Some((sequence.parse().ok()?, rest.parse().ok()?))
}

/// What lens-probe's spans and resources carry (`export::otlp::otel_value`), and what a
/// resource attribute given by the user can be.
#[derive(Debug, Serialize, Deserialize)]
enum SpooledValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

impl SpooledValue {
    fn new(value: &Value) -> SpooledValue {
        match value {
            Value::Bool(v) => SpooledValue::Bool(*v),
            Value::I64(v) => SpooledValue::Int(*v),
            Value::F64(v) => SpooledValue::Float(*v),
            Value::String(v) => SpooledValue::Str(v.as_str().to_owned()),
            other => SpooledValue::Str(other.to_string()),
        }
    }

    fn value(self) -> Value {
        match self {
            SpooledValue::Bool(v) => Value::Bool(v),
            SpooledValue::Int(v) => Value::I64(v),
            SpooledValue::Float(v) => Value::F64(v),
            SpooledValue::Str(v) => Value::String(v.into()),
        }
    }
}

type SpooledAttributes = Vec<(String, SpooledValue)>;

fn spooled_attributes<'a>(
    attributes: impl Iterator<Item = (&'a opentelemetry::Key, &'a Value)>,
) -> SpooledAttributes {
    attributes
        .map(|(key, value)| (key.as_str().to_owned(), SpooledValue::new(value)))
        .collect()
}

fn key_values(attributes: SpooledAttributes) -> Vec<KeyValue> {
    attributes
        .into_iter()
        .map(|(key, value)| KeyValue::new(key, value.value()))
        .collect()
}

fn unix_ns(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn system_time(ns: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_nanos(ns)
}

#[derive(Debug, Serialize, Deserialize)]
struct SpooledEvent {
    name: String,
    at_unix_ns: u64,
    attributes: SpooledAttributes,
}

#[derive(Debug, Serialize, Deserialize)]
struct SpooledSpan {
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    name: String,
    start_unix_ns: u64,
    end_unix_ns: u64,
    attributes: SpooledAttributes,
    events: Vec<SpooledEvent>,
    /// The error status's message; `None`: unset.
    error: Option<String>,
    scope: (String, Option<String>),
}

#[derive(Debug, Serialize, Deserialize)]
struct SpooledBatch {
    resource: SpooledAttributes,
    spans: Vec<SpooledSpan>,
}

impl SpooledBatch {
    fn new(resource: &Resource, spans: &[SpanData]) -> SpooledBatch {
        SpooledBatch {
            resource: spooled_attributes(resource.iter()),
            spans: spans
                .iter()
                .map(|span| SpooledSpan {
                    trace_id: span.span_context.trace_id().to_string(),
                    span_id: span.span_context.span_id().to_string(),
                    parent_span_id: span.parent_span_id.to_string(),
                    name: span.name.to_string(),
                    start_unix_ns: unix_ns(span.start_time),
                    end_unix_ns: unix_ns(span.end_time),
                    attributes: spooled_attributes(
                        span.attributes.iter().map(|kv| (&kv.key, &kv.value)),
                    ),
                    events: span
                        .events
                        .iter()
                        .map(|event| SpooledEvent {
                            name: event.name.to_string(),
                            at_unix_ns: unix_ns(event.timestamp),
                            attributes: spooled_attributes(
                                event.attributes.iter().map(|kv| (&kv.key, &kv.value)),
                            ),
                        })
                        .collect(),
                    error: match &span.status {
                        Status::Error { description } => Some(description.to_string()),
                        _ => None,
                    },
                    scope: (
                        span.instrumentation_scope.name().to_owned(),
                        span.instrumentation_scope.version().map(str::to_owned),
                    ),
                })
                .collect(),
        }
    }

    fn into_parts(self) -> (Resource, Vec<SpanData>) {
        let resource = Resource::builder_empty()
            .with_attributes(key_values(self.resource))
            .build();
        let spans = self
            .spans
            .into_iter()
            .map(|span| {
                let trace_id = TraceId::from_hex(&span.trace_id).unwrap_or(TraceId::INVALID);
                let span_id = SpanId::from_hex(&span.span_id).unwrap_or(SpanId::INVALID);
                let mut events = SpanEvents::default();
                events.events = span
                    .events
                    .into_iter()
                    .map(|event| {
                        Event::new(
                            event.name,
                            system_time(event.at_unix_ns),
                            key_values(event.attributes),
                            0,
                        )
                    })
                    .collect();
                let mut scope = InstrumentationScope::builder(span.scope.0);
                if let Some(version) = span.scope.1 {
                    scope = scope.with_version(version);
                }
                SpanData {
                    span_context: SpanContext::new(
                        trace_id,
                        span_id,
                        TraceFlags::SAMPLED,
                        false,
                        TraceState::default(),
                    ),
                    parent_span_id: SpanId::from_hex(&span.parent_span_id)
                        .unwrap_or(SpanId::INVALID),
                    parent_span_is_remote: false,
                    span_kind: SpanKind::Internal,
                    name: Cow::Owned(span.name),
                    start_time: system_time(span.start_unix_ns),
                    end_time: system_time(span.end_unix_ns),
                    attributes: key_values(span.attributes),
                    dropped_attributes_count: 0,
                    events,
                    links: SpanLinks::default(),
                    status: span.error.map_or(Status::Unset, Status::error),
                    instrumentation_scope: scope.build(),
                }
            })
            .collect();
        (resource, spans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    fn span(name: &'static str, id: u64, error: Option<&str>) -> SpanData {
        let mut events = SpanEvents::default();
        events.events.push(Event::new(
            "lens_probe.hang",
            system_time(1_700_000_000_500_000_000),
            vec![KeyValue::new("dl.rank", 3i64)],
            0,
        ));
        SpanData {
            span_context: SpanContext::new(
                TraceId::from_bytes([7; 16]),
                SpanId::from_bytes(id.to_be_bytes()),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: SpanId::from_bytes((id + 100).to_be_bytes()),
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: Cow::Borrowed(name),
            start_time: system_time(1_700_000_000_000_000_001),
            end_time: system_time(1_700_000_001_000_000_002),
            attributes: vec![
                KeyValue::new("dl.iteration", 12i64),
                KeyValue::new("nemo.span.group", "step"),
                KeyValue::new("nemo.span.truncated", true),
            ],
            dropped_attributes_count: 0,
            events,
            links: SpanLinks::default(),
            status: error.map_or(Status::Unset, |m| Status::error(m.to_owned())),
            instrumentation_scope: InstrumentationScope::builder("lens-probe")
                .with_version("0.1.0")
                .build(),
        }
    }

    fn spool(dir: &Path, max_bytes: u64) -> Spool {
        Spool::open(&SpoolConfig {
            dir: dir.to_path_buf(),
            max_bytes,
        })
        .unwrap()
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lens-spool-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_batch_comes_back_as_it_was_kept_and_goes_once_sent() {
        let dir = scratch("roundtrip");
        let resource = Resource::builder_empty()
            .with_attributes([
                KeyValue::new("dl.rank", 1i64),
                KeyValue::new("host.name", "n1"),
            ])
            .build();
        let kept = vec![
            span("train.step", 1, None),
            span("nccl.all_reduce", 2, Some("returned 5")),
        ];
        let spool = spool(&dir, DEFAULT_MAX_BYTES);
        assert_eq!(spool.keep(&resource, &kept), Ok(0));
        assert_eq!(spool.spans(), 2);
        let back = spool.oldest().unwrap().unwrap();
        assert_eq!(back.spans, kept);
        assert_eq!(back.resource, resource);
        spool.sent(back.sequence);
        assert_eq!(spool.spans(), 0);
        assert!(spool.oldest().is_none());
        // Only the lock is left.
        let left: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, [LOCK_FILE]);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_oldest_batches_go_at_the_bound_and_a_new_run_sends_the_rest_in_order() {
        let dir = scratch("bound");
        let resource = Resource::builder_empty().build();
        let batch: Vec<_> = (0..20).map(|i| span("train.step", i, None)).collect();
        let one = serde_json::to_vec(&SpooledBatch::new(&resource, &batch))
            .unwrap()
            .len() as u64;
        // Room for three batches: the fourth and fifth push out the first two.
        let spool = spool(&dir, one * 3 + one / 2);
        for _ in 0..3 {
            assert_eq!(spool.keep(&resource, &batch), Ok(0));
        }
        assert_eq!(spool.keep(&resource, &batch), Ok(20));
        assert_eq!(spool.keep(&resource, &batch), Ok(20));
        assert_eq!(spool.spans(), 60);
        drop(spool);
        // A later lens-probe finds the three left, oldest first, and numbers on after them.
        let again = self::spool(&dir, one * 10);
        assert_eq!(again.spans(), 60);
        let first = again.oldest().unwrap().unwrap().sequence;
        assert_eq!(first, 2);
        again.keep(&resource, &batch).unwrap();
        let sequences: Vec<u64> = again
            .files
            .lock()
            .unwrap()
            .by_sequence
            .keys()
            .copied()
            .collect();
        assert_eq!(sequences, [2, 3, 4, 5]);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_spool_dir_that_is_a_symlink_or_a_file_is_refused() {
        let dir = scratch("refused");
        fs::create_dir_all(&dir).unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink("/tmp", &link).unwrap();
        let config = |dir: PathBuf| SpoolConfig {
            dir,
            max_bytes: DEFAULT_MAX_BYTES,
        };
        assert!(
            Spool::open(&config(link))
                .unwrap_err()
                .contains("symbolic link")
        );
        let file = dir.join("file");
        fs::write(&file, b"").unwrap();
        assert!(
            Spool::open(&config(file))
                .unwrap_err()
                .contains("not a directory")
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_spool_dir_others_may_use_or_replace_is_refused() {
        let base = scratch("modes");
        fs::create_dir_all(&base).unwrap();
        let config = |dir: PathBuf| SpoolConfig {
            dir,
            max_bytes: DEFAULT_MAX_BYTES,
        };
        for (mode, needle) in [
            (0o755, "mode 0755"),
            (0o1777, "mode 1777"),
            (0o770, "mode 0770"),
        ] {
            let dir = base.join(format!("m{mode:o}"));
            fs::create_dir(&dir).unwrap();
            fs::set_permissions(&dir, fs::Permissions::from_mode(mode)).unwrap();
            let error = Spool::open(&config(dir)).unwrap_err();
            assert!(error.contains(needle), "{error}");
        }
        // A system directory: not lens-probe's alone.
        let error = Spool::open(&config("/etc".into())).unwrap_err();
        assert!(
            error.contains("mode 0755") || error.contains("owned by uid"),
            "{error}"
        );
        // Below a directory anyone may write to (not sticky): it could be swapped.
        let open = base.join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
        let error = Spool::open(&config(open.join("spool"))).unwrap_err();
        assert!(error.contains("writable by others"), "{error}");
        let _ = fs::remove_dir_all(&base);
    }

    #[test]
    fn one_spool_dir_serves_one_lens_probe_at_a_time() {
        let dir = scratch("lock");
        let first = spool(&dir, DEFAULT_MAX_BYTES);
        let error = Spool::open(&SpoolConfig {
            dir: dir.clone(),
            max_bytes: DEFAULT_MAX_BYTES,
        })
        .unwrap_err();
        assert!(error.contains("in use by another lens-probe"), "{error}");
        drop(first);
        // Free again once the first has gone.
        drop(spool(&dir, DEFAULT_MAX_BYTES));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn what_is_named_like_a_batch_but_is_not_one_is_never_read() {
        let dir = scratch("planted");
        drop(spool(&dir, DEFAULT_MAX_BYTES));
        // A directory, a link to a file, a FIFO (reading it would block for ever) and a
        // huge sparse file (reading it whole would take 1 GiB).
        fs::create_dir(dir.join("00000000000000000001-5.json")).unwrap();
        let secret = dir.join("secret");
        fs::write(&secret, b"{}").unwrap();
        std::os::unix::fs::symlink(&secret, dir.join("00000000000000000002-5.json")).unwrap();
        let fifo = CString::new(
            dir.join("00000000000000000003-5.json")
                .into_os_string()
                .into_encoded_bytes(),
        )
        .unwrap();
        // SAFETY: a plain mkfifo of a path we own.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let huge = fs::File::create(dir.join("00000000000000000004-7.json")).unwrap();
        huge.set_len(1 << 30).unwrap();
        drop(huge);
        let spool = spool(&dir, DEFAULT_MAX_BYTES * 2);
        // Only the regular file is taken for a batch, and it is refused unread.
        assert_eq!(spool.spans(), 7);
        let error = spool.oldest().unwrap().err().unwrap();
        assert_eq!(error.0, 7);
        assert!(error.1.contains("more than a batch"), "{}", error.1);
        assert!(spool.oldest().is_none());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        use crate::settings::parse_size;
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("500MiB"), Ok(500 << 20));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert!(parse_size("10KiB").unwrap_err().contains("at least 1MiB"));
        assert!(parse_size("1PB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("lots").is_err());
    }
}
