#!/usr/bin/env bash
# fuzz.sh - build the libFuzzer targets of tests/fuzz (clang, ASan + UBSan)
# into ./build-fuzz and run them (docs/testing.md).
#
#   scripts/fuzz.sh                 every target: its regression inputs, then
#                                   a fixed number of fuzzing runs from its
#                                   corpus with a fixed seed, so that one tree
#                                   always gives one result; what CI runs
#   scripts/fuzz.sh explore         every target: regression inputs, then
#                                   KDS_FUZZ_SECONDS (default 60) of fuzzing
#                                   with a random seed, to find what CI's
#                                   fixed runs do not reach
#   scripts/fuzz.sh run TARGET [libFuzzer options...]
#                                   fuzz one target until stopped (or as the
#                                   options say), e.g. -max_total_time=300
#   scripts/fuzz.sh seeds           rewrite tests/fuzz/corpus and regress from
#                                   the real files (fuzz_seeds)
#   scripts/fuzz.sh build           only build
#
# Environment: KDS_FUZZ_SECONDS (explore), KDS_FUZZ_RUNS_SCALE (ci: the fixed
# runs of each target are multiplied by it; default 1), KDS_FUZZ_SEED (ci;
# default 1), KDS_FUZZ_TARGETS (space-separated subset),
# CC (default clang-14), KDS_FUZZ_TMPDIR (the targets' scratch files;
# default /dev/shm when writable). Findings are written to build-fuzz/artifacts/TARGET/
# (crash-*, leak-*, timeout-*, oom-*); reproduce one with
#   ./build-fuzz/tests/fuzz/fuzz_TARGET FILE
# Exit status: non-zero when a regression input fails, a fuzz run finds
# something, or the build fails. Inputs of known open bugs (known-open.txt)
# are run and reported but do not fail the run.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build-fuzz
FUZZ_DIR=tests/fuzz
ALL_TARGETS="safetensors config model tokenizer state snapshot web_codec auth http_api"
TARGETS=${KDS_FUZZ_TARGETS:-$ALL_TARGETS}
SECONDS_EACH=${KDS_FUZZ_SECONDS:-60}
RUNS_SCALE=${KDS_FUZZ_RUNS_SCALE:-1}
CI_SEED=${KDS_FUZZ_SEED:-1}

# CI's runs per target: about 15 s each on a 2-core machine of CI's kind
# (docs/testing.md). A fixed seed and count from the committed corpus and a
# fresh scratch corpus make the pass follow nearly the same path every run
# (coverage that depends on timing or addresses can still move it), so a
# finding belongs to the commit that brought it, not to a lucky run.
ci_runs() {
  local n
  case $1 in
    safetensors) n=150000 ;;
    config) n=20000 ;;
    model) n=20000 ;;
    tokenizer) n=80000 ;;
    state) n=60000 ;;
    snapshot) n=20000 ;;
    web_codec) n=1200000 ;;
    auth) n=600000 ;;
    http_api) n=300000 ;;
    *) n=20000 ;;
  esac
  echo $((n * RUNS_SCALE))
}
CC_FUZZ=${CC:-clang-14}

# Stack traces with file:line when llvm-symbolizer is installed (llvm-14).
for s in /usr/lib/llvm-14/bin/llvm-symbolizer /usr/bin/llvm-symbolizer; do
  if [ -x "$s" ]; then export ASAN_SYMBOLIZER_PATH="$s"; break; fi
done
# Leaks are findings; an allocation libFuzzer's limit refuses is one too
# (a parser must cap sizes before it allocates).
# allocator_may_return_null: an allocation that fails must take the code's
# KDS_NOMEM path (which the targets then exercise), not abort.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

# The targets write every input out as files (and the snapshot target syncs
# an export file per run): on a tmpfs that costs no disk I/O.
use_tmpfs() {
  local d=${KDS_FUZZ_TMPDIR:-/dev/shm}
  if [ -d "$d" ] && [ -w "$d" ]; then export TMPDIR="$d"; fi
}

build() {
  if ! command -v "$CC_FUZZ" >/dev/null 2>&1; then
    echo "[fuzz] $CC_FUZZ not found (Debian 12: apt install clang-14 libclang-rt-14-dev)" >&2
    return 1
  fi
  mkdir -p "$BUILD"
  # two `run`s started together (one per core) build one after the other
  exec 9> "$BUILD/.build.lock"
  flock 9
  CC="$CC_FUZZ" cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKDS_FUZZ=ON -DKDS_TESTS=OFF \
    > "$BUILD/build.log" 2>&1 \
    || { cat "$BUILD/build.log"; echo "[fuzz] cmake configure failed" >&2; return 1; }
  cmake --build "$BUILD" -j"$(nproc)" --target fuzz_all >> "$BUILD/build.log" 2>&1 \
    || { tail -n 60 "$BUILD/build.log"; echo "[fuzz] build failed ($BUILD/build.log)" >&2; return 1; }
  flock -u 9
  exec 9>&-
}

# Ids of known open bugs: the first word of each line of known-open.txt.
known_ids() {
  [ -f "$FUZZ_DIR/known-open.txt" ] || return 0
  sed -e 's/#.*//' "$FUZZ_DIR/known-open.txt" | awk 'NF {print $1}' | paste -sd, -
}

# libFuzzer options every run gets. -rss_limit_mb also caps single
# allocations (malloc_limit_mb defaults to it): 2 GiB is far above anything
# a nano model or a seed-sized input needs.
common_opts() {
  local t=$1
  local opts=(-timeout=10 -rss_limit_mb=2048 -print_final_stats=1
              "-artifact_prefix=$BUILD/artifacts/$t/")
  case $t in
    config|model) opts+=("-dict=$FUZZ_DIR/dict/config.dict") ;;
    # A fixed part's position claims MLA rows that are address space until
    # they are loaded (eng_seq_load_fixed): allocations up to ASan's 1 TiB
    # are not findings here; resident memory is still capped.
    state) opts+=(-malloc_limit_mb=1048576) ;;
  esac
  printf '%s\n' "${opts[@]}"
}

# The regression inputs of one target: each must pass, except those named
# after a known open bug, which are reported either way.
run_regress() {
  local t=$1 bin=$BUILD/tests/fuzz/fuzz_$t dir=$FUZZ_DIR/regress/$t rc=0 f id
  [ -d "$dir" ] || return 0
  mkdir -p "$BUILD/artifacts/$t"
  for f in "$dir"/*; do
    [ -f "$f" ] || continue
    id=""
    for k in ${KNOWN//,/ }; do
      case $(basename "$f") in "$k"*) id=$k ;; esac
    done
    if env -u KDS_FUZZ_KNOWN "$bin" $(common_opts "$t") "$f" > "$BUILD/artifacts/$t/regress.log" 2>&1; then
      if [ -n "$id" ]; then
        echo "[fuzz] $t: $(basename "$f") passes now: remove '$id' from $FUZZ_DIR/known-open.txt"
      fi
    elif [ -n "$id" ]; then
      echo "[fuzz] $t: $(basename "$f") still fails (known open: $id)"
    else
      echo "[fuzz] $t: regression input $(basename "$f") FAILS:" >&2
      grep -E "ERROR|runtime error|property violated|SUMMARY" "$BUILD/artifacts/$t/regress.log" | head -5 >&2
      rc=1
    fi
  done
  return $rc
}

# A bounded fuzz run from the committed corpus (new inputs go to a scratch
# corpus under build-fuzz, never into the tree). mode: ci (fixed seed and
# runs, a fresh scratch corpus; a time cap only against a hang) or explore
# (random seed, KDS_FUZZ_SECONDS, the scratch corpus kept between runs).
run_fuzz() {
  local t=$1 mode=$2 bin=$BUILD/tests/fuzz/fuzz_$t log=$BUILD/artifacts/$t/fuzz.log
  local scratch=$BUILD/corpus/$t bound
  if [ "$mode" = ci ]; then
    scratch=$BUILD/corpus-ci/$t
    rm -rf "$scratch"
    bound=(-seed="$CI_SEED" -runs="$(ci_runs "$t")" -max_total_time=300)
  else
    bound=(-max_total_time="$SECONDS_EACH")
  fi
  mkdir -p "$BUILD/artifacts/$t" "$scratch"
  local t0=$SECONDS
  if KDS_FUZZ_KNOWN="$KNOWN" "$bin" $(common_opts "$t") "${bound[@]}" \
       "$scratch" "$FUZZ_DIR/corpus/$t" > "$log" 2>&1; then
    local execs cov
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1)
    echo "[fuzz] $t: $((SECONDS - t0))s, ${execs:-?} runs, $cov: nothing found"
  else
    echo "[fuzz] $t: FINDING (log: $log, input: $BUILD/artifacts/$t/):" >&2
    grep -E "ERROR|runtime error|property violated|SUMMARY|Test unit written" "$log" | head -8 >&2
    return 1
  fi
}

cmd=${1:-ci}
case $cmd in
  build) build ;;
  seeds)
    build
    rm -rf "$FUZZ_DIR/corpus" "$FUZZ_DIR/regress"
    "$BUILD/tests/fuzz/fuzz_seeds" "$PWD" "$PWD/$FUZZ_DIR"
    ;;
  run)
    t=${2:?usage: scripts/fuzz.sh run TARGET [libFuzzer options...]}
    shift 2
    build
    use_tmpfs
    KNOWN=$(known_ids)
    mkdir -p "$BUILD/artifacts/$t" "$BUILD/corpus/$t"
    exec env KDS_FUZZ_KNOWN="$KNOWN" "$BUILD/tests/fuzz/fuzz_$t" $(common_opts "$t") "$@" \
      "$BUILD/corpus/$t" "$FUZZ_DIR/corpus/$t"
    ;;
  ci|explore)
    build
    use_tmpfs
    KNOWN=$(known_ids)
    [ -n "$KNOWN" ] && echo "[fuzz] known open bugs (tests/fuzz/known-open.txt): $KNOWN"
    [ "$cmd" = ci ] && echo "[fuzz] fixed runs, seed $CI_SEED (scripts/fuzz.sh explore fuzzes at random)"
    status=0
    for t in $TARGETS; do
      run_regress "$t" || status=1
      run_fuzz "$t" "$cmd" || status=1
    done
    exit $status
    ;;
  *) echo "usage: scripts/fuzz.sh [ci|explore|run TARGET [opts...]|seeds|build]" >&2; exit 2 ;;
esac
