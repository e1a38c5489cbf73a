//! Finding the Rust toolchain pieces the eBPF build needs, and the pure helpers behind
//! `cargo xtask setup` (kept free of I/O so they can be unit-tested with sample strings).

use std::env;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The toolchain the eBPF crate is built with (`cargo +nightly-YYYY-MM-DD ...`), pinned by
/// date: bpf-linker is built against this nightly's own libLLVM, so a floating `nightly`
/// would break it on the next `rustup update`. The only place it is named: `cargo xtask
/// setup` installs it and the eBPF build (lens-userspace's build script too) uses it.
/// rustc 1.101.0-nightly (92ffebece 2026-10-28), LLVM 23.1.4.
pub const NIGHTLY: &str = "nightly-2026-10-29";

/// Where `cargo xtask setup` installs bpf-linker (`cargo install --root $LENS_BPF_LINKER_ROOT`,
/// so `$LENS_BPF_LINKER_ROOT/bin/bpf-linker`) and where the eBPF build takes it from. Unset:
/// cargo's own install root (`~/.cargo/bin`) and the build takes bpf-linker from `PATH` or
/// the cargo bin dirs. For machines where another checkout needs a bpf-linker built for
/// another LLVM in `~/.cargo/bin`.
pub const BPF_LINKER_ROOT_ENV: &str = "LENS_BPF_LINKER_ROOT";

/// The bpf-linker release `cargo xtask setup` installs (the only hard-coded version).
pub const BPF_LINKER_VERSION: &str = "0.13.0";

/// Environment variables a parent cargo (or a build script's environment) sets that
/// would misdirect a nested `cargo +nightly` invocation. Removed before spawning it.
const SCRUBBED_VARS: &[&str] = &[
    "RUSTC",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "RUSTC_LINKER",
    "RUSTDOC",
    "RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "RUSTDOCFLAGS",
    "CARGO_ENCODED_RUSTDOCFLAGS",
    "CARGO_BUILD_TARGET",
    "CARGO_BUILD_RUSTC",
    "CARGO_BUILD_RUSTC_WRAPPER",
    "CARGO_BUILD_RUSTC_WORKSPACE_WRAPPER",
    "CARGO_BUILD_RUSTFLAGS",
    "CARGO_BUILD_TARGET_DIR",
    "CARGO_TARGET_DIR",
    "RUSTUP_TOOLCHAIN",
    "CARGO_MAKEFLAGS",
    "MAKEFLAGS",
    "MFLAGS",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO",
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_MANIFEST_LINKS",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_NAME",
    "OUT_DIR",
    "TARGET",
    "HOST",
    "NUM_JOBS",
    "OPT_LEVEL",
    "PROFILE",
    "DEBUG",
];

/// Prefixes of variables set for build scripts / `cargo run` that a nested cargo must not see.
const SCRUBBED_PREFIXES: &[&str] = &[
    "CARGO_CFG_",
    "CARGO_FEATURE_",
    "CARGO_PKG_",
    "DEP_",
    "__CARGO",
];

/// Variables `cargo run` / rustup inject into the xtask process itself. Removed (only these)
/// before the workspace cargo commands of `cargo xtask test|demo`, so they run with the
/// default toolchain and the user's own RUSTFLAGS etc. stay untouched.
const RUN_INJECTED_VARS: &[&str] = &[
    "RUSTUP_TOOLCHAIN",
    "CARGO",
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_NAME",
];

/// `$HOME`, if set and non-empty.
pub fn home_dir() -> Option<PathBuf> {
    env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
}

/// Where cargo installs binaries: `$CARGO_HOME/bin` (if set), then `~/.cargo/bin`.
pub fn cargo_bin_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(cargo_home) = env::var_os("CARGO_HOME").filter(|v| !v.is_empty()) {
        dirs.push(PathBuf::from(cargo_home).join("bin"));
    }
    if let Some(home) = home_dir() {
        let dir = home.join(".cargo").join("bin");
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs
}

fn path_dirs() -> Vec<PathBuf> {
    env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect())
        .unwrap_or_default()
}

fn is_executable(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        path.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    }
    #[cfg(not(unix))]
    {
        path.is_file()
    }
}

fn find_in(dirs: impl IntoIterator<Item = PathBuf>, name: &str) -> Option<PathBuf> {
    dirs.into_iter()
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

/// Finds an executable on `PATH`, then in the cargo bin directories.
pub fn find_program(name: &str) -> Option<PathBuf> {
    find_in(path_dirs().into_iter().chain(cargo_bin_dirs()), name)
}

/// The rustup proxy for `name` (`cargo`, `rustc`, `rustup`), which understands `+nightly`.
///
/// Looks in the cargo bin directories first: inside a build script `PATH` may lead to a
/// toolchain's own `cargo`/`rustc`, which does not accept `+toolchain`. Falls back to
/// `PATH`, then to the bare name (so a spawn error names the program).
pub fn rustup_proxy(name: &str) -> PathBuf {
    find_in(cargo_bin_dirs().into_iter().chain(path_dirs()), name)
        .unwrap_or_else(|| PathBuf::from(name))
}

/// `PATH` with the cargo bin directories prepended when missing (bpf-linker lives there).
pub fn path_with_cargo_bin() -> OsString {
    let mut dirs = path_dirs();
    for bin in cargo_bin_dirs().into_iter().rev() {
        if !dirs.contains(&bin) && bin.is_dir() {
            dirs.insert(0, bin);
        }
    }
    env::join_paths(dirs).unwrap_or_else(|_| env::var_os("PATH").unwrap_or_default())
}

/// Names (from `names`) that [`scrub_nested_cargo_env`] removes. Pure, for tests.
pub fn nested_cargo_vars_to_remove<I, S>(names: I) -> Vec<OsString>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut out: Vec<OsString> = SCRUBBED_VARS.iter().map(OsString::from).collect();
    for name in names {
        let name = name.as_ref();
        let Some(s) = name.to_str() else { continue };
        if SCRUBBED_PREFIXES.iter().any(|p| s.starts_with(p)) && !out.iter().any(|o| o == name) {
            out.push(name.to_owned());
        }
    }
    out
}

/// Removes from `cmd` every variable a parent cargo/build script sets that would break a
/// nested `cargo +nightly` (see the list above), and puts the cargo bin dirs on `PATH`.
pub fn scrub_nested_cargo_env(cmd: &mut Command) -> &mut Command {
    for var in nested_cargo_vars_to_remove(env::vars_os().map(|(k, _)| k)) {
        cmd.env_remove(var);
    }
    cmd.env("PATH", path_with_cargo_bin())
}

/// Names (from `names`) that [`scrub_run_env`] removes. Pure, for tests.
pub fn run_injected_vars_to_remove<I, S>(names: I) -> Vec<OsString>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut out: Vec<OsString> = RUN_INJECTED_VARS.iter().map(OsString::from).collect();
    for name in names {
        let name = name.as_ref();
        if name.to_str().is_some_and(|s| s.starts_with("CARGO_PKG_")) {
            out.push(name.to_owned());
        }
    }
    out
}

/// Light scrub for the workspace's own cargo commands (`cargo xtask test|demo`): removes
/// what `cargo run` and rustup injected into xtask (so the default toolchain is used), keeps
/// everything else (`CI`, `RUSTFLAGS`, ...), and puts the cargo bin dirs on `PATH`.
pub fn scrub_run_env(cmd: &mut Command) -> &mut Command {
    for var in run_injected_vars_to_remove(env::vars_os().map(|(k, _)| k)) {
        cmd.env_remove(var);
    }
    cmd.env("PATH", path_with_cargo_bin())
}

/// A command for a rustup proxy (`cargo`, `rustc`, `rustup`) with a nested-cargo-safe
/// environment (never auto-installs a toolchain).
pub fn proxy_command(name: &str) -> Command {
    let mut cmd = Command::new(rustup_proxy(name));
    scrub_nested_cargo_env(&mut cmd);
    cmd.env("RUSTUP_AUTO_INSTALL", "0");
    cmd
}

/// Runs `cmd` and returns its stdout when it exits successfully.
pub fn capture(cmd: &mut Command) -> Option<String> {
    let out = cmd.stdin(std::process::Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether `rustup toolchain list` output has the toolchain that `+<toolchain>` resolves to
/// (`<toolchain>` or `<toolchain>-<host>`; for `nightly-2026-10-29` a floating `nightly-<host>`
/// or another date does not count, nor does `1.99.10-<host>` for `1.99.1`).
pub fn has_toolchain(toolchain_list: &str, toolchain: &str) -> bool {
    let prefix = format!("{toolchain}-");
    toolchain_list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .any(|name| {
            name == toolchain
                || name
                    .strip_prefix(&prefix)
                    .is_some_and(|host| host.starts_with(|c: char| c.is_ascii_alphabetic()))
        })
}

/// Whether `rustup toolchain list` output has the pinned [`NIGHTLY`].
pub fn has_nightly(toolchain_list: &str) -> bool {
    has_toolchain(toolchain_list, NIGHTLY)
}

/// The `channel` of a `rust-toolchain.toml` (`channel = "1.99.1"` → `1.99.1`), the pinned
/// user-space toolchain. A line-based read of the one key (no TOML parser in the builder).
pub fn toolchain_file_channel(toml: &str) -> Option<String> {
    toml.lines().find_map(|l| {
        let (key, value) = l.split_once('=')?;
        (key.trim() == "channel").then_some(())?;
        let value = value.split('#').next()?.trim();
        let value = value.strip_prefix('"')?.strip_suffix('"')?;
        (!value.is_empty()).then(|| value.to_owned())
    })
}

/// The LLVM major version from `rustc -vV` output ("LLVM version: 22.1.4" → 22).
pub fn parse_llvm_major(rustc_vv: &str) -> Option<u32> {
    rustc_vv
        .lines()
        .find_map(|l| l.trim().strip_prefix("LLVM version:"))
        .and_then(|v| v.trim().split('.').next()?.trim().parse().ok())
}

/// The link name of the toolchain's own libLLVM, from the file names in `<sysroot>/lib`:
/// `libLLVM-22-rust-1.97.0-nightly.so` → `LLVM-22-rust-1.97.0-nightly` (also accepts
/// `libLLVM-22.so`). The sorted first match wins; `None` if there is none.
pub fn llvm_dylib_name<I, S>(llvm_major: u32, file_names: I) -> Option<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let exact = format!("LLVM-{llvm_major}");
    let prefix = format!("LLVM-{llvm_major}-");
    let mut names: Vec<String> = file_names
        .into_iter()
        .filter_map(|n| {
            let stem = n.as_ref().strip_prefix("lib")?.strip_suffix(".so")?;
            (stem == exact || (stem.starts_with(&prefix) && stem.len() > prefix.len()))
                .then(|| stem.to_owned())
        })
        .collect();
    names.sort();
    names.into_iter().next()
}

/// Whether `bpf-linker --version` output is the release we install (0.13.x).
pub fn is_wanted_bpf_linker(version_output: &str) -> bool {
    let wanted_minor = BPF_LINKER_VERSION
        .rsplit_once('.')
        .map_or(BPF_LINKER_VERSION, |(mm, _)| mm);
    version_output.split_whitespace().any(|word| {
        word == wanted_minor
            || word
                .strip_prefix(wanted_minor)
                .is_some_and(|rest| rest.starts_with('.'))
    })
}

/// The pinned nightly's sysroot (`rustc +NIGHTLY --print sysroot`), if it works.
pub fn nightly_sysroot() -> Option<PathBuf> {
    let out = capture(proxy_command("rustc").args([&format!("+{NIGHTLY}"), "--print", "sysroot"]))?;
    let path = PathBuf::from(out.trim());
    path.is_dir().then_some(path)
}

/// Where rust-src puts the standard library sources inside a sysroot.
pub fn rust_src_dir(sysroot: &Path) -> PathBuf {
    sysroot
        .join("lib")
        .join("rustlib")
        .join("src")
        .join("rust")
        .join("library")
}

/// Whether the rust-src component is installed in `sysroot` (needed by `-Z build-std=core`).
pub fn rust_src_installed(sysroot: &Path) -> bool {
    rust_src_dir(sysroot)
        .join("core")
        .join("Cargo.toml")
        .is_file()
}

/// Whether rustup has the pinned nightly. `None`: no rustup.
pub fn nightly_installed() -> Option<bool> {
    toolchain_installed(NIGHTLY)
}

/// Whether rustup has `toolchain`. `None`: no rustup.
pub fn toolchain_installed(toolchain: &str) -> Option<bool> {
    capture(proxy_command("rustup").args(["toolchain", "list"]))
        .map(|list| has_toolchain(&list, toolchain))
}

/// `$LENS_BPF_LINKER_ROOT`, if set and non-empty.
pub fn bpf_linker_root() -> Option<PathBuf> {
    env::var_os(BPF_LINKER_ROOT_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Where bpf-linker is looked for: only `$LENS_BPF_LINKER_ROOT/bin` when that is set, else
/// `PATH` and the cargo bin dirs.
pub fn bpf_linker_dirs() -> Vec<PathBuf> {
    match bpf_linker_root() {
        Some(root) => vec![root.join("bin")],
        None => path_dirs().into_iter().chain(cargo_bin_dirs()).collect(),
    }
}

/// bpf-linker in `$LENS_BPF_LINKER_ROOT/bin`, else on `PATH` or in the cargo bin dirs.
pub fn find_bpf_linker() -> Option<PathBuf> {
    find_in(bpf_linker_dirs(), "bpf-linker")
}

/// The libLLVM a bpf-linker binary needs at run time, read from its bytes: the NUL-terminated
/// strings starting with `libLLVM` (the `DT_NEEDED` entry, e.g.
/// `libLLVM.so.22.1-rust-1.97.0-nightly`). Empty when it links LLVM statically.
pub fn linked_llvm_libs(binary: &[u8]) -> Vec<String> {
    const NEEDLE: &[u8] = b"libLLVM";
    let mut out: Vec<String> = Vec::new();
    let mut from = 0;
    while let Some(at) = memfind(&binary[from..], NEEDLE) {
        let start = from + at;
        // A whole string: preceded by NUL (or the start) and running to the next NUL.
        let whole = start == 0 || binary[start - 1] == 0;
        let end = binary[start..]
            .iter()
            .position(|&b| b == 0)
            .map_or(binary.len(), |n| start + n);
        let name = &binary[start..end];
        if whole
            && name.len() < 128
            && name
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(b))
        {
            let name = String::from_utf8_lossy(name).into_owned();
            if !out.contains(&name) {
                out.push(name);
            }
        }
        from = start + NEEDLE.len();
    }
    out
}

fn memfind(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Which LLVM a bpf-linker binary is built on, relative to the pinned nightly's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkerLlvm {
    /// It loads a libLLVM of the nightly's `<sysroot>/lib` from that directory.
    Nightly,
    /// It loads another libLLVM (named), or the same name from another directory (another
    /// nightly of the same version): it must be rebuilt.
    Other(String),
    /// No libLLVM dependency: LLVM is linked in statically; which one is unknown.
    Static,
}

/// Classifies a bpf-linker binary (its bytes) against the nightly's `<sysroot>/lib`
/// (`lib_dir`) and the file names there. Pure.
pub fn classify_linker_llvm<I, S>(binary: &[u8], lib_dir: &Path, lib_files: I) -> LinkerLlvm
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let needed = linked_llvm_libs(binary);
    if needed.is_empty() {
        return LinkerLlvm::Static;
    }
    let files: Vec<String> = lib_files
        .into_iter()
        .map(|f| f.as_ref().to_owned())
        .collect();
    let Some(name) = needed.iter().find(|n| files.contains(n)) else {
        return LinkerLlvm::Other(needed.join(", "));
    };
    // The run path it was linked with (`-Wl,-rpath,<lib_dir>`) must be this nightly's.
    let dir = lib_dir.as_os_str().as_encoded_bytes();
    let runpath_here = binary
        .split(|&b| b == 0)
        .any(|s| s.split(|&b| b == b':').any(|p| p == dir));
    if runpath_here {
        LinkerLlvm::Nightly
    } else {
        LinkerLlvm::Other(format!(
            "{name} from another directory than {}",
            lib_dir.display()
        ))
    }
}

/// [`classify_linker_llvm`] for the bpf-linker at `linker` and the pinned nightly. `None`
/// when the nightly or the files cannot be read.
pub fn bpf_linker_llvm(linker: &Path) -> Option<LinkerLlvm> {
    let lib_dir = nightly_sysroot()?.join("lib");
    let files: Vec<String> = std::fs::read_dir(&lib_dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    let binary = std::fs::read(linker).ok()?;
    Some(classify_linker_llvm(&binary, &lib_dir, files))
}

/// First line of `<bpf-linker> --version`, if it runs.
pub fn bpf_linker_version(path: &Path) -> Option<String> {
    capture(Command::new(path).arg("--version"))
        .map(|s| s.lines().next().unwrap_or("").trim().to_owned())
}

/// How to build bpf-linker against the nightly's own libLLVM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BpfLinkerInstall {
    /// Rust flags, one per element (pass as `CARGO_ENCODED_RUSTFLAGS`).
    pub rustflags: Vec<String>,
    /// Arguments to the cargo proxy, starting with `+nightly`.
    pub cargo_args: Vec<String>,
}

impl BpfLinkerInstall {
    /// Derives the install from `rustc +NIGHTLY -vV` output, the nightly sysroot, the file
    /// names in `<sysroot>/lib` and the install root (`--root`, when not cargo's default).
    /// Pure. `Err` is a one-line reason.
    pub fn derive<I, S>(
        rustc_vv: &str,
        sysroot: &Path,
        sysroot_lib_files: I,
        root: Option<&Path>,
    ) -> Result<Self, String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let major = parse_llvm_major(rustc_vv).ok_or_else(|| {
            format!("cannot find \"LLVM version: N.x\" in `rustc +{NIGHTLY} -vV`")
        })?;
        let lib_dir = sysroot.join("lib");
        let name = llvm_dylib_name(major, sysroot_lib_files).ok_or_else(|| {
            format!(
                "no libLLVM-{major}-*.so in {} (the nightly's own LLVM)",
                lib_dir.display()
            )
        })?;
        let lib = lib_dir.display().to_string();
        let root_args = root
            .map(|r| vec!["--root".to_owned(), r.display().to_string()])
            .unwrap_or_default();
        Ok(Self {
            rustflags: vec![
                "-L".into(),
                lib.clone(),
                "-l".into(),
                format!("dylib={name}"),
                "-C".into(),
                format!("link-arg=-Wl,-rpath,{lib}"),
            ],
            cargo_args: [
                format!("+{NIGHTLY}"),
                "install".into(),
                format!("bpf-linker@{BPF_LINKER_VERSION}"),
                "--locked".into(),
                "--force".into(),
                "--no-default-features".into(),
                "--features".into(),
                format!("llvm-{major},no-llvm-linking"),
            ]
            .into_iter()
            .chain(root_args)
            .collect(),
        })
    }

    /// The flags as `CARGO_ENCODED_RUSTFLAGS` (0x1f-separated, safe for paths with spaces).
    pub fn encoded_rustflags(&self) -> String {
        self.rustflags.join("\x1f")
    }

    /// A shell-like rendering, for printing: `RUSTFLAGS="..." cargo +NIGHTLY install ...`.
    pub fn display(&self) -> String {
        format!(
            "RUSTFLAGS=\"{}\" cargo {}",
            self.rustflags.join(" "),
            self.cargo_args.join(" ")
        )
    }
}

/// Renders a command for messages: program file name plus arguments.
pub fn display_command(cmd: &Command) -> String {
    let program = Path::new(cmd.get_program());
    let mut s = program
        .file_name()
        .unwrap_or(program.as_os_str())
        .to_string_lossy()
        .into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUSTC_VV: &str = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)
binary: rustc
commit-hash: e50aa6fba4e63ab34c72bf9acfd2c307c1155d1a
commit-date: 2026-05-19
host: x86_64-unknown-linux-gnu
release: 1.97.0-nightly
LLVM version: 22.1.4
";

    #[test]
    fn llvm_major_from_rustc_vv() {
        assert_eq!(parse_llvm_major(RUSTC_VV), Some(22));
        assert_eq!(parse_llvm_major("LLVM version: 19.1.7\n"), Some(19));
        assert_eq!(parse_llvm_major("LLVM version: 21\n"), Some(21));
        assert_eq!(parse_llvm_major("rustc 1.0\nhost: x\n"), None);
        assert_eq!(parse_llvm_major("LLVM version: banana\n"), None);
    }

    #[test]
    fn llvm_dylib_name_from_sysroot_listing() {
        let files = [
            "libLLVM.so.22.1-rust-1.97.0-nightly",
            "librustc_driver-b5a965480ee51f9a.so",
            "libLLVM-22-rust-1.97.0-nightly.so",
            "rustlib",
        ];
        assert_eq!(
            llvm_dylib_name(22, files).as_deref(),
            Some("LLVM-22-rust-1.97.0-nightly")
        );
        assert_eq!(llvm_dylib_name(21, files), None);
        assert_eq!(
            llvm_dylib_name(22, ["libLLVM-22.so"]).as_deref(),
            Some("LLVM-22")
        );
        assert_eq!(llvm_dylib_name(2, ["libLLVM-22-rust.so"]), None);
        assert_eq!(llvm_dylib_name(22, ["libLLVM-22-.so"]), None);
        assert_eq!(llvm_dylib_name(22, Vec::<String>::new()), None);
    }

    #[test]
    fn bpf_linker_install_is_derived_not_hardcoded() {
        let sysroot = Path::new("/root/.rustup/toolchains/nightly-x86_64-unknown-linux-gnu");
        let files = ["libLLVM-22-rust-1.97.0-nightly.so", "librustc_driver-x.so"];
        let plan = BpfLinkerInstall::derive(RUSTC_VV, sysroot, files, None).unwrap();
        let nl = "/root/.rustup/toolchains/nightly-x86_64-unknown-linux-gnu/lib";
        assert_eq!(
            plan.display(),
            format!(
                "RUSTFLAGS=\"-L {nl} -l dylib=LLVM-22-rust-1.97.0-nightly -C link-arg=-Wl,-rpath,{nl}\" \
                 cargo +{NIGHTLY} install bpf-linker@0.13.0 --locked --force --no-default-features \
                 --features llvm-22,no-llvm-linking"
            )
        );
        assert_eq!(
            plan.encoded_rustflags(),
            format!(
                "-L\x1f{nl}\x1f-l\x1fdylib=LLVM-22-rust-1.97.0-nightly\x1f-C\x1flink-arg=-Wl,-rpath,{nl}"
            )
        );

        let other = "LLVM version: 23.0.0\n";
        let plan = BpfLinkerInstall::derive(
            other,
            Path::new("/s"),
            ["libLLVM-23-rust-1.99.0-nightly.so"],
            Some(Path::new("/tmp/tools")),
        )
        .unwrap();
        assert!(
            plan.cargo_args
                .contains(&"llvm-23,no-llvm-linking".to_owned())
        );
        assert!(
            plan.rustflags
                .contains(&"dylib=LLVM-23-rust-1.99.0-nightly".to_owned())
        );
        assert!(
            plan.display()
                .ends_with("--features llvm-23,no-llvm-linking --root /tmp/tools"),
            "{}",
            plan.display()
        );

        let err = BpfLinkerInstall::derive(RUSTC_VV, Path::new("/s"), ["libLLVM-21-x.so"], None)
            .unwrap_err();
        assert!(
            err.contains("libLLVM-22-*.so") && !err.contains('\n'),
            "{err}"
        );
        assert!(BpfLinkerInstall::derive("no llvm here", Path::new("/s"), files, None).is_err());
    }

    #[test]
    fn nightly_detection() {
        // Only the pinned date counts: a floating nightly or another date does not.
        assert!(NIGHTLY.starts_with("nightly-20"), "{NIGHTLY} must be dated");
        let pinned = format!("{NIGHTLY}-x86_64-unknown-linux-gnu");
        let list = format!(
            "stable-x86_64-unknown-linux-gnu (active, default)\nnightly-x86_64-unknown-linux-gnu\n{pinned}\n"
        );
        assert!(has_nightly(&list));
        assert!(has_nightly(&format!("{pinned} (active)\n")));
        assert!(has_nightly(&format!("{NIGHTLY}\n")));
        assert!(!has_nightly(
            "stable-x86_64-unknown-linux-gnu (default)\nnightly-x86_64-unknown-linux-gnu\n"
        ));
        assert!(!has_nightly(
            "nightly-2026-05-19-x86_64-unknown-linux-gnu\n"
        ));
        assert!(!has_nightly("no installed toolchains\n"));
    }

    #[test]
    fn pinned_toolchain_detection() {
        let list = "stable-x86_64-unknown-linux-gnu (default)\n1.99.1-x86_64-unknown-linux-gnu\n";
        assert!(has_toolchain(list, "1.99.1"));
        assert!(!has_toolchain(list, "1.99"));
        assert!(!has_toolchain(
            "1.99.10-x86_64-unknown-linux-gnu\n",
            "1.99.1"
        ));
        assert!(!has_toolchain(
            "1.99.1-1-x86_64-unknown-linux-gnu\n",
            "1.99.1"
        ));
    }

    #[test]
    fn toolchain_file_channel_is_read() {
        let toml =
            "# pinned\n[toolchain]\nchannel = \"1.99.1\"  # comment\nprofile = \"minimal\"\n";
        assert_eq!(toolchain_file_channel(toml).as_deref(), Some("1.99.1"));
        assert_eq!(toolchain_file_channel("[toolchain]\nchannel=\"\"\n"), None);
        assert_eq!(toolchain_file_channel("[toolchain]\n"), None);
        let repo = include_str!("../../../rust-toolchain.toml");
        let channel = toolchain_file_channel(repo).expect("the workspace pins a channel");
        assert!(
            channel.starts_with(|c: char| c.is_ascii_digit()),
            "rust-toolchain.toml must pin a version, not {channel}"
        );
    }

    /// A made-up ELF tail: `.dynstr` with NUL-separated names, as the linker writes them.
    fn fake_linker(needed: &str, runpath: &str) -> Vec<u8> {
        let mut b = b"\x7fELF junk libLLVM is mentioned in text here\0".to_vec();
        for s in [runpath, needed, "libgcc_s.so.1", "libc.so.6"] {
            b.extend_from_slice(s.as_bytes());
            b.push(0);
        }
        b
    }

    #[test]
    fn linker_llvm_is_told_apart() {
        let lib =
            Path::new("/root/.rustup/toolchains/nightly-2026-10-29-x86_64-unknown-linux-gnu/lib");
        let files = [
            "libLLVM-23-rust-1.101.0-nightly.so",
            "libLLVM.so.23.1-rust-1.101.0-nightly",
            "librustc_driver-23e18013e8e3f5f8.so",
        ];
        let good = fake_linker(
            "libLLVM.so.23.1-rust-1.101.0-nightly",
            &lib.display().to_string(),
        );
        assert_eq!(
            linked_llvm_libs(&good),
            ["libLLVM.so.23.1-rust-1.101.0-nightly"]
        );
        assert_eq!(classify_linker_llvm(&good, lib, files), LinkerLlvm::Nightly);

        // The shared machine's linker: built on the floating nightly 1.97 (LLVM 22).
        let old = fake_linker(
            "libLLVM.so.22.1-rust-1.97.0-nightly",
            "/root/.rustup/toolchains/nightly-x86_64-unknown-linux-gnu/lib",
        );
        assert_eq!(
            classify_linker_llvm(&old, lib, files),
            LinkerLlvm::Other("libLLVM.so.22.1-rust-1.97.0-nightly".into())
        );
        // Same library name, another nightly's directory.
        let moved = fake_linker(
            "libLLVM.so.23.1-rust-1.101.0-nightly",
            "/root/.rustup/toolchains/nightly-2026-10-30-x86_64-unknown-linux-gnu/lib",
        );
        assert!(matches!(
            classify_linker_llvm(&moved, lib, files),
            LinkerLlvm::Other(why) if why.contains("another directory")
        ));
        let fixed = b"\x7fELF static build\0libc.so.6\0".to_vec();
        assert_eq!(classify_linker_llvm(&fixed, lib, files), LinkerLlvm::Static);
    }

    #[test]
    fn bpf_linker_version_check() {
        assert!(is_wanted_bpf_linker("bpf-linker 0.13.0"));
        assert!(is_wanted_bpf_linker("bpf-linker 0.13.2\n"));
        assert!(!is_wanted_bpf_linker("bpf-linker 0.9.13"));
        assert!(!is_wanted_bpf_linker("bpf-linker 0.130.0"));
        assert!(!is_wanted_bpf_linker("bpf-linker 0.14.0"));
        assert!(!is_wanted_bpf_linker(""));
    }

    #[test]
    fn nested_cargo_scrub_list() {
        let present = [
            "CARGO_CFG_TARGET_ARCH",
            "CARGO_FEATURE_DEFAULT",
            "CARGO_PKG_NAME",
            "CARGO_HOME",
            "RUSTUP_HOME",
            "CI",
            "PATH",
            "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER",
            "__CARGO_FIX_PLZ",
        ];
        let removed = nested_cargo_vars_to_remove(present);
        for must in [
            "RUSTC",
            "RUSTC_WRAPPER",
            "RUSTC_WORKSPACE_WRAPPER",
            "RUSTFLAGS",
            "CARGO_ENCODED_RUSTFLAGS",
            "CARGO_BUILD_TARGET",
            "CARGO_TARGET_DIR",
            "RUSTUP_TOOLCHAIN",
            "CARGO_MAKEFLAGS",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_CFG_TARGET_ARCH",
            "CARGO_FEATURE_DEFAULT",
            "CARGO_PKG_NAME",
            "__CARGO_FIX_PLZ",
        ] {
            assert!(removed.iter().any(|r| r == must), "{must} must be removed");
        }
        for keep in [
            "CARGO_HOME",
            "RUSTUP_HOME",
            "CI",
            "PATH",
            "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER",
        ] {
            assert!(!removed.iter().any(|r| r == keep), "{keep} must be kept");
        }
    }

    #[test]
    fn run_scrub_keeps_user_settings() {
        let removed =
            run_injected_vars_to_remove(["CARGO_PKG_VERSION", "RUSTFLAGS", "CI", "CARGO_HOME"]);
        assert!(removed.iter().any(|r| r == "RUSTUP_TOOLCHAIN"));
        assert!(removed.iter().any(|r| r == "CARGO_PKG_VERSION"));
        for keep in ["RUSTFLAGS", "CI", "CARGO_HOME"] {
            assert!(!removed.iter().any(|r| r == keep), "{keep} must be kept");
        }
    }

    #[test]
    fn command_rendering() {
        let mut cmd = Command::new("/root/.cargo/bin/cargo");
        cmd.args(["+nightly", "build"]);
        assert_eq!(display_command(&cmd), "cargo +nightly build");
    }
}
