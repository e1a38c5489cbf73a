//! `cargo xtask <command>`: project automation for lens-probe (see `cargo xtask help`).

mod bench;
mod cli;
mod demo;
mod setup;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use xtask::{Error, Result, ebpf, toolchain};

fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

fn main() -> ExitCode {
    let command = match cli::parse(std::env::args_os().skip(1)) {
        Ok(command) => command,
        // `--help` too: printed with status 0; a bad argument with the usage, status 2.
        Err(error) => error.exit(),
    };
    match command {
        cli::Command::Setup { dry_run } => match setup::run(dry_run) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(format!("xtask setup: {e}")),
        },
        cli::Command::BuildEbpf { debug, release } => {
            build_ebpf(cli::Command::release(debug, release))
        }
        cli::Command::Test => test(),
        cli::Command::Demo => demo::run(),
        cli::Command::Bench {
            quick,
            rounds,
            only,
        } => {
            let rounds = rounds.unwrap_or(if quick {
                1
            } else {
                bench::Options::DEFAULT_ROUNDS
            });
            match bench::run(bench::Options {
                rounds,
                quick,
                blocks: only.map_or(bench::Blocks::ALL, |only| bench::Blocks::of(&only)),
            }) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(e),
            }
        }
    }
}

fn fail(line: impl std::fmt::Display) -> ExitCode {
    eprintln!("{line}");
    ExitCode::FAILURE
}

fn build_ebpf(release: bool) -> ExitCode {
    let root = workspace_root();
    let target_dir = root.join("target").join("bpf");
    match ebpf::build(&root, &target_dir, release) {
        Ok(object) => {
            println!("{}", object.display());
            ExitCode::SUCCESS
        }
        Err(e) => fail(format!("xtask build-ebpf: {e}")),
    }
}

/// `cargo <args>` in the workspace root with the default toolchain, output streamed.
fn cargo(args: &[&str]) -> Command {
    let mut cmd = Command::new(toolchain::rustup_proxy("cargo"));
    toolchain::scrub_run_env(&mut cmd);
    cmd.current_dir(workspace_root())
        .args(args)
        .stdin(Stdio::null());
    cmd
}

/// Runs one named step; `Err` is the one line to print.
fn run_step(task: &str, cmd: &mut Command) -> Result<()> {
    run_step_reading(task, cmd, None)
}

/// [`run_step`], and when `read_line` is given, the step's stdout is streamed through it
/// (each line is still printed).
fn run_step_reading(
    task: &str,
    cmd: &mut Command,
    read_line: Option<&mut dyn FnMut(&str)>,
) -> Result<()> {
    use std::io::{BufRead, BufReader};
    let shown = toolchain::display_command(cmd);
    println!("==> [xtask {task}] {shown}");
    let start = Instant::now();
    let status = match read_line {
        None => cmd.status(),
        Some(read_line) => cmd.stdout(Stdio::piped()).spawn().and_then(|mut child| {
            if let Some(stdout) = child.stdout.take() {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    println!("{line}");
                    read_line(&line);
                }
            }
            child.wait()
        }),
    };
    match status {
        Ok(status) if status.success() => {
            println!(
                "==> [xtask {task}] `{shown}` ok ({:.1}s)",
                start.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Ok(status) => Err(Error::Msg(format!(
            "xtask {task}: step `{shown}` failed ({status})"
        ))),
        Err(e) => Err(Error::Msg(format!(
            "xtask {task}: step `{shown}` could not start: {e}"
        ))),
    }
}

/// Reads `test result: ok. 31 passed; 0 failed; 0 ignored; ...` into (passed, failed).
fn parse_test_result(line: &str) -> Option<(u64, u64)> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let (_, counts) = rest.split_once(". ")?;
    let mut passed = None;
    let mut failed = None;
    for part in counts.split(';') {
        let mut words = part.split_whitespace();
        let (Some(number), Some(label)) = (words.next(), words.next()) else {
            continue;
        };
        match label {
            "passed" => passed = number.parse().ok(),
            "failed" => failed = number.parse().ok(),
            _ => {}
        }
    }
    Some((passed?, failed?))
}

fn test() -> ExitCode {
    let start = Instant::now();
    if let Err(e) = setup::run(false) {
        return fail(format!("xtask test: step `cargo xtask setup` failed: {e}"));
    }
    if let Err(line) = run_step(
        "test",
        &mut cargo(&["build", "--workspace", "--all-targets"]),
    ) {
        return fail(line);
    }
    let (mut passed, mut failed) = (0u64, 0u64);
    let mut tally = |line: &str| {
        if let Some((p, f)) = parse_test_result(line) {
            passed += p;
            failed += f;
        }
    };
    let tested = run_step_reading(
        "test",
        &mut cargo(&["test", "--workspace", "--", "--test-threads=2"]),
        Some(&mut tally),
    );
    // One plain line with the whole suite's totals: the last line of the log.
    let totals = format!("tests: {passed} passed, {failed} failed");
    if let Err(line) = tested {
        println!("{totals}");
        return fail(line);
    }
    if passed == 0 {
        println!("{totals}");
        return fail("xtask test: `cargo test` ran no test");
    }
    let checks: [&[&str]; 2] = [
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
        &["fmt", "--all", "--", "--check"],
    ];
    for args in checks {
        if let Err(line) = run_step("test", &mut cargo(args)) {
            return fail(line);
        }
    }
    println!(
        "xtask test: all steps passed in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    println!("{totals}");
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtest_result_lines_are_tallied() {
        assert_eq!(
            parse_test_result(
                "test result: ok. 31 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.02s"
            ),
            Some((31, 0))
        );
        assert_eq!(
            parse_test_result("test result: FAILED. 2 passed; 5 failed; 0 ignored; 0 measured"),
            Some((2, 5))
        );
        assert_eq!(parse_test_result("test foo ... ok"), None);
        assert_eq!(parse_test_result("running 3 tests"), None);
    }
}
