//! Attribute names, one constant each: NeMo Lens' own semantic conventions (`dl.*`,
//! `nemo.*`, `slurm.*`, `k8s.*`, `wandb.*`, same strings as `nemo.lens.semconv`), the
//! OpenTelemetry ones lens-probe sets, and lens-probe's additions for what only a probe
//! sees (collective calls, sync waits). No attribute name is spelled anywhere else.

// ---- Distributed learning (dl.*), as NeMo Lens ----------------------------------------
pub const DL_RANK: &str = "dl.rank";
pub const DL_WORLD_SIZE: &str = "dl.world_size";
pub const DL_LOCAL_RANK: &str = "dl.local_rank";
pub const DL_ITERATION: &str = "dl.iteration";
pub const DL_MICROBATCH_ID: &str = "dl.microbatch_id";
/// lens-probe's own: which restart of an elastic job this process belongs to
/// (torchrun's `TORCHELASTIC_RESTART_COUNT`: 0 for the first attempt).
pub const DL_RESTART_COUNT: &str = "dl.restart_count";

// ---- Run identification (nemo.*), as NeMo Lens ----------------------------------------
pub const NEMO_RUN_ID: &str = "nemo.run.id";
pub const NEMO_USER_ID: &str = "nemo.user.id";

// ---- SLURM (slurm.*), as NeMo Lens -----------------------------------------------------
pub const SLURM_JOB_ID: &str = "slurm.job.id";
pub const SLURM_JOB_NAME: &str = "slurm.job.name";
pub const SLURM_NODELIST: &str = "slurm.nodelist";
pub const SLURM_NNODES: &str = "slurm.nnodes";
pub const SLURM_NTASKS: &str = "slurm.ntasks";
pub const SLURM_PARTITION: &str = "slurm.partition";
pub const SLURM_CLUSTER_NAME: &str = "slurm.cluster.name";
/// lens-probe's own (NeMo Lens has none): the job step a task belongs to (`srun`).
pub const SLURM_STEP_ID: &str = "slurm.step.id";
/// lens-probe's own: how many times SLURM requeued the job (`SLURM_RESTART_COUNT`).
pub const SLURM_RESTART_COUNT: &str = "slurm.restart_count";

// ---- Kubernetes (k8s.*), OpenTelemetry semconv -----------------------------------------
pub const K8S_NAMESPACE_NAME: &str = "k8s.namespace.name";
pub const K8S_POD_NAME: &str = "k8s.pod.name";
pub const K8S_POD_UID: &str = "k8s.pod.uid";
pub const K8S_NODE_NAME: &str = "k8s.node.name";
pub const K8S_CONTAINER_NAME: &str = "k8s.container.name";

// ---- W&B (wandb.*), as NeMo Lens -------------------------------------------------------
pub const WANDB_ENTITY: &str = "wandb.entity";
pub const WANDB_PROJECT: &str = "wandb.project";

// ---- OpenTelemetry process attributes --------------------------------------------------
pub const PROCESS_PID: &str = "process.pid";
/// The pid inside the process's own pid namespace (a container's view), when it differs.
pub const PROCESS_VPID: &str = "process.vpid";
pub const PROCESS_EXIT_CODE: &str = "process.exit.code";

// ---- lens-probe: span bookkeeping (nemo.*) ---------------------------------------------
/// The span group a span belongs to, so queries can filter by group.
pub const NEMO_SPAN_GROUP: &str = "nemo.span.group";
/// The span was still open when its process exited or tracing stopped.
pub const NEMO_SPAN_TRUNCATED: &str = "nemo.span.truncated";
/// The probe attached to an already running process: iterations count from the first
/// complete step it saw, not from the job's first.
pub const NEMO_ATTACHED_MID_RUN: &str = "nemo.attached_mid_run";
/// Duration of one backward pass (on its `backward` span event), ns.
pub const DL_BACKWARD_DURATION_NS: &str = "dl.backward.duration_ns";
/// Microbatches (backward passes) in a `forward_backward` span.
pub const DL_MICROBATCH_COUNT: &str = "dl.microbatch_count";
/// Checkpoint files written or read in one `checkpoint` / `load_checkpoint` span.
pub const NEMO_CHECKPOINT_FILES: &str = "nemo.checkpoint.files";

// ---- lens-probe: collective and sync calls ---------------------------------------------
/// `nccl` or `gloo`.
pub const DL_COLLECTIVE_BACKEND: &str = "dl.collective.backend";
/// `all_reduce`, `broadcast`, ….
pub const DL_COLLECTIVE_OP: &str = "dl.collective.op";
/// Elements the call was given.
pub const DL_COLLECTIVE_COUNT: &str = "dl.collective.count";
/// Bytes moved from this rank's point of view (count × element size).
pub const DL_COLLECTIVE_BYTES: &str = "dl.collective.bytes";
pub const DL_COLLECTIVE_DTYPE: &str = "dl.collective.dtype";
pub const DL_COLLECTIVE_REDUCE_OP: &str = "dl.collective.reduce_op";
/// Root (broadcast, reduce) or peer (send, recv).
pub const DL_COLLECTIVE_PEER: &str = "dl.collective.peer";
/// Hash of the communicator's `ncclUniqueId`: the same on every rank of one communicator.
pub const DL_COLLECTIVE_COMM_ID: &str = "dl.collective.comm_id";
/// The collective's number on its communicator in this process, from 0 at
/// `ncclCommInitRank`: the same collective has the same number on every rank.
pub const DL_COLLECTIVE_SEQ: &str = "dl.collective.seq";
/// How the span's end (the collective's completion) was inferred: `event_query`,
/// `event_synchronize`, `stream_synchronize`, `device_synchronize`, or `call_return`
/// when nothing told (the end is then the enqueue call's return). docs/collectives.md.
pub const DL_COLLECTIVE_END_SOURCE: &str = "dl.collective.end.source";
/// The completion lies in `[end − precision, end]`: what the observations bound.
pub const DL_COLLECTIVE_END_PRECISION_NS: &str = "dl.collective.end.precision_ns";
/// The enqueue call's own duration (entry to return).
pub const DL_COLLECTIVE_ENQUEUE_DURATION_NS: &str = "dl.collective.enqueue.duration_ns";
/// The communicator rank that called this collective last (among the ranks compared).
pub const DL_COLLECTIVE_LAST_RANK: &str = "dl.collective.last_rank";
/// Last enqueue − first enqueue of this collective across the ranks compared.
pub const DL_COLLECTIVE_ARRIVAL_SKEW_NS: &str = "dl.collective.arrival_skew_ns";
/// How long this rank's collective waited for the last rank to arrive.
pub const DL_COLLECTIVE_WAIT_NS: &str = "dl.collective.wait_ns";
/// Why the last rank was late, from its recent steps against the other ranks' median:
/// `data_loading`, `forward_backward`, `optimizer`, `host_sync`, or `none` (none of
/// them explains half the lateness). docs/collectives.md.
pub const DL_COLLECTIVE_STRAGGLER_CAUSE: &str = "dl.collective.straggler.cause";
/// Ranks whose calls were compared (those traced on this node; the communicator may
/// have more on other nodes).
pub const DL_COLLECTIVE_RANKS_COMPARED: &str = "dl.collective.ranks_compared";
// ---- lens-probe: hangs (`--hang-timeout`, docs/hangs.md) -------------------------------
/// `ranks_missing` (some traced ranks never entered the collective) or `not_completed`
/// (every traced rank entered it; it did not finish).
pub const LENS_PROBE_HANG_KIND: &str = "lens_probe.hang.kind";
/// Communicator ranks that entered the hung collective, and those that did not.
pub const LENS_PROBE_HANG_RANKS_ARRIVED: &str = "lens_probe.hang.ranks_arrived";
pub const LENS_PROBE_HANG_RANKS_MISSING: &str = "lens_probe.hang.ranks_missing";
/// One line per traced rank: the call it waits in, its Python stack and native place.
pub const LENS_PROBE_HANG_RANK_PLACES: &str = "lens_probe.hang.rank_places";
/// The Python stack of this span's process when the hang was found, innermost first.
pub const LENS_PROBE_HANG_PYTHON_STACK: &str = "lens_probe.hang.python_stack";
/// OpenTelemetry's code attributes: the Python function a rule's span is (its qualified
/// name) and its file.
pub const CODE_FUNCTION: &str = "code.function";
pub const CODE_FILEPATH: &str = "code.filepath";
/// The call's return code (`ncclResult_t`, `cudaError_t`).
pub const DL_CALL_RESULT: &str = "dl.call.result";
/// Bytes a GPU memory call asked for (an allocation, creation or mapping) or gave back
/// (a free or release of memory seen allocated).
pub const DL_GPU_MEMORY_BYTES: &str = "dl.gpu.memory.bytes";
/// Device memory the process held after the call, bytes (docs/memory.md).
pub const DL_GPU_MEMORY_HELD: &str = "dl.gpu.memory.held";
/// The most device memory the process held during the span, bytes: on `train.step`
/// (that step) and `train.job` (the run).
pub const DL_GPU_MEMORY_PEAK: &str = "dl.gpu.memory.peak";
/// What a GPU memory call did (`alloc`, `free`, `create`, `release`, `map`, `unmap`):
/// a metric attribute.
pub const DL_GPU_MEMORY_OP: &str = "dl.gpu.memory.op";
/// OpenTelemetry's stack trace attribute: the Python stack of the thread whose
/// allocation failed, innermost first, one frame a line.
pub const CODE_STACKTRACE: &str = "code.stacktrace";
/// `stream`, `event` or `device`.
pub const CUDA_SYNC_KIND: &str = "cuda.sync.kind";
/// `kernel`, `kernel_ex` or `graph` (launch counters).
pub const CUDA_LAUNCH_KIND: &str = "cuda.launch.kind";
/// Kernel launches (`cudaLaunchKernel`, `…ExC`, `cudaGraphLaunch`) the process made while
/// a phase span was open; set only when every one of them was counted.
pub const CUDA_LAUNCH_COUNT: &str = "cuda.launch.count";
/// A kernel's name on a step's `cuda.kernel.top` event: the host stub's symbol,
/// demangled, or `CUfunction 0x…` for a driver launch (span events only, never metrics).
pub const CUDA_KERNEL_NAME: &str = "cuda.kernel.name";
/// Launches of that kernel during the step.
pub const CUDA_KERNEL_LAUNCHES: &str = "cuda.kernel.launches";
/// `true`: launches are counted in sampled windows only (`--overhead-budget`); on a span,
/// its count is exact and the span lay inside a window; on a metric, counts are scaled up.
pub const CUDA_LAUNCH_SAMPLED: &str = "cuda.launch.sampled";
/// Prefix of the attribute a configured probe rule records an argument under when the
/// rule names none: `lens_probe.arg.0` for the first argument.
pub const LENS_PROBE_ARG_PREFIX: &str = "lens_probe.arg.";
/// Why lens-probe lost an event or a span (its own health metrics).
pub const LENS_PROBE_LOSS_CAUSE: &str = "lens_probe.loss.cause";
/// `user` or `system`: which side of lens-probe's own CPU time (OpenTelemetry's
/// `cpu.mode`, as on `process.cpu.time`).
pub const CPU_MODE: &str = "cpu.mode";

// ==== Export: resource attributes of the traced process ================================
// Added for `export::resource`: the OpenTelemetry resource NeMo Lens builds
// (`nemo.lens.providers` + `nemo.lens.resources`), read from the target, not lens-probe.

// ---- OpenTelemetry service attributes --------------------------------------------------
pub const SERVICE_NAME: &str = "service.name";
pub const SERVICE_VERSION: &str = "service.version";
/// `<run id>-rank<rank>`, as NeMo Lens.
pub const SERVICE_INSTANCE_ID: &str = "service.instance.id";

// ---- OpenTelemetry host, process and deployment attributes -----------------------------
pub const HOST_NAME: &str = "host.name";
/// GPUs the process may use (NeMo Lens' `host.gpu.count`).
pub const HOST_GPU_COUNT: &str = "host.gpu.count";
/// The command line, arguments joined with spaces.
pub const PROCESS_COMMAND_LINE: &str = "process.command_line";
pub const DEPLOYMENT_ENVIRONMENT: &str = "deployment.environment";

// ---- Kubernetes (k8s.*), OpenTelemetry semconv, as NeMo Lens ---------------------------
pub const K8S_JOB_NAME: &str = "k8s.job.name";
