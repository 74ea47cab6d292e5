#!/usr/bin/env bash
# sanitize.sh - build the whole test suite once more with AddressSanitizer
# and UBSan (clang, -DKDS_SANITIZE=ON: UBSan halts at its first report) into
# ./build-asan, CPU only, and run it (docs/testing.md).
#
#   scripts/sanitize.sh [Criterion options...]
#
# The suite's output goes to build-asan/test.log; one summary line is
# printed (not Criterion's own "Synthesis" line, so that the normal run's
# stays the one CI reads). Exit status non-zero when a test fails, or when
# the log holds a sanitizer report that did not fail a test (LeakSanitizer
# reports never do: ../shared/reference/libs.md §4.7).
#
# CUDA is off here: nvcc's objects are not instrumented and the GPU tests
# skip themselves without a device anyway. Environment: CC (default
# clang-14), KDS_SANITIZE_FILTER (a Criterion --filter; default: all).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build-asan
CC_SAN=${CC:-clang-14}
command -v "$CC_SAN" >/dev/null 2>&1 || { echo "[sanitize] $CC_SAN not found" >&2; exit 1; }
. scripts/suite_build.sh
CC="$CC_SAN" suite_build "$BUILD" sanitize -DKDS_SANITIZE=ON -DKDS_CUDA=OFF

for s in /usr/lib/llvm-14/bin/llvm-symbolizer /usr/bin/llvm-symbolizer; do
  if [ -x "$s" ]; then export ASAN_SYMBOLIZER_PATH="$s"; break; fi
done
# allocator_may_return_null: the tests that ask for absurd sizes check for
# KDS_NOMEM, which ASan would otherwise turn into an abort.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$PWD/tests/lsan.supp}"

filter=()
[ -n "${KDS_SANITIZE_FILTER:-}" ] && filter=(--filter "$KDS_SANITIZE_FILTER")
start=$(date +%s)
rc=0
"./$BUILD/kdaserve_tests" --jobs "$(nproc)" "${filter[@]}" "$@" > "$BUILD/test.log" 2>&1 || rc=$?
secs=$(( $(date +%s) - start ))
synth=$(grep -a "Synthesis:" "$BUILD/test.log" | tail -1 | sed 's/.*Synthesis: *//')
reports=$(grep -a -c -E "ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:" "$BUILD/test.log" || true)
if [ "$rc" -ne 0 ] || [ "$reports" -ne 0 ]; then
  echo "[sanitize] FAILED in ${secs}s: ${synth:-no Synthesis line}; $reports sanitizer report(s)" >&2
  grep -a -E "^\[(FAIL|----)\]|ERROR: (Address|Leak)Sanitizer|runtime error:|SUMMARY:" \
    "$BUILD/test.log" | head -40 >&2
  echo "[sanitize] full log: $BUILD/test.log" >&2
  exit 1
fi
echo "[sanitize] ASan+UBSan suite in ${secs}s: $synth"
