#!/usr/bin/env bash
# test.sh - set up (install + build) and run the whole test suite.
# Criterion prints its closing "Synthesis" line; the exit status is non-zero
# when any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# Tests that need a GPU skip themselves when none is present.
exec ./build/kdaserve_tests --jobs "$(nproc)" "$@"
