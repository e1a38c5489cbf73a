#!/usr/bin/env bash
# A collector that accepts OTLP connections and never answers, for MINUTES minutes
# (default 10), while the fake PyTorch trainer runs under lens-probe `per_step` with
# OTLP export: lens-probe's memory is sampled every 10 s and the trainer's step time is
# compared with a short run whose spans go to /dev/null (nothing waits there).
# Run from the repository root as root after `cargo build --release` and the fixtures
# (`cargo xtask test` builds them). Prints a table; docs/security.md records one run.
set -euo pipefail
MINUTES=${1:-10}
LENS=target/release/lens-probe
TRAINER=$(ls target/*/build/lens-tests-*/out/fixtures/faketorch/trainer_torch 2>/dev/null | head -1)
[ -x "$LENS" ] && [ -n "$TRAINER" ] || { echo "collector-outage: build lens-probe (release) and the fixtures first" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
export TRAINER_FORWARD_MS=1 TRAINER_INIT_MS=0 TRAINER_DISTRIBUTED=1 LENS_FAKE_BACKWARD_MS=0 LENS_FAKE_COLLECTIVE_MS=0

# Steps the trainer makes in 30 s with its spans written to /dev/null.
calibrate_steps=20000
start=$(date +%s%N)
# The trainer's own time (lens-probe's start-up and exit flush left out).
timed() { echo "t0=\$(date +%s%N); \"\$0\" $1 2 0 0; echo \$((\$(date +%s%N) - t0)) > $2"; }
"$LENS" --span-groups per_step --exporter file --export-file /dev/null --exec -- \
  sh -c "$(timed $calibrate_steps "$WORK/calibrate.ns")" "$TRAINER" >/dev/null 2>"$WORK/calibrate.err"
step_ns_ok=$(( $(cat "$WORK/calibrate.ns") / calibrate_steps ))
steps=$(( MINUTES * 60 * 1000000000 / step_ns_ok ))

# The collector: accepts, reads nothing, answers nothing.
python3 - "$WORK/port" <<'PY' &
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(64)
open(sys.argv[1], "w").write(str(s.getsockname()[1]))
held = []
while True:
    held.append(s.accept()[0])
PY
until [ -s "$WORK/port" ]; do sleep 0.05; done
OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$(cat "$WORK/port")" \
  "$LENS" --span-groups per_step --pid-file "$WORK/pid" --exec -- \
  sh -c "$(timed $steps "$WORK/outage.ns")" "$TRAINER" >/dev/null 2>"$WORK/outage.err" &
probe=$!
until [ -s "$WORK/pid" ]; do sleep 0.05; done
pid=$(cat "$WORK/pid")
start=$(date +%s%N)
echo "| minute | lens-probe VmRSS | VmHWM |"
echo "|---|---|---|"
while kill -0 "$pid" 2>/dev/null; do
  t=$(( ($(date +%s%N) - start) / 1000000000 ))
  rss=$(awk '/VmRSS/ {print $2}' /proc/$pid/status 2>/dev/null || true)
  hwm=$(awk '/VmHWM/ {print $2}' /proc/$pid/status 2>/dev/null || true)
  [ -n "$rss" ] && printf '| %d:%02d | %d MB | %d MB |\n' $((t / 60)) $((t % 60)) $((rss / 1024)) $((hwm / 1024))
  sleep 10
done
wait $probe || true
step_ns_outage=$(( $(cat "$WORK/outage.ns") / steps ))
echo
echo "trainer step, spans to /dev/null: $((step_ns_ok / 1000)) µs; collector hanging: $((step_ns_outage / 1000)) µs ($steps steps)"
grep -E "spans exported|events lost|lost" "$WORK/outage.err" || true
