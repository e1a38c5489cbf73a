//! The operating system as lens-probe sees it, with nothing of tracing in it: processes
//! (starting, attaching, waiting: `target`; the guardian that resumes a stopped one),
//! their mappings (`library`), ELF symbol tables and PLT stubs (`symbols`, `plt`),
//! capabilities (`privileges`), the files created as root (`output`) and lens-probe's own
//! CPU time (`usage`), and leaving without waiting for the kernel to remove the probes
//! (`teardown`); per-thread CPU clocks that run a BPF program (`thread_clock`).
pub mod guardian;
pub mod kernel;
pub mod library;
pub mod output;
pub mod plt;
pub mod privileges;
pub mod process;
pub mod symbols;
pub mod target;
pub mod teardown;
pub mod text;
pub mod thread_clock;
pub mod usage;
