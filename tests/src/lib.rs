//! Test harness for lens-probe: paths to the C fixtures built by `build.rs`
//! (see `tests/README.md`) and the skip rules for tests that need privileges, the
//! real NVIDIA libraries or the PyTorch venv.
//!
//! The skip rule: a test that cannot run here (not root, no uprobe PMU, no real
//! libraries, no PyTorch venv) prints `SKIP <test>: <reason>` and passes, except under
//! `CI=true` (or `CI=1`), where it panics instead: in CI a skip is a failure.

use std::path::{Path, PathBuf};

/// The directory the build script compiled the fixtures into
/// (`$OUT_DIR/fixtures`): `libcudart.so.12`, `libnccl.so.2` (and their link-name
/// symlinks), `trainer` and `real_libs_caller`; and `faketorch/` with `libtorch_cpu.so`,
/// `libc10.so` and `trainer_torch`.
pub fn fixtures_dir() -> &'static Path {
    Path::new(env!("LENS_FIXTURES_DIR"))
}

/// The fake training job, linked against the fake libraries next to it
/// (RUNPATH `$ORIGIN`). Usage `trainer [STEPS]`; its exact call pattern is in
/// `tests/README.md`.
pub fn trainer() -> PathBuf {
    fixtures_dir().join("trainer")
}

/// `hammer KIND N`: calls one function of the fake libraries N times in a loop and
/// prints the loop's time (KIND: `launch`, `sync`, `collective`, `group`; see
/// `tests/README.md`). Linked like [`trainer`]. Used by `cargo xtask bench`.
pub fn hammer() -> PathBuf {
    fixtures_dir().join("hammer")
}

/// `memory_user [oom]`: GPU memory allocated and freed in an exact pattern, through the
/// fake runtime and the fake driver directly (its header says which; `oom`: a 1 TiB
/// allocation fails). Linked like [`trainer`].
pub fn memory_user() -> PathBuf {
    fixtures_dir().join("memory_user")
}

/// `collective_rank RANK NRANKS STEPS`: one rank of a multi-rank job, each step an
/// `ncclAllReduce` on stream `0x5100`, a `cudaEventRecord` after it and a wait for it
/// (`COLLECTIVE_WAIT`: `query`, `watchdog`, `event_sync`, `stream_sync`); with
/// `LENS_FAKE_COLLECTIVE_US` the collectives complete later, with `LENS_FAKE_NCCL_TRUTH`
/// the fake libnccl writes when (see `tests/README.md`). Linked like [`trainer`].
pub fn collective_rank() -> PathBuf {
    fixtures_dir().join("collective_rank")
}

/// Waits (up to 30 s) until no `lens-probe` process is left: the kernel removes uprobes
/// one at a time (~0.1 s each) after an instance exits, and new attachments queue behind
/// that, so a test that needs an attachment within a deadline starts on a quiet kernel.
pub fn wait_for_lens_probe_teardown() {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let running = || {
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .any(|entry| {
                std::fs::read_to_string(entry.path().join("comm"))
                    .is_ok_and(|c| c.trim() == "lens-probe")
            })
    };
    while running() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `threads_dlopen LIBRARY`: loads LIBRARY while another thread waits in epoll_wait;
/// exits 3 if that wait was interrupted.
pub fn threads_dlopen() -> PathBuf {
    fixtures_dir().join("threads_dlopen")
}

/// The program that `dlopen`s the real `libcudart.so.12` and `libnccl.so.2` by path
/// and calls each probed function once: `real_libs_caller <cudart> <nccl>`.
pub fn real_libs_caller() -> PathBuf {
    fixtures_dir().join("real_libs_caller")
}

/// The directory holding the fake `libcudart.so.12` and `libnccl.so.2`.
pub fn fake_lib_dir() -> PathBuf {
    fixtures_dir().to_path_buf()
}

/// The fake PyTorch training job, linked against the fake `libtorch_cpu.so` and
/// `libc10.so` next to it and the fake `libnccl.so.2` one directory up (RUNPATH
/// `$ORIGIN:$ORIGIN/..`). Usage `trainer_torch [STEPS] [ACCUM] [EVAL_EVERY] [CKPT_EVERY]`;
/// its exact call sequence is in `tests/README.md`.
pub fn torch_trainer() -> PathBuf {
    fake_torch_dir().join("trainer_torch")
}

/// `env VARS... trainer_torch ARGS...`: the fake PyTorch trainer with its settings, as an
/// argument vector for `--exec` or `Session::exec`.
pub fn torch_trainer_argv(env: &[(&str, &str)], args: &[&str]) -> Vec<std::ffi::OsString> {
    let mut argv: Vec<std::ffi::OsString> = vec!["env".into()];
    argv.extend(env.iter().map(|(k, v)| format!("{k}={v}").into()));
    argv.push(torch_trainer().into_os_string());
    argv.extend(args.iter().map(Into::into));
    argv
}

/// `configured_trainer [STEPS] [EVAL_EVERY] [CKPT_EVERY]`: a training loop over its own
/// library `libmytrain.so` next to it (in `configured/`), for configured probe rules;
/// its calls are in `tests/README.md`.
pub fn configured_trainer() -> PathBuf {
    fixtures_dir().join("configured/configured_trainer")
}

/// `throwing_trainer [ROUNDS]`: C++ calls into `throwing/libtorch_cpu.so` and
/// `libtorch_python.so` (functions under libtorch's probed names that throw) and into its
/// own `my::Trainer::fails`, each exception caught by the caller; prints each outcome.
pub fn throwing_trainer() -> PathBuf {
    fixtures_dir().join("throwing/throwing_trainer")
}

/// The directory holding the fake `libtorch_cpu.so` and `libc10.so` (and
/// `trainer_torch`): `faketorch/` under [`fixtures_dir`].
pub fn fake_torch_dir() -> PathBuf {
    fixtures_dir().join("faketorch")
}

/// Where the uprobe PMU advertises its perf event type; missing when the kernel has
/// no uprobe support (or `/sys` is not mounted).
const UPROBE_TYPE_FILE: &str = "/sys/bus/event_source/devices/uprobe/type";

/// True when `CI` is `true` or `1`: skipping is then a failure.
fn under_ci() -> bool {
    std::env::var("CI")
        .map(|v| {
            let v = v.trim();
            v.eq_ignore_ascii_case("true") || v == "1"
        })
        .unwrap_or(false)
}

/// Applies the skip rule: panics under CI, otherwise prints `SKIP <test>: <reason>`.
/// `what`: the component that is missing (for tests of components of their own).
pub fn skip(test_name: &str, what: &str, reason: &str) {
    if under_ci() {
        panic!("{test_name}: {what} unavailable under CI=true: {reason}");
    }
    eprintln!("SKIP {test_name}: {reason}");
}

/// The reason BPF/uprobe tests cannot run in this process, or `None` when they can.
fn bpf_unavailable_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Some(format!(
            "needs root to load BPF programs and attach uprobes (euid is {euid}); \
             run the tests with sudo"
        ));
    }
    if !Path::new(UPROBE_TYPE_FILE).exists() {
        return Some(format!(
            "{UPROBE_TYPE_FILE} does not exist: the kernel has no uprobe PMU \
             (CONFIG_UPROBE_EVENTS) or /sys is not mounted"
        ));
    }
    None
}

/// Whether a test that loads BPF programs and attaches uprobes can run: true when
/// this process is root (euid 0) and the kernel has the uprobe PMU
/// (`/sys/bus/event_source/devices/uprobe/type`).
///
/// Otherwise prints `SKIP <test_name>: <reason>` to stderr and returns false, so the
/// test can `return` early; but under `CI=true` (or `CI=1`) it panics, since a skip
/// in CI is a failure.
pub fn require_bpf(test_name: &str) -> bool {
    match bpf_unavailable_reason() {
        None => true,
        Some(reason) => {
            skip(test_name, "BPF/uprobes", &reason);
            false
        }
    }
}

/// The standard error of a finished command, as text.
pub fn stderr_text(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Prefixes of the variables lens-probe reads its settings from.
pub const SETTING_PREFIXES: [&str; 3] = ["NEMO_LENS_", "LENS_PROBE_", "OTEL_"];

/// The lens-probe binary at `path` (a test's `CARGO_BIN_EXE_lens-probe`) as a command
/// that inherits none of the test process's own settings variables.
pub fn lens_probe_command(path: &str) -> std::process::Command {
    let mut command = std::process::Command::new(path);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if SETTING_PREFIXES.iter().any(|p| key.starts_with(p)) {
            command.env_remove(key.as_ref());
        }
    }
    command
}

/// lens-probe's contract for a failure it reports: exit status `code` and exactly one
/// line on stderr, starting with the program name, containing `needle`.
pub fn assert_one_line_error(output: &std::process::Output, code: i32, needle: &str) {
    let text = stderr_text(output);
    assert_eq!(output.status.code(), Some(code), "{text}");
    assert_eq!(text.lines().count(), 1, "not one line: {text:?}");
    assert!(text.starts_with("lens-probe: "), "{text}");
    assert!(text.contains(needle), "{needle:?} not in {text:?}");
}

/// Paths to the real NVIDIA runtime libraries (from the PyPI wheels
/// `nvidia-cuda-runtime-cu12` and `nvidia-nccl-cu12`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvidiaLibs {
    /// `.../nvidia/cuda_runtime/lib/libcudart.so.12`
    pub cudart: PathBuf,
    /// `.../nvidia/nccl/lib/libnccl.so.2`
    pub nccl: PathBuf,
}

/// The `pip install --target` directory `cargo xtask setup` fills: `$LENS_PYPI_CACHE`,
/// or `$HOME/.cache/lens-probe/pypi`.
fn pypi_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("LENS_PYPI_CACHE").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    std::env::var_os("HOME")
        .filter(|v| !v.is_empty())
        .map(|home| PathBuf::from(home).join(".cache/lens-probe/pypi"))
}

/// Finds the real `libcudart.so.12` and `libnccl.so.2` in the PyPI cache
/// (`$LENS_PYPI_CACHE`, default `$HOME/.cache/lens-probe/pypi`, a
/// `pip install --target` directory) at `nvidia/cuda_runtime/lib/libcudart.so.12` and
/// `nvidia/nccl/lib/libnccl.so.2`.
///
/// When either is missing the same rule as [`require_bpf`] applies: panic under
/// `CI=true` (or `CI=1`), otherwise print `SKIP <test_name>: <reason>` (which says to
/// run `cargo xtask setup`) and return `None`.
pub fn nvidia_libs(test_name: &str) -> Option<NvidiaLibs> {
    let Some(cache) = pypi_cache_dir() else {
        skip(
            test_name,
            "real NVIDIA libraries",
            "neither LENS_PYPI_CACHE nor HOME is set, so the PyPI cache cannot be found; \
             set LENS_PYPI_CACHE and run `cargo xtask setup`",
        );
        return None;
    };
    let libs = NvidiaLibs {
        cudart: cache.join("nvidia/cuda_runtime/lib/libcudart.so.12"),
        nccl: cache.join("nvidia/nccl/lib/libnccl.so.2"),
    };
    let missing: Vec<String> = [&libs.cudart, &libs.nccl]
        .into_iter()
        .filter(|p| !p.is_file())
        .map(|p| p.display().to_string())
        .collect();
    if missing.is_empty() {
        return Some(libs);
    }
    skip(
        test_name,
        "real NVIDIA libraries",
        &format!(
            "missing {}; run `cargo xtask setup` to download them into {} \
             (or point LENS_PYPI_CACHE at a `pip install --target` directory that has them)",
            missing.join(" and "),
            cache.display()
        ),
    );
    None
}

/// The Python virtual environment `cargo xtask setup` creates with PyPI PyTorch and
/// NeMo Lens (`torch==2.15.0`, `nemo-lens[sdk]==0.1.0`, Python 3.13; CPU use, no GPU).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchVenv {
    /// `DIR/bin/python`
    pub python: PathBuf,
    /// The venv directory.
    pub dir: PathBuf,
}

/// The stamp file `cargo xtask setup` writes into the venv once its `pip install` and
/// `import torch, nemo.lens` succeeded.
const TORCH_VENV_STAMP: &str = ".lens-requirements";

/// The venv directory `cargo xtask setup` fills: `$LENS_TORCH_VENV`, or
/// `$HOME/.cache/lens-probe/torch-venv`.
fn torch_venv_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("LENS_TORCH_VENV").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    std::env::var_os("HOME")
        .filter(|v| !v.is_empty())
        .map(|home| PathBuf::from(home).join(".cache/lens-probe/torch-venv"))
}

/// Finds the PyTorch venv (`$LENS_TORCH_VENV`, default
/// `$HOME/.cache/lens-probe/torch-venv`): it must have `bin/python` and the
/// `.lens-requirements` stamp that `cargo xtask setup` writes after a complete install.
///
/// When either is missing the same rule as [`require_bpf`] applies: panic under
/// `CI=true` (or `CI=1`), otherwise print `SKIP <test_name>: <reason>` (which says to
/// run `cargo xtask setup`) and return `None`.
pub fn torch_venv(test_name: &str) -> Option<TorchVenv> {
    let Some(dir) = torch_venv_dir() else {
        skip(
            test_name,
            "PyTorch venv",
            "neither LENS_TORCH_VENV nor HOME is set, so the PyTorch venv cannot be found; \
             set LENS_TORCH_VENV and run `cargo xtask setup`",
        );
        return None;
    };
    let venv = TorchVenv {
        python: dir.join("bin/python"),
        dir,
    };
    let stamp = venv.dir.join(TORCH_VENV_STAMP);
    let missing: Vec<String> = [&venv.python, &stamp]
        .into_iter()
        .filter(|p| !p.is_file())
        .map(|p| p.display().to_string())
        .collect();
    if missing.is_empty() {
        return Some(venv);
    }
    skip(
        test_name,
        "PyTorch venv",
        &format!(
            "missing {}; run `cargo xtask setup` to create the PyTorch venv in {} \
             (or point LENS_TORCH_VENV at a venv it made)",
            missing.join(" and "),
            venv.dir.display()
        ),
    );
    None
}

/// The real PyTorch CPU training script, `tests/fixtures/torch/train.py` (absolute).
/// Run it with [`TorchVenv::python`].
pub fn torch_train_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/torch/train.py")
}

/// A training-framework script of `tests/fixtures/frameworks/` (absolute), e.g.
/// `hf_trainer.py`: transformers, Lightning, DDP, FSDP2, DCP, torch.compile and
/// safetensors runs that write their framework's own ground truth to `$LENS_TRUTH`.
/// Run it with [`TorchVenv::python`] (or the venv's `torchrun`).
pub fn framework_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/frameworks")
        .join(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::process::Command;

    const CUDART_SYMBOLS: &[&str] = &[
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaGraphLaunch",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventRecord",
        "cudaEventRecordWithFlags",
        "cudaEventQuery",
        "__cudaRegisterFunction",
    ];

    const CUDA_SYMBOLS: &[&str] = &[
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuGraphLaunch",
        "cuModuleGetFunction",
    ];

    const NCCL_SYMBOLS: &[&str] = &[
        "ncclAllReduce",
        "ncclReduceScatter",
        "ncclBroadcast",
        "ncclReduce",
        "ncclAllGather",
        "ncclAlltoAll",
        "ncclSend",
        "ncclRecv",
        "ncclGroupStart",
        "ncclGroupEnd",
        "ncclGetVersion",
        "ncclCommInitRank",
    ];

    fn run_tool(cmd: &str, args: &[&str]) -> String {
        let out = Command::new(cmd)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running {cmd}: {e} (binutils is needed)"));
        assert!(
            out.status.success(),
            "{cmd} {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8 tool output")
    }

    /// `nm -D --defined-only` of a library: exported name -> address, for text symbols.
    fn exported_functions(lib: &Path) -> HashMap<String, u64> {
        let text = run_tool("nm", &["-D", "--defined-only", lib.to_str().unwrap()]);
        text.lines()
            .filter_map(|line| {
                let mut f = line.split_whitespace();
                let (addr, kind, name) = (f.next()?, f.next()?, f.next()?);
                (kind == "T").then(|| (name.to_string(), u64::from_str_radix(addr, 16).unwrap()))
            })
            .collect()
    }

    fn run_trainer(steps: &str, extra_env: &[(&str, &str)]) -> std::process::Output {
        let mut cmd = Command::new(trainer());
        cmd.arg(steps)
            .env("LENS_FAKE_SYNC_MS", "1")
            .env_remove("TRAINER_START_DELAY_MS")
            .env_remove("TRAINER_STEP_DELAY_MS")
            .env_remove("LD_LIBRARY_PATH");
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        cmd.output().expect("running trainer")
    }

    #[test]
    fn fixtures_exist() {
        for p in [
            trainer(),
            hammer(),
            collective_rank(),
            real_libs_caller(),
            fake_lib_dir().join("libcudart.so.12"),
            fake_lib_dir().join("libnccl.so.2"),
        ] {
            assert!(p.is_file(), "{} missing", p.display());
        }
    }

    #[test]
    fn trainer_runs_three_steps() {
        let out = run_trainer("3", &[]);
        assert!(
            out.status.success(),
            "trainer failed: {:?}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "trainer: 3 steps done\n"
        );
    }

    #[test]
    fn trainer_defaults_to_five_steps() {
        let mut cmd = Command::new(trainer());
        cmd.env("LENS_FAKE_SYNC_MS", "0");
        let out = cmd.output().expect("running trainer");
        assert!(out.status.success());
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "trainer: 5 steps done\n"
        );
    }

    #[test]
    fn fake_sync_calls_sleep() {
        // 3 steps x (10 + 5 + 2) ms of synchronisation with LENS_FAKE_SYNC_MS=10.
        let start = std::time::Instant::now();
        let out = run_trainer("3", &[("LENS_FAKE_SYNC_MS", "10")]);
        let took = start.elapsed();
        assert!(out.status.success());
        assert!(
            took >= std::time::Duration::from_millis(51),
            "trainer took only {took:?}"
        );
    }

    #[test]
    fn hammer_calls_one_function_n_times() {
        for kind in ["launch", "driver", "sync", "collective", "group"] {
            let out = Command::new(hammer())
                .args([kind, "3"])
                .env("LENS_FAKE_SYNC_MS", "0")
                .output()
                .expect("running hammer");
            assert!(out.status.success(), "hammer {kind} 3: {:?}", out.status);
            let stdout = String::from_utf8_lossy(&out.stdout);
            let time = stdout
                .strip_prefix(&format!("hammer: {kind} 3 calls in "))
                .and_then(|rest| rest.strip_suffix(" ns\n"))
                .unwrap_or_else(|| panic!("hammer {kind} 3 printed {stdout:?}"));
            assert!(time.parse::<u64>().is_ok(), "{stdout:?}");
        }
        for bad in [&["launch"][..], &["launch", "x"], &["teleport", "3"]] {
            let out = Command::new(hammer()).args(bad).output().unwrap();
            assert_eq!(out.status.code(), Some(2), "hammer {bad:?}");
        }
        let dyn_section = run_tool("readelf", &["-d", hammer().to_str().unwrap()]);
        for needed in ["[libcudart.so.12]", "[libnccl.so.2]", "[$ORIGIN]"] {
            assert!(
                dyn_section.contains(needed),
                "hammer lacks {needed}:\n{dyn_section}"
            );
        }
    }

    #[test]
    fn hammer_fork_runs_the_loop_in_a_child_that_never_execs() {
        let out = Command::new(hammer())
            .args(["launch", "3"])
            .env("HAMMER_FORK", "1")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).split(" in ").next(),
            Some("hammer: launch 3 calls"),
            "{out:?}"
        );
        // `wait`: each step waits for a line; all three given at once, the parent must
        // leave the child's two in the pipe.
        let mut child = Command::new(hammer())
            .args(["launch", "3"])
            .env("HAMMER_FORK", "wait")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), b"\n\n\n").unwrap();
        let parent = child.id();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), 3, "{stdout}");
        let pid = |line: &str, what: &str| -> u32 {
            line.strip_prefix(what)
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("{stdout}"))
        };
        assert_eq!(pid(lines[0], "hammer: parent pid "), parent);
        assert_ne!(pid(lines[1], "hammer: child pid "), parent);
        assert!(
            lines[2].starts_with("hammer: launch 3 calls in "),
            "{stdout}"
        );
    }

    #[test]
    fn trainer_uses_fake_libs_next_to_it() {
        let dyn_section = run_tool("readelf", &["-d", trainer().to_str().unwrap()]);
        for needed in ["[libcudart.so.12]", "[libnccl.so.2]", "[$ORIGIN]"] {
            assert!(
                dyn_section.contains(needed),
                "trainer lacks {needed}:\n{dyn_section}"
            );
        }
    }

    #[test]
    fn fake_libs_have_sonames() {
        for (lib, soname) in [
            ("libcudart.so.12", "[libcudart.so.12]"),
            ("libcuda.so.1", "[libcuda.so.1]"),
            ("libnccl.so.2", "[libnccl.so.2]"),
        ] {
            let d = run_tool(
                "readelf",
                &["-d", fake_lib_dir().join(lib).to_str().unwrap()],
            );
            assert!(
                d.lines()
                    .any(|l| l.contains("(SONAME)") && l.contains(soname)),
                "{lib} has no SONAME {soname}:\n{d}"
            );
        }
    }

    #[test]
    fn fake_libs_export_every_probed_symbol() {
        for (lib, symbols) in [
            ("libcudart.so.12", CUDART_SYMBOLS),
            ("libcuda.so.1", CUDA_SYMBOLS),
            ("libnccl.so.2", NCCL_SYMBOLS),
        ] {
            let path = fake_lib_dir().join(lib);
            let exported = exported_functions(&path);
            for sym in symbols {
                assert!(
                    exported.contains_key(*sym),
                    "{lib} does not export {sym}: {exported:?}"
                );
            }
        }
    }

    /// Each export is a real function of its own: a distinct address, and a body that
    /// starts with `push %rbp` like the real libraries.
    #[test]
    fn fake_lib_functions_are_distinct_and_start_with_push_rbp() {
        for (lib, symbols) in [
            ("libcudart.so.12", CUDART_SYMBOLS),
            ("libcuda.so.1", CUDA_SYMBOLS),
            ("libnccl.so.2", NCCL_SYMBOLS),
        ] {
            let path = fake_lib_dir().join(lib);
            let exported = exported_functions(&path);
            let mut by_addr: HashMap<u64, &str> = HashMap::new();
            for sym in symbols {
                let addr = exported[*sym];
                if let Some(other) = by_addr.insert(addr, sym) {
                    panic!("{lib}: {sym} and {other} share address {addr:#x}");
                }
            }

            let disasm = run_tool(
                "objdump",
                &["-d", "--no-show-raw-insn", path.to_str().unwrap()],
            );
            let mut lines = disasm.lines();
            let mut first_insn: HashMap<String, String> = HashMap::new();
            while let Some(line) = lines.next() {
                // "00000000000011fb <cudaLaunchKernel>:"
                let Some(name) = line
                    .strip_suffix(">:")
                    .and_then(|l| l.split_once(" <"))
                    .map(|(_, n)| n)
                else {
                    continue;
                };
                if let Some(insn) = lines.next() {
                    // "    11fb:\tpush   %rbp"
                    let insn = insn.split_once(':').map(|(_, i)| i).unwrap_or("");
                    first_insn.insert(
                        name.to_string(),
                        insn.split_whitespace().collect::<Vec<_>>().join(" "),
                    );
                }
            }
            for sym in symbols {
                let insn = first_insn
                    .get(*sym)
                    .unwrap_or_else(|| panic!("{lib}: no disassembly for {sym}"));
                assert_eq!(insn, "push %rbp", "{lib}: {sym} starts with `{insn}`");
            }
        }
    }

    /// The probed functions of the fake `libtorch_cpu.so`, exported (`nm -D`, `T`).
    const TORCH_EXPORTED_SYMBOLS: &[&str] = &[
        "_ZN5torch8autograd8profiler25record_function_enter_newERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERKSt8optionalIS7_E",
        "_ZN5torch8autograd6Engine7executeERKSt6vectorINS0_4EdgeESaIS3_EERKS2_IN2at6TensorESaIS9_EEbbbS7_",
        "_ZN6caffe29serialize19PyTorchStreamWriterC1ERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEEbm",
        "_ZN6caffe29serialize19PyTorchStreamWriterD1Ev",
        "_ZN6caffe29serialize19PyTorchStreamReaderC1ERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
        "_ZN6caffe29serialize19PyTorchStreamReaderD1Ev",
        "_ZN4c10d16ProcessGroupGloo9allreduceERSt6vectorIN2at6TensorESaIS3_EERKNS_16AllreduceOptionsE",
        "_ZN4c10d16ProcessGroupGloo9broadcastERSt6vectorIN2at6TensorESaIS3_EERKNS_16BroadcastOptionsE",
        "_ZN4c10d16ProcessGroupGloo9allgatherERSt6vectorIS1_IN2at6TensorESaIS3_EESaIS5_EERS5_RKNS_16AllgatherOptionsE",
        "_ZN4c10d16ProcessGroupGloo14reduce_scatterERSt6vectorIN2at6TensorESaIS3_EERS1_IS5_SaIS5_EERKNS_20ReduceScatterOptionsE",
        "_ZN4c10d16ProcessGroupGloo6reduceERSt6vectorIN2at6TensorESaIS3_EERKNS_13ReduceOptionsE",
        "_ZN4c10d16ProcessGroupGloo7barrierERKNS_14BarrierOptionsE",
        "_ZN4c10d16ProcessGroupGloo4sendERSt6vectorIN2at6TensorESaIS3_EEii",
        "_ZN4c10d16ProcessGroupGloo4recvERSt6vectorIN2at6TensorESaIS3_EEii",
    ];

    /// Static in the real library: a local `.symtab` symbol, absent from `.dynsym`.
    const TORCH_LOCAL_EXIT: &str = "_ZN5torch8autograd8profilerL24record_function_exit_newERKN3c1013intrusive_ptrINS1_20PythonRecordFunctionENS2_6detail34intrusive_target_default_null_typeIS4_EEEE";

    const C10_SYMBOLS: &[&str] = &[
        "_ZN3c108GradMode11set_enabledEb",
        "_ZN3c108GradMode10is_enabledEv",
    ];

    #[test]
    fn torch_trainer_runs_with_defaults_and_options() {
        for env in [
            &[][..],
            &[
                ("TRAINER_DISTRIBUTED", "1"),
                ("TRAINER_LOAD", "1"),
                ("TRAINER_BAD_SCOPE", "1"),
            ][..],
        ] {
            let mut cmd = Command::new(torch_trainer());
            cmd.env("TRAINER_INIT_MS", "0")
                .env("TRAINER_FORWARD_MS", "0")
                .env("LENS_FAKE_BACKWARD_MS", "0")
                .env("LENS_FAKE_CKPT_MS", "0")
                .env("LENS_FAKE_COLLECTIVE_MS", "0")
                .env_remove("TRAINER_START_DELAY_MS")
                .env_remove("LD_LIBRARY_PATH");
            for (k, v) in env {
                cmd.env(k, v);
            }
            let out = cmd.output().expect("running trainer_torch");
            assert!(
                out.status.success(),
                "trainer_torch {env:?} failed: {:?}\nstderr: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                "trainer_torch: 4 steps done\n"
            );
        }
    }

    #[test]
    fn torch_trainer_uses_fake_libs() {
        let d = run_tool("readelf", &["-d", torch_trainer().to_str().unwrap()]);
        for needed in [
            "[libtorch_cpu.so]",
            "[libc10.so]",
            "[libnccl.so.2]",
            "[$ORIGIN:$ORIGIN/..]",
        ] {
            assert!(d.contains(needed), "trainer_torch lacks {needed}:\n{d}");
        }
    }

    #[test]
    fn fake_torch_libs_have_the_probed_symbols() {
        let torch = fake_torch_dir().join("libtorch_cpu.so");
        let c10 = fake_torch_dir().join("libc10.so");
        for (path, symbols) in [(&torch, TORCH_EXPORTED_SYMBOLS), (&c10, C10_SYMBOLS)] {
            let exported = exported_functions(path);
            for sym in symbols {
                assert!(
                    exported.contains_key(*sym),
                    "{} does not export {sym}",
                    path.display()
                );
            }
        }
        let exported = exported_functions(&torch);
        assert!(
            !exported.contains_key(TORCH_LOCAL_EXIT),
            "record_function_exit_new must not be exported"
        );
        let symtab = run_tool("nm", &["--defined-only", torch.to_str().unwrap()]);
        assert!(
            symtab.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() == 3 && f[1] == "t" && f[2] == TORCH_LOCAL_EXIT
            }),
            "no local text symbol {TORCH_LOCAL_EXIT} in .symtab"
        );
    }

    #[test]
    fn real_libs_caller_reports_missing_library() {
        let out = Command::new(real_libs_caller())
            .args(["/nonexistent/libcudart.so.12", "/nonexistent/libnccl.so.2"])
            .env_remove("CALLER_START_DELAY_MS")
            .output()
            .expect("running real_libs_caller");
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("dlopen"));
    }

    /// The caller itself, driven against the fakes (which return 0 everywhere): every
    /// call is made once, in order, and reported.
    #[test]
    fn real_libs_caller_against_fakes() {
        let dir = fake_lib_dir();
        let out = Command::new(real_libs_caller())
            .arg(dir.join("libcudart.so.12"))
            .arg(dir.join("libnccl.so.2"))
            .env_remove("CALLER_START_DELAY_MS")
            .output()
            .expect("running real_libs_caller");
        assert!(
            out.status.success(),
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let expected = [
            "cudaLaunchKernel=0",
            "cudaLaunchKernelExC=0",
            "cudaGraphLaunch=0",
            "cudaStreamSynchronize=0",
            "cudaEventSynchronize=0",
            "cudaDeviceSynchronize=0",
            "cudaEventRecord=0",
            "cudaEventRecordWithFlags=0",
            "cudaEventQuery=0",
            "cudaMalloc=0",
            "cudaMallocAsync=0",
            "cudaMallocManaged=0",
            "cudaFree=0",
            "cudaFreeAsync=0",
            "cudaStreamBeginCapture=0",
            "cudaStreamEndCapture=0",
            "cudaGraphInstantiate=0",
            "cudaGraphInstantiateWithFlags=0",
            "ncclGetVersion=0 version=23203",
            "ncclAllReduce=0",
            "ncclBroadcast=0",
            "ncclReduce=0",
            "ncclAllGather=0",
            "ncclReduceScatter=0",
            "ncclSend=0",
            "ncclRecv=0",
            "ncclAlltoAll=0",
            "ncclGroupStart=0",
            "ncclGroupEnd=0",
            "ncclCommInitRank=0",
        ];
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(stdout.lines().collect::<Vec<_>>(), expected);
    }

    #[test]
    fn skip_rule() {
        // Only the non-CI branch can be exercised without mutating the process
        // environment; check the CI parsing on its own.
        if !under_ci() {
            let _ = require_bpf("skip_rule");
            let _ = nvidia_libs("skip_rule");
            let _ = torch_venv("skip_rule");
        }
    }

    #[test]
    fn torch_train_script_exists() {
        let script = torch_train_script();
        assert!(script.is_absolute(), "{}", script.display());
        assert!(script.is_file(), "{} missing", script.display());
    }

    /// The loader's top-level modules import one way (docs/architecture.md): a cycle
    /// between two of them fails here, named.
    #[test]
    fn no_import_cycles_between_top_level_modules() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = Command::new("python3")
            .arg(root.join("scripts/module-cycles.py"))
            .current_dir(&root)
            .output()
            .expect("running scripts/module-cycles.py");
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// When setup has run, the venv found is a Python >= 3.13 one whose `bin/python` runs.
    #[test]
    fn torch_venv_python_runs_when_present() {
        let Some(venv) = torch_venv("torch_venv_python_runs_when_present") else {
            return;
        };
        assert!(venv.python.starts_with(&venv.dir));
        let out = Command::new(&venv.python)
            .args(["-c", "import sys; print(sys.version_info[:2] >= (3, 13))"])
            .output()
            .expect("running the venv's python");
        assert!(out.status.success());
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "True");
    }
}

/// The rotel OTLP collector from the PyPI venv: its binary and the library directory
/// its `libpython3.13.so` dependency lives in (for `LD_LIBRARY_PATH`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rotel {
    pub agent: PathBuf,
    pub library_dir: PathBuf,
}

/// Finds `rotel-agent` in the PyTorch venv (see [`torch_venv`] for the skip rule).
pub fn rotel(test_name: &str) -> Option<Rotel> {
    let venv = torch_venv(test_name)?;
    let output = std::process::Command::new(&venv.python)
        .args([
            "-c",
            "import sysconfig, rotel, os; print(sysconfig.get_config_var('LIBDIR')); \
             print(os.path.join(os.path.dirname(rotel.__file__), 'rotel-agent'))",
        ])
        .output();
    let found = output.ok().filter(|o| o.status.success()).and_then(|o| {
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let mut lines = text.lines();
        let library_dir = PathBuf::from(lines.next()?);
        let agent = PathBuf::from(lines.next()?);
        agent.is_file().then_some(Rotel { agent, library_dir })
    });
    if found.is_none() {
        skip(
            test_name,
            "rotel collector",
            "rotel-agent is not in the PyTorch venv; run `cargo xtask setup`",
        );
    }
    found
}

/// A free loopback port (bound then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// rotel receiving OTLP on loopback, printing everything it receives (detailed) to a
/// log file, exporting nowhere.
pub struct RotelCollector {
    child: std::process::Child,
    log: PathBuf,
    pub grpc: u16,
    pub http: u16,
}

impl RotelCollector {
    pub fn start(rotel: &Rotel, name: &str) -> RotelCollector {
        let (grpc, http) = (free_port(), free_port());
        let log =
            std::env::temp_dir().join(format!("lens-rotel-{name}-{}.log", std::process::id()));
        let child = std::process::Command::new(&rotel.agent)
            .env("LD_LIBRARY_PATH", &rotel.library_dir)
            .args(["start", "--exporter", "blackhole"])
            .args(["--debug-log", "traces", "--debug-log", "metrics"])
            .args(["--debug-log-verbosity", "detailed"])
            .arg("--otlp-grpc-endpoint")
            .arg(format!("127.0.0.1:{grpc}"))
            .arg("--otlp-http-endpoint")
            .arg(format!("127.0.0.1:{http}"))
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let collector = RotelCollector {
            child,
            log,
            grpc,
            http,
        };
        collector.wait_until(|text| text.contains("Starting Rotel"), "to start");
        collector
    }

    /// What it printed so far.
    pub fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its log once `done` accepts it (up to 20 s).
    pub fn wait_until(&self, done: impl Fn(&str) -> bool, what: &str) -> String {
        self.wait_within(std::time::Duration::from_secs(20), done, what)
    }

    pub fn wait_within(
        &self,
        patience: std::time::Duration,
        done: impl Fn(&str) -> bool,
        what: &str,
    ) -> String {
        let deadline = std::time::Instant::now() + patience;
        loop {
            let text = self.text();
            if done(&text) {
                return text;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "rotel did not {what}:\n{text}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

impl Drop for RotelCollector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// `kubernetes-validate` (PyPI) from the PyTorch venv: checks Kubernetes manifests
/// against the OpenAPI schemas it ships for each Kubernetes minor version (offline).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesValidate {
    /// The venv's interpreter, which runs it as `python -m kubernetes_validate`.
    pub python: PathBuf,
    /// Its own version (`1.37.0`), which is also the newest Kubernetes it knows.
    pub version: String,
}

impl KubernetesValidate {
    /// `python -m kubernetes_validate`: add options (`--strict`, `-k 1.30.0`…), then
    /// the files (options after the first file are taken as file names). Exit status 0
    /// when every resource validated, or had no schema (a `WARN` line, e.g. a
    /// kustomization); 1 when one did not.
    pub fn command(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(&self.python);
        cmd.args(["-m", "kubernetes_validate"])
            .env_remove("PYTHONHOME")
            .env_remove("PYTHONPATH");
        cmd
    }
}

/// Finds `kubernetes-validate` in the PyTorch venv (see [`torch_venv`] for the skip
/// rule; a venv made before it was added to the requirements skips the same way).
pub fn kubernetes_validate(test_name: &str) -> Option<KubernetesValidate> {
    let venv = torch_venv(test_name)?;
    let output = std::process::Command::new(&venv.python)
        .args([
            "-c",
            "from kubernetes_validate.version import __version__; print(__version__)",
        ])
        .env_remove("PYTHONHOME")
        .env_remove("PYTHONPATH")
        .output();
    let found = output.ok().filter(|o| o.status.success()).and_then(|o| {
        let version = String::from_utf8_lossy(&o.stdout).trim().to_string();
        (!version.is_empty()).then(|| KubernetesValidate {
            python: venv.python.clone(),
            version,
        })
    });
    if found.is_none() {
        skip(
            test_name,
            "kubernetes-validate",
            "kubernetes-validate is not in the PyTorch venv; run `cargo xtask setup`",
        );
    }
    found
}

/// A span from an OTLP JSON lines file, with its resource's attributes (key → OTLP
/// `AnyValue`).
pub type FileSpan = (
    std::collections::BTreeMap<String, serde_json::Value>,
    serde_json::Value,
);

/// The metrics named `name` in an OTLP JSON lines file as lens-probe's `file` exporter
/// writes it, in file order (each collection of each process is one).
pub fn otlp_file_metrics(path: &Path, name: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut metrics = Vec::new();
    for line in text.lines() {
        let request: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        let Some(resources) = request["resourceMetrics"].as_array() else {
            continue;
        };
        for scope in resources
            .iter()
            .flat_map(|r| r["scopeMetrics"].as_array().unwrap())
        {
            let found = scope["metrics"].as_array().unwrap().iter();
            metrics.extend(found.filter(|metric| metric["name"] == name).cloned());
        }
    }
    metrics
}

/// The spans of an OTLP JSON lines file as lens-probe's `file` exporter writes it (one
/// `ExportTraceServiceRequest` or `ExportMetricsServiceRequest` per line; metrics lines
/// are skipped).
pub fn otlp_file_spans(path: &Path) -> Vec<FileSpan> {
    let mut spans = Vec::new();
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    for line in text.lines() {
        let request: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        let Some(resource_spans) = request["resourceSpans"].as_array() else {
            assert!(request["resourceMetrics"].is_array(), "{line}");
            continue;
        };
        for resource_spans in resource_spans {
            let resource = resource_spans["resource"]["attributes"]
                .as_array()
                .expect("resource attributes")
                .iter()
                .map(|kv| (kv["key"].as_str().unwrap().to_string(), kv["value"].clone()))
                .collect();
            for scope in resource_spans["scopeSpans"].as_array().expect("scopeSpans") {
                for span in scope["spans"].as_array().expect("spans") {
                    spans.push((std::collections::BTreeMap::clone(&resource), span.clone()));
                }
            }
        }
    }
    spans
}
