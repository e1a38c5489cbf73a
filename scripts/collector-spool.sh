#!/usr/bin/env bash
# The collector is down for MINUTES minutes (default 10; nothing listens on its port),
# then comes back for AFTER minutes (default 2), while the fake PyTorch trainer runs
# under lens-probe `per_step` with OTLP/HTTP export and `--spool-dir`. The collector,
# once back, counts every span it receives. Printed: lens-probe's memory and the spool's
# size every 30 s, the spans lens-probe made against the spans the collector got, and
# the trainer's step time against a run whose spans go to /dev/null.
# Run from the repository root as root after `cargo build --release` and the fixtures
# (`cargo xtask test` builds them), with the PyTorch venv (`cargo xtask setup`) for the
# collector's OTLP decoding. docs/security.md records one run.
set -euo pipefail
MINUTES=${1:-10}
AFTER=${2:-2}
LENS=target/release/lens-probe
TRAINER=$(ls target/*/build/lens-tests-*/out/fixtures/faketorch/trainer_torch 2>/dev/null | head -1)
PYTHON=${LENS_TORCH_VENV:-$HOME/.cache/lens-probe/torch-venv}/bin/python
[ -x "$LENS" ] && [ -n "$TRAINER" ] && [ -x "$PYTHON" ] || {
  echo "collector-spool: build lens-probe (release) and the fixtures, and run cargo xtask setup, first" >&2
  exit 1
}
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
# A trainer at a job's pace, not flat out: ~50 steps a second, 7 spans each.
export TRAINER_FORWARD_MS=10 TRAINER_INIT_MS=0 TRAINER_DISTRIBUTED=1 LENS_FAKE_BACKWARD_MS=5 LENS_FAKE_COLLECTIVE_MS=0

timed() { echo "t0=\$(date +%s%N); \"\$0\" $1 2 0 0; echo \$((\$(date +%s%N) - t0)) > $2"; }
calibrate_steps=1500
"$LENS" --span-groups per_step --exporter file --export-file /dev/null --exec -- \
  sh -c "$(timed $calibrate_steps "$WORK/calibrate.ns")" "$TRAINER" >/dev/null 2>"$WORK/calibrate.err"
step_ns_ok=$(( $(cat "$WORK/calibrate.ns") / calibrate_steps ))
steps=$(( (MINUTES + AFTER) * 60 * 1000000000 / step_ns_ok ))

port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$port" OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf \
  "$LENS" --span-groups per_step --spool-dir "$WORK/spool" --pid-file "$WORK/pid" --exec -- \
  sh -c "$(timed $steps "$WORK/run.ns")" "$TRAINER" >/dev/null 2>"$WORK/run.err" &
probe=$!
until [ -s "$WORK/pid" ]; do sleep 0.05; done
pid=$(cat "$WORK/pid")
start=$(date +%s)
collector_started=
collector=down
echo "| minute | collector | lens-probe VmRSS | VmHWM | spool |"
echo "|---|---|---|---|---|"
while kill -0 "$pid" 2>/dev/null; do
  t=$(( $(date +%s) - start ))
  if [ -z "$collector_started" ] && [ "$t" -ge $((MINUTES * 60)) ]; then
    # Back: an OTLP/HTTP collector that counts the spans it is sent.
    "$PYTHON" - "$port" "$WORK/received" <<'PY' &
import sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
port, out = int(sys.argv[1]), sys.argv[2]
lock, received = threading.Lock(), [0]
class Collector(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path.endswith("/v1/traces"):
            request = ExportTraceServiceRequest.FromString(body)
            n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            with lock:
                received[0] += n
                open(out, "w").write(str(received[0]))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("127.0.0.1", port), Collector).serve_forever()
PY
    collector_started=1
    collector=up
  fi
  rss=$(awk '/VmRSS/ {print $2}' /proc/$pid/status 2>/dev/null || true)
  hwm=$(awk '/VmHWM/ {print $2}' /proc/$pid/status 2>/dev/null || true)
  spool=$(du -sm "$WORK/spool" 2>/dev/null | cut -f1)
  [ -n "$rss" ] && printf '| %d:%02d | %s | %d MB | %d MB | %s MB |\n' $((t / 60)) $((t % 60)) \
    "$collector" $((rss / 1024)) $((hwm / 1024)) "${spool:-0}"
  sleep 30
done
wait $probe || true
step_ns_run=$(( $(cat "$WORK/run.ns") / steps ))
echo
echo "trainer step, spans to /dev/null: $((step_ns_ok / 1000)) µs; collector down then back: $((step_ns_run / 1000)) µs ($steps steps)"
grep -E "spans exported|spool |lost" "$WORK/run.err" || true
echo "the collector received $(cat "$WORK/received" 2>/dev/null || echo 0) spans; files left in the spool: $(ls "$WORK/spool" | wc -l)"
