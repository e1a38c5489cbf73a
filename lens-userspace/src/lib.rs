//! lens-probe: zero-code observability for distributed ML training.
//!
//! The data path reads top to bottom: [`probes`] (what to attach, where) → kernel events
//! → [`events`] (decode) → [`sink`] consumers such as the [`summary`]. A [`session`]
//! drives it for the processes in [`target`].
/// `eprintln!` that never panics: with stderr closed (`lens-probe … 2>&1 | head`) tracing
/// and exporting go on, and what cannot be printed is dropped.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `eprint!` that never panics (see [`say!`]).
#[macro_export]
macro_rules! say_raw {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr(), $($arg)*);
    }};
}

pub mod attach_status;
pub mod bpf;
pub mod budget;
pub mod calls;
pub mod discovery;
pub mod error;
pub mod events;
pub mod export;
pub mod gpu_kernels;
pub mod gpu_memory;
pub mod hangs;
pub mod names;
pub mod nccl;
pub mod patterns;
pub mod probes;
pub mod python;
pub mod semconv;
pub mod session;
pub mod settings;
pub mod sink;
pub mod spans;
pub mod summary;
pub mod sys;
pub mod timeline;

pub use error::{LensError, Result};
