//! Block 1b: the per-hit cost of each kind of probe, one function at a time. The fixture
//! `hammer KIND N` (tests/fixtures/hammer.c) calls one probed function N times in a tight
//! loop and prints the loop's own time; each kind runs uninstrumented, under bpftrace
//! `count()` on the same entry (the kernel's floor), under bpftrace with the return probe
//! too where lens-probe has one, and under lens-probe `per_step`. The loop runs on CPU 1,
//! the tracer (lens-probe, bpftrace) on CPU 0: what is measured is the cost on the probed
//! thread, not the two sharing a CPU. lens-probe's user side, flooded at these rates, would
//! otherwise take half the loop's CPU on a 2-CPU machine; its own CPU is a row of its own.

use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::fake::parse_bpftrace_count;
use super::proc::{Line, Proc, Stream};
use super::report::{Met, Row, Section, fmt_count, fmt_duration, median};
use super::rounds::Rounds;
use super::summary::Summary;
use super::{Ctx, RUN_TIMEOUT, Watch, fake_env, lens_command, lens_probe_pids, wait_teardown};
use xtask::error::{Context, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Launch,
    /// A launch straight to the driver (as cuBLAS, cuDNN, NCCL make them).
    Driver,
    Sync,
    Collective,
    Group,
    /// `cudaEventQuery` of an event no collective precedes (the caching allocator's).
    EventQuery,
    /// `cudaMalloc` and `cudaFree` (the fake runtime calls the fake driver's, as the real
    /// one does): a GPU memory call pair, rare in a real job.
    Memory,
}

impl Kind {
    pub(super) const ALL: [Kind; 7] = [
        Kind::Launch,
        Kind::Driver,
        Kind::Sync,
        Kind::Collective,
        Kind::Group,
        Kind::EventQuery,
        Kind::Memory,
    ];

    /// Issue 33's bound on lens-probe's cost, as a ratio to bpftrace on the same probes:
    /// a launch is only counted (1.05×); a kind that times its call or sends a record
    /// (entry + return, and `ncclGroupStart`'s record) 1.15×.
    fn bound(self) -> f64 {
        match self {
            Kind::Launch | Kind::Driver => 1.05,
            Kind::Sync | Kind::Collective | Kind::Group | Kind::EventQuery | Kind::Memory => 1.15,
        }
    }

    /// `hammer`'s first argument.
    fn arg(self) -> &'static str {
        match self {
            Kind::Launch => "launch",
            Kind::Driver => "driver",
            Kind::Sync => "sync",
            Kind::Collective => "collective",
            Kind::Group => "group",
            Kind::EventQuery => "event_query",
            Kind::Memory => "memory",
        }
    }

    fn library(self) -> &'static str {
        match self {
            Kind::Launch | Kind::Sync | Kind::EventQuery | Kind::Memory => "libcudart.so.12",
            Kind::Driver => "libcuda.so.1",
            Kind::Collective | Kind::Group => "libnccl.so.2",
        }
    }

    fn function(self) -> &'static str {
        match self {
            Kind::Launch => "cudaLaunchKernel",
            Kind::Driver => "cuLaunchKernel",
            Kind::Sync => "cudaStreamSynchronize",
            Kind::Collective => "ncclAllReduce",
            Kind::Group => "ncclGroupStart",
            Kind::EventQuery => "cudaEventQuery",
            Kind::Memory => "cudaMalloc",
        }
    }

    /// lens-probe's programs on this function (lens-userspace/src/probes/catalog/table.rs).
    fn programs(self) -> &'static str {
        match self {
            Kind::Launch => {
                "`count_only` (entry: counted in the kernel, and per kernel, no event) and \
                 `driver_launch` on the `cuLaunchKernel` the fake runtime calls (its caller is \
                 libcudart: not counted again)"
            }
            Kind::Driver => {
                "`driver_launch` (entry: the caller checked, counted in the kernel, and per \
                 kernel, no event)"
            }
            Kind::Sync => "`cuda_sync_entry` + `cuda_sync_return` (one record per call)",
            Kind::Collective => {
                "`nccl_collective_entry` (marks its stream for completion) + `nccl_collective_return` \
                 (one event per call)"
            }
            Kind::Group => "`nccl_group` (entry: one event per call)",
            Kind::EventQuery => {
                "`cuda_event_query_entry` + `cuda_event_query_return` (counted; the event is \
                 not one recorded after a collective: no event sent)"
            }
            Kind::Memory => {
                "`api_call_entry` + `api_call_return` on `cudaMalloc` and `cudaFree` (one \
                 record each), and on the `cuMemAlloc_v2` / `cuMemFree_v2` they call (return \
                 address read: the runtime's own, not recorded); per call pair"
            }
        }
    }

    /// Whether lens-probe also puts a return probe on the function.
    fn returns(self) -> bool {
        matches!(
            self,
            Kind::Sync | Kind::Collective | Kind::EventQuery | Kind::Memory
        )
    }

    /// Calls per timed run. The fake sync is a `nanosleep(0)` (~20 µs here): fewer calls
    /// keep its runs near the others' length.
    fn calls(self, quick: bool) -> u64 {
        let n = if quick { 100_000 } else { 500_000 };
        match self {
            Kind::Sync => n / 10,
            Kind::Memory => n / 5,
            _ => n,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    None,
    /// bpftrace `count()` on the entry; with `returns`, also on the return.
    Bpftrace {
        returns: bool,
    },
    Lens,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::None => "none",
            Variant::Bpftrace { returns: false } => "bpftrace",
            Variant::Bpftrace { returns: true } => "bpftrace-ret",
            Variant::Lens => "per_step",
        }
    }
}

/// Runs `hammer KIND 1` (so that the libraries' probes are in place: uprobes are per
/// file), then `hammer KIND N`, whose own loop time is the measure. `$0` is hammer.
const WRAPPER: &str = r#"T="$0"; "$T" "$1" 1 >/dev/null || exit 1; "$T" "$1" "$2""#;

/// `hammer: KIND N calls in T ns` → seconds.
pub(super) fn parse_loop_time(line: &str) -> Option<f64> {
    let rest = line.trim().strip_prefix("hammer: ")?;
    let (_, time) = rest.split_once(" calls in ")?;
    let ns: u64 = time.strip_suffix(" ns")?.parse().ok()?;
    Some(ns as f64 / 1e9)
}

fn bpftrace_script(ctx: &Ctx, kind: Kind, returns: bool) -> String {
    let target = format!(
        "{}:{}",
        ctx.fixtures.join(kind.library()).display(),
        kind.function()
    );
    let mut script = format!(
        "BEGIN {{ printf(\"lens-bench-ready\\n\"); }}\nuprobe:{target} {{ @ = count(); }}\n"
    );
    if kind == Kind::Launch {
        // The runtime launches through the driver, whose entry lens-probe probes too: the
        // floor is the same probe set.
        script.push_str(&format!(
            "uprobe:{}:cuLaunchKernel {{ @driver = count(); }}\n",
            ctx.fixtures.join("libcuda.so.1").display()
        ));
    }
    if returns {
        script.push_str(&format!("uretprobe:{target} {{ @ret = count(); }}\n"));
    }
    if kind == Kind::Memory {
        // The same points as lens-probe's: the free, and the driver calls both make.
        let points = [
            ("libcudart.so.12", "cudaFree"),
            ("libcuda.so.1", "cuMemAlloc_v2"),
            ("libcuda.so.1", "cuMemFree_v2"),
        ];
        for (i, (library, function)) in points.into_iter().enumerate() {
            let point = format!("{}:{function}", ctx.fixtures.join(library).display());
            script.push_str(&format!("uprobe:{point} {{ @m{i} = count(); }}\n"));
            if returns {
                script.push_str(&format!("uretprobe:{point} {{ @r{i} = count(); }}\n"));
            }
        }
    }
    script
}

/// The probed function's call count and the run's losses, from `--summary-json`: the
/// process run as `hammer KIND N`.
fn hammer_summary(summary: &Summary, kind: Kind, calls: u64) -> Result<(u64, u64)> {
    let n = calls.to_string();
    let process = summary
        .process("hammer", &[kind.arg(), &n])
        .ok_or_else(|| format!("no `hammer {} {n}` process in the summary", kind.arg()))?;
    Ok((process.calls_of(kind.function()), summary.lost()))
}

/// The CPU the loop runs on, and the one the tracer runs on (the same on a 1-CPU machine).
fn cpus() -> (&'static str, &'static str) {
    match std::thread::available_parallelism() {
        Ok(n) if n.get() >= 2 => ("1", "0"),
        _ => ("0", "0"),
    }
}

/// `taskset -c CPU`: a command run on that CPU only.
fn on_cpu(cpu: &str) -> Command {
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", cpu]);
    cmd
}

struct Run {
    loop_s: f64,
    /// lens-probe's own CPU (all its threads) over the run, from `--summary-json`.
    tracer_cpu_s: Option<f64>,
}

/// One kind's runs, each variant's in round order.
struct KindRuns<'a> {
    kind: Kind,
    calls: u64,
    rounds: &'a Rounds<(Kind, Variant), Run>,
}

impl KindRuns<'_> {
    fn runs(&self, variant: Variant) -> &[Run] {
        self.rounds.runs((self.kind, variant))
    }

    fn times(&self, variant: Variant) -> Vec<f64> {
        self.rounds.values((self.kind, variant), |r| r.loop_s)
    }

    /// Per round: (time of `variant` − uninstrumented time of the same round) / calls.
    fn per_call(&self, variant: Variant) -> Vec<f64> {
        self.rounds.over_base(
            (self.kind, variant),
            (self.kind, Variant::None),
            |r| r.loop_s,
            self.calls as f64,
        )
    }
}

pub(super) struct PerKindBlock {
    quick: bool,
    rounds: Rounds<(Kind, Variant), Run>,
    bpftrace_skipped: Option<String>,
    /// Counts that differ from what the loop made, and lost events.
    checks: Vec<String>,
}

impl PerKindBlock {
    fn kinds(&self) -> impl Iterator<Item = KindRuns<'_>> {
        Kind::ALL.into_iter().map(|kind| KindRuns {
            kind,
            calls: kind.calls(self.quick),
            rounds: &self.rounds,
        })
    }
}

/// What each kind runs under, in the order they run in a round.
fn variants(kind: Kind, bpftrace: bool) -> Vec<Variant> {
    let mut variants = vec![Variant::None];
    if bpftrace {
        variants.push(Variant::Bpftrace { returns: false });
        if kind.returns() {
            variants.push(Variant::Bpftrace { returns: true });
        }
    }
    variants.push(Variant::Lens);
    variants
}

pub(super) fn block(ctx: &Ctx, watch: &mut Watch, quick: bool) -> Result<PerKindBlock> {
    let cases = Kind::ALL.into_iter().flat_map(|kind| {
        variants(kind, ctx.bpftrace.is_ok())
            .into_iter()
            .map(move |variant| (kind, variant))
    });
    let mut checks = Vec::new();
    let rounds = Rounds::measure(
        ctx.rounds,
        cases,
        watch,
        |(kind, variant), round| run(ctx, kind, kind.calls(quick), variant, round, &mut checks),
        |(kind, variant), run| {
            let calls = kind.calls(quick);
            format!(
                "hammer {} {calls} under {:<12} {:.1} ns per call",
                kind.arg(),
                variant.name(),
                run.loop_s / calls as f64 * 1e9
            )
        },
    )?;
    Ok(PerKindBlock {
        quick,
        rounds,
        bpftrace_skipped: ctx.bpftrace.as_ref().err().map(ToString::to_string),
        checks,
    })
}

/// One timed `hammer KIND N` run: what its variants share.
struct HammerRun<'a> {
    ctx: &'a Ctx,
    kind: Kind,
    calls: u64,
    name: String,
    log: PathBuf,
    deadline: Instant,
    /// The CPU the tracer runs on.
    tracer_on: &'static str,
}

fn run(
    ctx: &Ctx,
    kind: Kind,
    calls: u64,
    variant: Variant,
    round: u32,
    checks: &mut Vec<String>,
) -> Result<Run> {
    let name = format!("hammer-{}-{}-r{round}", kind.arg(), variant.name());
    let run = HammerRun {
        ctx,
        kind,
        calls,
        log: ctx.logs.join(format!("{name}.log")),
        name,
        deadline: Instant::now() + RUN_TIMEOUT,
        tracer_on: cpus().1,
    };
    let mut loop_s = None;
    let mut on_line = |l: &Line| {
        if l.stream == Stream::Out
            && let Some(s) = parse_loop_time(&l.text)
        {
            loop_s = Some(s);
        }
    };
    let mut tracer_cpu_s = None;
    match variant {
        Variant::None => {
            let mut cmd = Command::new("env");
            cmd.current_dir(&ctx.root);
            run.wrap(&mut cmd);
            Proc::spawn(&run.name, &mut cmd, &run.log)?.finish_ok(run.deadline, &mut on_line)?;
        }
        Variant::Lens => tracer_cpu_s = run.under_lens(&mut on_line, checks)?,
        Variant::Bpftrace { returns } => run.under_bpftrace(returns, &mut on_line, checks)?,
    }
    let loop_s = loop_s.ok_or_else(|| {
        format!(
            "{}: hammer printed no loop time (output in {})",
            run.name,
            run.log.display()
        )
    })?;
    Ok(Run {
        loop_s,
        tracer_cpu_s,
    })
}

impl HammerRun<'_> {
    /// Appends `taskset -c CPU sh -c WRAPPER hammer KIND N` and the fixtures' environment.
    fn wrap(&self, cmd: &mut Command) {
        cmd.args(["taskset", "-c", cpus().0, "sh", "-c", WRAPPER])
            .arg(self.ctx.fixtures.join("hammer"))
            .arg(self.kind.arg())
            .arg(self.calls.to_string());
        fake_env(cmd);
    }

    /// Under `lens-probe --span-groups per_step`; returns lens-probe's own CPU, and checks
    /// its count of the calls and its losses.
    fn under_lens(
        &self,
        on_line: &mut impl FnMut(&Line),
        checks: &mut Vec<String>,
    ) -> Result<Option<f64>> {
        let (ctx, name, kind, calls) = (self.ctx, &self.name, self.kind, self.calls);
        let summary_path = ctx.out.join(format!("{name}.summary.json"));
        let _ = fs::remove_file(&summary_path);
        let pid_file = ctx.out.join(format!("{name}.pid"));
        let mut cmd = lens_command(ctx, Some(on_cpu(self.tracer_on)), "per_step", &pid_file);
        cmd.args(["--exporter", "file", "--export-file", "/dev/null"])
            .arg("--summary-json")
            .arg(&summary_path)
            .args(["--exec", "--"]);
        self.wrap(&mut cmd);
        let before = lens_probe_pids();
        Proc::spawn(name, &mut cmd, &self.log)?.finish_ok(self.deadline, on_line)?;
        wait_teardown(name, &before);
        let json = Summary::read(&summary_path).context(name)?;
        let (counted, lost) = hammer_summary(&json, kind, calls)
            .context(format!("{name}: {}", summary_path.display()))?;
        if counted != calls {
            checks.push(format!(
                "{name}: lens-probe counted {counted} calls of {}, expected {calls}",
                kind.function()
            ));
        }
        if lost != 0 {
            checks.push(format!("{name}: lens-probe lost {lost} events"));
        }
        Ok(json.tracer_cpu_s())
    }

    /// Under bpftrace `count()`, started first; checks its counts.
    fn under_bpftrace(
        &self,
        returns: bool,
        on_line: &mut impl FnMut(&Line),
        checks: &mut Vec<String>,
    ) -> Result<()> {
        let (ctx, name, kind) = (self.ctx, &self.name, self.kind);
        let program = ctx.bpftrace.as_ref().map_err(Clone::clone)?;
        let mut bt = on_cpu(self.tracer_on);
        bt.arg(program).current_dir(&ctx.root).args([
            "-B",
            "none",
            "-e",
            &bpftrace_script(ctx, kind, returns),
        ]);
        let mut bt = Proc::spawn(&format!("{name} (bpftrace)"), &mut bt, &self.log)?;
        // BEGIN runs once every probe is attached.
        bt.wait_line(
            Instant::now() + Duration::from_secs(120),
            "its BEGIN probe ran",
            |l| l.text.trim() == "lens-bench-ready",
        )?;
        let mut cmd = Command::new("env");
        cmd.current_dir(&ctx.root);
        self.wrap(&mut cmd);
        let result = Proc::spawn(name, &mut cmd, &ctx.logs.join(format!("{name}.run.log")))?
            .finish_ok(self.deadline, on_line);
        bt.signal("INT");
        let mut count = None;
        let mut ret_count = None;
        bt.finish(Instant::now() + Duration::from_secs(120), |l| {
            if let Some(n) = parse_bpftrace_count(&l.text) {
                count = Some(n);
            } else if let Some(n) = l
                .text
                .trim()
                .strip_prefix("@ret: ")
                .and_then(|n| n.trim().parse::<u64>().ok())
            {
                ret_count = Some(n);
            }
        })?;
        result?;
        // The warm-up call and the loop's.
        let expected = self.calls + 1;
        if count != Some(expected) || (returns && ret_count != Some(expected)) {
            checks.push(format!(
                "{name}: bpftrace counted {count:?} entries and {ret_count:?} returns, \
                 expected {expected}"
            ));
        }
        Ok(())
    }
}

fn ns(seconds: f64) -> String {
    fmt_duration(seconds)
}

impl PerKindBlock {
    pub(super) fn section(&self) -> Section {
        let rows = self.kinds().flat_map(|k| self.kind_rows(&k)).collect();
        Section {
            title: "1b. Per-hit cost per probe kind (`hammer KIND N`: one fake-library function \
                    called N times in a loop on CPU 1, the tracer on CPU 0, the loop's own time; rows \
                    with + : traced − uninstrumented, per call)"
                .into(),
            rows,
        }
    }

    /// One kind's rows: uninstrumented, under bpftrace, under lens-probe, lens-probe's CPU.
    fn kind_rows(&self, k: &KindRuns) -> Vec<Row> {
        let (kind, calls) = (k.kind, k.calls);
        let bound = kind.bound();
        let target = format!("≤ {bound:.2}× bpftrace");
        let target = target.as_str();
        let mut rows = Vec::new();
        let call = format!("`{}`", kind.function());
        let base: Vec<f64> = k
            .times(Variant::None)
            .iter()
            .map(|t| t / calls as f64)
            .collect();
        rows.push(super::report::row(
            format!(
                "**{}** (`hammer {} {}`): uninstrumented {call}, per call",
                kind.arg(),
                kind.arg(),
                fmt_count(calls as f64)
            ),
            &base,
            ns,
            None,
            "",
            Met::NoTarget,
        ));
        let floor_values = k.per_call(Variant::Bpftrace { returns: false });
        let ret_values = k.per_call(Variant::Bpftrace { returns: true });
        let lens = k.per_call(Variant::Lens);
        let floor = median(&floor_values);
        let ret = median(&ret_values);
        // No ratio to a cost the noise made zero or negative.
        let ratio =
            |values: &[f64], to: Option<f64>| Some(median(values)? / to.filter(|t| *t > 0.0)?);
        let met = |r: Option<f64>| match (r, &self.bpftrace_skipped) {
            (Some(r), _) => Met::from_bool(r <= bound),
            (None, Some(why)) => Met::NotMeasured(why.clone()),
            (None, None) => Met::NotMeasured("no value".into()),
        };
        let floor_label = if kind == Kind::Launch {
            format!(
                "+ bpftrace `count()` on the entries of {call} and the `cuLaunchKernel` it \
                 calls (kernel floor)"
            )
        } else {
            format!("+ bpftrace `count()` on the entry of {call} (kernel floor)")
        };
        match &self.bpftrace_skipped {
            Some(why) => rows.push(Row::not_measured(&floor_label, "", why)),
            None => rows.push(super::report::row(
                floor_label,
                &floor_values,
                ns,
                floor.filter(|f| *f > 0.0).map(|_| 1.0),
                "",
                Met::NoTarget,
            )),
        }
        if kind.returns() {
            let label = format!(
                "+ bpftrace `count()` on the entry and the return of {call} (ratio: to the floor)"
            );
            match &self.bpftrace_skipped {
                Some(why) => rows.push(Row::not_measured(&label, "", why)),
                None => rows.push(super::report::row(
                    label,
                    &ret_values,
                    ns,
                    ratio(&ret_values, floor),
                    "",
                    Met::NoTarget,
                )),
            }
            rows.push(super::report::row(
                format!(
                    "+ lens-probe `per_step`: {} (ratio: to the floor)",
                    kind.programs()
                ),
                &lens,
                ns,
                ratio(&lens, floor),
                "",
                Met::NoTarget,
            ));
            let r = ratio(&lens, ret);
            rows.push(super::report::row(
                "… the same, ratio to bpftrace on the same probes (entry + return)",
                &lens,
                ns,
                r,
                target,
                met(r),
            ));
        } else {
            let r = ratio(&lens, floor);
            rows.push(super::report::row(
                format!(
                    "+ lens-probe `per_step`: {} (ratio: to the floor, the same probe)",
                    kind.programs()
                ),
                &lens,
                ns,
                r,
                target,
                met(r),
            ));
        }
        rows.push(tracer_cpu_row(k));
        rows
    }

    pub(super) fn notes(&self) -> String {
        let mut n = String::new();
        let sizes: Vec<String> = self
            .kinds()
            .map(|k| format!("{} {}", k.kind.arg(), fmt_count(k.calls as f64)))
            .collect();
        n.push_str(&format!(
            "- Per probe kind: `LENS_FAKE_SYNC_MS=0 sh -c 'hammer KIND 1; hammer KIND N'` \
             (tests/fixtures/hammer.c, N: {}); the time is the loop's own (`hammer` reads \
             `CLOCK_MONOTONIC` around it), so process start-up, library loading and \
             lens-probe's attach are left out. lens-probe runs as `lens-probe --span-groups \
             per_step --exporter file --export-file /dev/null --summary-json F --exec -- sh -c …` \
             (probes on every function of the fake libraries; one fires, two for `launch`, \
             whose fake runtime launches through the fake driver's `cuLaunchKernel`; `driver` \
             calls that straight); bpftrace runs `uprobe:LIB:FUNC {{ @ = count(); }}` (for \
             `launch` also on `cuLaunchKernel`; and `uretprobe:LIB:FUNC {{ @ret = count(); }}` \
             for the entry + return rows), started first, the loop runs once its `BEGIN` has \
             fired. The loop runs on CPU 1 and the tracer on CPU 0 (`taskset`): the rows are \
             the cost on the probed thread. Unpinned, lens-probe's user side, flooded by 500 000 \
             records a second, shared the loop's CPU and doubled the `collective` row. Kinds \
             and variants are interleaved in every round. `collective` makes one \
             `ncclCommInitRank` before its loop; `sync` is a `nanosleep(0)` ({} per call \
             here), whose jitter is of the order of the probes' cost: its rows are the \
             noisiest.\n",
            sizes.join(", "),
            self.kinds()
                .find(|k| k.kind == Kind::Sync)
                .and_then(|k| median(&k.times(Variant::None)).map(|t| t / k.calls as f64))
                .map_or("?".into(), fmt_duration),
        ));
        if let Some(why) = &self.bpftrace_skipped {
            n.push_str(&format!("- Per-kind bpftrace rows not measured: {why}.\n"));
        }
        for c in &self.checks {
            n.push_str(&format!("- **Check**: {c}.\n"));
        }
        n
    }
}

/// lens-probe's own CPU over a kind's traced runs.
fn tracer_cpu_row(k: &KindRuns) -> Row {
    let tracer_cpu: Vec<f64> = k
        .runs(Variant::Lens)
        .iter()
        .filter_map(|r| r.tracer_cpu_s)
        .collect();
    super::report::row(
        "  lens-probe's own CPU over its whole run (every thread, start-up included; on the \
         other CPU)",
        &tracer_cpu,
        ns,
        None,
        "",
        Met::NoTarget,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hammer_lines_and_summaries() {
        assert_eq!(
            parse_loop_time("hammer: launch 500000 calls in 2218936 ns"),
            Some(0.002218936)
        );
        assert_eq!(parse_loop_time("hammer: launch 5 calls"), None);
        let doc = r#"{"losses": {"kernel": {"ring_buffer_full": 0}, "undecodable": 1},
          "processes": [
            {"command_line": ["/f/hammer", "group", "1"], "calls": {"ncclGroupStart": 1}},
            {"command_line": ["/f/hammer", "group", "500"], "calls": {"ncclGroupStart": 500}}
          ]}"#;
        let json = serde_json::from_str::<Summary>(doc).unwrap();
        assert_eq!(hammer_summary(&json, Kind::Group, 500).unwrap(), (500, 1));
        assert!(hammer_summary(&json, Kind::Launch, 500).is_err());
    }

    #[test]
    fn kinds() {
        assert_eq!(
            Kind::ALL.iter().filter(|k| k.returns()).count(),
            4,
            "sync, collective, event_query and memory have return probes"
        );
        assert_eq!(Kind::Memory.calls(false), 100_000);
        assert_eq!(Kind::Sync.calls(false), 50_000);
        assert_eq!(Kind::Launch.calls(true), 100_000);
    }
}
