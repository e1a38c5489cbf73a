//! `--hang-timeout`: in-flight collectives read from the kernel, and the watcher's
//! verdicts handed to the sink.

use aya::maps::HashMap as BpfHashMap;
use lens_common::{Event, InflightKey, ProbeId, maps};

use crate::{
    events::{self},
    hangs::{self, HangChange},
    sink::EventSink,
};

use super::Session;

impl Session {
    /// The calls traced threads are in now (the kernel's entries waiting for returns).
    pub(super) fn inflight_calls(&self) -> Vec<hangs::InflightCall> {
        let Some(map) = self.ebpf.map(maps::INFLIGHT) else {
            return Vec::new();
        };
        let Ok(inflight) = BpfHashMap::<_, InflightKey, Event>::try_from(map) else {
            return Vec::new();
        };
        inflight
            .iter()
            .filter_map(|entry| entry.ok())
            .filter_map(|(key, event)| {
                let probe = ProbeId::from_u32(key.probe)?;
                let nccl = events::CollectiveOp::from_probe(probe).is_some();
                let bytes = crate::nccl::DataType::from_raw(event.datatype)
                    .filter(|_| nccl)
                    .map(|dtype| event.count.saturating_mul(dtype.size_bytes()));
                let collective = nccl || events::CollectiveOp::from_gloo_probe(probe).is_some();
                Some(hangs::InflightCall {
                    pid: (key.pid_tgid >> 32) as u32,
                    tid: key.pid_tgid as u32,
                    probe,
                    start_ns: event.start_ns,
                    handle: if collective { event.comm } else { 0 },
                    bytes,
                })
            })
            .collect()
    }

    /// One look for hung collectives (`--hang-timeout`).
    pub(super) fn check_hangs(&mut self, sink: &mut dyn EventSink) {
        let inflight = self.inflight_calls();
        let changes = self
            .hangs
            .check(crate::spans::monotonic_now_ns(), &inflight);
        self.report_hangs(changes, sink);
    }

    /// Hangs found (with where each rank is, read now) and resolved: on the console and
    /// to the sink.
    pub(super) fn report_hangs(&mut self, changes: Vec<HangChange>, sink: &mut dyn EventSink) {
        for change in changes {
            match change {
                HangChange::Found(hang) => {
                    let report = hangs::HangReport::read(hang);
                    for line in report.console_lines() {
                        eprintln!("{line}");
                    }
                    sink.on_hang(&report);
                }
                HangChange::Resolved(resolved) => {
                    eprintln!("{}", resolved.console_line());
                    sink.on_hang_resolved(&resolved);
                }
            }
        }
    }
}
