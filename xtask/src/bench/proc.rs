//! Child processes whose output lines are timestamped as they arrive (one reader thread
//! per stream), logged to a file, and waited for with a deadline.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use xtask::error::{Context, Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Out,
    Err,
}

#[derive(Clone, Debug)]
pub struct Line {
    pub stream: Stream,
    /// When the line was read from the pipe.
    pub at: Instant,
    pub text: String,
}

pub struct Proc {
    name: String,
    child: Child,
    rx: Receiver<Line>,
    log: Option<File>,
    log_path: PathBuf,
    pub started: Instant,
    pub pid: u32,
}

fn reader(stream: Stream, pipe: impl Read + Send + 'static, tx: mpsc::Sender<Line>) {
    thread::spawn(move || {
        let mut pipe = BufReader::new(pipe);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match pipe.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    let at = Instant::now();
                    while buf.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                        buf.pop();
                    }
                    let text = String::from_utf8_lossy(&buf).into_owned();
                    if tx.send(Line { stream, at, text }).is_err() {
                        return;
                    }
                }
            }
        }
    });
}

impl Proc {
    /// Spawns `cmd` with stdin closed and both output streams read line by line; every
    /// line also goes to `log_path`.
    pub fn spawn(name: &str, cmd: &mut Command, log_path: &Path) -> Result<Proc> {
        let mut log = File::create(log_path).ok();
        if let Some(log) = log.as_mut() {
            let _ = writeln!(log, "$ {}", super::shown(cmd));
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(|source| Error::Spawn {
                command: super::shown(cmd),
                source,
            })
            .context(name)?;
        let (tx, rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            reader(Stream::Out, out, tx.clone());
        }
        if let Some(err) = child.stderr.take() {
            reader(Stream::Err, err, tx);
        }
        Ok(Proc {
            name: name.to_owned(),
            pid: child.id(),
            child,
            rx,
            log,
            log_path: log_path.to_owned(),
            started,
        })
    }

    fn note(&mut self, line: &Line) {
        if let Some(log) = self.log.as_mut() {
            let tag = match line.stream {
                Stream::Out => "out",
                Stream::Err => "err",
            };
            let at = line
                .at
                .saturating_duration_since(self.started)
                .as_secs_f64();
            let _ = writeln!(log, "{at:9.4} {tag} {}", line.text);
        }
    }

    fn timeout(&mut self, what: &str) -> Error {
        let _ = self.child.kill();
        let _ = self.child.wait();
        Error::Msg(format!(
            "{}: timed out {what} (killed; output in {})",
            self.name,
            self.log_path.display()
        ))
    }

    /// The next line, `None` once both streams are closed.
    pub fn next_line(&mut self, deadline: Instant) -> Result<Option<Line>> {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.rx.recv_timeout(left) {
            Ok(line) => {
                self.note(&line);
                Ok(Some(line))
            }
            Err(RecvTimeoutError::Disconnected) => Ok(None),
            Err(RecvTimeoutError::Timeout) => Err(self.timeout("waiting for output")),
        }
    }

    /// Reads lines until one satisfies `wanted`.
    pub fn wait_line(
        &mut self,
        deadline: Instant,
        what: &str,
        mut wanted: impl FnMut(&Line) -> bool,
    ) -> Result<Line> {
        while let Some(line) = self.next_line(deadline)? {
            if wanted(&line) {
                return Ok(line);
            }
        }
        Err(Error::Msg(format!(
            "{}: ended before {what} (output in {})",
            self.name,
            self.log_path.display()
        )))
    }

    /// Lines that are already there, without waiting.
    pub fn drain(&mut self) {
        while let Ok(line) = self.rx.try_recv() {
            self.note(&line);
        }
    }

    /// Reads every remaining line through `on_line`, then waits for the exit; returns the
    /// status and when the exit was seen (polled every 2 ms).
    pub fn finish(
        mut self,
        deadline: Instant,
        mut on_line: impl FnMut(&Line),
    ) -> Result<(ExitStatus, Instant)> {
        while let Some(line) = self.next_line(deadline)? {
            on_line(&line);
        }
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    let at = Instant::now();
                    if let Some(log) = self.log.as_mut() {
                        let t = at.saturating_duration_since(self.started).as_secs_f64();
                        let _ = writeln!(log, "{t:9.4} exit {status}");
                    }
                    return Ok((status, at));
                }
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(2)),
                Ok(None) => return Err(self.timeout("waiting for the exit")),
                Err(e) => return Err(format!("wait failed: {e}")).context(&self.name),
            }
        }
    }

    /// [`finish`](Self::finish), failing unless the exit status is 0.
    pub fn finish_ok(self, deadline: Instant, on_line: impl FnMut(&Line)) -> Result<Instant> {
        let name = self.name.clone();
        let log = self.log_path.clone();
        let (status, at) = self.finish(deadline, on_line)?;
        if status.success() {
            Ok(at)
        } else {
            Err(Error::Msg(format!(
                "{name} failed ({status}); output in {}",
                log.display()
            )))
        }
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends a signal (`INT`, `TERM`) with kill(1).
    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
