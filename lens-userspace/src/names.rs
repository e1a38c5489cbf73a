//! Every span and span-event name lens-probe gives, as NeMo Lens' docs name them
//! (`train.*`) and for what only a probe sees. Calls are named after the call: the
//! collectives', syncs', GPU memory and graph calls' names are in `calls`
//! (`nccl.all_reduce`, `cuda.malloc`, …).
pub const JOB: &str = "train.job";
pub const MODEL_INIT: &str = "train.model_init";
pub const LOAD_CHECKPOINT: &str = "train.load_checkpoint";
pub const STEP: &str = "train.step";
pub const FORWARD_BACKWARD: &str = "train.forward_backward";
pub const OPTIMIZER: &str = "train.optimizer";
pub const EVALUATE: &str = "train.evaluate";
pub const CHECKPOINT: &str = "train.checkpoint";
pub const NCCL_COMM_INIT: &str = "nccl.comm_init";
/// A collective found hung (`--hang-timeout`): exported when found, error status;
/// also the name of the event added to the calls its ranks were waiting in.
pub const HANG: &str = "lens_probe.hang";
/// Span event: one backward pass inside `train.forward_backward`.
pub const BACKWARD_EVENT: &str = "backward";
/// Span event on `train.step`: one of its most launched kernels.
pub const KERNEL_TOP_EVENT: &str = "cuda.kernel.top";
/// Span event: an allocation failed for want of GPU memory, on the allocation's span
/// and on the span it ran in.
pub const OUT_OF_MEMORY_EVENT: &str = "gpu.out_of_memory";
