#!/usr/bin/env bash
# bootstrap.sh - install what is missing (Debian 12, apt) and build kdaserve
# into ./build. Safe to run again: installs nothing that is present and
# rebuilds only what changed. Used by run.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the build and the tests need.
PKGS=(build-essential cmake pkg-config git
      libopenblas-dev libcjson-dev libxxhash-dev libcriterion-dev
      liblmdb-dev libmsgpack-dev libwebsockets-dev libpcre2-dev libreadline-dev
      libzstd-dev  # long transcript texts (documents) are stored compressed
      libopenmpi-dev openmpi-bin  # expert parallelism over MPI ranks (docs/expert-parallel.md)
      chromium   # chromium: the web page test's headless browser (tests/test_web_page.c)
      clang-14 libclang-rt-14-dev llvm-14)  # the sanitizer and fuzz passes (docs/testing.md)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js runs the tokenizer tests' reference (OpenAI tiktoken from npm,
# tests/node/). Looked for by command, not by package: a nodesource nodejs
# already carries npm, and Debian's npm package would conflict with it.
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
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

# The tokenizer tests compare with tiktoken@1.0.22 (pinned by
# tests/node/package-lock.json) on OpenAI's cl100k_base/o200k_base ranks,
# rebuilt from that package and sha256-checked into build/tok-ref. Not fatal
# here (kdaserve itself does not need them); the tests retry and then fail.
# ws and @msgpack/msgpack are the WebSocket protocol tests' client (tests/test_serve.c);
# playwright-core drives chromium for the web page test (tests/node/web_page.test.js);
# openai (the official SDK, pinned) is the HTTP API tests' client (tests/node/openai_api.test.js).
if [ ! -f tests/node/node_modules/tiktoken/package.json ] \
   || [ ! -f tests/node/node_modules/openai/package.json ] \
   || [ ! -f tests/node/node_modules/ws/package.json ] \
   || [ ! -f tests/node/node_modules/@msgpack/msgpack/package.json ] \
   || [ ! -f tests/node/node_modules/playwright-core/package.json ]; then
  echo "[bootstrap] npm ci in tests/node (the tiktoken reference and the WebSocket client for the tests)"
  (cd tests/node && npm ci --no-audit --no-fund --loglevel=error) >> build.log 2>&1 \
    || echo "[bootstrap] warning: npm ci failed (see build.log); the tokenizer tests need it" >&2
fi
if [ -f tests/node/node_modules/tiktoken/package.json ] \
   && { [ ! -f build/tok-ref/cl100k_base.tiktoken ] || [ ! -f build/tok-ref/o200k_base.tiktoken ]; }; then
  node tests/node/build_ranks.js build/tok-ref >> build.log 2>&1 \
    || echo "[bootstrap] warning: rebuilding the cl100k/o200k rank files failed (see build.log)" >&2
fi
