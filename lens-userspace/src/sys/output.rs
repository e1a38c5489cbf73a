//! Files lens-probe creates, as root, where a user said (`--pid-file`, `--summary-json`,
//! `--export-file`, `--perfetto`). Opened before the capabilities are dropped (a directory only
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

crate::error::reason_error! {
    /// Why an output file could not be opened, as its flag's error says it.
    struct OpenFailed;
}

/// An output file, open for writing.
#[derive(Debug)]
pub struct OutputFile {
    flag: &'static str,
    path: PathBuf,
    file: File,
    /// Written beside `path` and renamed over it once whole ([`OutputFile::create_replacing`]).
    partial: Option<Partial>,
}

/// A hidden file beside an output's path: removed unless it was renamed over the path.
#[derive(Debug)]
struct Partial(PathBuf);

impl Partial {
    /// Puts it in place of `path`, whole at once (a rename does not follow a link put at
    /// `path` meanwhile, it replaces it).
    fn rename_over(mut self, path: &Path) -> io::Result<()> {
        std::fs::rename(&self.0, path)?;
        self.0 = PathBuf::new();
        Ok(())
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        // Never written whole: the old file stays, the partial one goes.
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

impl OutputFile {
    /// Creates (or truncates) `path` for `flag`: a regular file or a character device
    /// (`/dev/null`, `/dev/stdout`), never a symbolic link or a FIFO.
    pub fn create(flag: &'static str, path: &Path) -> Result<OutputFile, LensError> {
        let file = match standard_stream(path) {
            Some(stream) => stream,
            None => open(path),
        }
        .map_err(|reason| output_error(flag, path, reason.to_string()))?;
        Ok(OutputFile {
            flag,
            path: path.to_path_buf(),
            file,
            partial: None,
        })
    }

    /// For a file written once, at the end (`--summary-json`): created now as a hidden
    /// file beside `path` (so that a directory lens-probe may not write to fails at
    /// start), and renamed over `path` once written whole. A run that fails, or a crash,
    /// leaves an earlier file at `path` as it was, never truncated or half written. A
    /// character device (`/dev/stdout`, `/dev/null`) is written in place; a symbolic link
    /// at `path` is refused as by [`OutputFile::create`].
    pub fn create_replacing(flag: &'static str, path: &Path) -> Result<OutputFile, LensError> {
        use std::os::unix::fs::FileTypeExt;
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_char_device() => return Self::create(flag, path),
            Ok(meta) if meta.file_type().is_symlink() => return Self::create(flag, path),
            Ok(meta) if !meta.is_file() => {
                return Err(output_error(
                    flag,
                    path,
                    "is neither a regular file nor a device: give a regular file".into(),
                ));
            }
            _ => {}
        }
        let name = path
            .file_name()
            .ok_or_else(|| output_error(flag, path, "names no file".into()))?;
        let partial = path.with_file_name(format!(
            ".{}.{}.partial",
            name.to_string_lossy(),
            std::process::id()
        ));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&partial)
            .map_err(|error| output_error(flag, path, error.to_string()))?;
        Ok(OutputFile {
            flag,
            path: path.to_path_buf(),
            file,
            partial: Some(Partial(partial)),
        })
    }

    /// Writes `bytes` and flushes them to the file: a full disk or a closed pipe is an
    /// error naming the flag and the path.
    pub fn write_all(mut self, bytes: &[u8]) -> Result<(), LensError> {
        self.file
            .write_all(bytes)
            .and_then(|()| self.file.flush())
            .and_then(|()| match self.partial.take() {
                Some(partial) => partial.rename_over(&self.path),
                None => Ok(()),
            })
            .map_err(|error| output_error(self.flag, &self.path, error.to_string()))
    }

    /// For a file written while the run goes (`--export-file`): created as by
    /// [`OutputFile::create_replacing`], and put in place at its first whole line, then
    /// appended to where it stands. A run that fails at start leaves an earlier file as
    /// it was; one that has written is followed at `path` as it grows.
    pub fn create_streamed(flag: &'static str, path: &Path) -> Result<StreamedFile, LensError> {
        let output = Self::create_replacing(flag, path)?;
        Ok(StreamedFile {
            path: output.path,
            out: io::BufWriter::new(output.file),
            partial: output.partial,
        })
    }
}

/// An output written line by line ([`OutputFile::create_streamed`]).
#[derive(Debug)]
pub struct StreamedFile {
    path: PathBuf,
    out: io::BufWriter<File>,
    /// Until the first line is whole: the hidden file it is written to.
    partial: Option<Partial>,
}

impl StreamedFile {
    /// Writes `line` and a newline and flushes them; the first puts the file in place.
    pub fn write_line(&mut self, line: &str) -> io::Result<()> {
        writeln!(self.out, "{line}")?;
        self.write_chunk(&[])
    }

    /// Writes `bytes` (a whole record of the file's format) and flushes them; the first
    /// puts the file in place.
    pub fn write_chunk(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.out.flush()?;
        match self.partial.take() {
            Some(partial) => partial.rename_over(&self.path),
            None => Ok(()),
        }
    }
}

/// Refuses two outputs at one path (`--perfetto run.json --export-file run.json`): each
/// would replace the other. Devices (`/dev/null`, `/dev/stdout`) may be shared.
pub fn check_distinct(outputs: &[(&'static str, &Path)]) -> Result<(), LensError> {
    use std::os::unix::fs::FileTypeExt;
    let shareable = |path: &Path| {
        is_standard_stream(path)
            || std::fs::metadata(path).is_ok_and(|meta| meta.file_type().is_char_device())
    };
    for (index, (flag, path)) in outputs.iter().enumerate() {
        let same = |(_, other): &&(&'static str, &Path)| other.components().eq(path.components());
        if let Some((earlier, _)) = outputs[..index].iter().find(same)
            && !shareable(path)
        {
            return Err(output_error(
                flag,
                path,
                format!("is also {earlier}'s file; give each output a file of its own"),
            ));
        }
    }
    Ok(())
}

fn output_error(flag: &'static str, path: &Path, reason: String) -> LensError {
    LensError::Output {
        flag,
        path: path.to_path_buf(),
        reason,
    }
}

/// `/dev/stdout` and `/dev/stderr`, named so: lens-probe's own output streams. They are
/// links (to `/proc/self/fd/N`), which no other output path may be: these two are taken
/// by name and written through a copy of the descriptor, never by following the link.
pub fn is_standard_stream(path: &Path) -> bool {
    path == Path::new("/dev/stdout") || path == Path::new("/dev/stderr")
}

fn standard_stream(path: &Path) -> Option<Result<File, OpenFailed>> {
    use std::os::fd::AsFd;
    let copy = if path == Path::new("/dev/stdout") {
        io::stdout().as_fd().try_clone_to_owned()
    } else if path == Path::new("/dev/stderr") {
        io::stderr().as_fd().try_clone_to_owned()
    } else {
        return None;
    };
    Some(copy.map(File::from).map_err(|e| e.to_string().into()))
}

fn open(path: &Path) -> Result<File, OpenFailed> {
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
    fn two_outputs_may_not_share_a_file_but_may_share_a_device() {
        let a = Path::new("/tmp/run.out");
        let error = check_distinct(&[
            ("--export-file", a),
            ("--perfetto", Path::new("/tmp/./run.out")),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            error.starts_with("--perfetto /tmp/./run.out: is also --export-file's file"),
            "{error}"
        );
        assert!(
            check_distinct(&[("--export-file", a), ("--perfetto", Path::new("/tmp/b"))]).is_ok()
        );
        let null = Path::new("/dev/null");
        assert!(check_distinct(&[("--export-file", null), ("--perfetto", null)]).is_ok());
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
    fn a_file_written_at_the_end_replaces_the_old_one_only_once_whole() {
        let dir = scratch("replacing");
        let path = dir.join("summary.json");
        std::fs::write(&path, "earlier run").unwrap();
        // A run that fails before writing: the earlier file as it was, nothing else left.
        let file = OutputFile::create_replacing("--summary-json", &path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "earlier run");
        drop(file);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "earlier run");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        // One that writes: the new content whole, no partial file left.
        let file = OutputFile::create_replacing("--summary-json", &path).unwrap();
        file.write_all(b"{\"new\": true}\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"new\": true}\n");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        // A device is written in place; a link is refused.
        OutputFile::create_replacing("--summary-json", Path::new("/dev/null"))
            .unwrap()
            .write_all(b"{}")
            .unwrap();
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let error = OutputFile::create_replacing("--summary-json", &link).unwrap_err();
        assert!(error.to_string().contains("symbolic link"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_streamed_file_takes_the_old_ones_place_at_its_first_line() {
        let dir = scratch("streamed");
        let path = dir.join("spans.jsonl");
        std::fs::write(&path, "earlier run\n").unwrap();
        drop(OutputFile::create_streamed("--export-file", &path).unwrap());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "earlier run\n");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        // In place from the first line, then appended to where it stands.
        let mut file = OutputFile::create_streamed("--export-file", &path).unwrap();
        file.write_line("{\"first\": 1}").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"first\": 1}\n");
        file.write_line("{\"second\": 2}").unwrap();
        drop(file);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"first\": 1}\n{\"second\": 2}\n"
        );
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn dev_stdout_and_dev_stderr_are_lens_probes_own_streams() {
        // Links, but taken by name: written through a copy of the descriptor.
        for path in ["/dev/stdout", "/dev/stderr"] {
            assert!(is_standard_stream(Path::new(path)));
            assert_eq!(
                crate::settings::cli::check_output_file(Path::new(path)),
                Ok(())
            );
            OutputFile::create("--export-file", Path::new(path))
                .unwrap()
                .write_all(b"")
                .unwrap();
        }
        assert!(!is_standard_stream(Path::new("/proc/self/fd/1")));
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
