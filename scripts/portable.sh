#!/usr/bin/env bash
# portable.sh - build the whole test suite once more for a generic x86-64
# (-DKDS_NATIVE=OFF: no AVX-512, so the kernels' portable paths: BLAS from
# 64 tokens, the scalar block-format loops, MLA heads one row at a time)
# into ./build-portable, CPU only, and run it (docs/testing.md). What a
# user whose CPU lacks AVX-512 builds must keep the same contracts (a
# batched token's bits are its lone decode's), and this pass holds them.
#
#   scripts/portable.sh [Criterion options...]
#
# The suite's output goes to build-portable/test.log; one summary line is
# printed (not Criterion's own "Synthesis" line, so that the normal run's
# stays the one CI reads). Exit status non-zero when a test fails.
# Environment: KDS_PORTABLE_FILTER (a Criterion --filter; default: all).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build-portable
mkdir -p "$BUILD"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKDS_NATIVE=OFF -DKDS_CUDA=OFF \
  > "$BUILD/build.log" 2>&1 \
  || { cat "$BUILD/build.log"; echo "[portable] cmake configure failed" >&2; exit 1; }
cmake --build "$BUILD" -j"$(nproc)" >> "$BUILD/build.log" 2>&1 \
  || { tail -n 60 "$BUILD/build.log"; echo "[portable] build failed ($BUILD/build.log)" >&2; exit 1; }

# The tokenizer tests' reference ranks live in the build directory; the
# normal build made them already (scripts/bootstrap.sh).
if [ -d build/tok-ref ] && [ ! -f "$BUILD/tok-ref/o200k_base.tiktoken" ]; then
  cp -r build/tok-ref "$BUILD/"
fi

filter=()
[ -n "${KDS_PORTABLE_FILTER:-}" ] && filter=(--filter "$KDS_PORTABLE_FILTER")
start=$(date +%s)
rc=0
"./$BUILD/kdaserve_tests" --jobs "$(nproc)" "${filter[@]}" "$@" > "$BUILD/test.log" 2>&1 || rc=$?
secs=$(( $(date +%s) - start ))
synth=$(grep -a "Synthesis:" "$BUILD/test.log" | tail -1 | sed 's/.*Synthesis: *//')
if [ "$rc" -ne 0 ]; then
  echo "[portable] FAILED in ${secs}s: ${synth:-no Synthesis line}" >&2
  grep -a -E "^\[(FAIL|----)\]" "$BUILD/test.log" | head -40 >&2
  echo "[portable] full log: $BUILD/test.log" >&2
  exit 1
fi
echo "[portable] generic x86-64 suite in ${secs}s: $synth"
