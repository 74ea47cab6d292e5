#!/usr/bin/env bash
# test.sh - set up (install + build) and run the whole test suite, then the
# same suite built for a generic x86-64 (no AVX-512), under ASan + UBSan,
# and the fuzz targets (docs/testing.md).
# The normal run's output comes first, as always; the other passes
# print one summary line each; Criterion's closing "Synthesis" line of the
# normal run is printed again last, so CI's line reader still ends on it.
# The exit status is non-zero when any test of any pass fails.
#
# KDS_TEST_PASSES (default "suite portable sanitize fuzz") chooses passes; extra
# arguments go to the normal run's kdaserve_tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
PASSES=${KDS_TEST_PASSES:-suite portable sanitize fuzz}
status=0
synth=""
for pass in $PASSES; do
  start=$(date +%s)
  case $pass in
    suite)
      # Tests that need a GPU skip themselves when none is present.
      # stderr (Criterion's report) through tee, stdout untouched
      set +e
      { ./build/kdaserve_tests --jobs "$(nproc)" "$@" 2>&1 1>&3 3>&- \
          | tee build/test-stderr.log 1>&2 3>&-; } 3>&1
      rc=${PIPESTATUS[0]}
      set -e
      [ "$rc" -eq 0 ] || status=1
      synth=$(grep -a "Synthesis:" build/test-stderr.log | tail -1 || true)
      ;;
    portable) scripts/portable.sh || status=1 ;;
    sanitize) scripts/sanitize.sh || status=1 ;;
    fuzz) scripts/fuzz.sh ci || status=1 ;;
    *) echo "[test] unknown pass '$pass'" >&2; status=1 ;;
  esac
  echo "[test] pass '$pass': $(( $(date +%s) - start ))s" >&2
done
[ -n "$synth" ] && echo "$synth" >&2
exit $status
