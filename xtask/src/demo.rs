//! `cargo xtask demo`: a real two-rank PyTorch DDP run on CPU (gloo), launched by the
//! cached venv's `torchrun` and traced from its first instruction by the release
//! lens-probe, every rank exported: the span tree on the console as the ranks run, and the
//! whole run as a Perfetto timeline in `target/demo/timeline.perfetto-trace`.

use std::ffi::OsString;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use xtask::{toolchain, torch_venv};

use crate::{cargo, fail, run_step, workspace_root};

/// The training script: plain DDP over gloo, 6 optimizer steps of 2 microbatches each and
/// 2 evaluation loops, a few seconds on CPU. It writes its ground truth only where the
/// tests ask for it (`LENS_TRUTH`), so the demo runs it as any user would.
pub const SCRIPT: &str = "tests/fixtures/frameworks/ddp_train.py";
/// torchrun's `--nproc-per-node`.
pub const RANKS: u32 = 2;
/// The timeline, under the cargo target directory.
pub const TIMELINE: &str = "demo/timeline.perfetto-trace";
/// The training processes' environment: gloo on loopback, and one OpenMP thread per rank
/// said outright (torchrun warns when it has to choose it).
pub const TARGET_ENV: &[(&str, &str)] = &[("GLOO_SOCKET_IFNAME", "lo"), ("OMP_NUM_THREADS", "1")];

/// What the demo traces: these paths, absolute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub lens_probe: PathBuf,
    pub timeline: PathBuf,
    pub torchrun: PathBuf,
    pub script: PathBuf,
    /// torchrun's rendezvous port (free when picked).
    pub port: u16,
}

impl Plan {
    /// lens-probe's arguments: every span group a step has, every rank, the timeline, and
    /// torchrun after `--exec --`.
    pub fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = [
            "--span-groups",
            "per_step",
            "--export-strategy",
            "all_ranks",
            "--perfetto",
        ]
        .map(OsString::from)
        .to_vec();
        args.push(self.timeline.clone().into());
        args.extend(["--exec", "--"].map(OsString::from));
        args.push(self.torchrun.clone().into());
        args.extend(
            [
                "--nproc-per-node".to_string(),
                RANKS.to_string(),
                "--master-addr".to_string(),
                "127.0.0.1".to_string(),
                "--master-port".to_string(),
                self.port.to_string(),
            ]
            .map(OsString::from),
        );
        args.push(self.script.clone().into());
        args
    }

    /// The command line as a user in `root` would type it: the environment first, paths
    /// under `root` relative to it.
    pub fn shown(&self, root: &Path) -> String {
        let env = TARGET_ENV.iter().map(|(k, v)| format!("{k}={v}"));
        let words = std::iter::once(self.lens_probe.clone().into_os_string())
            .chain(self.args())
            .map(|word| {
                let path = Path::new(&word);
                path.strip_prefix(root)
                    .unwrap_or(path)
                    .to_string_lossy()
                    .into_owned()
            });
        env.chain(words).collect::<Vec<_>>().join(" ")
    }

    /// The command, run in `root`.
    fn command(&self, root: &Path) -> Command {
        let mut cmd = Command::new(&self.lens_probe);
        toolchain::scrub_run_env(&mut cmd);
        cmd.current_dir(root)
            .args(self.args())
            .envs(TARGET_ENV.iter().copied())
            .stdin(Stdio::null());
        cmd
    }
}

/// Where cargo builds: `$CARGO_TARGET_DIR` (relative to `root`, where the demo runs cargo),
/// else `root/target`.
pub fn target_dir(root: &Path, cargo_target_dir: Option<OsString>) -> PathBuf {
    match cargo_target_dir.filter(|d| !d.is_empty()) {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    }
}

/// What to do with the timeline, once written: the lines printed last.
pub fn how_to_open(timeline: &str) -> String {
    format!(
        "xtask demo: the timeline is {timeline}\n\
         \x20 open it: drag the file into https://ui.perfetto.dev (the page reads it in your browser; nothing is uploaded)\n\
         \x20 or query it with Perfetto's trace_processor:\n\
         \x20   trace_processor {timeline}\n\
         \x20   > select name, count(*) from slice group by name;"
    )
}

/// A TCP port free on the loopback now (the kernel's pick).
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub fn run() -> ExitCode {
    let start = Instant::now();
    if let Err(e) = crate::setup::run(false) {
        return fail(format!("xtask demo: step `cargo xtask setup` failed: {e}"));
    }
    let root = workspace_root();
    let venv = torch_venv::venv_dir();
    let torchrun = venv.join("bin").join("torchrun");
    if !torchrun.is_file() {
        return fail(format!(
            "xtask demo: no PyTorch venv with torchrun at {} (`cargo xtask setup` makes it; \
             {} names another)",
            venv.display(),
            torch_venv::VENV_ENV
        ));
    }
    if let Err(line) = run_step(
        "demo",
        &mut cargo(&["build", "--release", "-p", "lens-userspace"]),
    ) {
        return fail(line);
    }
    let target = target_dir(&root, std::env::var_os("CARGO_TARGET_DIR"));
    let timeline = target.join(TIMELINE);
    if let Some(dir) = timeline.parent()
        && let Err(e) = std::fs::create_dir_all(dir)
    {
        return fail(format!("xtask demo: cannot create {}: {e}", dir.display()));
    }
    let port = match free_port() {
        Ok(port) => port,
        Err(e) => return fail(format!("xtask demo: no free TCP port on 127.0.0.1: {e}")),
    };
    let plan = Plan {
        lens_probe: target.join("release").join("lens-probe"),
        timeline,
        torchrun,
        script: root.join(SCRIPT),
        port,
    };
    let traced = Instant::now();
    let shown = plan.shown(&root);
    println!("==> [xtask demo] {shown}");
    let status = match plan.command(&root).status() {
        Ok(status) => status,
        Err(e) => {
            return fail(format!(
                "xtask demo: cannot run {}: {e}",
                plan.lens_probe.display()
            ));
        }
    };
    if !status.success() {
        return fail(format!("xtask demo: `{shown}` failed ({status})"));
    }
    println!(
        "==> [xtask demo] traced run ok ({:.1}s)",
        traced.elapsed().as_secs_f64()
    );
    let written = std::fs::metadata(&plan.timeline).map(|m| m.len());
    let relative = plan.timeline.strip_prefix(&root).unwrap_or(&plan.timeline);
    match written {
        Ok(bytes) if bytes > 0 => {}
        _ => {
            return fail(format!(
                "xtask demo: lens-probe wrote no timeline at {}",
                relative.display()
            ));
        }
    }
    println!("{}", how_to_open(&relative.to_string_lossy()));
    println!("xtask demo: done in {:.1}s", start.elapsed().as_secs_f64());
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        Plan {
            lens_probe: PathBuf::from("/src/target/release/lens-probe"),
            timeline: PathBuf::from("/src/target/demo/timeline.perfetto-trace"),
            torchrun: PathBuf::from("/venv/bin/torchrun"),
            script: PathBuf::from("/src").join(SCRIPT),
            port: 29_511,
        }
    }

    #[test]
    fn lens_probe_traces_every_rank_of_torchrun_into_the_timeline() {
        let args: Vec<String> = plan()
            .args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "--span-groups",
                "per_step",
                "--export-strategy",
                "all_ranks",
                "--perfetto",
                "/src/target/demo/timeline.perfetto-trace",
                "--exec",
                "--",
                "/venv/bin/torchrun",
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                "29511",
                "/src/tests/fixtures/frameworks/ddp_train.py",
            ]
        );
    }

    #[test]
    fn the_command_is_shown_with_its_environment_and_paths_from_the_root() {
        assert_eq!(
            plan().shown(Path::new("/src")),
            "GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 target/release/lens-probe \
             --span-groups per_step --export-strategy all_ranks \
             --perfetto target/demo/timeline.perfetto-trace --exec -- /venv/bin/torchrun \
             --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 \
             tests/fixtures/frameworks/ddp_train.py"
        );
    }

    #[test]
    fn the_target_dir_is_cargos() {
        let root = Path::new("/src");
        assert_eq!(target_dir(root, None), PathBuf::from("/src/target"));
        assert_eq!(
            target_dir(root, Some("".into())),
            PathBuf::from("/src/target")
        );
        assert_eq!(
            target_dir(root, Some("out".into())),
            PathBuf::from("/src/out")
        );
        assert_eq!(
            target_dir(root, Some("/tmp/t".into())),
            PathBuf::from("/tmp/t")
        );
    }

    #[test]
    fn it_ends_with_how_to_open_the_timeline() {
        let text = how_to_open("target/demo/timeline.perfetto-trace");
        assert!(text.contains("https://ui.perfetto.dev"), "{text}");
        assert!(text.contains("nothing is uploaded"), "{text}");
        assert!(
            text.contains("trace_processor target/demo/timeline.perfetto-trace"),
            "{text}"
        );
        assert!(
            text.ends_with("select name, count(*) from slice group by name;"),
            "{text}"
        );
    }

    #[test]
    fn the_script_is_in_the_tree() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        assert!(root.join(SCRIPT).is_file());
    }
}
