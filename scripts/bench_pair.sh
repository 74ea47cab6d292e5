#!/usr/bin/env bash
# bench_pair.sh ROUNDS OUT MODEL_A MODEL_B -- BENCH_ARGS...
#
# Two models measured in alternation on a shared machine (docs/benchmarks.md,
# "Kimi K3 on CPU"): ROUNDS rounds of `kdaserve bench --model M BENCH_ARGS`
# for A then B, the order swapped every round, each run headed by the load
# average and the time, all into OUT. scripts/bench_pair_table.py OUT prints
# the per-round ratios B / A and their medians: only those are comparable
# when other tenants' load moves from minute to minute.
#
#   KDASERVE=build/kdaserve (default) picks the binary.
set -euo pipefail
R=$1 OUT=$2 A=$3 B=$4
shift 4
[ "${1:-}" = "--" ] && shift
BIN=${KDASERVE:-build/kdaserve}
: > "$OUT"
for ((i = 1; i <= R; i++)); do
    if ((i % 2)); then order=("$A" "$B"); else order=("$B" "$A"); fi
    for m in "${order[@]}"; do
        echo "=== round $i model $m load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%H:%M:%S)" >> "$OUT"
        "$BIN" bench --model "$m" "$@" >> "$OUT" 2>&1
    done
done
