#!/usr/bin/env bash
# portable.sh - build the whole test suite once more for CPUs without
# AVX-512 and run it (docs/testing.md), CPU only:
#   x86-64     -DKDS_NATIVE=OFF, a generic x86-64 (SSE2): the kernels'
#              scalar paths, into ./build-portable
#   x86-64-v3  AVX2 + FMA + F16C (most laptops, Zen 3 and older built
#              with -march=native): the eight-lane dot products, into
#              ./build-portable-v3
# Both take BLAS from 64 tokens, the scalar block-format loops and BLAS in
# MLA attention, and must keep the same contracts as the AVX-512 build (a
# batched token's bits are its lone decode's); this pass holds them.
#
#   scripts/portable.sh [Criterion options...]
#
# Each suite's output goes to its build directory's test.log; one summary
# line per build is printed (not Criterion's own "Synthesis" line, so that
# the normal run's stays the one CI reads). Exit status non-zero when a
# test fails. Environment: KDS_PORTABLE_ARCHES (default "x86-64 x86-64-v3"),
# KDS_PORTABLE_FILTER (a Criterion --filter; default: all).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/suite_build.sh
filter=()
[ -n "${KDS_PORTABLE_FILTER:-}" ] && filter=(--filter "$KDS_PORTABLE_FILTER")
status=0
for arch in ${KDS_PORTABLE_ARCHES:-x86-64 x86-64-v3}; do
  case $arch in
    x86-64) BUILD=build-portable; flags=() ;;
    x86-64-v3) BUILD=build-portable-v3; flags=(-DCMAKE_C_FLAGS=-march=x86-64-v3) ;;
    *) echo "[portable] unknown arch '$arch' (x86-64, x86-64-v3)" >&2; exit 1 ;;
  esac
  suite_build "$BUILD" "portable $arch" -DKDS_NATIVE=OFF -DKDS_CUDA=OFF "${flags[@]}"

  start=$(date +%s)
  rc=0
  "./$BUILD/kdaserve_tests" --jobs "$(nproc)" "${filter[@]}" "$@" > "$BUILD/test.log" 2>&1 || rc=$?
  secs=$(( $(date +%s) - start ))
  synth=$(grep -a "Synthesis:" "$BUILD/test.log" | tail -1 | sed 's/.*Synthesis: *//')
  if [ "$rc" -ne 0 ]; then
    echo "[portable] $arch: FAILED in ${secs}s: ${synth:-no Synthesis line}" >&2
    grep -a -E "^\[(FAIL|----)\]" "$BUILD/test.log" | head -40 >&2
    echo "[portable] full log: $BUILD/test.log" >&2
    status=1
  else
    echo "[portable] $arch suite in ${secs}s: $synth"
  fi
done
exit $status
