//! The event path fed by the kernel-side generator (`bench_emit`, lens-ebpf/src/bench_gen.rs)
//! through the real ring buffer, decoder and span builder (the throughput example's harness):
//! every event a paced run sends arrives, decodes to the collective it describes and
//! becomes one span.
use std::time::Duration;

use lens_probe::{
    events::{CollectiveOp, ProbeEvent},
    nccl::{DataType, RedOp},
    settings::groups::SpanGroups,
    sink::{EventSink, SinkInput},
    spans::{SpanBuilder, SpanExporter, SpanRecord},
};

/// The bench harness lives with the example that runs it, out of the library.
#[path = "../../lens-userspace/examples/throughput/harness.rs"]
mod throughput;
use throughput::{EVENT_COMM, EVENT_COUNT, EVENT_STREAM, MAX_EVENTS_PER_RUN, Options};

/// Checks each event against what the generator writes.
#[derive(Default)]
struct Expect {
    pid: u32,
    all_reduces: u64,
    /// The first few events that are not the expected all-reduce.
    unexpected: Vec<String>,
    others: u64,
}

impl Expect {
    fn event(&mut self, event: &ProbeEvent) {
        let expected = matches!(
            event,
            ProbeEvent::Collective {
                timing,
                op: CollectiveOp::AllReduce,
                count: EVENT_COUNT,
                datatype: Some(DataType::Float32),
                redop: Some(RedOp::Sum),
                peer: None,
                comm: EVENT_COMM,
                stream: EVENT_STREAM,
                result: 0,
                ..
            } if timing.tgid == self.pid && timing.tid != 0 && timing.end_ns >= timing.start_ns
        );
        if expected {
            self.all_reduces += 1;
        } else {
            self.others += 1;
            if self.unexpected.len() < 5 {
                self.unexpected.push(format!("{event:?}"));
            }
        }
    }
}

impl EventSink for Expect {
    fn on(&mut self, input: &SinkInput<'_>) {
        if let SinkInput::Event(event) = *input {
            self.event(event);
        }
    }
}

#[derive(Default)]
struct CountSpans {
    all_reduce: u64,
    other: Vec<&'static str>,
}

impl SpanExporter for CountSpans {
    fn export(&mut self, span: SpanRecord) {
        if span.name == "nccl.all_reduce" {
            self.all_reduce += 1;
        } else {
            self.other.push(span.name);
        }
    }
}

#[test]
fn generator_events_arrive_whole_and_become_spans() {
    if !lens_tests::require_bpf("generator_events_arrive_whole_and_become_spans") {
        return;
    }
    const EVENTS: u64 = 200_000;
    let mut expect = Expect {
        pid: std::process::id(),
        ..Expect::default()
    };
    let mut spans = SpanBuilder::new(
        "per_step".parse::<SpanGroups>().unwrap(),
        CountSpans::default(),
    );
    // 4 s at 50 000 events/s: a rate any machine drains, loaded or not.
    let report = throughput::run(
        Options {
            rate: Some(50_000.0),
            events: Some(EVENTS),
            duration: Some(Duration::from_secs(60)),
            events_per_run: MAX_EVENTS_PER_RUN,
            pin: None,
        },
        &mut (&mut expect, &mut spans),
    )
    .unwrap();
    assert_eq!(report.sent, EVENTS, "{report:?}");
    assert_eq!(report.lost_ring_full, 0, "{report:?}");
    assert_eq!(report.received, EVENTS, "{report:?}");
    assert_eq!(report.undecodable, 0, "{report:?}");
    assert_eq!(report.lost(), 0, "{report:?}");
    assert_eq!(report.runs, EVENTS.div_ceil(u64::from(MAX_EVENTS_PER_RUN)));
    assert_eq!(
        (expect.all_reduces, expect.others),
        (EVENTS, 0),
        "unexpected events, first ones: {:#?}",
        expect.unexpected
    );
    // Paced: not faster than asked (the run takes ~4 s).
    assert!(report.producer_s >= 3.5, "{report:?}");
    let spans = spans.into_exporter();
    assert_eq!(spans.all_reduce, EVENTS);
    // And the job span, closed when the run ends.
    assert_eq!(spans.other, ["train.job"]);
}
