#!/usr/bin/env bash
# gpu-check.sh: check lens-probe on a machine with one NVIDIA GPU (real CUDA launches and
# syncs, NCCL with world size 1), and measure its overhead there.
#
# What the machine needs (no network): root (or CAP_BPF + CAP_PERFMON + CAP_SYS_ADMIN),
# one NVIDIA GPU with `nvidia-smi`, a Python with a CUDA build of PyTorch and its NCCL,
# and, copied from this repository, the built `lens-probe` binary and this script.
#
#   LENS_PROBE=./lens-probe PYTHON=/opt/venv/bin/python bash scripts/gpu-check.sh
#
# Environment:
#   LENS_PROBE         the lens-probe binary       (default ./target/release/lens-probe)
#   PYTHON             Python with torch + NCCL    (default python3)
#   GPU_CHECK_STEPS    training steps per run      (default 40)
#   GPU_CHECK_ROUNDS   rounds of the overhead table, uninstrumented and per_step
#                      interleaved                 (default 3)
#   GPU_CHECK_OUT      where the logs go           (default a new /tmp/lens-gpu-check.*)
#
# Steps (under 5 minutes in all):
#   1. writes gpu_train.py: torch.distributed with backend nccl, world size 1
#      (MASTER_ADDR 127.0.0.1, a free port), a model on cuda:0 in DDP, a DataLoader,
#      Adam, torch.cuda.synchronize() at the end of every step, an evaluation under
#      torch.no_grad() and a torch.save checkpoint; it prints the loop's own time;
#   2. runs it under `lens-probe --span-groups all --exporter console --exec`, shows the
#      span tree and lens-probe's summary (launches, syncs, collectives) and checks them;
#   3. runs it uninstrumented and under `--span-groups per_step`, interleaved, and prints
#      a small overhead table (median loop times);
#   4. writes gpu_launches.py (a few SGD steps, each after 400 elementwise `add_` kernels:
#      runtime launches only) and runs it under `--span-groups per_step --exporter file`:
#      every runtime launch is counted once although the real libcudart launches through
#      libcuda's cuLaunchKernel (probed too), and the steps' `cuda.kernel.top` events
#      name the add kernel, demangled, with its 400 launches (libtorch_cuda.so has no
#      symbols for its stubs: named as __cudaRegisterFunction registered them);
#   5. writes gpu_memory.py (4 x 256 MiB on cuda:0, one freed; a CUDA graph of 10 adds
#      captured and replayed 3 times; an allocation of 1 PiB from ask_for_too_much(),
#      caught) and runs it under `--span-groups per_step`: the peak lens-probe counts from
#      the CUDA calls is at least torch.cuda.max_memory_reserved() (and within 1 GiB of
#      it), the failed allocation is one console line naming ask_for_too_much, the
#      captured adds are counted as captured, the replays as graph launches.
#
# Exit: 0 when every check passed, 1 when one failed or a run broke, 2 when this machine
# cannot run the check (no GPU, no lens-probe, no PyTorch with CUDA and NCCL).
set -euo pipefail

LENS_PROBE="${LENS_PROBE:-./target/release/lens-probe}"
PYTHON="${PYTHON:-python3}"
STEPS="${GPU_CHECK_STEPS:-40}"
ROUNDS="${GPU_CHECK_ROUNDS:-3}"
RUN_TIMEOUT=150

say() { echo "gpu-check: $*"; }
cannot() {
    echo "gpu-check: $*" >&2
    exit 2
}
fail() {
    echo "gpu-check: FAILED: $*" >&2
    exit 1
}

command -v nvidia-smi >/dev/null 2>&1 || cannot "no NVIDIA GPU here: nvidia-smi not found"
nvidia-smi -L >/dev/null 2>&1 || cannot "nvidia-smi finds no usable GPU: $(nvidia-smi -L 2>&1 | head -n 1)"
[[ -x "$LENS_PROBE" ]] || cannot "no lens-probe binary at $LENS_PROBE (set LENS_PROBE)"
command -v "$PYTHON" >/dev/null 2>&1 || cannot "no Python at '$PYTHON' (set PYTHON)"
[[ "$STEPS" =~ ^[1-9][0-9]*$ ]] || cannot "GPU_CHECK_STEPS must be a positive number, not '$STEPS'"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || cannot "GPU_CHECK_ROUNDS must be a positive number, not '$ROUNDS'"
torch_check="$("$PYTHON" - <<'PY' 2>&1
import sys
try:
    import torch
    import torch.distributed as dist
except Exception as e:
    print(f"cannot import torch: {e}")
    sys.exit(1)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA device")
    sys.exit(1)
if not dist.is_available() or not dist.is_nccl_available():
    print(f"torch {torch.__version__} has no NCCL backend")
    sys.exit(1)
nccl = torch.cuda.nccl.version()
nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {torch.cuda.get_device_name(0)}")
PY
)" || cannot "$PYTHON: $(tail -n 1 <<<"$torch_check")"

OUT="${GPU_CHECK_OUT:-$(mktemp -d /tmp/lens-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
LENS_PROBE="$(cd "$(dirname "$LENS_PROBE")" && pwd)/$(basename "$LENS_PROBE")"

# NCCL on one GPU needs no network; keep its bootstrap on loopback.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
# Settings from the environment would change what lens-probe does.
unset NEMO_LENS_SPAN_GROUPS NEMO_LENS_EXPORTER OTEL_EXPORTER_OTLP_ENDPOINT \
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT 2>/dev/null || true

cat >"$OUT/gpu_train.py" <<'PY'
"""A 1-GPU DDP training loop over NCCL (world size 1), for lens-probe's GPU check.

Usage: python gpu_train.py STEPS CKPT_DIR. Prints `step N` as each step begins and, at
the end, `gpu-check loop_s=SECONDS steps=N`: the loop's own time, from just before
step 0 to after the last step's torch.cuda.synchronize().
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    steps = int(sys.argv[1])
    ckpt_dir = sys.argv[2]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)

    model = nn.Sequential(
        nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 10)
    ).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    accum = 2
    batch = 64
    n = batch * accum * steps
    g = torch.Generator().manual_seed(0)
    train = DataLoader(
        TensorDataset(torch.randn(n, 1024, generator=g), torch.randint(0, 10, (n,), generator=g)),
        batch_size=batch,
        pin_memory=True,
    )
    val = DataLoader(
        TensorDataset(torch.randn(2 * batch, 1024), torch.randint(0, 10, (2 * batch,))),
        batch_size=batch,
    )
    batches = iter(train)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(steps):
        print(f"step {step}", flush=True)
        opt.zero_grad(set_to_none=True)
        for _ in range(accum):
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y) / accum
            loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        torch.cuda.synchronize()
        if (step + 1) % 20 == 0:
            model.eval()
            with torch.no_grad():
                for x, y in val:
                    loss_fn(model(x.to(device)), y.to(device))
            model.train()
            torch.cuda.synchronize()
    loop = time.perf_counter() - start
    torch.save({"model": model.module.state_dict()}, os.path.join(ckpt_dir, "gpu_check.pt"))
    print(f"gpu-check loop_s={loop:.6f} steps={steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
PY

say "$torch_check"
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1)"
say "lens-probe: $LENS_PROBE ($("$LENS_PROBE" --version 2>&1 | head -n 1)), kernel $(uname -r)"
say "logs in $OUT"

# run NAME [lens-probe args...]: runs gpu_train.py (plain when no lens-probe args),
# stdout to OUT/NAME.out, stderr to OUT/NAME.err; prints the loop time.
run() {
    local name="$1"
    shift
    local cmd=("$PYTHON" -u "$OUT/gpu_train.py" "$STEPS" "$OUT")
    if (($# > 0)); then
        cmd=("$LENS_PROBE" "$@" --exec -- "${cmd[@]}")
    fi
    if ! timeout "$RUN_TIMEOUT" "${cmd[@]}" >"$OUT/$name.out" 2>"$OUT/$name.err"; then
        tail -n 20 "$OUT/$name.err" >&2 || true
        fail "run '$name' failed or took over ${RUN_TIMEOUT}s: ${cmd[*]} (logs: $OUT/$name.out, $OUT/$name.err)"
    fi
    local loop
    loop="$(sed -n 's/^gpu-check loop_s=\([0-9.]*\) .*/\1/p' "$OUT/$name.out")"
    [[ -n "$loop" ]] || fail "run '$name' printed no loop time (see $OUT/$name.out)"
    echo "$loop"
}

# 1. Everything on, console output: the span tree and the summary.
say "1/5: lens-probe --span-groups all --exporter console --exec -- python gpu_train.py $STEPS"
all_loop="$(run traced-all --span-groups all --exporter console --summary-json "$OUT/summary.json")"
echo
echo "---- span tree (first 60 lines; all of it in $OUT/traced-all.err) ----"
# (head closes the pipe early: SIGPIPE upstream is expected, not a failure)
{ grep -v '^lens-probe summary' "$OUT/traced-all.err" | sed -n '/job started/,$p' | head -n 60; } || true
echo "---- lens-probe summary ----"
sed -n '/^lens-probe summary/,$p' "$OUT/traced-all.err"
echo

# The checks, from --summary-json.
"$PYTHON" - "$OUT/summary.json" "$STEPS" <<'PY' || fail "lens-probe missed part of the GPU run (see above)"
import json
import sys

summary = json.load(open(sys.argv[1]))
steps = int(sys.argv[2])
procs = [p for p in summary["processes"] if any("gpu_train.py" in a for a in p.get("command_line", []))]
ok = True


def check(what, good, detail):
    global ok
    ok &= bool(good)
    print(f"gpu-check: {'PASS' if good else 'FAIL'}: {what}: {detail}")


check("the training process is in the summary", procs, f"{len(summary['processes'])} processes")
if procs:
    p = procs[0]
    calls = p.get("calls", {})
    launches = {k: v for k, v in calls.items() if "Launch" in k}
    syncs = {k: v["calls"] for k, v in p.get("sync_waits", {}).items()}
    collectives = {k: v["calls"] for k, v in p.get("collectives", {}).items()}
    comms = p.get("communicators", [])
    check("CUDA kernel launches counted", sum(launches.values()) > 0, launches or "none")
    check(f"a sync wait per step (>= {steps})", sum(syncs.values()) >= steps, syncs or "none")
    check(
        f"NCCL collectives (>= {steps} all_reduce)",
        collectives.get("all_reduce", 0) >= steps,
        collectives or "none",
    )
    check(
        "the NCCL communicator (rank 0 of 1)",
        any(c.get("nranks") == 1 and c.get("rank") == 0 for c in comms),
        comms or "none",
    )
    check("the process exited 0", p.get("exit") == {"exited": 0}, p.get("exit"))
lost = sum(summary["losses"]["kernel"].values()) + summary["losses"].get("undecodable", 0)
check("no event lost", lost == 0, summary["losses"])
sys.exit(0 if ok else 1)
PY
tree="$OUT/traced-all.err"
steps_seen="$(grep -c 'train.step ' "$tree" || true)"
if ((steps_seen >= STEPS)); then
    say "PASS: $steps_seen train.step spans for $STEPS steps"
else
    fail "$steps_seen train.step spans for $STEPS steps (see $tree)"
fi
# Collective completion: the all_reduce spans end where the host learnt the collective
# finished (ProcessGroupNCCL's watchdog queries its end event; torch.cuda.synchronize()),
# not at the enqueue call's return.
"$PYTHON" - "$tree" <<'PY' || fail "collective completion not inferred (see above)"
import re
import statistics
import sys

sources, precisions, enqueue, total = {}, [], [], 0
for line in open(sys.argv[1], errors="replace"):
    if "nccl.all_reduce" not in line:
        continue
    total += 1
    m = re.search(r"dl\.collective\.end\.source=(\w+)", line)
    source = m.group(1) if m else "none"
    sources[source] = sources.get(source, 0) + 1
    m = re.search(r"dl\.collective\.end\.precision_ns=(\d+)", line)
    if m:
        precisions.append(int(m.group(1)))
    m = re.search(r"dl\.collective\.enqueue\.duration_ns=(\d+)", line)
    if m:
        enqueue.append(int(m.group(1)))
inferred = total - sources.get("call_return", 0) - sources.get("none", 0)
good = total > 0 and inferred >= 0.9 * total
detail = f"{inferred} of {total} inferred, sources {sources}"
if precisions:
    detail += f", precision median {statistics.median(precisions) / 1e6:.3f} ms"
if enqueue:
    detail += f", enqueue median {statistics.median(enqueue) / 1e3:.1f} us"
print(f"gpu-check: {'PASS' if good else 'FAIL'}: all_reduce spans end at the inferred completion: {detail}")
sys.exit(0 if good else 1)
PY
# torch.cuda.synchronize() is cudaDeviceSynchronize.
for span in train.forward_backward train.optimizer nccl.all_reduce cuda.device_synchronize train.evaluate train.checkpoint; do
    grep -q "$span" "$tree" && say "PASS: $span spans" || fail "no $span span (see $tree)"
done

# 2. Overhead: uninstrumented and per_step, interleaved.
say "2/5: overhead, $ROUNDS rounds of: uninstrumented, lens-probe --span-groups per_step"
: >"$OUT/overhead.txt"
for ((round = 1; round <= ROUNDS; round++)); do
    if ((round > 1 && SECONDS > 240)); then
        say "stopping after $((round - 1)) rounds: ${SECONDS}s used, the check keeps under 5 minutes"
        break
    fi
    none="$(run "none-r$round")"
    echo "none $none" >>"$OUT/overhead.txt"
    per_step="$(run "per_step-r$round" --span-groups per_step --exporter console)"
    echo "per_step $per_step" >>"$OUT/overhead.txt"
    say "round $round/$ROUNDS: loop uninstrumented ${none} s, per_step ${per_step} s"
done
echo "all $all_loop" >>"$OUT/overhead.txt"

say "3/5: results ($STEPS steps, loop time from step 0 to the last synchronize)"
"$PYTHON" - "$OUT/overhead.txt" <<'PY'
import statistics
import sys

runs = {}
for line in open(sys.argv[1]):
    name, value = line.split()
    runs.setdefault(name, []).append(float(value))
base = statistics.median(runs["none"])
print("| run | loop median (s) | runs | vs uninstrumented |")
print("|---|---|---|---|")
for name in ("none", "per_step", "all"):
    values = runs.get(name, [])
    if not values:
        continue
    m = statistics.median(values)
    label = {"none": "uninstrumented", "per_step": "`--span-groups per_step`", "all": "`--span-groups all` (console tree, 1 run)"}[name]
    print(f"| {label} | {m:.3f} | {', '.join(f'{v:.3f}' for v in values)} | {m / base:.3f}x |")
PY
# 4. Driver launches counted once, and kernel names, on the real driver.
say "4/5: runtime launches through the real libcuda counted once; the steps' top kernels named"
cat >"$OUT/gpu_launches.py" <<'PY'
"""5 SGD steps on cuda:0, each with 400 x.add_(1) between its backward and its optimizer
step (one elementwise kernel each, launched with cudaLaunchKernel, which the runtime passes
on to libcuda's cuLaunchKernel): inside the step, whose top kernel they are."""
import torch

model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 64, device="cuda")
y = torch.zeros(1024, device="cuda")
torch.cuda.synchronize()
for step in range(5):
    model(x).sum().backward()
    for _ in range(400):
        y.add_(1)
    opt.step()
    opt.zero_grad()
torch.cuda.synchronize()
print("gpu-check launches done", flush=True)
PY
if ! timeout "$RUN_TIMEOUT" "$LENS_PROBE" --span-groups per_step --exporter file \
    --export-file "$OUT/launches.jsonl" --summary-json "$OUT/launches-summary.json" \
    --exec -- "$PYTHON" -u "$OUT/gpu_launches.py" >"$OUT/launches.out" 2>"$OUT/launches.err"; then
    tail -n 20 "$OUT/launches.err" >&2 || true
    fail "the launches run failed (logs: $OUT/launches.out, $OUT/launches.err)"
fi
"$PYTHON" - "$OUT/launches-summary.json" "$OUT/launches.jsonl" <<'PY' || fail "launches counted twice or kernels not named (see above)"
import json
import sys

summary = json.load(open(sys.argv[1]))
procs = [p for p in summary["processes"] if any("gpu_launches.py" in a for a in p.get("command_line", []))]
ok = True


def check(what, good, detail):
    global ok
    ok &= bool(good)
    print(f"gpu-check: {'PASS' if good else 'FAIL'}: {what}: {detail}")


check("the launches process is in the summary", procs, f"{len(summary['processes'])} processes")
calls = procs[0].get("calls", {}) if procs else {}
runtime = sum(v for k, v in calls.items() if k.startswith("cudaLaunchKernel"))
driver = sum(v for k, v in calls.items() if k in ("cuLaunchKernel", "cuLaunchKernelEx"))
launches = {k: v for k, v in calls.items() if "Launch" in k}
check("2000 add_ kernels counted through the runtime", runtime >= 2000, launches)
# Were the runtime's own calls into cuLaunchKernel counted again, there would be >= 2000.
check("the runtime's calls into libcuda not counted again", driver < 500, launches)


def attrs(item):
    out = {}
    for kv in item.get("attributes", []):
        value = kv.get("value", {})
        for kind in ("stringValue", "intValue", "boolValue", "doubleValue"):
            if kind in value:
                out[kv["key"]] = value[kind]
    return out


tops = []
for line in open(sys.argv[2]):
    line = line.strip()
    if not line:
        continue
    doc = json.loads(line)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                if span.get("name") != "train.step":
                    continue
                for event in span.get("events", []):
                    if event.get("name") == "cuda.kernel.top":
                        a = attrs(event)
                        tops.append((a.get("cuda.kernel.name", ""), int(a.get("cuda.kernel.launches", 0))))
adds = [t for t in tops if "at::native" in t[0] and t[1] >= 400]
check(
    "a step's top kernel is the add, demangled, with its 400 launches",
    adds,
    adds[:1] or tops[:3] or "no cuda.kernel.top event",
)
sys.exit(0 if ok else 1)
PY

# 5. GPU memory, an out-of-memory, and a CUDA graph.
say "5/5: GPU memory held vs torch.cuda.max_memory_reserved(), an induced OOM, a CUDA graph"
cat >"$OUT/gpu_memory.py" <<'PY'
"""Memory on cuda:0 in a known pattern, a CUDA graph, then an allocation that cannot fit."""
import torch

blocks = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
del blocks[1]
y = torch.zeros(1024, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    y.add_(1)  # warm-up outside the capture
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    for _ in range(10):
        y.add_(1)
for _ in range(3):
    graph.replay()
torch.cuda.synchronize()
print(f"gpu-check max_memory_reserved={torch.cuda.max_memory_reserved()}", flush=True)


def ask_for_too_much():
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        print("gpu-check oom raised", flush=True)


ask_for_too_much()
PY
if ! timeout "$RUN_TIMEOUT" "$LENS_PROBE" --span-groups per_step --exporter file \
    --export-file "$OUT/memory.jsonl" --summary-json "$OUT/memory-summary.json" \
    --exec -- "$PYTHON" -u "$OUT/gpu_memory.py" >"$OUT/memory.out" 2>"$OUT/memory.err"; then
    tail -n 20 "$OUT/memory.err" >&2 || true
    fail "the memory run failed (logs: $OUT/memory.out, $OUT/memory.err)"
fi
"$PYTHON" - "$OUT/memory-summary.json" "$OUT/memory.out" "$OUT/memory.err" <<'PY' || fail "GPU memory, OOM or graphs not seen as expected (see above)"
import json
import re
import sys

summary = json.load(open(sys.argv[1]))
out = open(sys.argv[2]).read()
err = open(sys.argv[3]).read()
procs = [p for p in summary["processes"] if any("gpu_memory.py" in a for a in p.get("command_line", []))]
ok = True


def check(what, good, detail):
    global ok
    ok &= bool(good)
    print(f"gpu-check: {'PASS' if good else 'FAIL'}: {what}: {detail}")


check("the memory process is in the summary", procs, f"{len(summary['processes'])} processes")
p = procs[0] if procs else {}
memory = p.get("gpu_memory") or {}
m = re.search(r"max_memory_reserved=(\d+)", out)
reserved = int(m.group(1)) if m else 0
peak = memory.get("peak_bytes", 0)
check(
    "peak held >= torch.cuda.max_memory_reserved(), within 1 GiB",
    reserved > 0 and reserved <= peak <= reserved + (1 << 30),
    f"lens-probe peak {peak}, torch {reserved}",
)
check("the out-of-memory counted", memory.get("out_of_memory", 0) >= 1, memory)
line = next((l for l in err.splitlines() if "out of GPU memory" in l), "")
check("one console line naming ask_for_too_much", "ask_for_too_much" in line, line or "none")
check("torch raised its OutOfMemoryError", "gpu-check oom raised" in out, "")
captured = sum(p.get("captured_launches", {}).values())
check("the 10 adds captured, not run", captured >= 10, p.get("captured_launches"))
calls = p.get("calls", {})
graph_launches = calls.get("cudaGraphLaunch", 0) + calls.get("cuGraphLaunch", 0)
check("the 3 replays counted as graph launches", graph_launches >= 3, graph_launches)
check("one capture", calls.get("cudaStreamBeginCapture", 0) + calls.get("cuStreamBeginCapture_v2", 0) >= 1, calls.get("cudaStreamBeginCapture"))
sys.exit(0 if ok else 1)
PY

say "done; logs in $OUT"
