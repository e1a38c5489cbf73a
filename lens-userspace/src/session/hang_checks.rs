//! `--hang-timeout`: in-flight collectives read from the kernel, and the watcher's
//! verdicts handed to the sink.

use lens_common::ProbeId;

use crate::{
    hangs::{self, HangChange},
    nccl::DataType,
    sink::EventSink,
};

use super::Session;

impl Session {
    /// The calls traced threads are in now (the kernel's entries waiting for returns).
    pub(super) fn inflight_calls(&self) -> Vec<hangs::InflightCall> {
        self.bpf
            .maps
            .inflight
            .calls()
            .into_iter()
            .filter_map(|call| {
                let (handle, bytes) = call.collective.map_or((0, None), |entry| {
                    let bytes = DataType::from_raw(entry.datatype)
                        .map(|dtype| entry.count.saturating_mul(dtype.size_bytes()));
                    (entry.comm, bytes)
                });
                Some(hangs::InflightCall {
                    pid: (call.key.pid_tgid >> 32) as u32,
                    tid: call.key.pid_tgid as u32,
                    probe: ProbeId::from_u32(call.key.probe)?,
                    start_ns: call.start_ns,
                    handle,
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
                        crate::say!("{line}");
                    }
                    sink.on_hang(&report);
                }
                HangChange::Resolved(resolved) => {
                    crate::say!("{}", resolved.console_line());
                    sink.on_hang_resolved(&resolved);
                }
            }
        }
    }
}
