//! `cargo xtask bench`: lens-probe's overhead, measured side by side against the issue 6
//! targets, printed as one markdown table and written into `docs/performance.md` between
//! `<!-- bench:begin -->` and `<!-- bench:end -->`.
//!
//! Every measurement interleaves its variants (A B C A B C …) for `--rounds` rounds and
//! reports medians, so the drift of a noisy VM hits every variant alike. Blocks:
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
//! The table and its notes: [`tables`]. `--only` runs some of the blocks (then
//! docs/performance.md is left as it is).

mod attach;
mod budget;
mod fake;
mod frameworks;
mod hangs;
mod neighbour;
mod per_kind;
mod proc;
mod python;
mod report;
mod rounds;
mod scale;
mod summary;
mod tables;
mod teardown;
mod throughput;
mod torch;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use attach::attach_block;
use fake::fake_block;
use tables::{Results, notes, sections};
use torch::torch_block;
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

/// The bench's blocks, as `--only` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Block {
    /// The fake trainer: per-hit cost, slowdown per preset, its events (1, 2a, 5).
    Trainer,
    /// Per-hit cost per probe kind (1b).
    PerKind,
    /// An untraced process beside a traced one, the same library file (10).
    Neighbour,
    /// The PyTorch loop per preset, lens-probe's CPU and memory (2b, 4).
    Torch,
    /// `--pid` attach to a running PyTorch process (3, 4).
    Attach,
    /// The user side's event throughput from the kernel-side generator (5b).
    Throughput,
    /// `--overhead-budget` on a launch-heavy loop (2c).
    Budget,
    /// The Python stack sampler on a pure-Python loop (6).
    Python,
    /// Hang detection's look every second, on the fake trainer (7).
    Hangs,
    /// lens-probe's exit until its probes are out of the kernel (8).
    Teardown,
    /// transformers `Trainer` and 2-rank DDP loops per preset (9).
    Frameworks,
    /// Attach, links and teardown with 1, 8 and 64 traced processes (11).
    Scale,
}

impl Block {
    pub const ALL: [Block; 12] = [
        Block::Trainer,
        Block::PerKind,
        Block::Neighbour,
        Block::Torch,
        Block::Attach,
        Block::Throughput,
        Block::Budget,
        Block::Python,
        Block::Hangs,
        Block::Teardown,
        Block::Frameworks,
        Block::Scale,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Block::Trainer => "trainer",
            Block::PerKind => "per-kind",
            Block::Neighbour => "neighbour",
            Block::Torch => "torch",
            Block::Attach => "attach",
            Block::Throughput => "throughput",
            Block::Budget => "budget",
            Block::Python => "python",
            Block::Hangs => "hangs",
            Block::Teardown => "teardown",
            Block::Frameworks => "frameworks",
            Block::Scale => "scale",
        }
    }
}

/// A set of [`Block`]s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocks(u16);

impl Blocks {
    pub const ALL: Blocks = Blocks((1u16 << Block::ALL.len()) - 1);

    pub fn contains(self, block: Block) -> bool {
        self.0 & (1 << block as u16) != 0
    }

    pub fn of(blocks: &[Block]) -> Blocks {
        Blocks(blocks.iter().fold(0, |set, block| set | 1 << *block as u16))
    }
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

/// Other tracers seen between runs (they share uprobes on the same library files and
/// the CPUs: the numbers are then not clean).
#[derive(Default)]
struct Watch {
    foreign: BTreeSet<String>,
}

impl Watch {
    fn check(&mut self) {
        for pid in lens_probe_pids() {
            self.foreign.insert(format!("lens-probe (pid {pid})"));
        }
        if let Ok(out) = Command::new("pgrep")
            .args(["-x", "bpftrace"])
            .stderr(Stdio::null())
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                self.foreign.insert(format!("bpftrace (pid {pid})"));
            }
        }
    }
}

/// How a command is shown in logs and messages.
pub(crate) fn shown(cmd: &Command) -> String {
    torch_venv::display(cmd)
}

fn say(line: &str) {
    println!("==> [xtask bench] {line}");
}

pub fn run(opts: Options) -> Result<()> {
    let started = Instant::now();
    let root = crate::workspace_root();
    preflight()?;
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
        .current_dir(&root)
        .arg("tests/fixtures/build.sh")
        .arg(&fixtures)
        .stdin(Stdio::null());
    crate::run_step("bench", &mut build)?;

    let out = root.join("target").join("bench");
    let logs = out.join("logs");
    error::create_dir_all(&logs)?;
    let python = torch_venv::venv_python(&torch_venv::venv_dir());
    let ctx = Ctx {
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
            .ok_or_else(|| Missing("/usr/bin/time not found (apt-get install time)".to_owned())),
        clock_ticks: toolchain::capture(Command::new("getconf").arg("CLK_TCK"))
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(100.0),
        root,
    };
    if ctx.bpftrace.is_ok() {
        mount_tracefs()?;
    }
    // The fixture's sync calls are nanosleep(0): with the default 50 µs timer slack
    // each one takes ~70 µs, most of a step. Inherited by every process started here.
    let slack = set_timer_slack();

    let machine = Machine::read(&ctx.root);
    let mut watch = Watch::default();
    watch.check();
    let wanted = |block| opts.blocks.contains(block);
    let python = ctx.python.as_ref().ok();
    let fake = match wanted(Block::Trainer) {
        true => Some(fake_block(&ctx, &mut watch)?),
        false => None,
    };
    let per_kind = match wanted(Block::PerKind) {
        true => Some(per_kind::block(&ctx, &mut watch, opts.quick)?),
        false => None,
    };
    let neighbour = match wanted(Block::Neighbour) {
        true => Some(neighbour::block(&ctx, &mut watch, opts.quick)?),
        false => None,
    };
    let torch = match python.filter(|_| wanted(Block::Torch)) {
        Some(python) => Some(torch_block(&ctx, python, &mut watch)?),
        None => None,
    };
    let attach = match python.filter(|_| wanted(Block::Attach)) {
        Some(python) => Some(attach_block(&ctx, python, &mut watch)?),
        None => None,
    };
    let throughput = match wanted(Block::Throughput) {
        true => Some(throughput::block(&ctx, &mut watch, opts.quick)?),
        false => None,
    };
    let budget = match wanted(Block::Budget) {
        true => Some(budget::block(&ctx, &mut watch, opts.quick)?),
        false => None,
    };
    let python_sampler = match wanted(Block::Python) {
        true => Some(python::block(&ctx, &mut watch, opts.quick)?),
        false => None,
    };
    let hangs = match wanted(Block::Hangs) {
        true => Some(hangs::block(&ctx, &mut watch)?),
        false => None,
    };
    let teardown = match python.filter(|_| wanted(Block::Teardown)) {
        Some(python) => Some(teardown::block(&ctx, python, &mut watch)?),
        None => None,
    };
    let frameworks = match python.filter(|_| wanted(Block::Frameworks)) {
        Some(python) => Some(frameworks::block(&ctx, python, &mut watch, opts.quick)?),
        None => None,
    };
    let scale = match python.filter(|_| wanted(Block::Scale)) {
        Some(python) => Some(scale::block(&ctx, python, &mut watch, opts.quick)?),
        None => None,
    };
    watch.check();
    let load_end = loadavg();

    let results = Results {
        blocks: opts.blocks,
        fake,
        per_kind,
        neighbour,
        torch,
        attach,
        throughput,
        budget,
        python_sampler,
        hangs,
        teardown,
        frameworks,
        scale,
    };
    let table = report::table(&sections(&ctx, &results));
    let notes = notes(&ctx, &results, &watch, slack);
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
    let generated = format!(
        "## Latest `cargo xtask bench`\n\n\
         Generated by `cargo xtask bench{}{only}` ({} round{}, variants interleaved, medians) on \
         {}: kernel {}, CPU {}, {} cores, load average {} at the start and {} at the end, \
         commit {}. Took {:.0} s.\n\n{table}\n{notes}",
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
    );
    println!("\n{generated}");
    let results = ctx.out.join("results.md");
    error::write(&results, &generated)?;
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
            report::replace_between_markers(&doc, &generated).context(doc_path.display())?;
        error::write(&doc_path, updated)?;
        say(&format!("wrote the table into {}", doc_path.display()));
    }
    Ok(())
}

fn preflight() -> Result<()> {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("");
    if euid != "0" {
        return Err("xtask bench: needs root (lens-probe and bpftrace load BPF programs)".into());
    }
    if !Path::new("/sys/bus/event_source/devices/uprobe/type").exists() {
        return Err("xtask bench: this kernel has no uprobe PMU (CONFIG_UPROBE_EVENTS)".into());
    }
    Ok(())
}

/// bpftrace attaches uprobes through tracefs.
fn mount_tracefs() -> Result<()> {
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    if mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some("/sys/kernel/tracing"))
    {
        return Ok(());
    }
    let mut mount = Command::new("mount");
    mount.args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"]);
    crate::run_step("bench", &mut mount)
}

/// Sets this process's timer slack to 1 ns (children inherit it); false if it could not.
fn set_timer_slack() -> bool {
    fs::write("/proc/self/timerslack_ns", "1").is_ok()
        && fs::read_to_string("/proc/self/timerslack_ns").is_ok_and(|s| s.trim() == "1")
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

struct Machine {
    date: String,
    kernel: String,
    cpu: String,
    cores: usize,
    load: String,
    commit: String,
}

fn capture(program: &str, args: &[&str], dir: &Path) -> String {
    toolchain::capture(Command::new(program).args(args).current_dir(dir))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "?".into())
}

impl Machine {
    fn read(root: &Path) -> Machine {
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                let (key, value) = l.split_once(':')?;
                (key.trim() == "model name").then(|| value.trim().to_owned())
            })
            .unwrap_or_else(|| "?".into());
        let cores = cpuinfo
            .lines()
            .filter(|l| l.split(':').next().is_some_and(|k| k.trim() == "processor"))
            .count();
        let cores = if cores == 0 {
            std::thread::available_parallelism().map_or(0, usize::from)
        } else {
            cores
        };
        let mut commit = capture("git", &["rev-parse", "--short", "HEAD"], root);
        if !capture("git", &["status", "--porcelain"], root).is_empty() {
            commit.push_str(" + uncommitted changes");
        }
        Machine {
            date: capture("date", &["-u", "+%Y-%m-%d %H:%M UTC"], root),
            kernel: capture("uname", &["-r"], root),
            cpu,
            cores,
            load: loadavg(),
            commit,
        }
    }
}

/// `lens-probe --span-groups PRESET --pid-file PID_FILE` (run through `wrapper`, e.g.
/// `/usr/bin/time`, when given), the environment's NeMo Lens / OTLP settings removed.
fn lens_command(ctx: &Ctx, wrapper: Option<Command>, preset: &str, pid_file: &Path) -> Command {
    let _ = fs::remove_file(pid_file);
    let mut cmd = match wrapper {
        Some(mut wrapper) => {
            wrapper.arg(&ctx.lens);
            wrapper
        }
        None => Command::new(&ctx.lens),
    };
    scrub_lens_env(&mut cmd);
    cmd.current_dir(&ctx.root)
        .args(["--span-groups", preset])
        .arg("--pid-file")
        .arg(pid_file);
    cmd
}

/// Appends `target` (program, arguments and environment changes) to `cmd`: the command
/// a `lens-probe … --exec --` runs.
fn append_command(cmd: &mut Command, target: &Command) {
    cmd.arg(target.get_program()).args(target.get_args());
    for (key, value) in target.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
}

/// Live (not zombie) processes named `lens-probe`.
fn lens_probe_pids() -> BTreeSet<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return BTreeSet::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // `PID (COMM) STATE …`
            let Some((head, rest)) = stat.rsplit_once(") ") else {
                return false;
            };
            head.split_once(" (")
                .is_some_and(|(_, comm)| comm == "lens-probe")
                && !rest.starts_with('Z')
                && !rest.starts_with('X')
        })
        .collect()
}

/// lens-probe exits at once and leaves a child holding the probes' descriptors: the
/// kernel removes the uprobes (~0.1 s each) when that child closes them, as it exits (its
/// memory, and so its command line, is gone by then). Waits until every lens-probe that
/// was not running before the run (`before`) is gone, so that the next run does not
/// share the machine with that teardown; returns how long it took.
fn wait_teardown(name: &str, before: &BTreeSet<u32>) -> f64 {
    let started = Instant::now();
    let limit = Duration::from_secs(120);
    loop {
        let left: Vec<u32> = lens_probe_pids().difference(before).copied().collect();
        if left.is_empty() {
            return started.elapsed().as_secs_f64();
        }
        if started.elapsed() > limit {
            say(&format!(
                "{name}: lens-probe processes {left:?} still there after {} s; going on",
                limit.as_secs()
            ));
            return started.elapsed().as_secs_f64();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn scrub_lens_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if key.starts_with("NEMO_LENS_")
            || key.starts_with("OTEL_")
            || key.starts_with("LENS_PROBE_")
            || key == "PYTHONHOME"
            || key == "PYTHONPATH"
        {
            cmd.env_remove(key);
        }
    }
}

fn fake_env(cmd: &mut Command) {
    cmd.env("LENS_FAKE_SYNC_MS", "0")
        .env("TRAINER_STEP_DELAY_MS", "0")
        .env("TRAINER_START_DELAY_MS", "0")
        .env_remove("LENS_FAKE_SYNC_LOG");
}

#[cfg(test)]
mod tests {
    use super::attach::parse_uprobes_attached;
    use super::fake::{
        TrainerSummary, bpftrace_script, parse_bpftrace_count, parse_elapsed, trainer_summary,
    };
    use super::summary::Summary;
    use super::torch::parse_time_output;
    use super::*;

    #[test]
    fn wrapper_lines() {
        assert_eq!(
            parse_elapsed("lens-bench elapsed_ns=1500000000\n"),
            Some(1.5)
        );
        assert_eq!(parse_elapsed("trainer: 3 steps done"), None);
        assert_eq!(parse_bpftrace_count("@: 1101"), Some(1101));
        assert_eq!(parse_bpftrace_count("@ret: 5"), None);
        assert_eq!(
            parse_uprobes_attached("lens-probe: 61 uprobes attached (span groups: job)"),
            Some(61)
        );
        assert_eq!(
            parse_uprobes_attached("[2026-01-01T00:00:00Z INFO  lens_probe] 7 uprobes attached"),
            Some(7)
        );
        assert_eq!(parse_uprobes_attached("no"), None);
        assert_eq!(parse_time_output("1.50 0.25 51234\n"), Some((1.75, 51234)));
        assert_eq!(
            parse_time_output("Command exited with non-zero status 1\n0.10 0.20 300\n"),
            Some((0.30000000000000004, 300))
        );
        assert_eq!(parse_time_output(""), None);
    }

    #[test]
    fn summary_of_the_timed_trainer() {
        let doc = r#"{"losses": {"kernel": {"ring_buffer_full": 2, "unmatched_return": 1}, "undecodable": 0},
          "processes": [
            {"name": "sh", "command_line": ["sh", "-c", "x"], "calls": {}},
            {"name": "trainer", "command_line": ["/f/trainer", "1"], "calls": {"ncclAllReduce": 1}},
            {"name": "trainer", "command_line": ["/f/trainer", "40"],
             "calls": {"cudaLaunchKernel": 400, "ncclAllReduce": 40, "ncclCommInitRank": 1},
             "collectives": {"all_reduce": {"calls": 40, "bytes": 9}, "send": {"calls": 40}},
             "sync_waits": {"stream": {"calls": 40, "p50_ns": 3}},
             "probe_cost": {"estimated_ns": 2500000, "traced_ns": 90000000}}
          ],
          "lens_probe_cpu": {"user_s": 1.25, "system_s": 0.5, "wall_s": 3.0}}"#;
        let json = serde_json::from_str::<Summary>(doc).unwrap();
        assert_eq!(
            trainer_summary(&json, 40).unwrap(),
            TrainerSummary {
                calls: 441,
                events: 120,
                lost: 3,
                estimated_cost_s: Some(0.0025),
                tracer_cpu_s: Some(1.75),
            }
        );
        assert!(trainer_summary(&json, 7).is_err());
    }

    #[test]
    fn bpftrace_probes_the_per_step_functions() {
        let script = bpftrace_script(Path::new("/fx"), false);
        assert!(script.starts_with("BEGIN { printf(\"lens-bench-ready\\n\"); }\n"));
        assert!(script.contains("uprobe:/fx/libcudart.so.12:cudaLaunchKernel,\n"));
        // The driver's launch functions the fake runtime calls: lens-probe's probes are
        // hit there too.
        assert!(script.contains("uprobe:/fx/libcuda.so.1:cuLaunchKernel,\n"));
        assert!(script.contains("uprobe:/fx/libnccl.so.2:ncclCommInitRank\n{ @ = count(); }"));
        assert_eq!(script.matches("uprobe:").count(), 19);
        assert!(!script.contains("uretprobe"));
        let with_returns = bpftrace_script(Path::new("/fx"), true);
        assert_eq!(with_returns.matches("uretprobe:").count(), 11);
        assert!(with_returns.ends_with("{ @ret = count(); }\n"));
        // 24 calls a step: 10 + 1 launches, 7 collectives, group start and end, 1 graph
        // launch, 3 syncs; every one of those functions is probed.
        assert_eq!(CALLS_PER_STEP, 10 + 1 + 7 + 2 + 1 + 3);
        // Each runtime launch (10 + 1 kernels, 1 graph) reaches the driver once.
        assert_eq!(DRIVER_HITS_PER_STEP, 10 + 1 + 1);
    }
}
