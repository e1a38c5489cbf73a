//! The console line that says what is traced while a job starts. Attaching libtorch
//! (its symbol table, hundreds of probes) and a launcher's workers takes seconds during
//! which nothing else prints: the line says that lens-probe is at work, and on what.
use std::time::{Duration, Instant};

/// What is traced now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Traced {
    pub processes: usize,
    pub libraries: usize,
    pub uprobes: usize,
    /// The kernel links the uprobes went in as (fewer with uprobe_multi links): what the
    /// kernel has to remove, one at a time, after lens-probe exits.
    pub links: usize,
}

impl Traced {
    fn line(&self) -> String {
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        format!(
            "lens-probe: tracing {}: {}, {} in {}",
            plural(self.processes, "process", "processes"),
            plural(self.libraries, "library", "libraries"),
            plural(self.uprobes, "uprobe", "uprobes"),
            plural(self.links, "link", "links"),
        )
    }
}

/// A change is shown at once, then at most once every this long (a launcher's workers
/// each load a handful of libraries within a second or two: one line, not dozens).
const AT_MOST_EVERY: Duration = Duration::from_secs(2);

/// Decides when the line is due. Changes between two lines are not lost: the next
/// [`AttachStatus::due`] after the pause shows the latest counts.
#[derive(Debug, Default)]
pub struct AttachStatus {
    shown: Option<(Traced, Instant)>,
}

impl AttachStatus {
    /// The line to print now for `traced`, if any: nothing attached yet, nothing more
    /// than the last line said (processes that end are the summary's), or a line shown
    /// less than [`AT_MOST_EVERY`] ago, says nothing.
    pub fn due(&mut self, traced: Traced, now: Instant) -> Option<String> {
        if traced.libraries == 0 {
            return None;
        }
        match self.shown {
            Some((shown, _))
                if traced.processes <= shown.processes
                    && traced.libraries <= shown.libraries
                    && traced.uprobes <= shown.uprobes =>
            {
                return None;
            }
            Some((_, at)) if now.duration_since(at) < AT_MOST_EVERY => return None,
            _ => {}
        }
        self.shown = Some((traced, now));
        Some(traced.line())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `uprobes` went in as uprobe_multi links, 4 to a link.
    fn traced(processes: usize, libraries: usize, uprobes: usize) -> Traced {
        Traced {
            processes,
            libraries,
            uprobes,
            links: uprobes.div_ceil(4),
        }
    }

    #[test]
    fn the_first_attach_is_shown_at_once_and_a_burst_of_changes_as_one_line() {
        let mut status = AttachStatus::default();
        let start = Instant::now();
        assert_eq!(status.due(traced(1, 0, 0), start), None);
        assert_eq!(
            status.due(traced(1, 1, 4), start).as_deref(),
            Some("lens-probe: tracing 1 process: 1 library, 4 uprobes in 1 link")
        );
        // Three more libraries within the pause: nothing yet.
        for (libraries, at) in [(2, 100), (3, 500), (4, 1900)] {
            let now = start + Duration::from_millis(at);
            assert_eq!(status.due(traced(2, libraries, 40), now), None);
        }
        // Then the latest counts, once.
        let later = start + Duration::from_millis(2100);
        assert_eq!(
            status.due(traced(2, 4, 40), later).as_deref(),
            Some("lens-probe: tracing 2 processes: 4 libraries, 40 uprobes in 10 links")
        );
        assert_eq!(
            status.due(traced(2, 4, 40), later + AT_MOST_EVERY * 5),
            None
        );
        // A process that ends is no news.
        assert_eq!(
            status.due(traced(1, 4, 40), later + AT_MOST_EVERY * 6),
            None
        );
    }
}
