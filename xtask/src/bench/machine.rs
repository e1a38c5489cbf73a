//! The machine the bench runs on: what it must have, what is set on it for the runs, and
//! how it is described above the table.

use std::fs;
use std::path::Path;
use std::process::Command;

use xtask::error::Result;
use xtask::toolchain;

pub(super) fn preflight() -> Result<()> {
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
pub(super) fn mount_tracefs() -> Result<()> {
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
pub(super) fn set_timer_slack() -> bool {
    fs::write("/proc/self/timerslack_ns", "1").is_ok()
        && fs::read_to_string("/proc/self/timerslack_ns").is_ok_and(|s| s.trim() == "1")
}

pub(super) fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) struct Machine {
    pub(super) date: String,
    pub(super) kernel: String,
    pub(super) cpu: String,
    pub(super) cores: usize,
    pub(super) load: String,
    pub(super) commit: String,
}

fn capture(program: &str, args: &[&str], dir: &Path) -> String {
    toolchain::capture(Command::new(program).args(args).current_dir(dir))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "?".into())
}

impl Machine {
    pub(super) fn read(root: &Path) -> Machine {
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
