//! What the bench reads of `lens-probe --summary-json` (written by
//! lens-userspace/src/summary.rs `to_json` and lens-userspace/src/main.rs). Only the fields
//! the bench uses are typed; the others are ignored, so the summary may grow without the
//! bench following. Sections a run may lack (no budget, a process without collectives)
//! default to empty rather than failing the run.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use xtask::error::{self, Error, Result};

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub(super) struct Summary {
    #[serde(default)]
    pub(super) processes: Vec<Process>,
    #[serde(default)]
    pub(super) losses: Losses,
    /// lens-probe's own CPU over its run (`OwnCpu`).
    pub(super) lens_probe_cpu: Option<OwnCpu>,
    /// Only with `--overhead-budget` (`BudgetReport`).
    pub(super) overhead_budget: Option<BudgetAccount>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub(super) struct Process {
    /// `null` when lens-probe could not read it.
    #[serde(default)]
    pub(super) command_line: Option<Vec<String>>,
    /// Probe hits by function name.
    #[serde(default)]
    pub(super) calls: BTreeMap<String, u64>,
    /// By collective operation.
    #[serde(default)]
    pub(super) collectives: BTreeMap<String, Counted>,
    /// By sync kind.
    #[serde(default)]
    pub(super) sync_waits: BTreeMap<String, Counted>,
    #[serde(default)]
    pub(super) probe_cost: Option<ProbeCost>,
}

/// The `calls` of a collective's or a sync kind's statistics.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
pub(super) struct Counted {
    #[serde(default)]
    pub(super) calls: u64,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
pub(super) struct ProbeCost {
    pub(super) estimated_ns: u64,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub(super) struct Losses {
    /// By cause.
    #[serde(default)]
    pub(super) kernel: BTreeMap<String, u64>,
    #[serde(default)]
    pub(super) undecodable: u64,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
pub(super) struct OwnCpu {
    pub(super) user_s: f64,
    pub(super) system_s: f64,
}

/// The overhead budget's own account of a run.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
pub(super) struct BudgetAccount {
    pub(super) estimated_percent: f64,
    pub(super) sampled_percent: f64,
    pub(super) per_hit_ns: f64,
    /// A count, read as a float because the table's rows are made of floats.
    pub(super) windows: f64,
}

impl Summary {
    /// Reads the file `--summary-json` wrote; `Err` is one line naming it.
    pub(super) fn read(path: &Path) -> Result<Summary> {
        let text = error::read_to_string(path)?;
        serde_json::from_str(&text).map_err(|e| Error::json(path, e))
    }

    /// The process run as `PROGRAM ARGS…` (the program named by the end of its path).
    pub(super) fn process(&self, program: &str, args: &[&str]) -> Option<&Process> {
        self.processes.iter().find(|p| {
            let argv = p.command_line.as_deref().unwrap_or_default();
            argv.len() == args.len() + 1
                && argv[0].ends_with(program)
                && argv[1..].iter().zip(args).all(|(arg, want)| arg == want)
        })
    }

    /// Events the kernel and the decoder lost.
    pub(super) fn lost(&self) -> u64 {
        self.losses.kernel.values().sum::<u64>() + self.losses.undecodable
    }

    /// lens-probe's own CPU seconds (user + system).
    pub(super) fn tracer_cpu_s(&self) -> Option<f64> {
        self.lens_probe_cpu.map(|cpu| cpu.user_s + cpu.system_s)
    }
}

impl Process {
    /// Hits of one probed function.
    pub(super) fn calls_of(&self, function: &str) -> u64 {
        self.calls.get(function).copied().unwrap_or(0)
    }

    /// Events it sent to user space: collectives and sync waits.
    pub(super) fn events(&self) -> u64 {
        let calls =
            |stats: &BTreeMap<String, Counted>| stats.values().map(|c| c.calls).sum::<u64>();
        calls(&self.collectives) + calls(&self.sync_waits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Trimmed from a real `--summary-json` of `trainer 40` under `per_step`.
    const SAMPLE: &str = r#"{
      "processes": [
        {"pid": 11, "name": "sh", "command_line": ["sh", "-c", "x"], "ended": true,
         "exit": {"code": 0}, "communicators": [], "collectives": {}, "gloo_collectives": {},
         "sync_waits": {}, "calls": {}, "probe_cost": null},
        {"pid": 12, "name": "trainer", "command_line": null, "calls": {"ncclAllReduce": 1}},
        {"pid": 13, "name": "trainer", "command_line": ["/f/trainer", "40"], "ended": true,
         "communicators": [{"comm": 1, "rank": 0, "nranks": 1, "id_hash": 7, "result": 0}],
         "collectives": {"all_reduce": {"calls": 40, "bytes": 9, "call_time_ns": 5, "errors": 0},
                         "send": {"calls": 40, "bytes": 0, "call_time_ns": 1, "errors": 0}},
         "gloo_collectives": {},
         "sync_waits": {"stream": {"calls": 40, "total_ns": 9, "p50_ns": 3, "p99_ns": 4, "max_ns": 5}},
         "calls": {"cudaLaunchKernel": 400, "ncclAllReduce": 40, "ncclCommInitRank": 1},
         "probe_cost": {"estimated_ns": 2500000, "traced_ns": 90000000, "entry_hit_ns": 700,
                        "return_hit_ns": 300}}
      ],
      "processes_without_training": 2,
      "losses": {"kernel": {"ring_buffer_full": 2, "unmatched_return": 1}, "undecodable": 0},
      "lens_probe_cpu": {"user_s": 1.25, "system_s": 0.5, "wall_s": 3.0},
      "overhead_budget": {"budget_percent": 1.0, "per_hit_ns": 780.0, "estimated_percent": 0.4,
                          "sampled_percent": 2.5, "windows": 3},
      "stragglers": {}, "late_attaches": 0
    }"#;

    #[test]
    fn a_real_summary_reads() {
        let summary: Summary = serde_json::from_str(SAMPLE).unwrap();
        assert_eq!(summary.processes.len(), 3);
        assert_eq!(summary.lost(), 3);
        assert_eq!(summary.tracer_cpu_s(), Some(1.75));
        assert_eq!(
            summary.overhead_budget,
            Some(BudgetAccount {
                estimated_percent: 0.4,
                sampled_percent: 2.5,
                per_hit_ns: 780.0,
                windows: 3.0
            })
        );
        let trainer = summary.process("trainer", &["40"]).unwrap();
        assert_eq!(trainer.calls_of("cudaLaunchKernel"), 400);
        assert_eq!(trainer.calls_of("cudaStreamSynchronize"), 0);
        assert_eq!(trainer.events(), 120);
        assert_eq!(
            trainer.probe_cost,
            Some(ProbeCost {
                estimated_ns: 2_500_000
            })
        );
        assert!(summary.process("trainer", &["1"]).is_none());
        assert!(summary.process("sh", &["-c"]).is_none());
        assert!(summary.process("sh", &["-c", "x"]).is_some());
    }

    #[test]
    fn missing_sections_are_empty() {
        let summary: Summary = serde_json::from_str(r#"{"processes": []}"#).unwrap();
        assert_eq!(summary, Summary::default());
        assert_eq!(summary.lost(), 0);
        assert_eq!(summary.tracer_cpu_s(), None);
        assert!(serde_json::from_str::<Summary>(r#"{"processes": {}}"#).is_err());
    }
}
