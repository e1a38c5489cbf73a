//! Metrics: time series derived from the spans and counters of each traced process,
//! recorded with the OpenTelemetry SDK (one meter provider per process, so each carries
//! the process's resource) and collected by the export thread every
//! `OTEL_METRIC_EXPORT_INTERVAL` and when the process ends. Attributes stay low in
//! cardinality: operation, dtype, kind, group; never a pid, a kernel or a stream. Names
//! and units are listed in `docs/metrics.md`.
use std::{
    collections::BTreeMap,
    sync::{Arc, Weak},
    time::Duration,
};

use lens_common::ProbeId;
use opentelemetry::{
    KeyValue,
    metrics::{Counter, Gauge, Histogram, Meter, MeterProvider as _},
};
use opentelemetry_sdk::{
    Resource,
    error::OTelSdkResult,
    metrics::{
        InstrumentKind, ManualReader, Pipeline, SdkMeterProvider, Temporality,
        data::ResourceMetrics, reader::MetricReader,
    },
};

use crate::{
    semconv,
    spans::{AttrValue, SpanRecord, names},
    sys::usage::OwnCpu,
};

/// Metric names (see `docs/metrics.md`).
pub mod metric_names {
    pub const COLLECTIVE_CALLS: &str = "dl.collective.calls";
    pub const COLLECTIVE_BYTES: &str = "dl.collective.bytes";
    pub const COLLECTIVE_DURATION: &str = "dl.collective.duration";
    pub const COLLECTIVE_ARRIVAL_SKEW: &str = "dl.collective.arrival_skew";
    pub const COLLECTIVE_LAST_SEQ: &str = "dl.collective.last_seq";
    pub const HANGS: &str = "lens_probe.hangs";
    pub const SYNC_DURATION: &str = "cuda.sync.duration";
    pub const KERNEL_LAUNCHES: &str = "cuda.kernel.launches";
    pub const STEP_DURATION: &str = "dl.step.duration";
    pub const PHASE_DURATION: &str = "dl.phase.duration";
    pub const EVENTS_LOST: &str = "lens_probe.events.lost";
    pub const SPANS_LOST: &str = "lens_probe.spans.lost";
    pub const OVERHEAD: &str = "lens_probe.overhead";
    pub const CPU_TIME: &str = "lens_probe.cpu.time";
    /// OpenTelemetry's GPU memory name, on the process's resource: what this process
    /// holds, not the device's total.
    pub const GPU_MEMORY_USAGE: &str = "hw.gpu.memory.usage";
    pub const GPU_MEMORY_PEAK: &str = "dl.gpu.memory.peak";
    pub const GPU_MEMORY_CALLS: &str = "dl.gpu.memory.calls";
    pub const GPU_OUT_OF_MEMORY: &str = "dl.gpu.memory.out_of_memory";
}

/// `OTEL_METRIC_EXPORT_INTERVAL` (ms) of lens-probe's environment, default 60 s as the
/// OpenTelemetry SDKs have it.
pub fn export_interval() -> Duration {
    std::env::var("OTEL_METRIC_EXPORT_INTERVAL")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map_or(Duration::from_secs(60), Duration::from_millis)
}

/// A [`ManualReader`] the export thread can collect while the provider also holds it.
#[derive(Debug, Clone)]
pub struct SharedReader(Arc<ManualReader>);

impl SharedReader {
    fn new() -> SharedReader {
        SharedReader(Arc::new(
            ManualReader::builder()
                .with_temporality(Temporality::Cumulative)
                .build(),
        ))
    }

    pub fn collect(&self) -> Option<ResourceMetrics> {
        let mut metrics = ResourceMetrics::default();
        self.0.collect(&mut metrics).ok()?;
        Some(metrics)
    }
}

impl MetricReader for SharedReader {
    fn register_pipeline(&self, pipeline: Weak<Pipeline>) {
        self.0.register_pipeline(pipeline);
    }
    fn collect(&self, rm: &mut ResourceMetrics) -> OTelSdkResult {
        self.0.collect(rm)
    }
    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }
    fn temporality(&self, kind: InstrumentKind) -> Temporality {
        self.0.temporality(kind)
    }
}

/// Bucket bounds in seconds, from 10 µs (a collective's enqueue) to 10 min (a step).
const DURATION_BOUNDS: [f64; 16] = [
    1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0, 600.0,
];

/// The instruments of one traced process.
pub struct ProcessMetrics {
    provider: SdkMeterProvider,
    pub reader: SharedReader,
    collectives: CollectiveMetrics,
    hangs: Counter<u64>,
    sync_duration: Histogram<f64>,
    launches: LaunchMetrics,
    /// lens-probe's estimate of what its probes cost the process: a share of the time.
    overhead: Gauge<f64>,
    step_duration: Histogram<f64>,
    phase_duration: Histogram<f64>,
    memory: MemoryMetrics,
    /// The launch totals are an overhead budget's estimates (`cuda.launch.sampled`).
    pub launches_sampled: bool,
}

/// The process's GPU memory, from its memory calls (`gpu_memory`).
struct MemoryMetrics {
    usage: Gauge<u64>,
    peak: Gauge<u64>,
    calls: Counter<u64>,
    out_of_memory: Counter<u64>,
}

impl MemoryMetrics {
    fn new(meter: &Meter) -> MemoryMetrics {
        MemoryMetrics {
            usage: meter
                .u64_gauge(metric_names::GPU_MEMORY_USAGE)
                .with_unit("By")
                .with_description(
                    "Device memory this process holds: its allocations and created physical \
                     memory not yet freed, as its CUDA memory calls say",
                )
                .build(),
            peak: meter
                .u64_gauge(metric_names::GPU_MEMORY_PEAK)
                .with_unit("By")
                .with_description("The most device memory this process held so far")
                .build(),
            calls: meter
                .u64_counter(metric_names::GPU_MEMORY_CALLS)
                .with_unit("{call}")
                .with_description("CUDA memory calls, by what they did (dl.gpu.memory.op)")
                .build(),
            out_of_memory: meter
                .u64_counter(metric_names::GPU_OUT_OF_MEMORY)
                .with_unit("{call}")
                .with_description("Allocations that failed for want of device memory")
                .build(),
        }
    }
}

/// A process's collective calls: counts, sizes, durations, skew, and how far each
/// communicator got.
struct CollectiveMetrics {
    calls: Counter<u64>,
    bytes: Counter<u64>,
    duration: Histogram<f64>,
    arrival_skew: Histogram<f64>,
    last_seq: Gauge<u64>,
    /// The highest collective number seen per communicator (spans leave out of order).
    newest_seq: BTreeMap<String, u64>,
}

/// A process's kernel launches, added from the kernel's totals.
struct LaunchMetrics {
    counter: Counter<u64>,
    /// Launch totals already added (the kernel's counters are read as totals).
    recorded: BTreeMap<ProbeId, u64>,
}

fn string_attr(span: &SpanRecord, key: &'static str) -> Option<KeyValue> {
    match span.attr(key)? {
        AttrValue::Str(value) => Some(KeyValue::new(key, value.clone())),
        _ => None,
    }
}

/// A meter provider for `resource` read by a [`SharedReader`], and its meter.
fn provider(resource: Resource) -> (SdkMeterProvider, SharedReader, Meter) {
    let reader = SharedReader::new();
    let provider = SdkMeterProvider::builder()
        .with_resource(resource)
        .with_reader(reader.clone())
        .build();
    let meter = provider.meter("lens-probe");
    (provider, reader, meter)
}

impl ProcessMetrics {
    pub fn new(resource: Resource) -> ProcessMetrics {
        let (provider, reader, meter) = provider(resource);
        let seconds = |name: &'static str, description: &'static str| {
            meter
                .f64_histogram(name)
                .with_unit("s")
                .with_description(description)
                .with_boundaries(DURATION_BOUNDS.to_vec())
                .build()
        };
        // Instruments are exported in the order they are made: keep it.
        let collectives = CollectiveMetrics {
            calls: meter
                .u64_counter(metric_names::COLLECTIVE_CALLS)
                .with_unit("{call}")
                .with_description("Collective and point-to-point calls")
                .build(),
            bytes: meter
                .u64_counter(metric_names::COLLECTIVE_BYTES)
                .with_unit("By")
                .with_description("Bytes given to collective calls (count × element size)")
                .build(),
            duration: seconds(
                metric_names::COLLECTIVE_DURATION,
                "Collective duration: enqueue to inferred completion (NCCL; by \
                 dl.collective.end.source, call_return: the enqueue only); not for gloo",
            ),
            arrival_skew: seconds(
                metric_names::COLLECTIVE_ARRIVAL_SKEW,
                "Last enqueue minus first of one collective across the traced ranks, \
                 recorded by the rank that arrived last",
            ),
            last_seq: meter
                .u64_gauge(metric_names::COLLECTIVE_LAST_SEQ)
                .with_unit("{collective}")
                .with_description(
                    "The newest collective number (dl.collective.seq) this rank called on \
                     each communicator: across a job's ranks, the lowest one of a communicator \
                     whose numbers stopped moving is the rank it waits for",
                )
                .build(),
            newest_seq: BTreeMap::new(),
        };
        ProcessMetrics {
            collectives,
            hangs: meter
                .u64_counter(metric_names::HANGS)
                .with_unit("{hang}")
                .with_description("Collectives found hung (--hang-timeout)")
                .build(),
            sync_duration: seconds(
                metric_names::SYNC_DURATION,
                "Time waiting in CUDA synchronisation calls",
            ),
            launches: LaunchMetrics {
                counter: meter
                    .u64_counter(metric_names::KERNEL_LAUNCHES)
                    .with_unit("{launch}")
                    .with_description("CUDA kernel and graph launches")
                    .build(),
                recorded: BTreeMap::new(),
            },
            overhead: meter
                .f64_gauge(metric_names::OVERHEAD)
                .with_unit("1")
                .with_description(
                    "lens-probe's estimate of its probes' cost to the process: the calls \
                     probed times what a probe hit costs here, over the time traced",
                )
                .build(),
            step_duration: seconds(metric_names::STEP_DURATION, "Training step duration"),
            phase_duration: seconds(
                metric_names::PHASE_DURATION,
                "Duration of training-loop phases, by span group",
            ),
            memory: MemoryMetrics::new(&meter),
            provider,
            reader,
            launches_sampled: false,
        }
    }

    /// Records what a finished span says about the process.
    pub fn record_span(&mut self, span: &SpanRecord) {
        let seconds = span.duration_ns() as f64 / 1e9;
        if span.name == names::HANG {
            let attributes: Vec<KeyValue> = [
                semconv::DL_COLLECTIVE_BACKEND,
                semconv::DL_COLLECTIVE_OP,
                semconv::LENS_PROBE_HANG_KIND,
            ]
            .into_iter()
            .filter_map(|key| string_attr(span, key))
            .collect();
            self.hangs.add(1, &attributes);
            return;
        }
        if span.attr(semconv::DL_COLLECTIVE_OP).is_some() {
            self.record_last_seq(span);
            let attributes: Vec<KeyValue> = [
                semconv::DL_COLLECTIVE_BACKEND,
                semconv::DL_COLLECTIVE_OP,
                semconv::DL_COLLECTIVE_DTYPE,
            ]
            .into_iter()
            .filter_map(|key| string_attr(span, key))
            .collect();
            self.collectives.calls.add(1, &attributes);
            if let Some(bytes) = span.int_attr(semconv::DL_COLLECTIVE_BYTES) {
                self.collectives.bytes.add(bytes.max(0) as u64, &attributes);
            }
            // The skew once per collective: by the rank that came last.
            if let (Some(skew), Some(last), Some(rank)) = (
                span.int_attr(semconv::DL_COLLECTIVE_ARRIVAL_SKEW_NS),
                span.int_attr(semconv::DL_COLLECTIVE_LAST_RANK),
                span.int_attr(semconv::DL_RANK),
            ) && last == rank
            {
                let mut attributes = attributes.clone();
                attributes.extend(string_attr(span, semconv::DL_COLLECTIVE_STRAGGLER_CAUSE));
                self.collectives
                    .arrival_skew
                    .record(skew as f64 / 1e9, &attributes);
            }
            // gloo calls are seen at their entry alone: no duration to record.
            if span.attr(semconv::DL_COLLECTIVE_BACKEND) != Some(&"gloo".into()) {
                let mut attributes = attributes;
                attributes.extend(string_attr(span, semconv::DL_COLLECTIVE_END_SOURCE));
                self.collectives.duration.record(seconds, &attributes);
            }
        } else if let Some(kind) = string_attr(span, semconv::CUDA_SYNC_KIND) {
            self.sync_duration.record(seconds, &[kind]);
        } else if span.name != names::JOB && span.group != crate::settings::groups::SpanGroup::Job {
            if span.name == names::STEP && !span.truncated() {
                self.step_duration.record(seconds, &[]);
            }
            self.phase_duration.record(
                seconds,
                &[KeyValue::new(semconv::NEMO_SPAN_GROUP, span.group.name())],
            );
        }
    }

    /// `dl.collective.last_seq` by communicator (a job has a few: low cardinality).
    fn record_last_seq(&mut self, span: &SpanRecord) {
        let (Some(AttrValue::Str(comm)), Some(seq)) = (
            span.attr(semconv::DL_COLLECTIVE_COMM_ID),
            span.int_attr(semconv::DL_COLLECTIVE_SEQ),
        ) else {
            return;
        };
        let seq = seq.max(0) as u64;
        let newest = self
            .collectives
            .newest_seq
            .entry(comm.to_string())
            .or_default();
        if seq < *newest {
            return;
        }
        *newest = seq;
        // The rank is the process's resource attribute (`dl.rank`, a label once exported).
        let mut attributes = vec![KeyValue::new(
            semconv::DL_COLLECTIVE_COMM_ID,
            comm.to_string(),
        )];
        attributes.extend(string_attr(span, semconv::DL_COLLECTIVE_BACKEND));
        self.collectives.last_seq.record(seq, &attributes);
    }

    /// Launch counters: totals so far, read from the kernel while the process runs and
    /// when it ends; what is new since the last reading is added.
    pub fn record_calls(&mut self, calls: &BTreeMap<ProbeId, u64>) {
        for (probe, kind) in [
            (ProbeId::CudaLaunchKernel, "kernel"),
            (ProbeId::CudaLaunchKernelExC, "kernel_ex"),
            (ProbeId::CudaGraphLaunch, "graph"),
            (ProbeId::CuLaunchKernel, "driver_kernel"),
            (ProbeId::CuLaunchKernelEx, "driver_kernel_ex"),
            (ProbeId::CuGraphLaunch, "driver_graph"),
        ] {
            let Some(&total) = calls.get(&probe) else {
                continue;
            };
            let recorded = self.launches.recorded.entry(probe).or_default();
            let new = total.saturating_sub(*recorded);
            *recorded = total.max(*recorded);
            if new > 0 && self.launches_sampled {
                self.launches.counter.add(
                    new,
                    &[
                        KeyValue::new(semconv::CUDA_LAUNCH_KIND, kind),
                        KeyValue::new(semconv::CUDA_LAUNCH_SAMPLED, true),
                    ],
                );
            } else if new > 0 {
                self.launches
                    .counter
                    .add(new, &[KeyValue::new(semconv::CUDA_LAUNCH_KIND, kind)]);
            }
        }
    }
}

impl ProcessMetrics {
    /// A memory call returned: what the process holds now.
    pub fn record_memory(&mut self, change: &crate::gpu_memory::MemoryChange) {
        self.memory.usage.record(change.held, &[]);
        self.memory.peak.record(change.peak, &[]);
        let op = KeyValue::new(semconv::DL_GPU_MEMORY_OP, change.op.name());
        self.memory.calls.add(1, &[op]);
        if change.out_of_memory.is_some() {
            self.memory.out_of_memory.add(1, &[]);
        }
    }

    /// What the probes have cost the process so far (a share of the time traced).
    pub fn record_probe_cost(&mut self, cost: crate::sink::ProbeCost) {
        self.overhead.record(cost.share(), &[]);
    }
}

impl Drop for ProcessMetrics {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// lens-probe's own health, as metrics of the `lens-probe` service.
pub struct ProbeMetrics {
    provider: SdkMeterProvider,
    pub reader: SharedReader,
    events_lost: Counter<u64>,
    spans_lost: Counter<u64>,
    cpu_time: Counter<f64>,
}

impl ProbeMetrics {
    pub fn new(resource: Resource) -> ProbeMetrics {
        let (provider, reader, meter) = provider(resource);
        ProbeMetrics {
            events_lost: meter
                .u64_counter(metric_names::EVENTS_LOST)
                .with_unit("{event}")
                .with_description("Kernel events lost, by cause")
                .build(),
            spans_lost: meter
                .u64_counter(metric_names::SPANS_LOST)
                .with_unit("{span}")
                .with_description("Spans not delivered, by reason")
                .build(),
            cpu_time: meter
                .f64_counter(metric_names::CPU_TIME)
                .with_unit("s")
                .with_description("lens-probe's own CPU time, every thread, by mode")
                .build(),
            provider,
            reader,
        }
    }

    pub fn record_events_lost(&self, cause: &'static str, count: u64) {
        self.events_lost.add(
            count,
            &[KeyValue::new(semconv::LENS_PROBE_LOSS_CAUSE, cause)],
        );
    }

    pub fn record_spans_lost(&self, reason: &'static str, count: u64) {
        self.spans_lost.add(
            count,
            &[KeyValue::new(semconv::LENS_PROBE_LOSS_CAUSE, reason)],
        );
    }

    pub fn record_cpu_time(&self, cpu: &OwnCpu) {
        for (mode, seconds) in [("user", cpu.user_s), ("system", cpu.system_s)] {
            self.cpu_time
                .add(seconds, &[KeyValue::new(semconv::CPU_MODE, mode)]);
        }
    }
}

impl Drop for ProbeMetrics {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}
