#!/usr/bin/env bash
# bootstrap.sh - install what is missing (Debian 12, apt) and build kdaserve
# into ./build. Safe to run again: installs nothing that is present and
# rebuilds only what changed. Used by run.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the build and the tests need.
PKGS=(build-essential cmake pkg-config git
      libopenblas-dev libcjson-dev libxxhash-dev libcriterion-dev
      liblmdb-dev libmsgpack-dev libwebsockets-dev libpcre2-dev libreadline-dev)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[bootstrap] installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# CUDA is optional: build the CUDA kernels when nvcc is installed.
if [ -z "${CUDACXX:-}" ]; then
  for c in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
    if [ -x "$c" ]; then export CUDACXX="$c"; break; fi
  done
fi

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${KDS_CMAKE_ARGS:-} > build.log 2>&1 \
  || { cat build.log; echo "[bootstrap] cmake configure failed" >&2; exit 1; }
cmake --build build -j"$(nproc)" >> build.log 2>&1 \
  || { tail -n 80 build.log; echo "[bootstrap] build failed (full log: build.log)" >&2; exit 1; }
echo "[bootstrap] built ./build/kdaserve"
