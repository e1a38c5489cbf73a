#!/usr/bin/env bash
# A/B per-hit cost of two lens-probe builds on the fake libraries, interleaved:
#   scripts/ab-per-kind.sh OLD_LENS_PROBE NEW_LENS_PROBE FIXTURES_DIR [ROUNDS]
# For each probe kind, `hammer KIND N` (tests/fixtures/hammer.c) runs uninstrumented,
# under OLD and under NEW (`--span-groups per_step`), in the order none/old/new per
# round; prints the loop's own time per call (median over rounds) and NEW/OLD of the
# traced-minus-uninstrumented cost. Used to check that a refactor costs nothing
# (docs/performance.md, "A/B").
set -euo pipefail
old=$1 new=$2 fixtures=$3 rounds=${4:-5}
hammer="$fixtures/hammer"
export LENS_FAKE_SYNC_MS=0
declare -A calls=([launch]=500000 [driver]=500000 [sync]=50000 [collective]=500000 [group]=500000 [event_query]=500000)
loop_ns() { # kind n → ns per call of hammer's own loop
  sed -n 's/^hammer: [a-z_]* \([0-9]*\) calls in \([0-9]*\) ns$/\2 \1/p' | awk '{ printf "%.1f\n", $1 / $2 }'
}
run() { # variant kind n
  local variant=$1 kind=$2 n=$3 wrapper='T="$0"; "$T" "$1" 1 >/dev/null || exit 1; "$T" "$1" "$2"'
  case $variant in
    none) sh -c "$wrapper" "$hammer" "$kind" "$n" ;;
    old|new)
      local bin=$old; [ "$variant" = new ] && bin=$new
      "$bin" --span-groups per_step --exporter file --export-file /dev/null \
        --exec -- sh -c "$wrapper" "$hammer" "$kind" "$n" 2>/dev/null ;;
  esac | loop_ns
  # Uprobes are per file and leave the kernel seconds after lens-probe exits (a child of
  # it holds them until they are gone): the next run must not pay for them.
  while pgrep -x "$(basename "$old")" > /dev/null || pgrep -x "$(basename "$new")" > /dev/null; do
    sleep 0.2
  done
}
median() { sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
printf '| kind | uninstrumented ns/call | old: + ns/call | new: + ns/call | new / old |\n|---|---|---|---|---|\n'
for kind in launch driver sync collective group event_query; do
  n=${calls[$kind]}
  : > /tmp/ab.none; : > /tmp/ab.old; : > /tmp/ab.new
  for _ in $(seq "$rounds"); do
    for variant in none old new; do run "$variant" "$kind" "$n" >> "/tmp/ab.$variant"; done
  done
  none=$(median < /tmp/ab.none); o=$(median < /tmp/ab.old); w=$(median < /tmp/ab.new)
  awk -v k="$kind" -v n="$none" -v o="$o" -v w="$w" 'BEGIN {
    printf "| %s | %.0f | %.0f | %.0f | %.3f× |\n", k, n, o - n, w - n, (w - n) / (o - n) }'
done
