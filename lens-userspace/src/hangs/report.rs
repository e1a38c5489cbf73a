//! A hang as users read it: the console lines and what the span carries.
use lens_common::ProbeId;

use super::{
    Hang, HangKind, InflightCall, RankState, Resolved,
    location::{self, RankPlace},
};
use crate::events::CollectiveOp;

/// Python frames shown per rank on the console (innermost first); the span has them all.
const CONSOLE_FRAMES: usize = 6;

/// A hang with where each of its ranks is, read when it was found.
#[derive(Clone, Debug)]
pub struct HangReport {
    pub hang: Hang,
    /// One per rank, in [`Hang::ranks`] order.
    pub places: Vec<RankPlace>,
}

/// The name a user knows a probed call by.
pub fn call_name(probe: ProbeId) -> &'static str {
    match CollectiveOp::from_gloo_probe(probe) {
        Some(op) => op.gloo_span_name(),
        None => crate::probes::catalog::symbol(probe),
    }
}

fn seconds(ns: u64) -> String {
    format!("{:.1} s", ns as f64 / 1e9)
}

fn rank_list(ranks: &[RankState]) -> String {
    if ranks.is_empty() {
        return "none".into();
    }
    ranks
        .iter()
        .map(|r| r.rank.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Hang {
    /// `nccl all_reduce, communicator 00000000c0ffee12, seq 4, 16.0 KiB`.
    pub fn collective(&self) -> String {
        let op = self.op.map_or("collective", CollectiveOp::name);
        let mut text = format!(
            "{} {op}, communicator {:016x}, seq {}",
            self.backend.name(),
            self.comm,
            self.seq
        );
        if let Some(n) = self.bytes {
            text.push_str(&format!(", {}", crate::settings::format_size(n)));
        }
        text
    }

    /// What the hang is, in words: who arrived and who did not, for how long.
    pub fn summary(&self) -> String {
        let waited = seconds(self.detected_ns.saturating_sub(self.since_ns));
        match self.kind {
            HangKind::RanksMissing => format!(
                "{}: waiting {waited} for traced ranks that have not entered it; arrived: {}; \
                 missing: {}",
                self.collective(),
                rank_list(&self.arrived),
                rank_list(&self.missing)
            ),
            HangKind::NotCompleted => format!(
                "{}: every traced rank ({}) entered it; not finished after {waited}",
                self.collective(),
                rank_list(&self.arrived)
            ),
        }
    }
}

/// Where a rank is, in words: the probed call it waits in, or how far it got.
pub fn rank_state(rank: &RankState, now_ns: u64) -> String {
    match &rank.waiting_in {
        Some(call) => in_call(call, now_ns),
        None => format!(
            "in no probed call, {} collectives entered on this communicator",
            rank.entered
        ),
    }
}

fn in_call(call: &InflightCall, now_ns: u64) -> String {
    format!(
        "in {} for {}",
        call_name(call.probe),
        seconds(now_ns.saturating_sub(call.start_ns))
    )
}

impl HangReport {
    /// Reads where each rank of `hang` is now.
    pub fn read(hang: Hang) -> HangReport {
        let places = hang
            .ranks()
            .map(|rank| {
                let tid = rank.waiting_in.as_ref().map_or(rank.pid, |call| call.tid);
                location::read(rank.pid, tid)
            })
            .collect();
        HangReport { hang, places }
    }

    /// Per rank: its state, its Python stack (innermost first) and native place.
    pub fn rank_lines(&self) -> Vec<String> {
        self.hang
            .ranks()
            .zip(&self.places)
            .map(|(rank, place)| {
                let mut line = format!(
                    "rank {} (pid {}): {}",
                    rank.rank,
                    rank.pid,
                    rank_state(rank, self.hang.detected_ns)
                );
                if !place.python.is_empty() {
                    let frames: Vec<String> = place
                        .python
                        .iter()
                        .take(CONSOLE_FRAMES)
                        .map(ToString::to_string)
                        .collect();
                    line.push_str(&format!("; python: {}", frames.join(" < ")));
                }
                if let Some(native) = &place.native {
                    line.push_str(&format!("; native: {native}"));
                }
                line
            })
            .collect()
    }

    pub fn console_lines(&self) -> Vec<String> {
        std::iter::once(format!("lens-probe: hang: {}", self.hang.summary()))
            .chain(
                self.rank_lines()
                    .into_iter()
                    .map(|line| format!("lens-probe: hang:   {line}")),
            )
            .collect()
    }
}

impl Resolved {
    pub fn console_line(&self) -> String {
        let lasted = seconds(self.at_ns.saturating_sub(self.hang.since_ns));
        let how = if self.every_rank_went_on {
            "every traced rank went on"
        } else {
            "a process it involved ended before every rank went on"
        };
        format!(
            "lens-probe: hang resolved: {} after {lasted}: {how}",
            self.hang.collective()
        )
    }
}
