#!/usr/bin/env bash
# run.sh - set up (install + build) and start kdaserve on the default model.
# With no arguments it starts the session service (`kdaserve serve`): the web
# chat page at http://127.0.0.1:8080/ and the kdaserve.v1 WebSocket protocol
# on the same port (docs/protocol.md); Ctrl-C stops it and saves every
# session. With arguments it runs that subcommand instead, e.g.
# `scripts/run.sh chat` or `scripts/run.sh generate --prompt "Hi"`.
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
  echo "[run] starting the session service: open http://127.0.0.1:8080/ (Ctrl-C stops it)"
  set -- serve
fi
exec ./build/kdaserve "$1" --model "$MODEL" "${@:2}"
