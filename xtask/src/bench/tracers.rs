//! lens-probe and bpftrace processes seen from outside: other tracers running beside the
//! bench, and the teardown each lens-probe run leaves behind.

use std::collections::BTreeSet;
use std::fs;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::say;

/// Other tracers seen between runs (they share uprobes on the same library files and
/// the CPUs: the numbers are then not clean).
#[derive(Default)]
pub(super) struct Watch {
    pub(super) foreign: BTreeSet<String>,
}

impl Watch {
    pub(super) fn check(&mut self) {
        for pid in lens_probe_pids() {
            self.foreign.insert(format!("lens-probe (pid {pid})"));
        }
        if let Ok(out) = Command::new("pgrep")
            .args(["-x", "bpftrace"])
            .stderr(Stdio::null())
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                self.foreign.insert(format!("bpftrace (pid {pid})"));
            }
        }
    }
}

/// Live (not zombie) processes named `lens-probe`.
pub(super) fn lens_probe_pids() -> BTreeSet<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return BTreeSet::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // `PID (COMM) STATE …`
            let Some((head, rest)) = stat.rsplit_once(") ") else {
                return false;
            };
            head.split_once(" (")
                .is_some_and(|(_, comm)| comm == "lens-probe")
                && !rest.starts_with('Z')
                && !rest.starts_with('X')
        })
        .collect()
}

/// lens-probe exits at once and leaves a child holding the probes' descriptors: the
/// kernel removes the uprobes (~0.1 s each) when that child closes them, as it exits (its
/// memory, and so its command line, is gone by then). Waits until every lens-probe that
/// was not running before the run (`before`) is gone, so that the next run does not
/// share the machine with that teardown; returns how long it took.
pub(super) fn wait_teardown(name: &str, before: &BTreeSet<u32>) -> f64 {
    let started = Instant::now();
    let limit = Duration::from_secs(120);
    loop {
        let left: Vec<u32> = lens_probe_pids().difference(before).copied().collect();
        if left.is_empty() {
            return started.elapsed().as_secs_f64();
        }
        if started.elapsed() > limit {
            say(&format!(
                "{name}: lens-probe processes {left:?} still there after {} s; going on",
                limit.as_secs()
            ));
            return started.elapsed().as_secs_f64();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
