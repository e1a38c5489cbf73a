//! The console exporter: each process's span tree, indented, printed one top-level phase
//! at a time as it completes (a step with its phases and calls, an evaluation, a
//! checkpoint), and the job line when the process ends.
use std::{
    collections::{HashMap, HashSet},
    io::Write,
};

use super::{AttrValue, SpanExporter, SpanId, SpanRecord, SpanStatus};
use crate::{semconv, settings::format_size, summary::format_duration, sys::target::ProcessInfo};

/// The widest line printed without `-v`: a terminal's.
pub const LINE_WIDTH: usize = 120;

/// What a person reads on a span's line without `-v`, in this order, with a short label
/// (`None`: the value alone). The rest is in `-v` and in every export.
const SHOWN_ATTRIBUTES: &[(&str, Option<&str>)] = &[
    (semconv::DL_ITERATION, Some("iter")),
    (semconv::DL_MICROBATCH_COUNT, Some("microbatches")),
    (semconv::NEMO_CHECKPOINT_FILES, Some("files")),
    (semconv::DL_COLLECTIVE_BYTES, None),
    (semconv::DL_COLLECTIVE_DTYPE, None),
    (semconv::DL_COLLECTIVE_PEER, Some("peer")),
    (semconv::DL_COLLECTIVE_END_SOURCE, Some("end")),
    (semconv::DL_COLLECTIVE_LAST_RANK, Some("last rank")),
    (semconv::CUDA_LAUNCH_COUNT, Some("launches")),
    (semconv::PROCESS_EXIT_CODE, Some("exit")),
];

/// Attributes the name already says, or that only queries need.
const HIDDEN_ATTRIBUTES: &[&str] = &[
    semconv::NEMO_SPAN_GROUP,
    semconv::NEMO_SPAN_TRUNCATED,
    semconv::DL_COLLECTIVE_BACKEND,
    semconv::DL_COLLECTIVE_OP,
    semconv::CUDA_SYNC_KIND,
    semconv::PROCESS_PID,
];

struct ConsoleProcess {
    /// `rank N` when the process has one, else `pid N`: starts every line.
    label: String,
    job: Option<SpanId>,
    start_ns: u64,
    /// Finished spans waiting for their top-level ancestor to finish.
    pending: Vec<SpanRecord>,
    /// Spans of the trees printed last, by depth: a collective ends (completes) after
    /// its phase was printed, and is printed on its own below it.
    printed: HashMap<SpanId, usize>,
}

/// Printed spans remembered for late children (a few steps' worth).
const PRINTED_REMEMBERED: usize = 4096;

pub struct ConsoleTree<W: Write> {
    out: W,
    processes: HashMap<u32, ConsoleProcess>,
    /// `-v`: every attribute on every line, however long.
    all_attributes: bool,
}

impl<W: Write> ConsoleTree<W> {
    pub fn new(out: W) -> ConsoleTree<W> {
        ConsoleTree {
            out,
            processes: HashMap::new(),
            all_attributes: false,
        }
    }

    /// Every attribute on every line (`-v`), instead of lines of at most
    /// [`LINE_WIDTH`] with what a person reads.
    pub fn with_all_attributes(mut self, all: bool) -> ConsoleTree<W> {
        self.all_attributes = all;
        self
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

/// How one process's lines are written: its label, the time offsets count from, and
/// whether every attribute is shown (`-v`).
#[derive(Clone, Copy)]
struct LineStyle<'a> {
    label: &'a str,
    origin_ns: u64,
    all: bool,
}

fn line(style: LineStyle<'_>, span: &SpanRecord, depth: usize) -> String {
    let LineStyle {
        label,
        origin_ns,
        all,
    } = style;
    let offset = format!(
        "+{:.3}s",
        span.start_ns.saturating_sub(origin_ns) as f64 / 1e9
    );
    let process = label;
    let label = format!("{}{}", "  ".repeat(depth), span.name);
    let mut text = format!(
        "  [{process}] {offset:>10}  {label:<40} {:>10}",
        format_duration(span.duration_ns())
    );
    if all {
        for (key, value) in &span.attributes {
            if !HIDDEN_ATTRIBUTES.contains(key) {
                text.push_str(&format!("  {key}={value}"));
            }
        }
    } else {
        for (key, short) in SHOWN_ATTRIBUTES {
            let Some(value) = span.attr(key) else {
                continue;
            };
            // Said when inferred from what followed, not when it is the call's return.
            if *key == semconv::DL_COLLECTIVE_END_SOURCE && value.to_string() == "call_return" {
                continue;
            }
            let value = match (*key, value) {
                (semconv::DL_COLLECTIVE_BYTES, AttrValue::Int(n)) => format_size(*n as u64),
                _ => value.to_string(),
            };
            match short {
                Some(short) => text.push_str(&format!("  {short}={value}")),
                None => text.push_str(&format!("  {value}")),
            }
        }
    }
    if span.truncated() {
        text.push_str("  (truncated)");
    }
    if let SpanStatus::Error(message) = &span.status {
        text.push_str(&format!("  ERROR: {message}"));
    }
    fit(text, all)
}

/// At most [`LINE_WIDTH`] characters unless `all` (`-v`): the rest is cut, marked `…`.
fn fit(text: String, all: bool) -> String {
    if all || text.chars().count() <= LINE_WIDTH {
        return text;
    }
    let mut cut: String = text.chars().take(LINE_WIDTH - 1).collect();
    cut.push('…');
    cut
}

/// Lines of `root` and everything below it among `children` (pending spans by parent,
/// each list in start order), depth first.
fn subtree(
    style: LineStyle<'_>,
    children: &HashMap<SpanId, Vec<&SpanRecord>>,
    root: &SpanRecord,
    depth: usize,
    out: &mut Vec<String>,
    depths: &mut Vec<(SpanId, usize)>,
) {
    out.push(line(style, root, depth));
    depths.push((root.id, depth));
    for child in children.get(&root.id).into_iter().flatten() {
        subtree(style, children, child, depth + 1, out, depths);
    }
}

impl<W: Write> SpanExporter for ConsoleTree<W> {
    fn process_started(&mut self, info: &ProcessInfo, job: Option<SpanId>, start_ns: u64) {
        let label = match info.rank {
            Some(rank) => format!("rank {}", rank.rank),
            None => format!("pid {}", info.pid),
        };
        let _ = writeln!(
            self.out,
            "lens-probe: [{label}] job started: pid {}: {}",
            info.pid,
            info.command_line.join(" ")
        );
        self.processes.insert(
            info.pid,
            ConsoleProcess {
                label,
                job,
                start_ns,
                pending: Vec::new(),
                printed: HashMap::new(),
            },
        );
    }

    fn export(&mut self, span: SpanRecord) {
        let Some(process) = self.processes.get_mut(&span.pid) else {
            return;
        };
        let label = process.label.clone();
        let style = LineStyle {
            label: &label,
            origin_ns: process.start_ns,
            all: self.all_attributes,
        };
        if process.job == Some(span.id) {
            let mut text = line(style, &span, 0);
            // The job line: its name and duration, no offset.
            if let Some(at) = text.find(span.name) {
                text.drain(..at);
            }
            let _ = writeln!(self.out, "lens-probe: [{}] {text}", process.label);
            return;
        }
        let top_level = span.parent.is_none() || span.parent == process.job;
        if let Some(depth) = span.parent.and_then(|p| process.printed.get(&p).copied()) {
            let text = line(style, &span, depth + 1);
            let text = fit(
                format!("{text}  (completed after its parent)"),
                self.all_attributes,
            );
            let _ = writeln!(self.out, "{text}");
            return;
        }
        if !top_level {
            process.pending.push(span);
            return;
        }
        // One pass to index the pending spans by parent: long phases gather many.
        let mut children: HashMap<SpanId, Vec<&SpanRecord>> = HashMap::new();
        for pending in &process.pending {
            if let Some(parent) = pending.parent {
                children.entry(parent).or_default().push(pending);
            }
        }
        for list in children.values_mut() {
            list.sort_by_key(|s| (s.start_ns, s.id));
        }
        let mut lines = Vec::new();
        let mut depths = Vec::new();
        subtree(style, &children, &span, 0, &mut lines, &mut depths);
        // Whatever hangs below this span has been printed with it.
        let mut below: HashSet<SpanId> = HashSet::from([span.id]);
        let mut queue = vec![span.id];
        while let Some(parent) = queue.pop() {
            for child in children.get(&parent).into_iter().flatten() {
                below.insert(child.id);
                queue.push(child.id);
            }
        }
        drop(children);
        if process.printed.len() > PRINTED_REMEMBERED {
            process.printed.clear();
        }
        process.printed.extend(depths);
        process.pending.retain(|s| !below.contains(&s.id));
        // One write per tree (stderr is unbuffered: `writeln!` would make two).
        let mut text = lines.join("\n");
        text.push('\n');
        let _ = self.out.write_all(text.as_bytes());
    }

    fn process_ended(&mut self, pid: u32) {
        self.processes.remove(&pid);
        let _ = self.out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::groups::SpanGroup;

    /// A collective span with everything a completed, matched all-reduce carries.
    fn collective() -> SpanRecord {
        let attributes: super::super::Attributes = vec![
            (semconv::NEMO_SPAN_GROUP, "forward_backward".into()),
            (semconv::DL_COLLECTIVE_BACKEND, "nccl".into()),
            (semconv::DL_COLLECTIVE_OP, "all_reduce".into()),
            (semconv::DL_COLLECTIVE_COUNT, 262_144i64.into()),
            (semconv::DL_COLLECTIVE_BYTES, 1_048_576i64.into()),
            (semconv::DL_COLLECTIVE_DTYPE, "float32".into()),
            (semconv::DL_COLLECTIVE_REDUCE_OP, "sum".into()),
            (semconv::DL_COLLECTIVE_COMM_ID, "a42da58c09d279a5".into()),
            (semconv::DL_RANK, 0i64.into()),
            (semconv::DL_WORLD_SIZE, 8i64.into()),
            (semconv::DL_COLLECTIVE_END_SOURCE, "event_query".into()),
            (
                semconv::DL_COLLECTIVE_END_PRECISION_NS,
                20_216_936i64.into(),
            ),
            (semconv::DL_COLLECTIVE_ENQUEUE_DURATION_NS, 12_345i64.into()),
            (semconv::DL_COLLECTIVE_SEQ, 1_234_567i64.into()),
            (semconv::DL_COLLECTIVE_LAST_RANK, 7i64.into()),
            (semconv::DL_COLLECTIVE_ARRIVAL_SKEW_NS, 10_210_000i64.into()),
            (semconv::DL_COLLECTIVE_WAIT_NS, 10_100_000i64.into()),
            (semconv::DL_COLLECTIVE_RANKS_COMPARED, 8i64.into()),
        ];
        SpanRecord {
            id: SpanId(2),
            parent: Some(SpanId(1)),
            name: "nccl.all_reduce",
            group: SpanGroup::ForwardBackward,
            pid: 4242,
            tid: 4242,
            start_ns: 1_500_000_000,
            end_ns: 1_520_000_000,
            attributes,
            events: Vec::new(),
            status: SpanStatus::Error(
                "nccl.all_reduce returned 6 (a long message that goes on and on past the \
                 end of any terminal line)"
                    .into(),
            ),
        }
    }

    #[test]
    fn a_line_fits_a_terminal_and_says_what_a_person_reads() {
        let span = collective();
        let style = LineStyle {
            label: "rank 12345",
            origin_ns: 0,
            all: false,
        };
        let text = line(style, &span, 3);
        assert!(
            text.chars().count() <= LINE_WIDTH,
            "{} chars: {text}",
            text.chars().count()
        );
        for shown in [
            "nccl.all_reduce",
            "20.00 ms",
            "1.0 MiB",
            "float32",
            "end=event_query",
        ] {
            assert!(text.contains(shown), "{shown:?} not in {text}");
        }
        assert!(!text.contains("precision"), "{text}");
    }

    #[test]
    fn with_v_every_attribute_is_on_the_line() {
        let span = collective();
        let style = LineStyle {
            label: "rank 0",
            origin_ns: 0,
            all: true,
        };
        let text = line(style, &span, 3);
        for (key, value) in &span.attributes {
            if !HIDDEN_ATTRIBUTES.contains(key) {
                assert!(
                    text.contains(&format!("{key}={value}")),
                    "{key} not in {text}"
                );
            }
        }
        assert!(
            text.contains("and on past the end of any terminal line"),
            "{text}"
        );
    }
}
