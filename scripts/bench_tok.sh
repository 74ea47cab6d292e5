#!/usr/bin/env bash
# bench_tok.sh [ROUNDS] [REPEATS] - tokenizer encoding speed, ours against the
# reference (OpenAI tiktoken@1.0.22 from npm, run by node), on the same text
# in the same run: for cl100k_base, o200k_base and the Kimi pattern (over the
# cl100k ranks), ROUNDS rounds alternate ours and the reference, each
# encoding the corpus REPEATS times (median per round); the table shows the
# median over rounds. Single-threaded on both sides. Figures go to
# docs/benchmarks.md ("Tokenizer").
#
# Corpus: fixed files of a Debian 12 install (the bootstrap installs them),
# half English prose (licence texts), half C (library headers), repeated to
# ~4 MB; its size and sha256 are printed so that runs can be compared.
# Timing covers encoding only (both sides load their vocabulary first).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
REPEATS=${2:-5}
OUT=build/tok-bench
mkdir -p "$OUT"

[ -x build/kdaserve ] || { echo "bench_tok: build first (scripts/bootstrap.sh)" >&2; exit 1; }
command -v node >/dev/null || { echo "bench_tok: node is needed (scripts/bootstrap.sh)" >&2; exit 1; }
[ -f tests/node/node_modules/tiktoken/package.json ] || (cd tests/node && npm ci --no-audit --no-fund)
[ -f build/tok-ref/cl100k_base.tiktoken ] && [ -f build/tok-ref/o200k_base.tiktoken ] \
  || node tests/node/build_ranks.js build/tok-ref

files=(/usr/share/common-licenses/GPL-3 /usr/share/common-licenses/LGPL-2.1
       /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/MPL-2.0
       /usr/share/common-licenses/GFDL-1.3 /usr/share/common-licenses/Artistic
       /usr/include/xxhash.h /usr/include/pcre2.h /usr/include/lmdb.h
       /usr/include/cjson/cJSON.h)
corpus=$OUT/corpus.txt
: > "$corpus"
for i in $(seq 8); do cat "${files[@]}" >> "$corpus"; done
echo "corpus: $(wc -c < "$corpus") bytes, sha256 $(sha256sum "$corpus" | cut -c1-16)..."
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')," \
     "node $(node --version), load $(cut -d' ' -f1-3 /proc/loadavg)"

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
field() { sed -E 's/.*"'"$1"'": ?([0-9.]+).*/\1/'; }

printf '\n| tokenizer | kdaserve MB/s | tiktoken@1.0.22 MB/s | ratio | ids equal |\n|---|---|---|---|---|\n'
# ratio: the median over rounds of ours / reference within a round (the two
# ran back to back, so a round's ratio is less exposed to other load)
for enc in cl100k_base o200k_base kimi; do
  case $enc in
    cl100k_base) args=(--vocab build/tok-ref/cl100k_base.tiktoken --pattern cl100k) ;;
    o200k_base)  args=(--vocab build/tok-ref/o200k_base.tiktoken --pattern o200k) ;;
    kimi)        args=(--vocab build/tok-ref/cl100k_base.tiktoken --pattern kimi) ;;
  esac
  : > "$OUT/ours.$enc"; : > "$OUT/ref.$enc"
  for r in $(seq "$ROUNDS"); do
    ./build/kdaserve tokenize "${args[@]}" --bench "$REPEATS" < "$corpus" >> "$OUT/ours.$enc"
    node tests/node/bench.js "$enc" "$corpus" "$REPEATS" >> "$OUT/ref.$enc"
  done
  ours=$(field median_mbps < "$OUT/ours.$enc" | median)
  ref=$(field median_mbps < "$OUT/ref.$enc" | median)
  ratio=$(paste <(field median_mbps < "$OUT/ours.$enc") <(field median_mbps < "$OUT/ref.$enc") \
          | awk '{print $1 / $2}' | median)
  # and the ids themselves, all of them
  case $enc in
    kimi) ref_args=(custom ordinary build/tok-ref/cl100k_base.tiktoken kimi) ;;
    *)    ref_args=("$enc" ordinary) ;;
  esac
  ./build/kdaserve tokenize "${args[@]}" < "$corpus" > "$OUT/ids.ours.$enc"
  base64 -w0 "$corpus" | { cat; echo; } | node tests/node/ref_encode.js "${ref_args[@]}" \
    > "$OUT/ids.ref.$enc"
  same=no
  cmp -s "$OUT/ids.ours.$enc" "$OUT/ids.ref.$enc" && same=yes
  printf '| %s | %.1f | %.2f | %.1fx | %s |\n' "$enc" "$ours" "$ref" "$ratio" "$same"
done
