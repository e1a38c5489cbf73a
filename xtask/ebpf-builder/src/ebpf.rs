//! Building the `lens-ebpf` crate into a BPF object (ELF), for `cargo xtask build-ebpf`
//! and lens-userspace's build script.

use std::fmt;
use std::io::{self, BufRead, BufReader, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};

use crate::toolchain::{self, NIGHTLY};

/// The eBPF target triple.
pub const TARGET: &str = "bpfel-unknown-none";
/// The package and binary that hold the BPF programs.
pub const PACKAGE: &str = "lens-ebpf";
/// The binary of the same package that holds the bench's event generator, an object of
/// its own so that lens-probe's carries no test program.
pub const BENCH_BINARY: &str = "lens-ebpf-bench";

/// Why the eBPF build could not run or failed. Every message is one line that says what to do.
#[derive(Debug)]
#[non_exhaustive]
pub enum BuildError {
    /// rustup (and so `cargo +nightly`) is not available.
    RustupMissing,
    /// No `nightly` toolchain is installed.
    NightlyMissing,
    /// The rust-src component is missing from the nightly toolchain at `sysroot`.
    RustSrcMissing { sysroot: PathBuf },
    /// bpf-linker is not in the directories searched (`$LENS_BPF_LINKER_ROOT/bin`, else
    /// `PATH` and the cargo bin directories).
    BpfLinkerMissing { searched: Vec<PathBuf> },
    /// The bpf-linker found loads another LLVM than the pinned nightly's (`llvm` names it):
    /// it could not read the nightly's bitcode.
    BpfLinkerOtherLlvm { path: PathBuf, llvm: String },
    /// The nested `cargo +nightly build` failed. Its full output went to stderr (inside a
    /// build script: to `output_log`, cargo's capture of the script's stderr);
    /// `first_error` is the first `error...` line with its `-->` location, if any.
    CargoFailed {
        status: ExitStatus,
        command: String,
        first_error: Option<String>,
        output_log: Option<PathBuf>,
    },
    /// The build succeeded but the object is not where it should be.
    ObjectMissing { path: PathBuf, binary: &'static str },
    /// An I/O error, e.g. cargo could not be spawned.
    Io { context: String, source: io::Error },
}

const SETUP_HINT: &str = "run `cargo xtask setup`";

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RustupMissing => write!(
                f,
                "rustup not found on PATH or in ~/.cargo/bin (the eBPF build needs `cargo +{NIGHTLY}`): \
                 install rustup from https://rustup.rs, then {SETUP_HINT}"
            ),
            Self::NightlyMissing => write!(
                f,
                "the {NIGHTLY} Rust toolchain is not installed (the eBPF program is built with it): {SETUP_HINT}"
            ),
            Self::RustSrcMissing { sysroot } => write!(
                f,
                "the rust-src component is missing from the {NIGHTLY} toolchain ({} has no library sources; \
                 `-Z build-std=core` needs them): {SETUP_HINT}",
                sysroot.display()
            ),
            Self::BpfLinkerMissing { searched } => match toolchain::bpf_linker_root() {
                Some(root) => write!(
                    f,
                    "bpf-linker not found in {}/bin (${} is set; it links the eBPF object): {SETUP_HINT}",
                    root.display(),
                    toolchain::BPF_LINKER_ROOT_ENV
                ),
                None => {
                    let cargo_bins = toolchain::cargo_bin_dirs();
                    let dirs: Vec<String> = searched
                        .iter()
                        .filter(|d| cargo_bins.contains(d))
                        .map(|d| d.display().to_string())
                        .collect();
                    write!(
                        f,
                        "bpf-linker not found on PATH or in {} (it links the eBPF object): {SETUP_HINT}",
                        dirs.join(", ")
                    )
                }
            },
            Self::BpfLinkerOtherLlvm { path, llvm } => write!(
                f,
                "{} is built on another LLVM ({llvm}) than the {NIGHTLY} toolchain's: {SETUP_HINT} \
                 (it rebuilds bpf-linker; set ${} to keep this one)",
                path.display(),
                toolchain::BPF_LINKER_ROOT_ENV
            ),
            Self::CargoFailed {
                status,
                command,
                first_error,
                output_log,
            } => {
                write!(f, "`{command}` failed ({status})")?;
                if let Some(first) = first_error {
                    write!(f, ": {first}")?;
                }
                match output_log {
                    Some(log) => write!(f, "; full compiler output in {}", log.display())?,
                    None => write!(f, "; full compiler output above")?,
                }
                write!(f, " (if the toolchain is broken, {SETUP_HINT})")
            }
            Self::ObjectMissing { path, binary } => write!(
                f,
                "the eBPF build succeeded but left no object at {} (is `[[bin]] name = \"{binary}\"` still in \
                 {PACKAGE}/Cargo.toml?); {SETUP_HINT} and retry",
                path.display()
            ),
            Self::Io { context, source } => {
                let source = source.to_string().replace('\n', " ");
                write!(f, "{context}: {source} ({SETUP_HINT})")
            }
        }
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// The inputs whose change requires a rebuild (for `cargo:rerun-if-changed`): lens-ebpf's and
/// lens-common's `src` directories and `Cargo.toml`s.
pub fn inputs(workspace_root: &Path) -> Vec<PathBuf> {
    ["lens-ebpf", "lens-common"]
        .into_iter()
        .flat_map(|krate| {
            let dir = workspace_root.join(krate);
            [dir.join("src"), dir.join("Cargo.toml")]
        })
        .collect()
}

/// Checks what the eBPF build needs: the pinned nightly, its rust-src component, and a
/// bpf-linker (see [`toolchain::find_bpf_linker`]) that is not built on another LLVM.
/// Returns that bpf-linker. Installs nothing (`cargo xtask setup` does).
pub fn check_toolchain() -> Result<PathBuf, BuildError> {
    match toolchain::nightly_installed() {
        None => return Err(BuildError::RustupMissing),
        Some(false) => return Err(BuildError::NightlyMissing),
        Some(true) => {}
    }
    let sysroot = toolchain::nightly_sysroot().ok_or(BuildError::NightlyMissing)?;
    if !toolchain::rust_src_installed(&sysroot) {
        return Err(BuildError::RustSrcMissing { sysroot });
    }
    let Some(linker) = toolchain::find_bpf_linker() else {
        return Err(BuildError::BpfLinkerMissing {
            searched: toolchain::bpf_linker_dirs(),
        });
    };
    if let Some(toolchain::LinkerLlvm::Other(llvm)) = toolchain::bpf_linker_llvm(&linker) {
        return Err(BuildError::BpfLinkerOtherLlvm { path: linker, llvm });
    }
    Ok(linker)
}

/// The Rust flags for the BPF build, one per element: `linker` is the bpf-linker that
/// [`check_toolchain`] checked (not whichever `bpf-linker` comes first on `PATH`).
pub fn rustflags(linker: &Path) -> Vec<String> {
    vec![
        format!("--cfg=bpf_target_arch=\"{}\"", std::env::consts::ARCH),
        "-Cdebuginfo=2".into(),
        "-Clink-arg=--btf".into(),
        format!("-Clinker={}", linker.display()),
    ]
}

/// Where `build` leaves the programs' object for a given target dir and profile.
pub fn object_path(target_dir: &Path, release: bool) -> PathBuf {
    binary_path(target_dir, release, PACKAGE)
}

/// Where `build` leaves the bench generator's object.
pub fn bench_object_path(target_dir: &Path, release: bool) -> PathBuf {
    binary_path(target_dir, release, BENCH_BINARY)
}

fn binary_path(target_dir: &Path, release: bool, binary: &str) -> PathBuf {
    target_dir
        .join(TARGET)
        .join(if release { "release" } else { "debug" })
        .join(binary)
}

/// The cargo arguments of the BPF build (after the cargo proxy).
pub fn cargo_args(target_dir: &Path, release: bool) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = [
        format!("+{NIGHTLY}").as_str(),
        "build",
        "-Z",
        "build-std=core",
        "--target",
        TARGET,
    ]
    .into_iter()
    .map(Into::into)
    .collect();
    if release {
        args.push("--release".into());
    }
    for a in [
        "-p",
        PACKAGE,
        "--bin",
        PACKAGE,
        "--bin",
        BENCH_BINARY,
        "--target-dir",
    ] {
        args.push(a.into());
    }
    args.push(target_dir.as_os_str().to_owned());
    args
}

/// Copies the child's stderr to ours line by line, returning the first compiler error.
fn tee_to_stderr(child_stderr: impl Read) -> Option<String> {
    let mut finder = FirstError::default();
    for line in BufReader::new(child_stderr).split(b'\n') {
        let Ok(line) = line else { break };
        let mut err = io::stderr().lock();
        let _ = err.write_all(&line).and_then(|()| err.write_all(b"\n"));
        finder.push(&strip_ansi(&String::from_utf8_lossy(&line)));
    }
    finder.finish()
}

/// Removes ANSI escape sequences (`ESC [ ... letter`) from a line of colored output.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Finds the first `error...` line of compiler output and the `-->` location after it.
#[derive(Default)]
struct FirstError {
    error: Option<String>,
    lines_since: usize,
    done: bool,
}

impl FirstError {
    const MAX_LEN: usize = 300;

    fn push(&mut self, line: &str) {
        if self.done {
            return;
        }
        match &mut self.error {
            None if line.starts_with("error") => self.error = Some(line.trim_end().to_owned()),
            None => {}
            Some(error) => {
                self.lines_since += 1;
                if let Some(location) = line.trim_start().strip_prefix("--> ") {
                    error.push_str(" at ");
                    error.push_str(location.trim());
                    self.done = true;
                } else if self.lines_since >= 3 {
                    self.done = true;
                }
            }
        }
    }

    fn finish(self) -> Option<String> {
        let mut error = self.error?;
        if error.len() > Self::MAX_LEN {
            let cut = (0..=Self::MAX_LEN)
                .rev()
                .find(|&i| error.is_char_boundary(i))
                .unwrap_or(0);
            error.truncate(cut);
            error.push('…');
        }
        Some(error)
    }
}

/// Inside a build script, cargo keeps the script's stderr in `<OUT_DIR>/../stderr`.
fn build_script_stderr_log() -> Option<PathBuf> {
    std::env::var_os("CARGO_MANIFEST_DIR")?;
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR")?);
    Some(out_dir.parent()?.join("stderr"))
}

/// Builds the lens-ebpf crate for `bpfel-unknown-none` and returns the path of the
/// programs' BPF object (`<target_dir>/bpfel-unknown-none/<release|debug>/lens-ebpf`); the
/// bench generator's is beside it ([`bench_object_path`]).
///
/// Runs `cargo +nightly build -Z build-std=core --target bpfel-unknown-none [--release]
/// -p lens-ebpf --bin lens-ebpf --bin lens-ebpf-bench --target-dir <target_dir>` in
/// `workspace_root`, with the
/// parent cargo's environment scrubbed (safe to call from a build script) and the compiler
/// output sent to stderr. A relative `target_dir` is taken relative to `workspace_root`.
/// Checks the toolchain first ([`check_toolchain`]).
pub fn build(
    workspace_root: &Path,
    target_dir: &Path,
    release: bool,
) -> Result<PathBuf, BuildError> {
    let linker = check_toolchain()?;
    let target_dir = workspace_root.join(target_dir);

    let mut cmd = toolchain::proxy_command("cargo");
    cmd.current_dir(workspace_root)
        .args(cargo_args(&target_dir, release))
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags(&linker).join("\x1f"))
        .stdin(Stdio::null())
        // A build script's stdout is cargo's instruction channel: keep it clean.
        .stdout(Stdio::from(io::stderr()))
        .stderr(Stdio::piped());
    let command = toolchain::display_command(&cmd);
    if io::stderr().is_terminal() {
        cmd.arg("--color=always");
    }
    let io_error = |source| BuildError::Io {
        context: format!("cannot run `{command}`"),
        source,
    };
    let mut child = cmd.spawn().map_err(io_error)?;
    let first_error = child.stderr.take().map(tee_to_stderr).unwrap_or_default();
    let status = child.wait().map_err(io_error)?;
    if !status.success() {
        return Err(BuildError::CargoFailed {
            status,
            command,
            first_error,
            output_log: build_script_stderr_log(),
        });
    }
    for (path, binary) in [
        (bench_object_path(&target_dir, release), BENCH_BINARY),
        (object_path(&target_dir, release), PACKAGE),
    ] {
        if !path.is_file() {
            return Err(BuildError::ObjectMissing { path, binary });
        }
    }
    Ok(object_path(&target_dir, release))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_cover_ebpf_and_common() {
        let got = inputs(Path::new("/ws"));
        let want: Vec<PathBuf> = [
            "lens-ebpf/src",
            "lens-ebpf/Cargo.toml",
            "lens-common/src",
            "lens-common/Cargo.toml",
        ]
        .iter()
        .map(|p| Path::new("/ws").join(p))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn object_location() {
        assert_eq!(
            object_path(Path::new("/ws/target/bpf"), true),
            Path::new("/ws/target/bpf/bpfel-unknown-none/release/lens-ebpf")
        );
        assert_eq!(
            object_path(Path::new("t"), false),
            Path::new("t/bpfel-unknown-none/debug/lens-ebpf")
        );
        assert_eq!(
            bench_object_path(Path::new("t"), true),
            Path::new("t/bpfel-unknown-none/release/lens-ebpf-bench")
        );
    }

    #[test]
    fn cargo_invocation() {
        let args: Vec<String> = cargo_args(Path::new("/ws/target/bpf"), true)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args.join(" "),
            format!(
                "+{NIGHTLY} build -Z build-std=core --target bpfel-unknown-none --release -p lens-ebpf --bin lens-ebpf \
             --bin lens-ebpf-bench --target-dir /ws/target/bpf"
            )
        );
        let debug = cargo_args(Path::new("x"), false);
        assert!(!debug.iter().any(|a| a == "--release"));
    }

    #[test]
    fn rustflags_for_bpf() {
        let linker = Path::new("/tools/bin/bpf-linker");
        let flags = rustflags(linker).join("\x1f");
        assert!(flags.starts_with("--cfg=bpf_target_arch=\""));
        assert!(
            flags.ends_with(
                "\x1f-Cdebuginfo=2\x1f-Clink-arg=--btf\x1f-Clinker=/tools/bin/bpf-linker"
            ),
            "{flags}"
        );
        #[cfg(target_arch = "x86_64")]
        assert_eq!(rustflags(linker)[0], "--cfg=bpf_target_arch=\"x86_64\"");
    }

    #[test]
    fn messages_are_one_line_and_say_what_to_run() {
        let status = std::process::Command::new("false").status().unwrap();
        let errors = [
            BuildError::RustupMissing,
            BuildError::NightlyMissing,
            BuildError::RustSrcMissing {
                sysroot: "/s".into(),
            },
            BuildError::BpfLinkerMissing {
                searched: vec!["/root/.cargo/bin".into()],
            },
            BuildError::BpfLinkerOtherLlvm {
                path: "/root/.cargo/bin/bpf-linker".into(),
                llvm: "libLLVM.so.22.1-rust-1.97.0-nightly".into(),
            },
            BuildError::CargoFailed {
                status,
                command: "cargo +nightly build".into(),
                first_error: None,
                output_log: None,
            },
            BuildError::CargoFailed {
                status,
                command: "cargo +nightly build".into(),
                first_error: Some("error[E0283]: type annotations needed at src/a.rs:1:2".into()),
                output_log: Some("/t/build/x/stderr".into()),
            },
            BuildError::ObjectMissing {
                path: "/o".into(),
                binary: BENCH_BINARY,
            },
            BuildError::Io {
                context: "cannot run `cargo`".into(),
                source: io::Error::other("a\nb"),
            },
        ];
        for e in errors {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "{msg}");
            assert!(msg.contains("cargo xtask setup"), "{msg}");
        }
    }

    fn first_error_of(output: &str) -> Option<String> {
        let mut finder = FirstError::default();
        for line in output.lines() {
            finder.push(&strip_ansi(line));
        }
        finder.finish()
    }

    #[test]
    fn first_compiler_error_is_extracted() {
        let output = "   Compiling lens-ebpf v0.1.0 (/w/lens-ebpf)
\x1b[0m\x1b[1m\x1b[38;5;9merror[E0283]\x1b[0m\x1b[0m\x1b[1m: type annotations needed\x1b[0m
\x1b[0m   \x1b[0m\x1b[0m\x1b[1m\x1b[38;5;12m--> \x1b[0m\x1b[0mlens-ebpf/src/programs.rs:91:15\x1b[0m
    |
error: could not compile `lens-ebpf` (bin \"lens-ebpf\") due to 1 previous error
";
        assert_eq!(
            first_error_of(output).as_deref(),
            Some("error[E0283]: type annotations needed at lens-ebpf/src/programs.rs:91:15")
        );
        assert_eq!(
            first_error_of(
                "error: linking with `bpf-linker` failed: exit status: 1\n  |\n  = note: x\n  = y\n"
            )
            .as_deref(),
            Some("error: linking with `bpf-linker` failed: exit status: 1")
        );
        assert_eq!(first_error_of("   Compiling x\nwarning: unused\n"), None);
        let long = format!("error: {}", "é".repeat(400));
        let got = first_error_of(&long).unwrap();
        assert!(got.len() <= FirstError::MAX_LEN + '…'.len_utf8() && got.ends_with('…'));
    }
}
