//! The console exporter: each process's span tree, indented, printed one top-level phase
//! at a time as it completes (a step with its phases and calls, an evaluation, a
//! checkpoint), and the job line when the process ends.
use std::{
    collections::{HashMap, HashSet},
    io::Write,
};

use super::{SpanExporter, SpanId, SpanRecord, SpanStatus};
use crate::{semconv, summary::format_duration, target::ProcessInfo};

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
}

impl<W: Write> ConsoleTree<W> {
    pub fn new(out: W) -> ConsoleTree<W> {
        ConsoleTree {
            out,
            processes: HashMap::new(),
        }
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

fn line(label: &str, span: &SpanRecord, depth: usize, origin_ns: u64) -> String {
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
    for (key, value) in &span.attributes {
        if !HIDDEN_ATTRIBUTES.contains(key) {
            text.push_str(&format!("  {key}={value}"));
        }
    }
    if span.truncated() {
        text.push_str("  (truncated)");
    }
    if let SpanStatus::Error(message) = &span.status {
        text.push_str(&format!("  ERROR: {message}"));
    }
    text
}

/// Lines of `root` and everything below it among `children` (pending spans by parent,
/// each list in start order), depth first.
fn subtree(
    label: &str,
    children: &HashMap<SpanId, Vec<&SpanRecord>>,
    root: &SpanRecord,
    depth: usize,
    origin_ns: u64,
    out: &mut Vec<String>,
    depths: &mut Vec<(SpanId, usize)>,
) {
    out.push(line(label, root, depth, origin_ns));
    depths.push((root.id, depth));
    for child in children.get(&root.id).into_iter().flatten() {
        subtree(label, children, child, depth + 1, origin_ns, out, depths);
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
        if process.job == Some(span.id) {
            let mut text = line(&process.label, &span, 0, process.start_ns);
            // The job line: its name and duration, no offset.
            if let Some(at) = text.find(span.name) {
                text.drain(..at);
            }
            let _ = writeln!(self.out, "lens-probe: [{}] {text}", process.label);
            return;
        }
        let top_level = span.parent.is_none() || span.parent == process.job;
        if let Some(depth) = span.parent.and_then(|p| process.printed.get(&p).copied()) {
            let text = line(&process.label, &span, depth + 1, process.start_ns);
            let _ = writeln!(self.out, "{text}  (completed after its parent)");
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
        subtree(
            &process.label,
            &children,
            &span,
            0,
            process.start_ns,
            &mut lines,
            &mut depths,
        );
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
