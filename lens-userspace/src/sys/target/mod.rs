//! The processes being traced: attaching to a running one, starting one gated until the
//! probes are in place, and noticing when they exit.
mod environment;
mod gated;
mod signals;

use std::{
    ffi::CString,
    fs,
    io::{self, Read},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::Path,
    sync::Arc,
};

use crate::error::{LensError, Result};

pub use environment::{
    ENVIRONMENT_ALLOW_LIST, RankInfo, looks_secret, read_environment, read_variable,
    redact_command_line, redact_url_userinfo,
};
pub use gated::{GatedChild, resolve_program, spawn_gated};
pub use signals::{
    ExitStatus, STOP_SIGNALS, hold_stop_signals, release_stop_signals, resume, stop,
    stop_requested, try_wait_child, wait_forwarding_stops, with_signals_blocked,
};

/// What is known about a traced process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessInfo {
    pub pid: u32,
    /// Short name (`/proc/PID/comm`).
    pub name: String,
    pub command_line: Vec<String>,
    /// Started by lens-probe (`--exec`): seen from its first instruction, so the job and
    /// its initialisation are whole. `false` for processes attached to while running.
    pub traced_from_start: bool,
    /// Its place in a distributed job, from its environment.
    pub rank: Option<RankInfo>,
    /// What it sees of itself (environment, cgroup, files in its root), read while it
    /// runs: its spans are often exported after it has gone.
    pub view: Arc<TargetView>,
}

/// A process's own view of where it runs, as resource detection needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TargetView {
    pub environment: Vec<(String, String)>,
    /// `/proc/PID/cgroup`.
    pub cgroup: String,
    /// `/etc/hostname` in its root.
    pub hostname_file: Option<String>,
    /// `/var/run/secrets/kubernetes.io` exists in its root (it runs in a pod).
    pub kubernetes_secrets: bool,
    /// Its service account's namespace file, in its root.
    pub service_account_namespace: Option<String>,
    /// `nvidia[0-9]+` device files in its `/dev`.
    pub nvidia_devices: usize,
    /// Its pid inside its own pid namespace, when that is not the host's (a container).
    pub namespace_pid: Option<u32>,
}

/// The pid of `pid` in its innermost pid namespace (the last `NSpid` entry of its
/// status), when it differs from the host's.
fn namespace_pid(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    let innermost: u32 = line.split_whitespace().last()?.parse().ok()?;
    (innermost != pid).then_some(innermost)
}

/// Inside a process's root.
const K8S_SECRETS: &str = "var/run/secrets/kubernetes.io";
const K8S_NAMESPACE_FILE: &str = "var/run/secrets/kubernetes.io/serviceaccount/namespace";
const HOSTNAME_FILE: &str = "etc/hostname";
const DEV: &str = "dev";

/// Opens `relative` inside the directory tree rooted at `root` as a process with that
/// root would: symlinks, absolute ones included (`/var/run` → `/run` in most images),
/// resolve within it (`openat2(RESOLVE_IN_ROOT)`), not in lens-probe's own tree.
fn open_in_root(root: &Path, relative: &str, flags: i32) -> io::Result<fs::File> {
    let root = fs::File::open(root)?;
    let path = CString::new(relative).map_err(io::Error::other)?;
    // SAFETY: open_how is plain integers; all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_IN_ROOT;
    // SAFETY: valid fd, NUL-terminated path and a correctly sized open_how.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            path.as_ptr(),
            &how as *const libc::open_how,
            size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd we own.
    Ok(unsafe { fs::File::from_raw_fd(fd as RawFd) })
}

fn read_trimmed(root: &Path, relative: &str) -> Option<String> {
    let mut text = String::new();
    open_in_root(root, relative, libc::O_RDONLY)
        .ok()?
        .read_to_string(&mut text)
        .ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// `nvidia[0-9]+` entries of `dev` inside `root`.
fn nvidia_devices(root: &Path) -> usize {
    let Ok(dev) = open_in_root(root, DEV, libc::O_RDONLY | libc::O_DIRECTORY) else {
        return 0;
    };
    fs::read_dir(format!("/proc/self/fd/{}", dev.as_raw_fd()))
        .map(|entries| {
            entries
                .filter_map(|entry| entry.ok())
                .filter(|entry| {
                    let name = entry.file_name();
                    let name = name.to_string_lossy();
                    name.strip_prefix("nvidia").is_some_and(|number| {
                        !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit())
                    })
                })
                .count()
        })
        .unwrap_or(0)
}

impl TargetView {
    /// The view of a process whose root directory is `root` (`/proc/PID/root`, which
    /// resolves in its own mount namespace).
    pub fn read(root: &Path, environment: Vec<(String, String)>, cgroup: String) -> TargetView {
        TargetView {
            environment,
            cgroup,
            hostname_file: read_trimmed(root, HOSTNAME_FILE),
            kubernetes_secrets: open_in_root(root, K8S_SECRETS, libc::O_PATH).is_ok(),
            service_account_namespace: read_trimmed(root, K8S_NAMESPACE_FILE),
            nvidia_devices: nvidia_devices(root),
            namespace_pid: None,
        }
    }

    /// The view of running process `pid`.
    pub fn capture(pid: u32) -> TargetView {
        TargetView {
            namespace_pid: namespace_pid(pid),
            ..TargetView::read(
                Path::new(&format!("/proc/{pid}/root")),
                read_environment(pid),
                fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default(),
            )
        }
    }
}

/// The processes descended from `pid` now (children, theirs, …), from
/// `/proc/PID/task/TID/children`, parents before their children.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut queue = vec![pid];
    while let Some(parent) = queue.pop() {
        let Ok(tasks) = fs::read_dir(format!("/proc/{parent}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children = fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                // Bounded: a pid seen twice (reused while reading) is not walked again.
                if child != pid && !found.contains(&child) && found.len() < 65_536 {
                    found.push(child);
                    queue.push(child);
                }
            }
        }
    }
    found
}

impl ProcessInfo {
    pub fn read(pid: u32) -> Result<ProcessInfo> {
        // The process wrote both: shown everywhere with control characters escaped.
        let name = fs::read_to_string(format!("/proc/{pid}/comm"))
            .map_err(|_| LensError::NoSuchProcess(pid))?;
        let name = super::text::printable(name.trim_end()).into_owned();
        let command_line = redact_command_line(
            fs::read(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .split(|b| *b == 0)
                .filter(|arg| !arg.is_empty())
                .map(|arg| super::text::printable(&String::from_utf8_lossy(arg)).into_owned())
                .collect(),
        );
        let view = TargetView::capture(pid);
        Ok(ProcessInfo {
            pid,
            name,
            command_line,
            traced_from_start: false,
            rank: RankInfo::from_environment(&view.environment),
            view: Arc::new(view),
        })
    }
}

/// A pidfd: readable once the process has exited, for processes that are not our children
/// too.
pub fn pidfd_open(pid: u32) -> Result<OwnedFd> {
    // SAFETY: plain syscall; the returned fd is owned by us.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        let error = io::Error::last_os_error();
        return Err(if error.raw_os_error() == Some(libc::ESRCH) {
            LensError::NoSuchProcess(pid)
        } else {
            error.into()
        });
    }
    // SAFETY: a fresh fd from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

#[cfg(test)]
mod tests {
    use std::{ffi::OsStr, path::PathBuf};

    use super::environment::{RANK_VARIABLES, allowed_variable, environment_entries};
    use super::*;

    #[test]
    fn a_view_resolves_absolute_symlinks_inside_the_targets_root() {
        // As in most images: /var/run -> /run (absolute), the secret under /run.
        let root = std::env::temp_dir().join(format!("lens-view-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let secrets = root.join("run/secrets/kubernetes.io/serviceaccount");
        fs::create_dir_all(&secrets).unwrap();
        fs::write(secrets.join("namespace"), "team-b\n").unwrap();
        fs::create_dir_all(root.join("var")).unwrap();
        std::os::unix::fs::symlink("/run", root.join("var/run")).unwrap();
        fs::create_dir_all(root.join("dev")).unwrap();
        for device in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
            fs::write(root.join("dev").join(device), "").unwrap();
        }
        let view = TargetView::read(&root, Vec::new(), String::new());
        let _ = fs::remove_dir_all(&root);
        assert!(view.kubernetes_secrets);
        assert_eq!(view.service_account_namespace.as_deref(), Some("team-b"));
        assert_eq!(view.nvidia_devices, 2);
        assert_eq!(view.hostname_file, None);
    }

    #[test]
    fn only_allow_listed_variables_are_kept() {
        let environ = b"RANK=3\0FOO=bar\0MY_API_TOKEN=hunter2\0WORLD_SIZE=8\0\
                        AWS_SECRET_ACCESS_KEY=abc\0SLURM_JOB_ID=42\0PATH=/bin\0=x\0noequals\0";
        assert_eq!(
            environment_entries(environ, allowed_variable),
            [
                ("RANK".to_string(), "3".to_string()),
                ("WORLD_SIZE".to_string(), "8".to_string()),
                ("SLURM_JOB_ID".to_string(), "42".to_string()),
            ]
        );
        // Every variable the rank is read from is on the list.
        for variable in RANK_VARIABLES.iter().flatten() {
            assert!(allowed_variable(variable), "{variable}");
        }
    }

    #[test]
    fn no_allow_listed_name_looks_secret_and_secret_names_do() {
        for name in ENVIRONMENT_ALLOW_LIST {
            assert!(!looks_secret(name), "{name}");
        }
        for name in [
            "MY_API_TOKEN",
            "AWS_SECRET_ACCESS_KEY",
            "db.password",
            "PGPASSWD",
            "api_key",
            "WANDB_API_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "ssh.private",
            "--hf-token",
            "Authorization",
        ] {
            assert!(looks_secret(name), "{name}");
        }
        for name in ["team", "RANK", "service.name", "--lr", "LOCAL_RANK"] {
            assert!(!looks_secret(name), "{name}");
        }
    }

    #[test]
    fn secret_options_and_assignments_are_redacted_in_command_lines() {
        let args = |text: &str| -> Vec<String> { text.split(' ').map(str::to_string).collect() };
        assert_eq!(
            redact_command_line(args(
                "env WANDB_API_KEY=abc python train.py --hf-token hunter2 --lr 3e-4 \
                 --db-password=hunter2 --key-file k.pem --token --verbose"
            )),
            args(
                "env WANDB_API_KEY=*** python train.py --hf-token *** --lr 3e-4 \
                 --db-password=*** --key-file *** --token --verbose"
            )
        );
        assert_eq!(
            redact_command_line(args("python train.py --batch-size 8")),
            args("python train.py --batch-size 8")
        );
        // Found by an adversarial pass: URL user-info, and short secret words as parts.
        assert_eq!(
            redact_command_line(args(
                "python t.py --url https://user:pw@host/x --auth X --db_pass X --pat X \
                 --bearer X --patience 3 --author me"
            )),
            args(
                "python t.py --url https://…@host/x --auth *** --db_pass *** --pat *** \
                 --bearer *** --patience 3 --author me"
            )
        );
    }

    #[test]
    fn credentials_in_urls_are_masked_wherever_they_are() {
        assert_eq!(
            redact_url_userinfo(
                "error sending request for url (http://user:secret@collector:4318/v1/traces)"
            ),
            "error sending request for url (http://…@collector:4318/v1/traces)"
        );
        assert_eq!(
            redact_url_userinfo("a=https://u@h b=http://h:1/p@x"),
            "a=https://…@h b=http://h:1/p@x"
        );
        assert!(!looks_secret("PATH") && !looks_secret("--compass") && looks_secret("GITLAB_PAT"));
    }

    #[test]
    fn one_variable_is_read_for_a_comparison() {
        let me = std::process::id();
        assert!(read_variable(me, "PATH").is_some() || std::env::var_os("PATH").is_none());
        assert_eq!(read_variable(me, "LENS_NO_SUCH_VARIABLE_XYZ"), None);
        assert!(
            read_environment(me)
                .iter()
                .all(|(k, _)| allowed_variable(k))
        );
    }

    #[test]
    fn programs_are_found_on_path_or_by_path() {
        assert!(resolve_program(OsStr::new("sh")).is_some());
        assert_eq!(
            resolve_program(OsStr::new("/bin/sh")),
            Some(PathBuf::from("/bin/sh"))
        );
        assert_eq!(resolve_program(OsStr::new("no-such-program-xyz")), None);
        assert_eq!(resolve_program(OsStr::new("/etc/passwd")), None);
        assert_eq!(resolve_program(OsStr::new("/etc")), None);
    }

    #[test]
    fn a_gated_child_runs_only_after_release_and_reports_its_status() {
        let child = spawn_gated(&["sh".into(), "-c".into(), "exit 7".into()]).unwrap();
        let pid = child.pid;
        assert_eq!(try_wait_child(pid), None, "must wait at the gate");
        assert_eq!(child.release().unwrap(), pid);
        let mut status = None;
        for _ in 0..500 {
            status = try_wait_child(pid);
            if status.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(status, Some(ExitStatus::Exited(7)));
    }

    #[test]
    fn a_missing_command_is_one_clear_error() {
        let error = spawn_gated(&["no-such-program-xyz".into()]).err().unwrap();
        assert_eq!(
            error.to_string(),
            "cannot run no-such-program-xyz: command not found or not executable"
        );
    }
}
