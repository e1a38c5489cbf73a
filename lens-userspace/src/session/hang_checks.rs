//! `--hang-timeout`: in-flight collectives read from the kernel, and the watcher's
//! verdicts handed to the sink.

use lens_common::{InflightKey, ProbeId};

use crate::{
    hangs::{self, HangChange},
    nccl::DataType,
    sink::EventSink,
};

use super::Session;

/// A call in flight, from its key and what its entry record says: when it began, the
/// communicator or group it runs on (collectives; 0 for the others) and its bytes.
fn inflight_call(
    key: InflightKey,
    start_ns: u64,
    handle: u64,
    bytes: Option<u64>,
) -> Option<hangs::InflightCall> {
    Some(hangs::InflightCall {
        pid: (key.pid_tgid >> 32) as u32,
        tid: key.pid_tgid as u32,
        probe: ProbeId::from_u32(key.probe)?,
        start_ns,
        handle,
        bytes,
    })
}

impl Session {
    /// The calls traced threads are in now (the kernel's entries waiting for returns).
    pub(super) fn inflight_calls(&self) -> Vec<hangs::InflightCall> {
        let inflight = &self.bpf.maps.inflight;
        let collectives = inflight
            .collectives
            .calls()
            .into_iter()
            .filter_map(|(key, entry)| {
                let call = entry.body;
                let bytes = DataType::from_raw(call.datatype)
                    .map(|dtype| call.count.saturating_mul(dtype.size_bytes()));
                inflight_call(key, call.times.start_ns, call.comm, bytes)
            });
        let syncs = inflight
            .syncs
            .calls()
            .into_iter()
            .map(|(key, entry)| (key, entry.body.times.start_ns));
        let inits = inflight
            .comm_inits
            .calls()
            .into_iter()
            .map(|(key, entry)| (key, entry.body.times.start_ns));
        let queries = inflight
            .queries
            .calls()
            .into_iter()
            .map(|(key, entry)| (key, entry.body.times.start_ns));
        let others = syncs
            .chain(inits)
            .chain(queries)
            .filter_map(|(key, start_ns)| inflight_call(key, start_ns, 0, None));
        collectives.chain(others).collect()
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
