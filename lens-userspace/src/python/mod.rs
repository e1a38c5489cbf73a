//! Python functions as spans (docs/python.md): a CPU-clock BPF sampler reads the frame
//! stacks of traced CPython threads; here the interpreter of a process is found and
//! described to it (`runtime`), code objects are named (`code`; on 3.10 with the help of
//! the module's source, `source`), and the stacks are turned into entries and returns of
//! the configured Python rules (`tracker`).
pub mod code;
pub mod follow;
pub mod runtime;
pub mod sampler;
pub mod source;
pub mod tracker;

pub use runtime::{PythonRuntime, find_runtime};
pub use tracker::PythonTracker;
