//! Draining the ring buffer: decode each record, update the session's state for control
//! events (fork, exec, exit, library loads) and hand the rest to the sink.

use aya::maps::{MapData, RingBuf};
use log::warn;

use crate::{
    events::{self, ControlEvent, Decoded, ProbeEvent},
    sink::EventSink,
    sys::target::{self, ExitStatus},
};

use super::Session;

impl Session {
    pub(super) fn drain(&mut self, ring: &mut RingBuf<MapData>, sink: &mut dyn EventSink) {
        loop {
            let batch = events::decode_batch(ring);
            if batch.is_empty() {
                return;
            }
            // Phase marks may close steps: their kernels are read first.
            if let Some(kernels) = self.gpu.kernels.as_mut() {
                kernels.on_batch(probe_events(&batch), &mut self.bpf.maps.launches, sink);
            }
            self.hold_candidates(&batch);
            for decoded in batch {
                match decoded {
                    Ok(Decoded::Control(control)) => self.on_control(control, sink),
                    Ok(Decoded::Probe(sample @ ProbeEvent::PyStack { .. })) => {
                        self.python
                            .on_sample(&sample, &mut self.bpf.maps.python, sink);
                    }
                    Ok(Decoded::Probe(mut event)) => {
                        self.hangs.observe(&mut event);
                        let rank = self.targets.rank_of(event.tgid());
                        self.gpu.memory.on_event(&mut event, rank);
                        self.python
                            .on_event(&mut event, &mut self.bpf.maps.python, sink);
                        sink.on_event(&event);
                    }
                    Err(error) => {
                        self.events.undecodable += 1;
                        warn!("undecodable event: {error:?}");
                    }
                }
            }
            // Held candidates that did not become targets go on.
            for pid in self.stops.held_candidates.drain() {
                target::resume(pid);
            }
            let now = crate::spans::monotonic_now_ns();
            self.python.confirm(now, &mut self.bpf.maps.python, sink);
        }
    }

    /// A process-lifecycle notice: targets, attaching and exits follow it.
    fn on_control(&mut self, control: ControlEvent, sink: &mut dyn EventSink) {
        match control {
            ControlEvent::LinkMapChanged {
                tgid,
                stopped,
                traced,
            } => self.on_link_map_changed(tgid, stopped, traced, sink),
            ControlEvent::ProcessForked { parent, child } => self.on_fork(parent, child, sink),
            ControlEvent::ProcessExec { tgid, traced: true } => self.on_exec(tgid, sink),
            ControlEvent::ProcessExec {
                tgid,
                traced: false,
            } => self.on_node_exec(tgid),
            ControlEvent::ProcessExit { tgid, wait_status } => {
                self.targets
                    .exited(tgid, ExitStatus::from_wait_status(wait_status));
            }
        }
    }
}

/// The events of a batch that are for the sinks.
pub(super) fn probe_events(
    batch: &[std::result::Result<Decoded, events::DecodeError>],
) -> impl Iterator<Item = &ProbeEvent> {
    batch.iter().filter_map(|decoded| match decoded {
        Ok(Decoded::Probe(event)) => Some(event),
        _ => None,
    })
}
