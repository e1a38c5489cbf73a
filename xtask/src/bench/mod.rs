//! `cargo xtask bench`: lens-probe's overhead, measured side by side against the issue 6
//! targets, printed as one markdown table and written into `docs/performance.md` between
//! `<!-- bench:begin -->` and `<!-- bench:end -->`.
//!
//! Every measurement interleaves its variants (A B C A B C …) for `--rounds` rounds and
//! reports medians, so the drift of a noisy VM hits every variant alike. Blocks:
//!
//! 1. the fake `trainer` (tests/fixtures) uninstrumented, under lens-probe with each
//!    preset, and under bpftrace `count()` on the same functions: per-hit cost,
//!    launch-heavy slowdown per preset and event throughput (from `--summary-json`);
//! 2. per probe kind ([`per_kind`]): `hammer KIND N` calls one function N times, under
//!    bpftrace and lens-probe: per-hit cost of launches, syncs, collectives, groups;
//! 3. the real PyTorch script `tests/fixtures/torch/train.py` (torch venv) per preset:
//!    loop time (from its `step 0` line to the end of the process), and lens-probe's CPU
//!    and memory during the `per_step` runs;
//! 4. `--pid` attach to a running PyTorch process;
//! 5. the user side's event throughput ([`throughput`]): a kernel-side generator feeds
//!    the ring buffer, decoder and span builder at increasing rates;
//! 6. the Python stack sampler ([`python`]) on a pure-Python loop;
//! 7. hang detection on a job that does not hang ([`hangs`]).
//!
//! `--only` runs some of them (then docs/performance.md is left as it is).

mod budget;
mod hangs;
mod json;
mod per_kind;
mod proc;
mod python;
mod report;
mod throughput;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use json::Json;
use proc::{Line, Proc, Stream};
use report::{Met, Row, Section, fmt_count, fmt_duration, median, row};
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// The fake trainer: per-hit cost, slowdown per preset, its events (1, 2a, 5).
    Trainer,
    /// Per-hit cost per probe kind (1b).
    PerKind,
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
}

impl Block {
    pub const ALL: [Block; 8] = [
        Block::Trainer,
        Block::PerKind,
        Block::Torch,
        Block::Attach,
        Block::Throughput,
        Block::Budget,
        Block::Python,
        Block::Hangs,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Block::Trainer => "trainer",
            Block::PerKind => "per-kind",
            Block::Torch => "torch",
            Block::Attach => "attach",
            Block::Throughput => "throughput",
            Block::Budget => "budget",
            Block::Python => "python",
            Block::Hangs => "hangs",
        }
    }
}

/// A set of [`Block`]s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocks(u8);

impl Blocks {
    pub const ALL: Blocks = Blocks(((1u16 << Block::ALL.len()) - 1) as u8);

    pub fn contains(self, block: Block) -> bool {
        self.0 & (1 << block as u8) != 0
    }

    /// `per-kind,throughput` → those two.
    pub fn parse(list: &str) -> Result<Blocks, String> {
        let mut set = 0;
        for name in list.split(',').map(str::trim) {
            let block = Block::ALL
                .into_iter()
                .find(|b| b.name() == name)
                .ok_or_else(|| {
                    let names: Vec<&str> = Block::ALL.iter().map(|b| b.name()).collect();
                    format!(
                        "unknown bench block `{name}` (blocks: {})",
                        names.join(", ")
                    )
                })?;
            set |= 1 << block as u8;
        }
        Ok(Blocks(set))
    }
}

/// Probed calls per step of the fake `trainer` (the table in tests/README.md): 10 + 1
/// kernel launches, 7 collective and point-to-point calls, group start and end, 1 graph
/// launch, 3 syncs. (The README's prose says 25; its table, and the summaries, give 24.)
const CALLS_PER_STEP: u64 = 24;
/// Plus one `ncclCommInitRank` per trainer process.
const CALLS_PER_PROCESS: u64 = 1;
/// Events a step sends to user space under `per_step`: 7 collectives + 3 sync waits.
const EVENTS_PER_STEP: u64 = 10;

/// The functions the `per_step` preset probes in the fake libcudart / libnccl (the
/// catalog in lens-userspace/src/probes/catalog.rs): library, function, and whether
/// lens-probe also puts a return probe on it.
const FAKE_PROBES: &[(&str, &str, bool)] = &[
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
const FAKE_WRAPPER: &str = r#"T="$0"; "$T" 1 >/dev/null || exit 1; s=$(date +%s%N); "$T" "$1" >/dev/null || exit 1; e=$(date +%s%N); echo "lens-bench elapsed_ns=$((e-s))""#;

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

struct Ctx {
    root: PathBuf,
    lens: PathBuf,
    fixtures: PathBuf,
    out: PathBuf,
    logs: PathBuf,
    rounds: u32,
    sizes: Sizes,
    python: Result<PathBuf, String>,
    bpftrace: Result<PathBuf, String>,
    time: Result<PathBuf, String>,
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

pub fn run(opts: Options) -> Result<(), String> {
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
    fs::create_dir_all(&logs).map_err(|e| format!("cannot create {}: {e}", logs.display()))?;
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
            Err(format!(
                "no torch venv at {} (run `cargo xtask setup`)",
                python.display()
            ))
        },
        bpftrace: toolchain::find_program("bpftrace")
            .ok_or_else(|| "bpftrace not found (apt-get install bpftrace)".to_owned()),
        time: Some(PathBuf::from("/usr/bin/time"))
            .filter(|p| p.is_file())
            .ok_or_else(|| "/usr/bin/time not found (apt-get install time)".to_owned()),
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
    watch.check();
    let load_end = loadavg();

    let results = Results {
        blocks: opts.blocks,
        fake,
        per_kind,
        torch,
        attach,
        throughput,
        budget,
        python_sampler,
        hangs,
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
    fs::write(&results, &generated)
        .map_err(|e| format!("cannot write {}: {e}", results.display()))?;
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
        let doc = fs::read_to_string(&doc_path)
            .map_err(|e| format!("cannot read {}: {e}", doc_path.display()))?;
        let updated = report::replace_between_markers(&doc, &generated)
            .map_err(|e| format!("{}: {e}", doc_path.display()))?;
        fs::write(&doc_path, updated)
            .map_err(|e| format!("cannot write {}: {e}", doc_path.display()))?;
        say(&format!("wrote the table into {}", doc_path.display()));
    }
    Ok(())
}

fn preflight() -> Result<(), String> {
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
fn mount_tracefs() -> Result<(), String> {
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

// ---------------------------------------------------------------------------------------
// Block 1: the fake trainer.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fake {
    None,
    Lens(&'static str),
    /// bpftrace `count()` on the entries; with `returns`, also on the return probes
    /// lens-probe uses.
    Bpftrace {
        returns: bool,
    },
}

impl Fake {
    fn name(self) -> &'static str {
        match self {
            Fake::None => "none",
            Fake::Lens(preset) => preset,
            Fake::Bpftrace { returns: false } => "bpftrace",
            Fake::Bpftrace { returns: true } => "bpftrace-ret",
        }
    }
}

/// What `--summary-json` says about the timed trainer process, and the run's losses.
#[derive(Clone, Debug, PartialEq)]
struct TrainerSummary {
    calls: u64,
    events: u64,
    lost: u64,
}

fn sum_members(value: Option<&Json>, field: Option<&str>) -> u64 {
    value
        .map(|v| {
            v.members()
                .iter()
                .filter_map(|(_, m)| match field {
                    Some(f) => m.get(f)?.as_u64(),
                    None => m.as_u64(),
                })
                .sum()
        })
        .unwrap_or(0)
}

/// The trainer process run with `steps` (not the `trainer 1` warm-up) in a summary.
fn trainer_summary(json: &Json, steps: u64) -> Result<TrainerSummary, String> {
    let steps = steps.to_string();
    let process = json
        .get("processes")
        .map(Json::as_array)
        .unwrap_or_default()
        .iter()
        .find(|p| {
            let argv = p
                .get("command_line")
                .map(Json::as_array)
                .unwrap_or_default();
            argv.len() == 2
                && argv[0].as_str().is_some_and(|a| a.ends_with("trainer"))
                && argv[1].as_str() == Some(steps.as_str())
        })
        .ok_or_else(|| format!("no `trainer {steps}` process in the summary"))?;
    let losses = json.get("losses");
    let lost = sum_members(losses.and_then(|l| l.get("kernel")), None)
        + losses
            .and_then(|l| l.get("undecodable"))
            .and_then(Json::as_u64)
            .unwrap_or(0);
    Ok(TrainerSummary {
        calls: sum_members(process.get("calls"), None),
        events: sum_members(process.get("collectives"), Some("calls"))
            + sum_members(process.get("sync_waits"), Some("calls")),
        lost,
    })
}

fn parse_elapsed(line: &str) -> Option<f64> {
    let ns: u64 = line
        .trim()
        .strip_prefix("lens-bench elapsed_ns=")?
        .parse()
        .ok()?;
    Some(ns as f64 / 1e9)
}

/// bpftrace's final `@: N` line.
fn parse_bpftrace_count(line: &str) -> Option<u64> {
    line.trim().strip_prefix("@: ")?.trim().parse().ok()
}

fn bpftrace_script(fixtures: &Path, returns: bool) -> String {
    let probe = |kind: &str, lib: &str, func: &str| {
        format!("{kind}:{}:{func}", fixtures.join(lib).display())
    };
    let entries: Vec<String> = FAKE_PROBES
        .iter()
        .map(|(lib, func, _)| probe("uprobe", lib, func))
        .collect();
    let mut script = format!(
        "BEGIN {{ printf(\"lens-bench-ready\\n\"); }}\n{}\n{{ @ = count(); }}\n",
        entries.join(",\n")
    );
    if returns {
        let rets: Vec<String> = FAKE_PROBES
            .iter()
            .filter(|(_, _, ret)| *ret)
            .map(|(lib, func, _)| probe("uretprobe", lib, func))
            .collect();
        script.push_str(&format!("{}\n{{ @ret = count(); }}\n", rets.join(",\n")));
    }
    script
}

struct FakeRun {
    elapsed_s: f64,
    summary: Option<TrainerSummary>,
    bpftrace_count: Option<u64>,
    /// lens-probe's exit → its teardown child gone.
    teardown_s: Option<f64>,
}

struct FakeBlock {
    steps: u64,
    runs: Vec<(Fake, Vec<FakeRun>)>,
    /// Why bpftrace was not measured.
    bpftrace_skipped: Option<String>,
    /// bpftrace counts that differ from the fixture's documented pattern.
    count_mismatches: Vec<String>,
}

impl FakeBlock {
    fn runs(&self, variant: Fake) -> &[FakeRun] {
        self.runs
            .iter()
            .find(|(v, _)| *v == variant)
            .map_or(&[], |(_, r)| r)
    }

    fn times(&self, variant: Fake) -> Vec<f64> {
        self.runs(variant).iter().map(|r| r.elapsed_s).collect()
    }

    /// Probed calls of one timed run: the per_step summaries' count, else the pattern's.
    fn calls(&self) -> u64 {
        let counted: Vec<f64> = self
            .runs(Fake::Lens("per_step"))
            .iter()
            .filter_map(|r| r.summary.as_ref().map(|s| s.calls as f64))
            .collect();
        median(&counted).map_or(self.steps * CALLS_PER_STEP + CALLS_PER_PROCESS, |c| {
            c as u64
        })
    }

    /// Per round: (time of `variant` − uninstrumented time of the same round) / calls.
    fn per_call(&self, variant: Fake) -> Vec<f64> {
        let calls = self.calls() as f64;
        self.times(variant)
            .iter()
            .zip(self.times(Fake::None))
            .map(|(t, base)| (t - base) / calls)
            .collect()
    }
}

fn fake_block(ctx: &Ctx, watch: &mut Watch) -> Result<FakeBlock, String> {
    let steps = ctx.sizes.trainer_steps;
    let mut variants = vec![Fake::None];
    variants.extend(PRESETS.map(Fake::Lens));
    if ctx.bpftrace.is_ok() {
        variants.push(Fake::Bpftrace { returns: false });
        variants.push(Fake::Bpftrace { returns: true });
    }
    let mut block = FakeBlock {
        steps,
        runs: variants.iter().map(|v| (*v, Vec::new())).collect(),
        bpftrace_skipped: ctx.bpftrace.as_ref().err().cloned(),
        count_mismatches: Vec::new(),
    };
    for round in 1..=ctx.rounds {
        for (variant, runs) in block.runs.iter_mut() {
            watch.check();
            let run = fake_run(ctx, *variant, round)?;
            if let Some(count) = run.bpftrace_count {
                // The warm-up `trainer 1` and the timed run.
                let expected = CALLS_PER_STEP * (steps + 1) + 2 * CALLS_PER_PROCESS;
                if count != expected {
                    block.count_mismatches.push(format!(
                        "{} round {round}: bpftrace counted {count} calls, expected {expected}",
                        variant.name()
                    ));
                }
            }
            say(&format!(
                "round {round}/{}: trainer {steps} under {:<12} {:.3} s",
                ctx.rounds,
                variant.name(),
                run.elapsed_s
            ));
            runs.push(run);
        }
    }
    Ok(block)
}

fn fake_run(ctx: &Ctx, variant: Fake, round: u32) -> Result<FakeRun, String> {
    let steps = ctx.sizes.trainer_steps.to_string();
    let trainer = ctx.fixtures.join("trainer");
    let name = format!("fake-{}-r{round}", variant.name());
    let log = ctx.logs.join(format!("{name}.log"));
    let deadline = Instant::now() + RUN_TIMEOUT;
    let wrapper = |cmd: &mut Command| {
        cmd.args(["sh", "-c", FAKE_WRAPPER])
            .arg(&trainer)
            .arg(&steps);
    };
    let mut elapsed = None;
    let mut on_line = |l: &Line| {
        if l.stream == Stream::Out
            && let Some(s) = parse_elapsed(&l.text)
        {
            elapsed = Some(s);
        }
    };
    let mut summary = None;
    let mut bpftrace_count = None;
    let mut teardown_s = None;
    match variant {
        Fake::None => {
            let mut cmd = Command::new("sh");
            cmd.current_dir(&ctx.root)
                .args(["-c", FAKE_WRAPPER])
                .arg(&trainer)
                .arg(&steps);
            fake_env(&mut cmd);
            Proc::spawn(&name, &mut cmd, &log)?.finish_ok(deadline, &mut on_line)?;
        }
        Fake::Lens(preset) => {
            let summary_path = ctx.out.join(format!("{name}.summary.json"));
            let _ = fs::remove_file(&summary_path);
            let pid_file = ctx.out.join(format!("{name}.pid"));
            let mut cmd = lens_command(ctx, None, preset, &pid_file);
            // The console tree would hold every span of the run in memory (the fake trainer
            // never ends its first phase) and print it at exit: see the notes.
            cmd.args(["--exporter", "file", "--export-file", "/dev/null"])
                .arg("--summary-json")
                .arg(&summary_path)
                .args(["--exec", "--"]);
            wrapper(&mut cmd);
            fake_env(&mut cmd);
            let before = lens_probe_pids();
            Proc::spawn(&name, &mut cmd, &log)?.finish_ok(deadline, &mut on_line)?;
            teardown_s = Some(wait_teardown(&name, &before));
            let text = fs::read_to_string(&summary_path)
                .map_err(|e| format!("{name}: cannot read {}: {e}", summary_path.display()))?;
            let json = Json::parse(&text)
                .map_err(|e| format!("{name}: {}: {e}", summary_path.display()))?;
            summary = Some(
                trainer_summary(&json, ctx.sizes.trainer_steps)
                    .map_err(|e| format!("{name}: {}: {e}", summary_path.display()))?,
            );
        }
        Fake::Bpftrace { returns } => {
            let program = ctx.bpftrace.as_ref().map_err(Clone::clone)?;
            let mut bt = Command::new(program);
            bt.current_dir(&ctx.root).args([
                "-B",
                "none",
                "-e",
                &bpftrace_script(&ctx.fixtures, returns),
            ]);
            let mut bt = Proc::spawn(&format!("{name} (bpftrace)"), &mut bt, &log)?;
            // BEGIN runs once every probe is attached.
            bt.wait_line(
                Instant::now() + Duration::from_secs(120),
                "its BEGIN probe ran",
                |l| l.text.trim() == "lens-bench-ready",
            )?;
            let mut cmd = Command::new("sh");
            cmd.current_dir(&ctx.root)
                .args(["-c", FAKE_WRAPPER])
                .arg(&trainer)
                .arg(&steps);
            fake_env(&mut cmd);
            let trainer_log = ctx.logs.join(format!("{name}.trainer.log"));
            let result =
                Proc::spawn(&name, &mut cmd, &trainer_log)?.finish_ok(deadline, &mut on_line);
            bt.signal("INT");
            bt.finish(Instant::now() + Duration::from_secs(120), |l| {
                if let Some(n) = parse_bpftrace_count(&l.text) {
                    bpftrace_count = Some(n);
                }
            })?;
            result?;
            if bpftrace_count.is_none() {
                return Err(format!(
                    "{name}: bpftrace printed no count (output in {})",
                    log.display()
                ));
            }
        }
    }
    let elapsed_s = elapsed.ok_or_else(|| {
        format!(
            "{name}: the wrapper printed no elapsed time (output in {})",
            log.display()
        )
    })?;
    Ok(FakeRun {
        elapsed_s,
        summary,
        bpftrace_count,
        teardown_s,
    })
}

// ---------------------------------------------------------------------------------------
// Block 2: the PyTorch training loop.

/// lens-probe's own resource use over one PyTorch `--exec` run, read from `/proc` (not
/// with `/usr/bin/time`: its figures include the children lens-probe waits for, i.e. the
/// traced Python).
#[derive(Clone, Debug, Default)]
struct Usage {
    /// CPU time of all its threads from `step 0` to the end of the loop (schedstat, ns).
    loop_cpu_s: Option<f64>,
    /// Its user + sys time from its start to the end of the loop (`/proc/PID/stat`: all
    /// its threads, ended ones too; not its children).
    to_loop_end_cpu_s: Option<f64>,
    /// VmHWM at the end of the loop, KiB: its peak RSS until then.
    peak_rss_kib: Option<u64>,
    /// VmRSS at the end of the loop, KiB.
    loop_end_rss_kib: Option<u64>,
}

struct TorchRun {
    loop_s: f64,
    usage: Option<Usage>,
    /// lens-probe's exit → its teardown child gone.
    teardown_s: Option<f64>,
}

struct TorchBlock {
    steps: u32,
    /// `None` = uninstrumented.
    runs: Vec<(Option<&'static str>, Vec<TorchRun>)>,
}

impl TorchBlock {
    fn runs(&self, preset: Option<&str>) -> &[TorchRun] {
        self.runs
            .iter()
            .find(|(p, _)| *p == preset)
            .map_or(&[], |(_, r)| r)
    }

    fn times(&self, preset: Option<&str>) -> Vec<f64> {
        self.runs(preset).iter().map(|r| r.loop_s).collect()
    }
}

/// Sum of the CPU time (ns) of every thread of `pid` (`/proc/PID/task/*/schedstat`).
fn process_cpu_ns(pid: u32) -> Option<u64> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        let text = fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        total += text
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(total)
}

/// utime + stime of `pid` in clock ticks (`/proc/PID/stat` fields 14 and 15).
fn process_stat_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

fn status_kib(pid: u32, key: &str) -> Option<u64> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_prefix(key)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
}

/// `/usr/bin/time -f '%U %S %M'` output: (user + sys seconds, max RSS KiB). The last line
/// (a first line says so when the command failed).
fn parse_time_output(text: &str) -> Option<(f64, u64)> {
    let last = text.lines().rev().find(|l| !l.trim().is_empty())?;
    let mut f = last.split_whitespace();
    let user: f64 = f.next()?.parse().ok()?;
    let sys: f64 = f.next()?.parse().ok()?;
    let rss: u64 = f.next()?.parse().ok()?;
    Some((user + sys, rss))
}

fn read_pid_file(path: &Path) -> Option<u32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn torch_block(ctx: &Ctx, python: &Path, watch: &mut Watch) -> Result<TorchBlock, String> {
    let mut runs: Vec<(Option<&'static str>, Vec<TorchRun>)> = vec![(None, Vec::new())];
    runs.extend(PRESETS.map(|p| (Some(p), Vec::new())));
    let mut block = TorchBlock {
        steps: ctx.sizes.torch_steps,
        runs,
    };
    for round in 1..=ctx.rounds {
        for (preset, runs) in block.runs.iter_mut() {
            watch.check();
            let run = torch_run(ctx, python, *preset, round)?;
            say(&format!(
                "round {round}/{}: train.py loop ({} steps) under {:<9} {:.3} s",
                ctx.rounds,
                ctx.sizes.torch_steps,
                preset.unwrap_or("none"),
                run.loop_s
            ));
            runs.push(run);
        }
    }
    Ok(block)
}

fn torch_run(
    ctx: &Ctx,
    python: &Path,
    preset: Option<&'static str>,
    round: u32,
) -> Result<TorchRun, String> {
    let name = format!("torch-{}-r{round}", preset.unwrap_or("none"));
    let log = ctx.logs.join(format!("{name}.log"));
    let script = ctx.root.join("tests/fixtures/torch/train.py");
    let measure = preset == Some("per_step");
    let pid_file = ctx.out.join(format!("{name}.pid"));
    let mut cmd = match preset {
        None => Command::new(python),
        Some(preset) => {
            let mut cmd = lens_command(ctx, None, preset, &pid_file);
            cmd.args(["--exporter", "console", "--exec", "--"])
                .arg(python);
            cmd
        }
    };
    cmd.current_dir(&ctx.root)
        .args(["-u", "-c", TORCH_WRAPPER])
        .arg(&script)
        .args(ctx.sizes.torch_args());
    scrub_lens_env(&mut cmd);

    let mut step0 = None;
    let mut done = None;
    let mut usage = Usage::default();
    let mut lens_pid = None;
    let mut cpu0 = None;
    let before = lens_probe_pids();
    let p = Proc::spawn(&name, &mut cmd, &log)?;
    p.finish_ok(Instant::now() + RUN_TIMEOUT, |l| {
        if l.stream != Stream::Out {
            return;
        }
        if l.text == "step 0" && step0.is_none() {
            step0 = Some(l.at);
            if measure {
                lens_pid = read_pid_file(&pid_file);
                cpu0 = lens_pid.and_then(process_cpu_ns);
            }
        } else if l.text == DONE_MARKER {
            done = Some(l.at);
            if let Some(pid) = lens_pid {
                let cpu1 = process_cpu_ns(pid);
                if let (Some(a), Some(b)) = (cpu0, cpu1) {
                    usage.loop_cpu_s = Some(b.saturating_sub(a) as f64 / 1e9);
                }
                usage.to_loop_end_cpu_s =
                    process_stat_ticks(pid).map(|t| t as f64 / ctx.clock_ticks);
                usage.loop_end_rss_kib = status_kib(pid, "VmRSS:");
                usage.peak_rss_kib = status_kib(pid, "VmHWM:");
            }
        }
    })?;
    let teardown_s = preset.map(|_| wait_teardown(&name, &before));
    let (Some(step0), Some(done)) = (step0, done) else {
        return Err(format!(
            "{name}: no `step 0` / `{DONE_MARKER}` line (output in {})",
            log.display()
        ));
    };
    Ok(TorchRun {
        loop_s: done.saturating_duration_since(step0).as_secs_f64(),
        usage: measure.then_some(usage),
        teardown_s,
    })
}

// ---------------------------------------------------------------------------------------
// Block 3: attaching to a running PyTorch process.

#[derive(Clone, Debug, Default)]
struct AttachRun {
    /// lens-probe start → its `tracing pid` line.
    tracing_s: f64,
    /// lens-probe start → its `N uprobes attached` line.
    attached_s: Option<f64>,
    uprobes: Option<u32>,
    /// From the end of `--duration` to lens-probe's exit.
    exit_s: f64,
    /// lens-probe's exit → its teardown child gone (the kernel has removed the uprobes).
    teardown_s: f64,
    /// `/usr/bin/time`: user + sys seconds and max RSS (KiB) of the whole `--pid` run
    /// (lens-probe has no child it waits for there, so these are its own).
    total_cpu_s: Option<f64>,
    max_rss_kib: Option<u64>,
}

fn parse_uprobes_attached(line: &str) -> Option<u32> {
    let (before, _) = line.split_once(" uprobes attached")?;
    before.rsplit(' ').next()?.parse().ok()
}

fn attach_block(ctx: &Ctx, python: &Path, watch: &mut Watch) -> Result<Vec<AttachRun>, String> {
    watch.check();
    let mut target = torch_venv::python_command(python);
    target
        .current_dir(&ctx.root)
        .arg("-u")
        .arg(ctx.root.join("tests/fixtures/torch/train.py"))
        .args(ATTACH_TARGET_ARGS);
    let mut target = Proc::spawn(
        "attach target",
        &mut target,
        &ctx.logs.join("attach-target.log"),
    )?;
    target.wait_line(Instant::now() + Duration::from_secs(180), "`step 1`", |l| {
        l.text == "step 1"
    })?;
    let mut runs = Vec::new();
    for round in 1..=ctx.rounds {
        target.drain();
        if !target.running() {
            return Err(
                "the PyTorch process to attach to ended early (see attach-target.log)".into(),
            );
        }
        let name = format!("attach-r{round}");
        let pid_file = ctx.out.join(format!("{name}.pid"));
        let time_file = ctx.out.join(format!("{name}.time"));
        let _ = fs::remove_file(&time_file);
        let timed = ctx.time.as_ref().ok().map(|time| {
            let mut timed = Command::new(time);
            timed.arg("-o").arg(&time_file).args(["-f", "%U %S %M"]);
            timed
        });
        let mut cmd = lens_command(ctx, timed, "per_step", &pid_file);
        cmd.args(["--exporter", "console", "-v", "--duration", "3s", "--pid"])
            .arg(target.pid.to_string());
        let before = lens_probe_pids();
        let p = Proc::spawn(&name, &mut cmd, &ctx.logs.join(format!("{name}.log")))?;
        let started = p.started;
        let mut run = AttachRun::default();
        let mut tracing = None;
        let exit = p.finish_ok(Instant::now() + RUN_TIMEOUT, |l| {
            let since = l.at.saturating_duration_since(started).as_secs_f64();
            if l.stream != Stream::Err {
                return;
            }
            if tracing.is_none() && l.text.starts_with("lens-probe: tracing pid") {
                tracing = Some(since);
            }
            if run.uprobes.is_none()
                && let Some(n) = parse_uprobes_attached(&l.text)
            {
                run.uprobes = Some(n);
                run.attached_s = Some(since);
            }
        })?;
        let Some(tracing) = tracing else {
            return Err(format!("{name}: lens-probe never printed `tracing pid`"));
        };
        run.tracing_s = tracing;
        run.exit_s =
            exit.saturating_duration_since(started).as_secs_f64() - tracing - ATTACH_DURATION_S;
        run.teardown_s = wait_teardown(&name, &before);
        if let Some((cpu, rss)) = fs::read_to_string(&time_file)
            .ok()
            .and_then(|t| parse_time_output(&t))
        {
            run.total_cpu_s = Some(cpu);
            run.max_rss_kib = Some(rss);
        }
        say(&format!(
            "round {round}/{}: attach to pid {} took {:.3} s; exit {:.3} s after --duration, \
             teardown {:.3} s after that",
            ctx.rounds, target.pid, run.tracing_s, run.exit_s, run.teardown_s
        ));
        runs.push(run);
    }
    target.drain();
    Ok(runs)
}

// ---------------------------------------------------------------------------------------
// The table.

fn pct(fraction: f64) -> String {
    format!("{:.2} % of a core", fraction * 100.0)
}

fn megabytes(kib: f64) -> String {
    format!("{:.1} MB", kib * 1024.0 / 1e6)
}

fn ratio_to(values: &[f64], base: &[f64]) -> Option<f64> {
    Some(median(values)? / median(base)?)
}

/// What the blocks that ran measured.
struct Results {
    blocks: Blocks,
    fake: Option<FakeBlock>,
    per_kind: Option<per_kind::PerKindBlock>,
    torch: Option<TorchBlock>,
    attach: Option<Vec<AttachRun>>,
    throughput: Option<throughput::ThroughputBlock>,
    budget: Option<budget::BudgetBlock>,
    python_sampler: Option<python::PythonBlock>,
    hangs: Option<hangs::HangsBlock>,
}

/// The table's sections, in order, for the blocks that ran.
fn sections(ctx: &Ctx, r: &Results) -> Vec<Section> {
    let (torch, attach) = (r.torch.as_ref(), r.attach.as_deref());
    let mut out = Vec::new();
    if let Some(fake) = &r.fake {
        out.push(trainer_cost_section(fake));
    }
    if let Some(per_kind) = &r.per_kind {
        out.push(per_kind.section());
    }
    let torch_wanted = r.blocks.contains(Block::Torch);
    if r.fake.is_some() || torch_wanted {
        out.push(slowdown_section(ctx, r.fake.as_ref(), torch, torch_wanted));
    }
    if let Some(budget) = &r.budget {
        out.push(budget.section());
    }
    if let Some(python) = &r.python_sampler {
        out.push(python.section());
    }
    if let Some(hangs) = &r.hangs {
        out.push(hangs.section());
    }
    if r.blocks.contains(Block::Attach) {
        out.push(attach_section(ctx, attach));
    }
    if torch_wanted || r.blocks.contains(Block::Attach) {
        out.push(usage_section(ctx, torch, torch_wanted, attach));
    }
    if let Some(fake) = &r.fake {
        out.push(trainer_throughput_section(fake));
    }
    if let Some(throughput) = &r.throughput {
        out.push(throughput.section());
    }
    out
}

/// Section 1: Per-hit cost on the fake trainer.
fn trainer_cost_section(fake: &FakeBlock) -> Section {
    let none = fake.times(Fake::None);
    let calls = fake.calls();
    let mut rows = vec![row(
        format!("uninstrumented `trainer {}`", fake.steps),
        &none,
        fmt_duration,
        Some(1.0),
        "",
        Met::NoTarget,
    )];
    let bpf = Fake::Bpftrace { returns: false };
    let bpf_ret = Fake::Bpftrace { returns: true };
    let lens = Fake::Lens("per_step");
    let entries = FAKE_PROBES.len();
    let returns = FAKE_PROBES.iter().filter(|p| p.2).count();
    let labelled = [
        (
            bpf,
            format!("bpftrace `count()` on the {entries} entry points (kernel floor)"),
        ),
        (
            bpf_ret,
            format!(
                "bpftrace `count()` on the {entries} entries + the {returns} return probes lens-probe uses"
            ),
        ),
        (lens, "lens-probe `--span-groups per_step`".to_owned()),
    ];
    for (variant, label) in &labelled {
        match (variant, &fake.bpftrace_skipped) {
            (Fake::Bpftrace { .. }, Some(why)) => rows.push(Row::not_measured(label, "", why)),
            _ => rows.push(row(
                label.clone(),
                &fake.times(*variant),
                fmt_duration,
                ratio_to(&fake.times(*variant), &none),
                "",
                Met::NoTarget,
            )),
        }
    }
    let floor = median(&fake.per_call(bpf));
    for (variant, label) in &labelled {
        let label = format!("per probed call: {label}");
        let values = fake.per_call(*variant);
        let ratio = median(&values).zip(floor).map(|(v, f)| v / f);
        let (target, met) = match variant {
            Fake::Lens(_) => (
                "≤ 1.05× bpftrace",
                ratio.map_or(Met::NotMeasured("no bpftrace".into()), |r| {
                    Met::from_bool(r <= 1.05)
                }),
            ),
            _ => ("", Met::NoTarget),
        };
        match (variant, &fake.bpftrace_skipped) {
            (Fake::Bpftrace { .. }, Some(why)) => rows.push(Row::not_measured(label, "", why)),
            _ => rows.push(row(label, &values, fmt_duration, ratio, target, met)),
        }
    }
    Section {
        title: format!(
            "1. Per-hit cost on the fake libraries (`trainer {}`: {} probed calls per run; ratio of the per-call rows: to bpftrace's floor)",
            fake.steps,
            fmt_count(calls as f64)
        ),
        rows,
    }
}

/// Section 2: Slowdown per preset: (a) the fake trainer, (b) PyTorch when `torch_wanted`.
fn slowdown_section(
    ctx: &Ctx,
    fake: Option<&FakeBlock>,
    torch: Option<&TorchBlock>,
    torch_wanted: bool,
) -> Section {
    let no_torch = ctx.python.as_ref().err().map_or("", String::as_str);
    let mut rows = Vec::new();
    if let Some(fake) = fake {
        let none = fake.times(Fake::None);
        rows.push(row(
            format!(
                "(a) fake trainer, launch-heavy, `trainer {}`: none",
                fake.steps
            ),
            &none,
            fmt_duration,
            Some(1.0),
            "",
            Met::NoTarget,
        ));
        for preset in PRESETS {
            let t = fake.times(Fake::Lens(preset));
            rows.push(row(
                format!("(a) fake trainer: `{preset}`"),
                &t,
                fmt_duration,
                ratio_to(&t, &none),
                "",
                Met::NoTarget,
            ));
        }
    }
    match torch {
        Some(torch) => {
            let base = torch.times(None);
            rows.push(row(
                format!("(b) PyTorch `train.py` loop ({} steps): none", torch.steps),
                &base,
                fmt_duration,
                Some(1.0),
                "",
                Met::NoTarget,
            ));
            for preset in PRESETS {
                let t = torch.times(Some(preset));
                let ratio = ratio_to(&t, &base);
                let (target, met) = if preset == "per_step" {
                    (
                        "≤ 1.005× (≤ 0.5 %)",
                        ratio.map_or(Met::NotMeasured("no value".into()), |r| {
                            Met::from_bool(r <= 1.005)
                        }),
                    )
                } else {
                    ("", Met::NoTarget)
                };
                rows.push(row(
                    format!("(b) PyTorch loop: `{preset}`"),
                    &t,
                    fmt_duration,
                    ratio,
                    target,
                    met,
                ));
            }
        }
        None if torch_wanted => rows.push(Row::not_measured(
            "(b) PyTorch loop: `per_step`",
            "≤ 1.005× (≤ 0.5 %)",
            no_torch,
        )),
        None => {}
    }
    Section {
        title: "2. Training-loop slowdown per preset (ratio: to uninstrumented)".into(),
        rows,
    }
}

/// Section 3: Attach time.
fn attach_section(ctx: &Ctx, attach: Option<&[AttachRun]>) -> Section {
    let no_torch = ctx.python.as_ref().err().map_or("", String::as_str);
    let rows = match attach {
        Some(runs) => {
            let tracing: Vec<f64> = runs.iter().map(|r| r.tracing_s).collect();
            let attached: Vec<f64> = runs.iter().filter_map(|r| r.attached_s).collect();
            let exit: Vec<f64> = runs.iter().map(|r| r.exit_s).collect();
            let teardown: Vec<f64> = runs.iter().map(|r| r.teardown_s).collect();
            let uprobes = runs.iter().find_map(|r| r.uprobes);
            let met = median(&tracing).map_or(Met::NotMeasured("no value".into()), |m| {
                Met::from_bool(m <= 1.0)
            });
            vec![
                row(
                    "`--pid` to a running PyTorch process, `per_step`: lens-probe start → `tracing pid`",
                    &tracing,
                    fmt_duration,
                    None,
                    "≤ 1 s",
                    met,
                ),
                row(
                    format!(
                        "… → `{} uprobes attached`",
                        uprobes.map_or("N".into(), |n| n.to_string())
                    ),
                    &attached,
                    fmt_duration,
                    None,
                    "",
                    Met::NoTarget,
                ),
                row(
                    "end of `--duration 3s` → lens-probe exited",
                    &exit,
                    fmt_duration,
                    None,
                    "",
                    Met::NoTarget,
                ),
                row(
                    "lens-probe exited → its child holding the probes gone (kernel teardown)",
                    &teardown,
                    fmt_duration,
                    None,
                    "",
                    Met::NoTarget,
                ),
            ]
        }
        None => vec![Row::not_measured(
            "`--pid` attach to a running PyTorch process",
            "≤ 1 s",
            no_torch,
        )],
    };
    Section {
        title: "3. Attach time".into(),
        rows,
    }
}

/// Section 4: lens-probe's CPU and memory.
fn usage_section(
    ctx: &Ctx,
    torch: Option<&TorchBlock>,
    torch_wanted: bool,
    attach: Option<&[AttachRun]>,
) -> Section {
    let no_torch = ctx.python.as_ref().err().map_or("", String::as_str);
    let mut rows = Vec::new();
    let cpu_target = "≤ 1 % of a core";
    let rss_target = "≤ 50 MB";
    let met_max = |values: &[f64], limit: f64| {
        median(values).map_or(Met::NotMeasured("no value".into()), |m| {
            Met::from_bool(m <= limit)
        })
    };
    let mb_limit = 50e6 / 1024.0;
    match torch {
        Some(torch) => {
            let usage: Vec<(f64, &Usage)> = torch
                .runs(Some("per_step"))
                .iter()
                .filter_map(|r| Some((r.loop_s, r.usage.as_ref()?)))
                .collect();
            let pick = |f: &dyn Fn(f64, &Usage) -> Option<f64>| -> Vec<f64> {
                usage.iter().filter_map(|(l, u)| f(*l, u)).collect()
            };
            let loop_cpu = pick(&|l, u| Some(u.loop_cpu_s? / l));
            let start_cpu = pick(&|_, u| u.to_loop_end_cpu_s);
            let start_cpu_share = pick(&|l, u| Some(u.to_loop_end_cpu_s? / l));
            let peak = pick(&|_, u| Some(u.peak_rss_kib? as f64));
            let end_rss = pick(&|_, u| Some(u.loop_end_rss_kib? as f64));
            rows.push(row(
                "`--exec`: lens-probe CPU during the loop (all its threads, `step 0` → loop end) / loop time",
                &loop_cpu,
                pct,
                None,
                cpu_target,
                met_max(&loop_cpu, 0.01),
            ));
            rows.push(row(
                "`--exec`: lens-probe CPU from its start to the loop's end (BPF load, symbols, attach included), seconds",
                &start_cpu,
                |v| format!("{v:.2} s"),
                None,
                "",
                Met::NoTarget,
            ));
            rows.push(row(
                "… the same / loop time",
                &start_cpu_share,
                pct,
                None,
                cpu_target,
                met_max(&start_cpu_share, 0.01),
            ));
            rows.push(row(
                "`--exec`: lens-probe peak RSS until the loop's end (VmHWM)",
                &peak,
                megabytes,
                None,
                rss_target,
                met_max(&peak, mb_limit),
            ));
            rows.push(row(
                "`--exec`: lens-probe RSS at the loop's end (VmRSS)",
                &end_rss,
                megabytes,
                None,
                rss_target,
                met_max(&end_rss, mb_limit),
            ));
        }
        None if torch_wanted => rows.push(Row::not_measured(
            "lens-probe CPU and RSS during a PyTorch loop",
            cpu_target,
            no_torch,
        )),
        None => {}
    }
    match (attach, &ctx.time) {
        (Some(runs), Ok(_)) => {
            let cpu: Vec<f64> = runs.iter().filter_map(|r| r.total_cpu_s).collect();
            let rss: Vec<f64> = runs
                .iter()
                .filter_map(|r| Some(r.max_rss_kib? as f64))
                .collect();
            rows.push(row(
                "`--pid`, 3 s: lens-probe CPU over its whole run (`/usr/bin/time` user+sys)",
                &cpu,
                |v| format!("{v:.2} s"),
                None,
                "",
                Met::NoTarget,
            ));
            rows.push(row(
                "`--pid`, 3 s: lens-probe max RSS (`/usr/bin/time` %M)",
                &rss,
                megabytes,
                None,
                rss_target,
                met_max(&rss, mb_limit),
            ));
        }
        (Some(_), Err(why)) => rows.push(Row::not_measured(
            "`--pid`: lens-probe CPU and max RSS",
            rss_target,
            why,
        )),
        (None, _) => {}
    }
    Section {
        title: "4. lens-probe CPU and memory (PyTorch, `per_step`)".into(),
        rows,
    }
}

/// Section 5: the events the fake trainer sends, bounded by its uprobes' cost (block 5b
/// measures the user side itself).
fn trainer_throughput_section(fake: &FakeBlock) -> Section {
    let per_step_runs = fake.runs(Fake::Lens("per_step"));
    let rates: Vec<f64> = per_step_runs
        .iter()
        .filter_map(|r| Some(r.summary.as_ref()?.events as f64 / r.elapsed_s))
        .collect();
    let lost: u64 = fake
        .runs
        .iter()
        .flat_map(|(_, runs)| runs)
        .filter_map(|r| Some(r.summary.as_ref()?.lost))
        .sum();
    let lens_runs = fake
        .runs
        .iter()
        .filter(|(v, _)| matches!(v, Fake::Lens(_)))
        .map(|(_, r)| r.len())
        .sum::<usize>();
    let rows = vec![
        row(
            "events/s sent and received (7 collectives + 3 sync waits per step) / trainer time, `per_step`",
            &rates,
            |r| format!("{} /s", fmt_count(r)),
            None,
            "(the rate target: 5b)",
            Met::NoTarget,
        ),
        Row {
            what: format!("events lost over all {lens_runs} lens-probe runs on the fake trainer"),
            median: fmt_count(lost as f64),
            spread: "—".into(),
            ratio: "—".into(),
            target: "0".into(),
            met: Met::from_bool(lost == 0),
        },
    ];
    Section {
        title: "5. Event throughput (fake trainer, `per_step`: as many events as its uprobes let it send)".into(),
        rows,
    }
}

fn notes(ctx: &Ctx, r: &Results, watch: &Watch, slack: bool) -> String {
    let (torch, attach) = (r.torch.as_ref(), r.attach.as_deref());
    let mut n = String::from("How each row was measured:\n\n");
    if let Some(fake) = &r.fake {
        fake_notes(&mut n, fake);
    }
    if let Some(budget) = &r.budget {
        n.push_str(&budget.notes());
    }
    if let Some(python) = &r.python_sampler {
        n.push_str(&python.notes());
    }
    if let Some(hangs) = &r.hangs {
        n.push_str(&hangs.notes());
    }
    if let Some(per_kind) = &r.per_kind {
        n.push_str(&per_kind.notes());
    }
    if let Some(throughput) = &r.throughput {
        n.push_str(&throughput.notes());
    }
    if slack {
        n.push_str(
            "- The timer slack of every process started is 1 ns (`/proc/self/timerslack_ns`, \
             inherited): the fake syncs are `nanosleep(0)`, which otherwise take ~70 µs each \
             (the default 50 µs slack) and make the step mostly sleep. Probe costs are \
             unchanged by it.\n",
        );
    } else {
        n.push_str("- The timer slack could not be lowered: the fake syncs sleep ~70 µs each.\n");
    }
    if let Some(torch) = torch {
        let args = ctx.sizes.torch_args().join(" ");
        n.push_str(&format!(
            "- PyTorch: `python -u -c WRAPPER tests/fixtures/torch/train.py {args}` with the \
             torch venv's Python (CPU), plain or under `lens-probe --span-groups PRESET \
             --exporter console --exec -- python …` (console tree to a log file). WRAPPER runs \
             the script with `runpy` as `__main__` and prints `{DONE_MARKER}` when its `main()` \
             returns (train.py is not changed; the interpreter's exit, ~0.8 s with torch, is \
             left out). Loop time: from the arrival of the `step 0` line to the arrival of \
             that marker ({} steps).\n",
            torch.steps
        ));
        n.push_str(
            "- CPU and RSS of the `per_step` PyTorch runs come from `/proc/PID` of lens-probe \
             (`--pid-file`): the loop's CPU is the change of its threads' \
             `/proc/PID/task/*/schedstat` run times between `step 0` and the end of the loop; \
             the CPU from its start is `/proc/PID/stat` utime + stime at the loop's end; RSS \
             is VmHWM / VmRSS then. `/usr/bin/time` is not used around `--exec` runs: its \
             user, sys and max RSS include the children lens-probe waits for, the traced \
             Python (~820 MB max RSS). It is used around the `--pid` runs, which have none.\n",
        );
    }
    n.push_str(
        "- `all` and `per_step` enable the same eight span groups today \
         (lens-userspace/src/settings/groups.rs): their rows differ by noise only.\n",
    );
    if let Some(torch) = torch {
        let base = torch.times(None);
        if let (Some(m), Some((lo, hi))) = (median(&base), report::min_max(&base))
            && base.len() > 1
        {
            let spread = (hi - lo) / m * 100.0;
            n.push_str(&format!(
                "- The uninstrumented PyTorch loop itself varied by {spread:.1} % (min to max) \
                 over the rounds on this machine: smaller differences are noise{}.\n",
                if spread > 0.5 {
                    ", so the 0.5 % target cannot be resolved here"
                } else {
                    ""
                }
            ));
        }
    }
    if let Some(runs) = attach {
        let uprobes = runs
            .iter()
            .find_map(|r| r.uprobes)
            .map_or("?".into(), |n| n.to_string());
        n.push_str(&format!(
            "- Attach: one `python -u train.py {}` runs throughout; each round runs \
             `lens-probe --span-groups per_step --exporter console -v --duration 3s --pid PID` \
             ({uprobes} uprobes), under `/usr/bin/time -f '%U %S %M'` when there is one, and \
             times its stderr lines from its start.\n",
            ATTACH_TARGET_ARGS.join(" ")
        ));
    }
    let mut teardowns = Vec::new();
    for preset in PRESETS {
        let fake_t: Vec<f64> = r
            .fake
            .iter()
            .flat_map(|fake| fake.runs(Fake::Lens(preset)))
            .filter_map(|r| r.teardown_s)
            .collect();
        if let Some(m) = median(&fake_t) {
            teardowns.push(format!("fake trainer `{preset}` {}", fmt_duration(m)));
        }
    }
    if let Some(torch) = torch {
        for preset in PRESETS {
            let t: Vec<f64> = torch
                .runs(Some(preset))
                .iter()
                .filter_map(|r| r.teardown_s)
                .collect();
            if let Some(m) = median(&t) {
                teardowns.push(format!("PyTorch `{preset}` {}", fmt_duration(m)));
            }
        }
    }
    if !teardowns.is_empty() {
        n.push_str(&format!(
            "- lens-probe exits at once and leaves a child holding the probes' descriptors; \
             the kernel removes the uprobes (~0.1 s each) when it closes them. Each run waits \
             for that child before the next starts. Exit → teardown done, medians: {}.\n",
            teardowns.join(", ")
        ));
    }
    if let Some(fake) = &r.fake {
        if let Some(why) = &fake.bpftrace_skipped {
            n.push_str(&format!("- bpftrace not measured: {why}.\n"));
        }
        for m in &fake.count_mismatches {
            n.push_str(&format!("- **Check**: {m}.\n"));
        }
    }
    if let Err(why) = &ctx.python
        && (r.blocks.contains(Block::Torch) || r.blocks.contains(Block::Attach))
    {
        n.push_str(&format!("- PyTorch rows not measured: {why}.\n"));
    }
    if watch.foreign.is_empty() {
        n.push_str("- No other lens-probe or bpftrace process was seen between the runs.\n");
    } else {
        let list: Vec<&str> = watch.foreign.iter().map(String::as_str).collect();
        n.push_str(&format!(
            "- **Other tracers were running during the bench** ({}): they share the CPUs and \
             the uprobes of shared library files (the torch venv's), so these numbers are \
             not clean.\n",
            list.join(", ")
        ));
    }
    n.push_str(&format!(
        "- Logs of every run: `{}`.\n",
        ctx.logs
            .strip_prefix(&ctx.root)
            .unwrap_or(&ctx.logs)
            .display()
    ));
    n
}

/// The fake trainer's notes (blocks 1, 2a, 5).
fn fake_notes(n: &mut String, fake: &FakeBlock) {
    let steps = fake.steps;
    n.push_str(&format!(
        "- Fake trainer: `LENS_FAKE_SYNC_MS=0 sh -c 'trainer 1; t0; trainer {steps}; t1'` with \
         the fixtures built into `target/bench-fixtures`; the time is `trainer {steps}`'s own \
         (`date +%s%N` around it, after a `trainer 1` that has the libraries' probes \
         attached), not lens-probe's start-up or teardown. lens-probe runs as \
         `target/release/lens-probe --span-groups PRESET --exporter file --export-file /dev/null \
         --summary-json F --exec -- sh -c …`; bpftrace \
         runs `uprobe:LIB:FUNC,… {{ @ = count(); }}` on the same {} functions (started first, \
         the trainer runs once its `BEGIN` has fired, then SIGINT). {} probed calls per timed \
         run ({CALLS_PER_STEP} per step + `ncclCommInitRank`, from the `per_step` runs' \
         `--summary-json`); events: {EVENTS_PER_STEP} per step.\n",
        FAKE_PROBES.len(),
        fmt_count(fake.calls() as f64),
    ));
    n.push_str(
        "- Per probed call = (traced − uninstrumented time of the same round) / calls, \
         median over the rounds. lens-probe puts return probes on 10 of the 24 calls of a \
         step (collectives, syncs), bpftrace's floor row has entry probes only; the \
         entries + returns row is the kernel floor for lens-probe's probe set.\n",
    );
    n.push_str(
        "- The fake trainer's lens-probe runs export to a file (`/dev/null`) rather than the \
         console: the console tree keeps every span of a top-level phase until it ends and \
         then links children by scanning all of them (quadratic). The fake trainer never ends \
         its first phase, so 20 000 steps cost lens-probe ~3 min of CPU after the trainer \
         has exited (measured by hand; outside the timed part, but too long for a bench).\n",
    );
}

#[cfg(test)]
mod tests {
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
             "sync_waits": {"stream": {"calls": 40, "p50_ns": 3}}}
          ]}"#;
        let json = Json::parse(doc).unwrap();
        assert_eq!(
            trainer_summary(&json, 40).unwrap(),
            TrainerSummary {
                calls: 441,
                events: 120,
                lost: 3
            }
        );
        assert!(trainer_summary(&json, 7).is_err());
    }

    #[test]
    fn bpftrace_probes_the_per_step_functions() {
        let script = bpftrace_script(Path::new("/fx"), false);
        assert!(script.starts_with("BEGIN { printf(\"lens-bench-ready\\n\"); }\n"));
        assert!(script.contains("uprobe:/fx/libcudart.so.12:cudaLaunchKernel,\n"));
        assert!(script.contains("uprobe:/fx/libnccl.so.2:ncclCommInitRank\n{ @ = count(); }"));
        assert_eq!(script.matches("uprobe:").count(), 16);
        assert!(!script.contains("uretprobe"));
        let with_returns = bpftrace_script(Path::new("/fx"), true);
        assert_eq!(with_returns.matches("uretprobe:").count(), 11);
        assert!(with_returns.ends_with("{ @ret = count(); }\n"));
        // 24 calls a step: 10 + 1 launches, 7 collectives, group start and end, 1 graph
        // launch, 3 syncs; every one of those functions is probed.
        assert_eq!(CALLS_PER_STEP, 10 + 1 + 7 + 2 + 1 + 3);
    }
}
