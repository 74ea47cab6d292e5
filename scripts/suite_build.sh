# suite_build.sh - sourced by sanitize.sh and portable.sh: build the test
# suite again into another build directory.
#
#   suite_build DIR LABEL [cmake options...]
#
# Configures DIR (Release, the given options) and builds it, output in
# DIR/build.log (shown, with "[LABEL] ... failed", when a step fails: then
# it exits). Copies the tokenizer tests' reference ranks, which live in the
# build directory, from the normal build (scripts/bootstrap.sh made them).
suite_build() {
  local dir=$1 label=$2
  shift 2
  mkdir -p "$dir"
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" > "$dir/build.log" 2>&1 \
    || { cat "$dir/build.log"; echo "[$label] cmake configure failed" >&2; exit 1; }
  cmake --build "$dir" -j"$(nproc)" >> "$dir/build.log" 2>&1 \
    || { tail -n 60 "$dir/build.log"; echo "[$label] build failed ($dir/build.log)" >&2; exit 1; }
  if [ -d build/tok-ref ] && [ ! -f "$dir/tok-ref/o200k_base.tiktoken" ]; then
    cp -r build/tok-ref "$dir/"
  fi
}
