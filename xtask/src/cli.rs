//! The command line of `cargo xtask`.

use std::ffi::OsString;

use clap::{Parser, Subcommand};

use crate::bench::Block;

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "Project automation for lens-probe")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, PartialEq, Eq, Subcommand)]
pub enum Command {
    /// Install what the build and tests need
    ///
    /// The nightly toolchain with rust-src, bpf-linker, the NVIDIA PyPI wheels, gcc, and a
    /// Python 3.13 venv with PyTorch and NeMo Lens; each step is skipped when already done.
    Setup {
        /// Only print what it would do
        #[arg(long, short = 'n')]
        dry_run: bool,
    },
    /// Build the eBPF object into target/bpf and print its path
    BuildEbpf {
        /// A debug build (the default is release; the last of --debug and --release wins)
        #[arg(long, overrides_with = "release")]
        debug: bool,
        /// A release build (the default)
        #[arg(long, overrides_with = "debug")]
        release: bool,
    },
    /// Setup, then build, test, clippy -D warnings and fmt --check the workspace
    Test,
    /// Setup, build lens-probe, trace a 2-rank PyTorch DDP run into a Perfetto timeline
    ///
    /// Real PyTorch on CPU from the setup's venv: `torchrun --nproc-per-node 2` over gloo
    /// runs tests/fixtures/frameworks/ddp_train.py (6 steps, 2 evaluations, a few
    /// seconds) under `lens-probe --span-groups per_step --export-strategy all_ranks
    /// --perfetto target/demo/timeline.perfetto-trace --exec`: each rank's span tree on
    /// the console, then where the timeline is and how to open it (ui.perfetto.dev or
    /// trace_processor). Needs root and BPF.
    Demo,
    /// Measure lens-probe's overhead into docs/performance.md (needs root)
    ///
    /// Per-hit cost against bpftrace, overall and per probe kind; slowdown per preset on
    /// the fake trainer and on PyTorch; attach time, CPU and RSS; event throughput; the
    /// Python sampler; hang detection. Variants interleaved, medians of the rounds; one
    /// markdown table, printed and written into docs/performance.md.
    Bench {
        /// 1 round, smaller loops, docs left as they are
        #[arg(long)]
        quick: bool,
        /// Rounds of interleaved variants (default 5; 1 with --quick)
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        rounds: Option<u32>,
        /// These blocks only, comma-separated; docs left as they are
        #[arg(long, value_enum, value_delimiter = ',')]
        only: Option<Vec<Block>>,
    },
}

impl Command {
    /// For `build-ebpf`: whether the build is a release one.
    pub fn release(debug: bool, release: bool) -> bool {
        release || !debug
    }
}

/// Parses the arguments after `xtask`. An error is clap's: `--help` is one too, which
/// `exit()` prints with status 0; a bad argument (one that is not UTF-8 too) is named
/// with the usage, status 2.
pub fn parse<I, S>(args: I) -> Result<Command, clap::Error>
where
    I: IntoIterator<Item = S>,
    S: Into<OsString> + Clone,
{
    let argv =
        std::iter::once(OsString::from("cargo xtask")).chain(args.into_iter().map(Into::into));
    Cli::try_parse_from(argv).map(|cli| cli.command)
}

#[cfg(test)]
mod tests {
    use std::os::unix::ffi::OsStringExt;

    use clap::error::ErrorKind;

    use super::*;

    #[test]
    fn commands() {
        assert_eq!(parse(["setup"]).unwrap(), Command::Setup { dry_run: false });
        assert_eq!(
            parse(["setup", "--dry-run"]).unwrap(),
            Command::Setup { dry_run: true }
        );
        let build = |args: &[&str]| match parse(args).unwrap() {
            Command::BuildEbpf { debug, release } => Command::release(debug, release),
            other => panic!("{other:?}"),
        };
        assert!(build(&["build-ebpf"]));
        assert!(!build(&["build-ebpf", "--debug"]));
        assert!(build(&["build-ebpf", "--debug", "--release"]));
        assert!(!build(&["build-ebpf", "--release", "--debug"]));
        assert_eq!(parse(["test"]).unwrap(), Command::Test);
        assert_eq!(parse(["demo"]).unwrap(), Command::Demo);
        for help in [&["help"][..], &["-h"], &["--help"], &["test", "--help"]] {
            assert_eq!(parse(help).unwrap_err().kind(), ErrorKind::DisplayHelp);
        }
        assert_eq!(
            parse(["bench"]).unwrap(),
            Command::Bench {
                quick: false,
                rounds: None,
                only: None
            }
        );
        assert_eq!(
            parse(["bench", "--rounds", "3", "--quick"]).unwrap(),
            Command::Bench {
                quick: true,
                rounds: Some(3),
                only: None
            }
        );
        assert_eq!(
            parse(["bench", "--rounds=7"]).unwrap(),
            Command::Bench {
                quick: false,
                rounds: Some(7),
                only: None
            }
        );
        for args in [
            &["bench", "--only", "per-kind,throughput", "--quick"][..],
            &["bench", "--only=per-kind,throughput", "--quick"],
            &[
                "bench",
                "--only",
                "per-kind",
                "--quick",
                "--only",
                "throughput",
            ],
        ] {
            assert_eq!(
                parse(args).unwrap(),
                Command::Bench {
                    quick: true,
                    rounds: None,
                    only: Some(vec![Block::PerKind, Block::Throughput])
                }
            );
        }
    }

    /// `demo --help` says what the demo traces and what it leaves behind.
    #[test]
    fn demo_help() {
        let help = parse(["demo", "--help"]).unwrap_err();
        assert_eq!(help.kind(), ErrorKind::DisplayHelp);
        let text = help.to_string();
        for said in [
            "2-rank PyTorch DDP",
            "ddp_train.py",
            "--export-strategy all_ranks",
            "target/demo/timeline.perfetto-trace",
            "ui.perfetto.dev",
        ] {
            assert!(text.contains(said), "{said:?} not in:\n{text}");
        }
        assert!(!text.contains("fake trainer"), "{text}");
    }

    /// `--only` takes the names the bench's notes print.
    #[test]
    fn block_names() {
        use clap::ValueEnum;
        for block in Block::ALL {
            let value = block.to_possible_value().unwrap();
            assert_eq!(value.get_name(), block.name());
        }
        assert_eq!(Block::value_variants(), Block::ALL);
    }

    /// Each bad command line is refused, the error naming what was wrong.
    #[test]
    fn errors() {
        let refused = |args: &[&str], kind: ErrorKind, named: &str| {
            let error = parse(args).unwrap_err();
            assert_eq!(error.kind(), kind, "{args:?}: {error}");
            assert!(error.to_string().contains(named), "{args:?}: {error}");
        };
        refused(
            &[],
            ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand,
            "Usage",
        );
        refused(&["frobnicate"], ErrorKind::InvalidSubcommand, "frobnicate");
        refused(
            &["build-ebpf", "--fast"],
            ErrorKind::UnknownArgument,
            "--fast",
        );
        refused(&["test", "x"], ErrorKind::UnknownArgument, "'x'");
        refused(
            &["demo", "--release"],
            ErrorKind::UnknownArgument,
            "--release",
        );
        refused(&["setup", "--force"], ErrorKind::UnknownArgument, "--force");
        refused(&["bench", "--rounds"], ErrorKind::InvalidValue, "--rounds");
        refused(
            &["bench", "--rounds", "0"],
            ErrorKind::ValueValidation,
            "'0'",
        );
        refused(
            &["bench", "--rounds", "x"],
            ErrorKind::ValueValidation,
            "'x'",
        );
        refused(&["bench", "--only"], ErrorKind::InvalidValue, "--only");
        refused(
            &["bench", "--only", "trainer,gpu"],
            ErrorKind::InvalidValue,
            "invalid value 'gpu' for '--only <ONLY>'\n  [possible values: trainer, per-kind, \
             neighbour, torch, attach, throughput, budget, python, hangs, teardown, frameworks, \
             scale, recompute]",
        );
        refused(&["bench", "--fast"], ErrorKind::UnknownArgument, "--fast");
        refused(&["BUILD-EBPF"], ErrorKind::InvalidSubcommand, "BUILD-EBPF");
        // An argument that is not UTF-8 is clap's to refuse too.
        for at in [0, 2] {
            let mut args = ["bench", "--rounds", "3"].map(OsString::from);
            args[at] = OsString::from_vec(vec![b'3', 0xff]);
            let error = parse(args).unwrap_err();
            assert!(error.use_stderr(), "{at}: {error}");
        }
    }
}
