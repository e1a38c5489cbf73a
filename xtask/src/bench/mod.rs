//! `cargo xtask bench`: lens-probe's overhead, measured side by side against the issue 6
//! targets, printed as one markdown table and written into `docs/performance.md` between
//! `<!-- bench:begin -->` and `<!-- bench:end -->`.
//!
//! Every measurement interleaves its variants (A B C A B C …) for `--rounds` rounds and
//! reports medians, so the drift of a noisy VM hits every variant alike ([`rounds`]).
//! Blocks:
//!
//! 1. the fake `trainer` (tests/fixtures) uninstrumented, under lens-probe with each
//!    preset, and under bpftrace `count()` on the same functions: per-hit cost,
//!    launch-heavy slowdown per preset and event throughput (from `--summary-json`)
//!    ([`fake`]);
//! 2. per probe kind ([`per_kind`]): `hammer KIND N` calls one function N times, under
//!    bpftrace and lens-probe: per-hit cost of launches, syncs, collectives, groups;
//! 3. the real PyTorch script `tests/fixtures/torch/train.py` (torch venv) per preset:
//!    loop time (from its `step 0` line to the end of the process), and lens-probe's CPU
//!    and memory during the `per_step` runs ([`torch`]);
//! 4. `--pid` attach to a running PyTorch process ([`attach`]);
//! 5. the user side's event throughput ([`throughput`]): a kernel-side generator feeds
//!    the ring buffer, decoder and span builder at increasing rates;
//! 6. the Python stack sampler ([`python`]) on a pure-Python loop;
//! 7. hang detection on a job that does not hang ([`hangs`]).
//! 8. teardown: lens-probe's exit until its probes are out of the kernel ([`teardown`]).
//! 9. unmodified framework loops (transformers `Trainer`, 2-rank DDP) per preset
//!    ([`frameworks`]).
//! 10. an untraced process beside a traced one, the same library file ([`neighbour`]);
//! 11. attach, links and teardown with 1, 8 and 64 traced processes ([`scale`]).
//!
//! The table: [`tables`], its notes: [`notes`]. What lens-probe's `--summary-json` says is
//! read by [`summary`]. `--only` runs some of the blocks ([`blocks`]; then
//! docs/performance.md is left as it is).

mod attach;
mod blocks;
mod budget;
mod commands;
mod fake;
mod frameworks;
mod hangs;
mod machine;
mod neighbour;
mod notes;
mod per_kind;
mod proc;
mod python;
mod recompute;
mod report;
mod rounds;
mod scale;
mod summary;
mod tables;
mod teardown;
mod throughput;
mod torch;
mod tracers;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use attach::attach_block;
pub use blocks::{Block, Blocks};
use commands::{append_command, fake_env, lens_command, scrub_lens_env, shown};
use fake::fake_block;
use machine::Machine;
use notes::notes;
use tables::{FixtureResults, PythonResults, Results, sections};
use torch::torch_block;
use tracers::{Watch, lens_probe_pids, wait_teardown};
use xtask::error::{self, Context, Error, Result};
use xtask::{toolchain, torch_venv};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    pub rounds: u32,
    pub quick: bool,
    /// The blocks to run; docs/performance.md is rewritten only when all of them ran.
    pub blocks: Blocks,
}

impl Options {
    pub const DEFAULT_ROUNDS: u32 = 5;
}

/// Probed calls per step of the fake `trainer` (the table in tests/README.md): 10 + 1
/// kernel launches, 7 collective and point-to-point calls, group start and end, 1 graph
/// launch, 3 syncs. (The README's prose says 25; its table, and the summaries, give 24.)
const CALLS_PER_STEP: u64 = 24;
/// Hits per step at the fake driver's launch functions, which lens-probe does not count
/// as calls: each of the step's runtime launches (10 + 1 kernels, 1 graph) goes through
/// them.
const DRIVER_HITS_PER_STEP: u64 = 12;
/// Plus one `ncclCommInitRank` per trainer process.
const CALLS_PER_PROCESS: u64 = 1;
/// Events a step sends to user space under `per_step`: 7 collectives + 3 sync waits.
const EVENTS_PER_STEP: u64 = 10;

/// The functions the `per_step` preset probes in the fake libcudart / libcuda / libnccl
/// (the catalog in lens-userspace/src/probes/catalog.rs): library, function, and whether
/// lens-probe also puts a return probe on it. The driver's launch functions are hit too:
/// the fake runtime launches through `cuLaunchKernel`, which lens-probe leaves out of its
/// counts but still pays a hit for, as bpftrace does.
const FAKE_PROBES: &[(&str, &str, bool)] = &[
    ("libcuda.so.1", "cuLaunchKernel", false),
    ("libcuda.so.1", "cuLaunchKernelEx", false),
    ("libcuda.so.1", "cuGraphLaunch", false),
    ("libcudart.so.12", "cudaLaunchKernel", false),
    ("libcudart.so.12", "cudaLaunchKernelExC", false),
    ("libcudart.so.12", "cudaGraphLaunch", false),
    ("libcudart.so.12", "cudaStreamSynchronize", true),
    ("libcudart.so.12", "cudaDeviceSynchronize", true),
    ("libcudart.so.12", "cudaEventSynchronize", true),
    ("libnccl.so.2", "ncclAllReduce", true),
    ("libnccl.so.2", "ncclBroadcast", true),
    ("libnccl.so.2", "ncclReduce", true),
    ("libnccl.so.2", "ncclAllGather", true),
    ("libnccl.so.2", "ncclReduceScatter", true),
    ("libnccl.so.2", "ncclSend", true),
    ("libnccl.so.2", "ncclRecv", true),
    ("libnccl.so.2", "ncclGroupStart", false),
    ("libnccl.so.2", "ncclGroupEnd", false),
    ("libnccl.so.2", "ncclCommInitRank", true),
];

/// Runs `trainer 1` (so that the libraries' probes are in place: uprobes are per file),
/// then times `trainer N` itself; `$0` is the trainer, `$1` the step count.
const FAKE_WRAPPER: &str = r#"T="$0"; C="${T%/*}/monotonic_ns"; "$T" 1 >/dev/null || exit 1; s=$("$C"); "$T" "$1" >/dev/null || exit 1; e=$("$C"); echo "lens-bench elapsed_ns=$((e-s))""#;

/// `python -u -c TORCH_WRAPPER SCRIPT ARGS…`: runs SCRIPT as `__main__` with ARGS, then
/// prints [`DONE_MARKER`] as soon as its `main()` has returned, before the interpreter's
/// own teardown (~0.8 s for torch, the same with or without tracing).
const TORCH_WRAPPER: &str = "import os, runpy, sys\n\
     sys.argv = sys.argv[1:]\n\
     sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))\n\
     runpy.run_path(sys.argv[0], run_name='__main__')\n\
     print('lens-bench-done', flush=True)\n";
const DONE_MARKER: &str = "lens-bench-done";

/// Presets of the slowdown measurements (`none` = uninstrumented).
const PRESETS: [&str; 3] = ["default", "per_step", "all"];

const RUN_TIMEOUT: Duration = Duration::from_secs(600);

struct Sizes {
    trainer_steps: u64,
    torch_steps: u32,
}

impl Sizes {
    fn new(quick: bool) -> Sizes {
        if quick {
            Sizes {
                trainer_steps: 4_000,
                torch_steps: 100,
            }
        } else {
            Sizes {
                trainer_steps: 40_000,
                torch_steps: 600,
            }
        }
    }

    fn torch_args(&self) -> Vec<String> {
        [
            "--steps",
            &self.torch_steps.to_string(),
            "--accum",
            "2",
            "--hidden",
            "2048",
            "--optimizer",
            "adam",
            "--eval-every",
            "0",
            "--ckpt-every",
            "0",
            "--print-steps",
        ]
        .map(String::from)
        .to_vec()
    }
}

/// A long, slow run to attach to (20 ms per step; ~10 min at most, killed when done).
const ATTACH_TARGET_ARGS: &[&str] = &[
    "--steps",
    "30000",
    "--batch",
    "8",
    "--accum",
    "1",
    "--hidden",
    "256",
    "--optimizer",
    "sgd",
    "--eval-every",
    "0",
    "--ckpt-every",
    "0",
    "--step-sleep",
    "0.02",
    "--print-steps",
];
const ATTACH_DURATION_S: f64 = 3.0;

/// Why a program some blocks need is not there: their rows say it in place of a value.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Missing(String);

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Missing {
    fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<Missing> for Error {
    fn from(missing: Missing) -> Error {
        Error::Msg(missing.0)
    }
}

struct Ctx {
    root: PathBuf,
    lens: PathBuf,
    fixtures: PathBuf,
    out: PathBuf,
    logs: PathBuf,
    rounds: u32,
    sizes: Sizes,
    python: Result<PathBuf, Missing>,
    bpftrace: Result<PathBuf, Missing>,
    time: Result<PathBuf, Missing>,
    /// `getconf CLK_TCK`.
    clock_ticks: f64,
}

fn say(line: &str) {
    println!("==> [xtask bench] {line}");
}

impl Ctx {
    /// Where the runs go and what the machine has, for a bench of `opts`.
    fn new(root: PathBuf, fixtures: PathBuf, opts: &Options) -> Result<Ctx> {
        let out = root.join("target").join("bench");
        let logs = out.join("logs");
        error::create_dir_all(&logs)?;
        let python = torch_venv::venv_python(&torch_venv::venv_dir());
        Ok(Ctx {
            lens: root.join("target/release/lens-probe"),
            fixtures,
            out,
            logs,
            rounds: opts.rounds.max(1),
            sizes: Sizes::new(opts.quick),
            python: if python.is_file() {
                Ok(python)
            } else {
                Err(Missing(format!(
                    "no torch venv at {} (run `cargo xtask setup`)",
                    python.display()
                )))
            },
            bpftrace: toolchain::find_program("bpftrace")
                .ok_or_else(|| Missing("bpftrace not found (apt-get install bpftrace)".to_owned())),
            time: Some(PathBuf::from("/usr/bin/time"))
                .filter(|p| p.is_file())
                .ok_or_else(|| {
                    Missing("/usr/bin/time not found (apt-get install time)".to_owned())
                }),
            clock_ticks: toolchain::capture(Command::new("getconf").arg("CLK_TCK"))
                .and_then(|t| t.trim().parse().ok())
                .unwrap_or(100.0),
            root,
        })
    }
}

pub fn run(opts: Options) -> Result<()> {
    let started = Instant::now();
    let root = crate::workspace_root();
    machine::preflight()?;
    let fixtures = build(&root)?;
    let ctx = Ctx::new(root, fixtures, &opts)?;
    if ctx.bpftrace.is_ok() {
        machine::mount_tracefs()?;
    }
    // The fixture's sync calls are nanosleep(0): with the default 50 µs timer slack
    // each one takes ~70 µs, most of a step. Inherited by every process started here.
    let slack = machine::set_timer_slack();

    let machine = Machine::read(&ctx.root);
    let mut watch = Watch::default();
    watch.check();
    let results = run_blocks(&ctx, &opts, &mut watch)?;
    watch.check();
    let load_end = machine::loadavg();

    let table = report::table(&sections(&ctx, &results));
    let notes = notes(&ctx, &results, &watch, slack);
    let generated = format!(
        "{}\n\n{table}\n{notes}",
        header(&opts, &ctx, &machine, &load_end, started)
    );
    println!("\n{generated}");
    write_report(&ctx, &opts, &generated)
}

/// Builds lens-probe, the throughput generator and the fixtures; returns the fixtures'
/// directory.
fn build(root: &Path) -> Result<PathBuf> {
    crate::run_step(
        "bench",
        &mut crate::cargo(&[
            "build",
            "--release",
            "-p",
            "lens-userspace",
            "--bin",
            "lens-probe",
            "--example",
            "throughput",
        ]),
    )?;
    let fixtures = root.join("target").join("bench-fixtures");
    let mut build = Command::new("bash");
    toolchain::scrub_run_env(&mut build);
    build
        .current_dir(root)
        .arg("tests/fixtures/build.sh")
        .arg(&fixtures)
        .stdin(Stdio::null());
    crate::run_step("bench", &mut build)?;
    Ok(fixtures)
}

/// Runs the blocks `opts` asks for, in the table's order of issue 6; those that need the
/// torch venv only when there is one.
fn run_blocks(ctx: &Ctx, opts: &Options, watch: &mut Watch) -> Result<Results> {
    let wanted = |block| opts.blocks.contains(block);
    let venv = |block| ctx.python.as_ref().ok().filter(|_| wanted(block));
    let quick = opts.quick;
    let mut fixtures = FixtureResults::default();
    let mut python = PythonResults::default();
    if wanted(Block::Trainer) {
        fixtures.fake = Some(fake_block(ctx, watch)?);
    }
    if wanted(Block::PerKind) {
        fixtures.per_kind = Some(per_kind::block(ctx, watch, quick)?);
    }
    if wanted(Block::Neighbour) {
        fixtures.neighbour = Some(neighbour::block(ctx, watch, quick)?);
    }
    if let Some(py) = venv(Block::Torch) {
        python.torch = Some(torch_block(ctx, py, watch)?);
    }
    if let Some(py) = venv(Block::Attach) {
        python.attach = Some(attach_block(ctx, py, watch)?);
    }
    if wanted(Block::Throughput) {
        fixtures.throughput = Some(throughput::block(ctx, watch, quick)?);
    }
    if wanted(Block::Budget) {
        fixtures.budget = Some(budget::block(ctx, watch, quick)?);
    }
    if wanted(Block::Python) {
        python.sampler = Some(python::block(ctx, watch, quick)?);
    }
    if wanted(Block::Hangs) {
        fixtures.hangs = Some(hangs::block(ctx, watch)?);
    }
    if let Some(py) = venv(Block::Teardown) {
        python.teardown = Some(teardown::block(ctx, py, watch)?);
    }
    if let Some(py) = venv(Block::Frameworks) {
        python.frameworks = Some(frameworks::block(ctx, py, watch, quick)?);
    }
    if let Some(py) = venv(Block::Scale) {
        python.scale = Some(scale::block(ctx, py, watch, quick)?);
    }
    if let Some(py) = venv(Block::Recompute) {
        python.recompute = Some(recompute::block(ctx, py, watch, quick)?);
    }
    Ok(Results {
        blocks: opts.blocks,
        fixtures,
        python,
    })
}

/// The line above the table: how it was made, on what, and how long it took.
fn header(
    opts: &Options,
    ctx: &Ctx,
    machine: &Machine,
    load_end: &str,
    started: Instant,
) -> String {
    let only = if opts.blocks == Blocks::ALL {
        String::new()
    } else {
        let names: Vec<&str> = Block::ALL
            .into_iter()
            .filter(|b| opts.blocks.contains(*b))
            .map(Block::name)
            .collect();
        format!(" --only {}", names.join(","))
    };
    format!(
        "## Latest `cargo xtask bench`\n\n\
         Generated by `cargo xtask bench{}{only}` ({} round{}, variants interleaved, medians) on \
         {}: kernel {}, CPU {}, {} cores, load average {} at the start and {} at the end, \
         commit {}. Took {:.0} s.",
        if opts.quick { " --quick" } else { "" },
        ctx.rounds,
        if ctx.rounds == 1 { "" } else { "s" },
        machine.date,
        machine.kernel,
        machine.cpu,
        machine.cores,
        machine.load,
        load_end,
        machine.commit,
        started.elapsed().as_secs_f64()
    )
}

/// Writes the report into target/bench, and into docs/performance.md when every block
/// ran in full.
fn write_report(ctx: &Ctx, opts: &Options, generated: &str) -> Result<()> {
    let results = ctx.out.join("results.md");
    error::write(&results, generated)?;
    say(&format!(
        "results in {}, logs in {}",
        results.display(),
        ctx.logs.display()
    ));
    if opts.quick {
        say("--quick: docs/performance.md left as it is");
    } else if opts.blocks != Blocks::ALL {
        say("--only: docs/performance.md left as it is");
    } else {
        let doc_path = ctx.root.join("docs/performance.md");
        let doc = error::read_to_string(&doc_path)?;
        let updated =
            report::replace_between_markers(&doc, generated).context(doc_path.display())?;
        error::write(&doc_path, updated)?;
        say(&format!("wrote the table into {}", doc_path.display()));
    }
    Ok(())
}
