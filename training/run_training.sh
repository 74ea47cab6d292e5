#!/bin/sh
# run_training.sh - the exact command sequence that trained models/default.
#
#   training/run_training.sh [WORK_DIR]      (default /tmp/kds_train)
#
# Tokenises the committed corpus, trains (log: WORK_DIR/train.log,
# checkpoint: WORK_DIR/ckpt.pt), then exports to models/default. Needs
# Debian's python3-torch, libopenblas0-pthread, python3-regex, gcc; uses
# libjemalloc2 when installed (PyTorch 1.13's CPU allocator hands big
# buffers back to the kernel, and first-touch page faults then cost more
# than the arithmetic on this kind of VM). OMP_WAIT_POLICY=PASSIVE keeps two
# OpenMP threads from spinning against each other on a shared 2-core machine.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/kds_train}
PY=/usr/bin/python3
mkdir -p "$WORK"
JE=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
if [ -e "$JE" ]; then
    export LD_PRELOAD="$JE" MALLOC_CONF="retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1"
fi
export OMP_WAIT_POLICY=PASSIVE
$PY "$ROOT/training/prepare_data.py" "$WORK"
$PY "$ROOT/training/train.py" --data "$WORK" --out "$WORK/ckpt.pt" \
    --steps 900 --time-budget 2280 --batch 16 --seq 256 --lr 3e-3 --threads 2 --seed 1234 \
    > "$WORK/train.log" 2>&1
$PY "$ROOT/training/export.py" --ckpt "$WORK/ckpt.pt" --out "$ROOT/models/default"
