#!/usr/bin/env bash
# run.sh - set up (install + build) and start kdaserve on the default model.
# Until the trained default model lands, the default model is the generated
# `tiny` preset, made on first use in models/generated/tiny.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
MODEL="${KDASERVE_MODEL:-}"
if [ -z "$MODEL" ]; then
  if [ -f models/default/config.json ]; then
    MODEL=models/default
  else
    MODEL=models/generated/tiny
    if [ ! -f "$MODEL/config.json" ]; then
      ./build/kdaserve gen-model --preset tiny --seed 0 --out "$MODEL"
    fi
  fi
fi
if [ $# -eq 0 ]; then
  set -- generate --prompt "Once upon a time" --max-tokens 64
fi
exec ./build/kdaserve "$1" --model "$MODEL" "${@:2}"
