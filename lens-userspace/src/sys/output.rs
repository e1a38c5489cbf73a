//! Files lens-probe creates, as root, where a user said (`--pid-file`, `--summary-json`,
//! `--export-file`). Opened before the capabilities are dropped (a directory only
//! `CAP_DAC_OVERRIDE` may write fails at start, not after the whole trace), never through
//! a symbolic link (a link in a shared directory would otherwise let anyone aim root's
//! write at `/etc/...`), and every failure names the flag and the path.
use std::{
    fs::{File, OpenOptions},
    io::{self, Write},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use crate::error::LensError;

/// An output file, open for writing.
#[derive(Debug)]
pub struct OutputFile {
    flag: &'static str,
    path: PathBuf,
    file: File,
}

impl OutputFile {
    /// Creates (or truncates) `path` for `flag`: a regular file or a character device
    /// (`/dev/null`, `/dev/stdout`), never a symbolic link or a FIFO.
    pub fn create(flag: &'static str, path: &Path) -> Result<OutputFile, LensError> {
        let file = open(path).map_err(|reason| output_error(flag, path, reason))?;
        Ok(OutputFile {
            flag,
            path: path.to_path_buf(),
            file,
        })
    }

    /// Writes `bytes` and flushes them to the file: a full disk or a closed pipe is an
    /// error naming the flag and the path.
    pub fn write_all(mut self, bytes: &[u8]) -> Result<(), LensError> {
        self.file
            .write_all(bytes)
            .and_then(|()| self.file.flush())
            .map_err(|error| output_error(self.flag, &self.path, error.to_string()))
    }

    /// The open file, for a writer of its own (the OTLP file exporter).
    pub fn into_file(self) -> File {
        self.file
    }
}

fn output_error(flag: &'static str, path: &Path, reason: String) -> LensError {
    LensError::Output {
        flag,
        path: path.to_path_buf(),
        reason,
    }
}

fn open(path: &Path) -> Result<File, String> {
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        // A FIFO would block the open until a reader comes: never wait on one.
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|error| match error.raw_os_error() {
            Some(libc::ELOOP) => {
                "is a symbolic link: lens-probe never writes through one (give the file itself)"
                    .to_string()
            }
            Some(libc::ENXIO) => "is a FIFO without a reader: give a regular file".to_string(),
            _ => error.to_string(),
        })?;
    let kind = file.metadata().map_err(|e| e.to_string())?.file_type();
    use std::os::unix::fs::FileTypeExt;
    if kind.is_fifo() || kind.is_socket() {
        return Err("is a FIFO or a socket: give a regular file".into());
    }
    // Writes block as usual from here on.
    set_blocking(&file).map_err(|e| e.to_string())?;
    Ok(file)
}

fn set_blocking(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function's caller owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lens-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_symbolic_link_is_refused_and_its_target_untouched() {
        let dir = scratch("link");
        let target = dir.join("precious");
        std::fs::write(&target, "keep me").unwrap();
        let link = dir.join("lens.pid");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let error = OutputFile::create("--pid-file", &link)
            .unwrap_err()
            .to_string();
        assert!(error.contains("--pid-file"), "{error}");
        assert!(error.contains(&link.display().to_string()), "{error}");
        assert!(error.contains("symbolic link"), "{error}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_full_device_is_an_error_naming_the_flag_and_the_path() {
        let file = OutputFile::create("--summary-json", Path::new("/dev/full")).unwrap();
        let error = file.write_all(b"{}\n").unwrap_err().to_string();
        assert!(error.starts_with("--summary-json /dev/full: "), "{error}");
    }

    #[test]
    fn a_fifo_is_refused_without_waiting() {
        let dir = scratch("fifo");
        let fifo = dir.join("pipe");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let error = OutputFile::create("--export-file", &fifo)
            .unwrap_err()
            .to_string();
        assert!(error.contains("FIFO"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_regular_file_is_written() {
        let dir = scratch("regular");
        let path = dir.join("summary.json");
        std::fs::write(&path, "old and longer").unwrap();
        OutputFile::create("--summary-json", &path)
            .unwrap()
            .write_all(b"new")
            .unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
