//! Hand-parsed command line of `cargo xtask`.

use crate::bench::Blocks;

pub const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  setup [--dry-run]     install what the build and tests need (nightly + rust-src, bpf-linker,
                        the NVIDIA PyPI wheels, gcc, a Python 3.13 venv with PyTorch and
                        NeMo Lens); each step is skipped when already done;
                        --dry-run only prints what it would do
  build-ebpf [--debug]  build the eBPF object into target/bpf and print its path (release by default)
  test                  setup, then build, test, clippy -D warnings and fmt --check the workspace
  demo                  setup, build lens-probe and the fixtures, trace the fake trainer
  bench [--quick] [--rounds N] [--only BLOCK,...]
                        measure lens-probe's overhead (per-hit cost vs bpftrace, overall and
                        per probe kind, slowdown per preset on the fake trainer and on
                        PyTorch, attach time, CPU and RSS, event throughput, the Python
                        sampler, hang detection), variants interleaved, N rounds (default 5),
                        medians; prints one markdown table and writes it into
                        docs/performance.md. Needs root.
                        --quick: 1 round, smaller loops, docs left as they are. --only: these
                        blocks only (trainer, per-kind, torch, attach, throughput, budget,
                        python, hangs), docs left as they are
  help                  print this help";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Setup {
        dry_run: bool,
    },
    BuildEbpf {
        release: bool,
    },
    Test,
    Demo,
    Bench {
        quick: bool,
        rounds: Option<u32>,
        only: Option<Blocks>,
    },
    Help,
}

/// Parses the arguments after `xtask`. `Err` is a one-line reason (then print usage, exit 2).
pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Command, String> {
    let Some((first, rest)) = args.split_first() else {
        return Err("missing command".into());
    };
    let rest: Vec<&str> = rest.iter().map(AsRef::as_ref).collect();
    let unexpected = |cmd: &str, arg: &str| Err(format!("unexpected argument `{arg}` for `{cmd}`"));
    match first.as_ref() {
        "help" | "-h" | "--help" => Ok(Command::Help),
        "setup" => {
            let mut dry_run = false;
            for arg in rest {
                match arg {
                    "--dry-run" | "-n" => dry_run = true,
                    "-h" | "--help" => return Ok(Command::Help),
                    other => return unexpected("setup", other),
                }
            }
            Ok(Command::Setup { dry_run })
        }
        "build-ebpf" => {
            let mut release = true;
            for arg in rest {
                match arg {
                    "--debug" => release = false,
                    "--release" => release = true,
                    "-h" | "--help" => return Ok(Command::Help),
                    other => return unexpected("build-ebpf", other),
                }
            }
            Ok(Command::BuildEbpf { release })
        }
        "bench" => {
            let mut quick = false;
            let mut rounds = None;
            let mut only = None;
            let mut args = rest.iter();
            while let Some(arg) = args.next() {
                let value = match *arg {
                    "--quick" => {
                        quick = true;
                        continue;
                    }
                    "-h" | "--help" => return Ok(Command::Help),
                    "--rounds" => args.next().copied(),
                    "--only" => {
                        let list = args.next().ok_or("`--only` needs a list of blocks")?;
                        only = Some(Blocks::parse(list)?);
                        continue;
                    }
                    other => match (
                        other.strip_prefix("--rounds="),
                        other.strip_prefix("--only="),
                    ) {
                        (Some(value), _) => Some(value),
                        (_, Some(list)) => {
                            only = Some(Blocks::parse(list)?);
                            continue;
                        }
                        _ => return unexpected("bench", other),
                    },
                };
                match value.map(str::parse::<u32>) {
                    Some(Ok(n)) if n > 0 => rounds = Some(n),
                    Some(_) => {
                        return Err(format!(
                            "`--rounds` wants a whole number of at least 1, not `{}`",
                            value.unwrap_or_default()
                        ));
                    }
                    None => return Err("`--rounds` needs a value".into()),
                }
            }
            Ok(Command::Bench {
                quick,
                rounds,
                only,
            })
        }
        cmd @ ("test" | "demo") => match rest.first() {
            None => Ok(if cmd == "test" {
                Command::Test
            } else {
                Command::Demo
            }),
            Some(&("-h" | "--help")) => Ok(Command::Help),
            Some(other) => unexpected(cmd, other),
        },
        other => Err(format!("unknown command `{other}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands() {
        assert_eq!(parse(&["setup"]), Ok(Command::Setup { dry_run: false }));
        assert_eq!(
            parse(&["setup", "--dry-run"]),
            Ok(Command::Setup { dry_run: true })
        );
        assert_eq!(
            parse(&["build-ebpf"]),
            Ok(Command::BuildEbpf { release: true })
        );
        assert_eq!(
            parse(&["build-ebpf", "--debug"]),
            Ok(Command::BuildEbpf { release: false })
        );
        assert_eq!(
            parse(&["build-ebpf", "--debug", "--release"]),
            Ok(Command::BuildEbpf { release: true })
        );
        assert_eq!(parse(&["test"]), Ok(Command::Test));
        assert_eq!(parse(&["demo"]), Ok(Command::Demo));
        for help in ["help", "-h", "--help"] {
            assert_eq!(parse(&[help]), Ok(Command::Help));
        }
        assert_eq!(parse(&["test", "--help"]), Ok(Command::Help));
        assert_eq!(
            parse(&["bench"]),
            Ok(Command::Bench {
                quick: false,
                rounds: None,
                only: None
            })
        );
        assert_eq!(
            parse(&["bench", "--quick"]),
            Ok(Command::Bench {
                quick: true,
                rounds: None,
                only: None
            })
        );
        assert_eq!(
            parse(&["bench", "--rounds", "3", "--quick"]),
            Ok(Command::Bench {
                quick: true,
                rounds: Some(3),
                only: None
            })
        );
        assert_eq!(
            parse(&["bench", "--rounds=7"]),
            Ok(Command::Bench {
                quick: false,
                rounds: Some(7),
                only: None
            })
        );
        let only = Blocks::parse("per-kind,throughput").unwrap();
        assert_eq!(
            parse(&["bench", "--only", "per-kind,throughput", "--quick"]),
            Ok(Command::Bench {
                quick: true,
                rounds: None,
                only: Some(only)
            })
        );
        assert_eq!(
            parse(&["bench", "--only=per-kind,throughput"]),
            Ok(Command::Bench {
                quick: false,
                rounds: None,
                only: Some(only)
            })
        );
    }

    #[test]
    fn errors() {
        assert_eq!(parse::<&str>(&[]), Err("missing command".to_owned()));
        assert_eq!(
            parse(&["frobnicate"]),
            Err("unknown command `frobnicate`".to_owned())
        );
        assert_eq!(
            parse(&["build-ebpf", "--fast"]),
            Err("unexpected argument `--fast` for `build-ebpf`".to_owned())
        );
        assert_eq!(
            parse(&["test", "x"]),
            Err("unexpected argument `x` for `test`".to_owned())
        );
        assert_eq!(
            parse(&["demo", "--release"]),
            Err("unexpected argument `--release` for `demo`".to_owned())
        );
        assert!(parse(&["setup", "--force"]).is_err());
        assert_eq!(
            parse(&["bench", "--rounds"]),
            Err("`--rounds` needs a value".to_owned())
        );
        assert_eq!(
            parse(&["bench", "--rounds", "0"]),
            Err("`--rounds` wants a whole number of at least 1, not `0`".to_owned())
        );
        assert!(parse(&["bench", "--rounds", "x"]).is_err());
        assert_eq!(
            parse(&["bench", "--only"]),
            Err("`--only` needs a list of blocks".to_owned())
        );
        assert_eq!(
            parse(&["bench", "--only", "trainer,gpu"]),
            Err(
                "unknown bench block `gpu` (blocks: trainer, per-kind, torch, attach, throughput, budget, python, hangs)"
                    .to_owned()
            )
        );
        assert_eq!(
            parse(&["bench", "--fast"]),
            Err("unexpected argument `--fast` for `bench`".to_owned())
        );
        assert!(parse(&["BUILD-EBPF"]).is_err());
    }
}
