//! One process as `/proc/PID` shows it, for the code above `sys/` that reads a target:
//! its mappings (parsed in one place, [`super::library::parse_maps`]), the files behind
//! them, its memory, its threads. Everything read here comes from a process lens-probe
//! does not trust: callers bound what they read (docs/security.md).
use std::{
    fs::File,
    io,
    os::fd::RawFd,
    path::{Path, PathBuf},
};

use super::library::{MapsEntry, parse_maps};

/// A process, by pid (which may have ended: every read can fail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Process(u32);

impl Process {
    pub fn new(pid: u32) -> Process {
        Process(pid)
    }

    pub fn pid(self) -> u32 {
        self.0
    }

    /// Its file-backed mappings (`/proc/PID/maps`), in address order.
    pub fn mappings(self) -> io::Result<Vec<MapsEntry>> {
        Ok(parse_maps(&std::fs::read_to_string(self.path("maps"))?))
    }

    /// The file `mapping` maps, as the process sees it (its mount namespace), whatever
    /// its path says now: `/proc/PID/map_files/START-END`.
    pub fn mapped_file(self, mapping: &MapsEntry) -> PathBuf {
        self.path(&format!("map_files/{:x}-{:x}", mapping.start, mapping.end))
    }

    /// Its memory, for positioned reads (`/proc/PID/mem`).
    pub fn memory(self) -> io::Result<File> {
        File::open(self.path("mem"))
    }

    /// What thread `tid` is doing: `/proc/PID/task/TID/syscall` ("NR args… sp pc" in a
    /// system call, "running", or "-1 sp pc").
    pub fn thread_syscall(self, tid: u32) -> io::Result<String> {
        std::fs::read_to_string(self.path(&format!("task/{tid}/syscall")))
    }

    /// Thread `tid`'s name (`/proc/PID/task/TID/comm`: what `pthread_setname_np` or
    /// `prctl(PR_SET_NAME)` set, else the program's name).
    pub fn thread_name(self, tid: u32) -> io::Result<String> {
        let name = std::fs::read_to_string(self.path(&format!("task/{tid}/comm")))?;
        Ok(name.trim_end_matches('\n').to_string())
    }

    /// Whether thread `tid` still exists.
    pub fn has_thread(self, tid: u32) -> bool {
        self.path(&format!("task/{tid}")).exists()
    }

    /// Its threads' ids (`/proc/PID/task`), in no particular order.
    pub fn threads(self) -> io::Result<Vec<u32>> {
        let mut tids = Vec::new();
        for entry in std::fs::read_dir(self.path("task"))? {
            if let Some(tid) = entry?.file_name().to_str().and_then(|s| s.parse().ok()) {
                tids.push(tid);
            }
        }
        Ok(tids)
    }

    /// Its root directory, opened (for lookups confined to it).
    pub fn root(self) -> io::Result<File> {
        File::open(self.path("root"))
    }

    /// Its working directory, opened (for lookups confined to it).
    pub fn working_directory(self) -> io::Result<File> {
        File::open(self.path("cwd"))
    }

    fn path(self, entry: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/{entry}", self.0))
    }
}

/// Raises lens-probe's own open-file limit to its hard limit; returns the limit now in
/// force. (Processes lens-probe starts afterwards inherit it.)
pub fn raise_open_files_limit() -> io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid rlimit the kernel writes.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: as above; the kernel only reads it.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(limit.rlim_cur)
}

/// Every process on the host now (the numeric entries of `/proc`), in pid order.
pub fn all_pids() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids
}

/// lens-probe's own executable, as the kernel has it open (whatever its path now).
pub fn own_executable() -> &'static Path {
    Path::new("/proc/self/exe")
}

/// A path that opens lens-probe's descriptor `fd` again (the file it has open, even if
/// its name changed or went).
pub fn own_descriptor_path(fd: RawFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{fd}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_reads() {
        let me = Process::new(std::process::id());
        let maps = me.mappings().unwrap();
        // lens-probe's test binary maps itself.
        let exe = std::fs::read_link(own_executable()).unwrap();
        let own = maps
            .iter()
            .find(|m| Path::new(&m.path) == exe)
            .expect("the test binary is mapped");
        assert!(me.mapped_file(own).exists());
        assert!(me.has_thread(std::process::id()));
        assert!(!me.has_thread(u32::MAX));
        assert!(me.memory().is_ok());
        assert!(all_pids().contains(&std::process::id()));
        assert!(Process::new(u32::MAX).mappings().is_err());
    }
}
