#!/usr/bin/env bash
# bench_vs.sh - kdaserve and llama.cpp side by side on the same weights.
#
# Writes the model's GGUF with `kdaserve export-gguf` when it is missing,
# then runs `kdaserve bench` and llama.cpp's `llama-bench` in turn for N
# rounds (the order alternates, so neither always runs on a warmer or a
# quieter machine), takes each engine's best of R repeats in every round,
# and prints prefill and decode tokens/s with the ratio kdaserve /
# llama.cpp: medians over the rounds, and the load average. On a shared
# machine only the ratios of one run mean anything (docs/benchmarks.md).
#
# kdaserve's decode is also given as a share of the machine's memory read
# bandwidth (issue 18's second target): the bytes a token reads at the
# decode's speed against a plain streaming read in the same kdaserve run,
# each decode run between two reads when a token's bytes pass the
# last-level cache (`kdaserve bench --help`). --no-read leaves it out.
#
# kdaserve's prefill is measured twice a round: exact (its default: f32
# sums of the stored bf16 weights) and with --bf16, which rounds a
# prefill's activations to bf16 as llama.cpp's bf16 path does (equal
# precision; ~3e-3 relative error per product). Decode is exact in both.
# A build without bf16 dot products (no AVX-512 BF16) would run --bf16
# exactly, so there the second run is left out and a line says why.
#
# Both engines decode after the prompt: kdaserve's decode follows its
# prefill, and llama.cpp's tg test runs at depth P (llama-bench -d P, which
# fills the context first, untimed). Without it llama-bench decodes from an
# empty context, which at long prompts is another, cheaper measurement.
# --no-depth gives llama-bench builds from before -d (2025) the old way.
#
# --seqs N,N,... adds issue 18's third target, which is kdaserve's own:
# after the rounds, `kdaserve bench --seqs` (N sequences decoding together
# against one after another, 64-token prompts), exact and with --bf16, and
# prints each N's aggregate tokens/s and its ratio to one at a time.
#
# It does not build llama.cpp: give it a llama-bench that is already built
# (or a llama-cli, beside which llama-bench is looked for). The project's
# tests do not use this script.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/bench_vs.sh --llama-bench PATH --model DIR [--gguf FILE] [--rounds N]
                           [--threads T] [--prompt P] [--gen G] [--repeats R]
                           [--kdaserve PATH] [--kdaserve-args "ARGS"] [--llama-args "ARGS"]
                           [--no-bf16] [--no-depth] [--no-read] [--seqs N,N,...]

  --llama-bench PATH  llama.cpp's llama-bench (or llama-cli: llama-bench beside it)
  --model DIR         the kdaserve model directory (safetensors)
  --gguf FILE         its GGUF (default DIR.gguf beside the directory; written
                      with `kdaserve export-gguf` when missing)
  --rounds N          alternating rounds (default 4)
  --threads T         threads for both engines (default: nproc)
  --prompt P          prefill tokens (default 512)
  --gen G             decode tokens (default 128)
  --repeats R         repeats per engine per round, best taken (default 3)
  --kdaserve PATH     the kdaserve binary (default: build/kdaserve of this tree,
                      else kdaserve on PATH)
  --kdaserve-args ARGS  more kdaserve bench options for both of its runs
  --no-bf16           leave out kdaserve's --bf16 prefill run (left out anyway
                      where the build has no bf16 dot products: it would be exact)
  --llama-args ARGS   more llama-bench options, e.g. "-fa 0"
  --no-depth          llama.cpp decodes from an empty context, not at depth P
                      (for llama-bench builds without -d)
  --no-read           leave out kdaserve's streaming read of the memory (the
                      "decode % of read" column)
  --seqs N,N,...      then kdaserve's batched decode: N sequences together
                      against one after another (kdaserve bench --seqs, 64-token
                      prompts, --gen tokens each), exact and with --bf16; the
                      sequences one after another take N times a lone decode,
                      so large N take minutes on big models
EOF
}

die() {
    echo "bench_vs.sh: $*" >&2
    exit 1
}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
llama="" model="" gguf="" rounds=4 threads="" prompt=512 gen=128 repeats=3 kds="" largs="" kargs=""
nobf16=0 nodepth=0 noread=0 seqs=""
while [[ $# -gt 0 ]]; do
    case "$1" in
    --llama-bench) llama=${2:-}; shift 2 ;;
    --model) model=${2:-}; shift 2 ;;
    --gguf) gguf=${2:-}; shift 2 ;;
    --rounds) rounds=${2:-}; shift 2 ;;
    --threads) threads=${2:-}; shift 2 ;;
    --prompt) prompt=${2:-}; shift 2 ;;
    --gen) gen=${2:-}; shift 2 ;;
    --repeats) repeats=${2:-}; shift 2 ;;
    --kdaserve) kds=${2:-}; shift 2 ;;
    --llama-args) largs=${2:-}; shift 2 ;;
    --kdaserve-args) kargs=${2:-}; shift 2 ;;
    --no-bf16) nobf16=1; shift ;;
    --no-depth) nodepth=1; shift ;;
    --no-read) noread=1; shift ;;
    --seqs) seqs=${2:-}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument '$1'" ;;
    esac
done
[[ -n $llama ]] || { usage >&2; die "--llama-bench PATH is required"; }
[[ -n $model ]] || { usage >&2; die "--model DIR is required"; }
[[ -d $model && -f $model/config.json ]] || die "--model $model is not a model directory (no config.json)"
for v in rounds prompt gen repeats; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "--$v wants a positive whole number, got '${!v}'"
done
[[ -z $seqs || $seqs =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
    die "--seqs wants counts like 8,16,32,64, got '$seqs'"
threads=${threads:-$(nproc)}
[[ $threads =~ ^[1-9][0-9]*$ ]] || die "--threads wants a positive whole number, got '$threads'"

# llama-bench, or the llama-bench beside a llama-cli
[[ -x $llama ]] || die "--llama-bench $llama is not an executable file"
if [[ $(basename "$llama") != llama-bench* ]]; then
    beside=$(dirname "$llama")/llama-bench
    [[ -x $beside ]] || die "$llama is not llama-bench and there is no llama-bench beside it"
    llama=$beside
fi
if [[ -z $kds ]]; then
    if [[ -x $here/../build/kdaserve ]]; then kds=$here/../build/kdaserve; else kds=$(command -v kdaserve || true); fi
fi
[[ -n $kds && -x $kds ]] || die "no kdaserve binary (build it, or give --kdaserve PATH)"

model=${model%/}
gguf=${gguf:-$model.gguf}
if [[ ! -s $gguf ]]; then
    echo "writing $gguf with kdaserve export-gguf" >&2
    "$kds" export-gguf --model "$model" --out "$gguf" || die "export-gguf failed"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Without bf16 dot products (no AVX-512 BF16: a Zen 3, a portable build)
# kdaserve's --bf16 multiplies exactly, so its run would only repeat the
# exact one: leave it out, as --no-bf16 does, and say why. The build says
# so on its `device` line; a generated tiny model (9 MB) asks it in a moment.
bf16_note=""
if ((!nobf16)) && "$kds" gen-model --preset tiny --out "$tmp/probe" >/dev/null 2>&1 &&
    "$kds" bench --model "$tmp/probe" --threads 1 --prompt-tokens 1 --gen-tokens 1 --repeats 1 \
        --bandwidth-mib 0 --bf16 2>/dev/null | grep -q '^device.*no bf16 dot products'; then
    nobf16=1
    bf16_note="kdaserve's --bf16 left out: this build has no bf16 dot products, so it would multiply exactly"
fi

# kdaserve bench: the best prefill and decode tokens/s of R repeats, and
# the decode as a percentage of the memory read of the same run (the median
# of each decode run against the reads beside and inside it when kdaserve
# makes them, else the best run against its one read; - without a read);
# extra options in $1 (--bf16 runs the prefill only, without the read:
# decode is exact either way)
run_kds() {
    local extra=${1:-} g=$gen bw=""
    [[ -n $extra ]] && g=0
    { [[ -n $extra ]] || ((noread)); } && bw="--bandwidth-mib 0"
    # shellcheck disable=SC2086
    "$kds" bench --model "$model" --threads "$threads" --prompt-tokens "$prompt" \
        --gen-tokens "$g" --repeats "$repeats" $bw $kargs $extra >"$tmp/kds.out" \
        2>"$tmp/kds.err" ||
        { cat "$tmp/kds.err" >&2; die "kdaserve bench failed"; }
    awk '$1 == "prefill" {p = $2} $1 == "decode" {d = $2}
        /-> decode at [0-9.]+% of it/ { s = $0; sub(/.*-> decode at /, "", s); sub(/%.*/, "", s); one = s }
        /reads beside and inside it:/ { s = $0; sub(/.*inside it: /, "", s); sub(/%.*/, "", s); pair = s }
        /a prefill token multiply-adds/ { s = $0; sub(/.*multiply-adds /, "", s); sub(/ M.*/, "", s); madds = s }
        /f32 FMA peak on/ { s = $0; sub(/.*this run: /, "", s); sub(/ GFLOP.*/, "", s); peak = s }
        END {
        if (p == "" || d == "") exit 1
        print p, d, pair != "" ? pair : one != "" ? one : "-", madds != "" ? madds : "-",
            peak != "" ? peak : "-" }' "$tmp/kds.out" ||
        die "cannot read kdaserve bench's output: $(cat "$tmp/kds.out")"
}

# llama-bench: pp and tg tests (jsonl), the best of each test's samples; tg
# at depth P (after a prompt of P tokens, as kdaserve's decode) unless
# --no-depth
run_llama() {
    if ((nodepth)); then
        # shellcheck disable=SC2086
        "$llama" -m "$gguf" -t "$threads" -p "$prompt" -n "$gen" -r "$repeats" -o jsonl $largs \
            >"$tmp/llama.out" 2>"$tmp/llama.err" ||
            { tail -20 "$tmp/llama.err" >&2; die "llama-bench failed"; }
    else
        # shellcheck disable=SC2086
        "$llama" -m "$gguf" -t "$threads" -p "$prompt" -n 0 -r "$repeats" -o jsonl $largs \
            >"$tmp/llama.out" 2>"$tmp/llama.err" ||
            { tail -20 "$tmp/llama.err" >&2; die "llama-bench failed"; }
        # shellcheck disable=SC2086
        "$llama" -m "$gguf" -t "$threads" -p 0 -n "$gen" -d "$prompt" -r "$repeats" -o jsonl \
            $largs >>"$tmp/llama.out" 2>"$tmp/llama.err" ||
            { tail -20 "$tmp/llama.err" >&2
              die "llama-bench -d failed (a build from before -d? try --no-depth)"; }
    fi
    awk '
        function best(line,   s, n, i, a, b) {
            s = line; sub(/.*"samples_ts": *\[/, "", s); sub(/\].*/, "", s)
            n = split(s, a, ","); b = 0
            for (i = 1; i <= n; i++) if (a[i] + 0 > b) b = a[i] + 0
            return b
        }
        function field(line, name,   s) {
            s = line; if (!sub(".*\"" name "\": *", "", s)) return -1; sub(/[,}].*/, "", s)
            return s + 0
        }
        /samples_ts/ {
            if (field($0, "n_prompt") > 0 && field($0, "n_gen") == 0) p = best($0)
            if (field($0, "n_gen") > 0 && field($0, "n_prompt") == 0) d = best($0)
        }
        END { if (p == "" || d == "") exit 1; print p, d }' "$tmp/llama.out" ||
        die "cannot read llama-bench's output: $(head -c 400 "$tmp/llama.out")"
}

loadavg() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || uptime; }

median() { sort -g | awk '{v[NR] = $1} END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "kdaserve:  $kds"
echo "llama.cpp: $llama"
echo "model:     $model"
echo "gguf:      $gguf"
echo "threads $threads, prompt $prompt, gen $gen, best of $repeats per round, $rounds rounds"
echo "kdaserve bench options: ${kargs:-(none)}; llama-bench options: ${largs:-(none)}"
((nobf16)) || echo "kdaserve's prefill: exact, and with --bf16 (llama.cpp's precision)"
[[ -z $bf16_note ]] || echo "$bf16_note"
if ((nodepth)); then
    echo "decode: kdaserve after the prompt, llama.cpp from an empty context (--no-depth)"
else
    echo "decode: both after the prompt (llama-bench -d $prompt)"
fi
echo "load average at start: $(loadavg)"
echo
printf '%-6s %-10s %12s %12s %13s %12s %12s %9s %9s %9s %9s  %s\n' round first "kds prefill" \
    "kds bf16 pf" "llama prefill" "kds decode" "llama decode" "prefill x" "bf16 pf x" "decode x" \
    "kds read%" "load"
: >"$tmp/rounds"
for ((r = 1; r <= rounds; r++)); do
    bres="0 0"
    if ((r % 2)); then
        first=kdaserve
        kres=$(run_kds)
        ((nobf16)) || bres=$(run_kds --bf16)
        lres=$(run_llama)
    else
        first=llama.cpp
        lres=$(run_llama)
        kres=$(run_kds)
        ((nobf16)) || bres=$(run_kds --bf16)
    fi
    read -r kp kd kr km kpk <<<"$kres"
    read -r bp _ <<<"$bres"
    read -r lp ld <<<"$lres"
    rp=$(awk -v a="$kp" -v b="$lp" 'BEGIN { printf "%.3f", a / b }')
    rb=$(awk -v a="$bp" -v b="$lp" 'BEGIN { printf "%.3f", a / b }')
    rd=$(awk -v a="$kd" -v b="$ld" 'BEGIN { printf "%.3f", a / b }')
    # each engine's prefill as a share of the f32 FMA peak of kdaserve's
    # exact run: the products' multiply-adds a token (kdaserve's count,
    # the same weights for both) at each engine's tokens/s
    if [[ $km == - || $kpk == - ]]; then kf=-; lf=-; else
        kf=$(awk -v t="$kp" -v m="$km" -v g="$kpk" 'BEGIN { printf "%.1f", 100 * t * m * 2e-3 / g }')
        lf=$(awk -v t="$lp" -v m="$km" -v g="$kpk" 'BEGIN { printf "%.1f", 100 * t * m * 2e-3 / g }')
    fi
    echo "$kp $lp $kd $ld $rp $rd $bp $rb $kr $kf $lf" >>"$tmp/rounds"
    # without the --bf16 run its two columns say so, not 0.0
    if ((nobf16)); then bcol=-; bx=-; else bcol=$(printf '%.1f' "$bp"); bx=${rb}x; fi
    if [[ $kr == - ]]; then kcol=-; else kcol=$kr%; fi
    printf '%-6s %-10s %12.1f %12s %13.1f %12.2f %12.2f %8sx %9s %8sx %9s  %s\n' "$r" "$first" \
        "$kp" "$bcol" "$lp" "$kd" "$ld" "$rp" "$bx" "$rd" "$kcol" "$(loadavg)"
done

col() { awk -v c="$1" '{print $c}' "$tmp/rounds" | median; }
echo
echo "medians over $rounds rounds (each round: best of $repeats per engine):"
echo
echo "| | kdaserve tok/s | llama.cpp tok/s | kdaserve / llama.cpp |"
echo "|---|---|---|---|"
printf '| prefill, %s tokens (kdaserve exact) | %.1f | %.1f | %.2fx |\n' "$prompt" "$(col 1)" \
    "$(col 2)" "$(col 5)"
((nobf16)) || printf '| prefill, %s tokens (kdaserve --bf16: llama.cpp'"'"'s precision) | %.1f | %.1f | %.2fx |\n' \
    "$prompt" "$(col 7)" "$(col 2)" "$(col 8)"
printf '| decode, %s tokens after the prompt | %.2f | %.2f | %.2fx |\n' "$gen" "$(col 3)" "$(col 4)" \
    "$(col 6)"
if awk '$9 == "-" {bad = 1} END {exit bad}' "$tmp/rounds"; then
    echo
    printf 'kdaserve decode against the memory read of its own run: %.0f%% (median over the rounds; %s-%s%%)\n' \
        "$(col 9)" "$(awk '{print $9}' "$tmp/rounds" | sort -g | head -1)" \
        "$(awk '{print $9}' "$tmp/rounds" | sort -g | tail -1)"
fi

if awk '$10 == "-" {bad = 1} END {exit bad}' "$tmp/rounds"; then
    echo
    printf 'prefill against the f32 FMA peak measured in kdaserve'"'"'s run (the products'"'"' multiply-adds\n'
    printf 'a token at each engine'"'"'s speed; medians): kdaserve exact %.0f%%, llama.cpp %.0f%%\n' \
        "$(col 10)" "$(col 11)"
fi

# kdaserve bench --seqs: "N=8  together 66.4 (66.4)  one after another
# 18.3 (18.3)  x3.64" -> "8 66.4 18.3 3.64", one line per N
run_seqs() {
    local extra=${1:-}
    # shellcheck disable=SC2086
    "$kds" bench --model "$model" --threads "$threads" --prompt-tokens 64 --gen-tokens "$gen" \
        --repeats 1 --seqs "$seqs" --bandwidth-mib 0 $kargs $extra >"$tmp/seqs.out" \
        2>"$tmp/seqs.err" ||
        { cat "$tmp/seqs.err" >&2; die "kdaserve bench --seqs failed"; }
    awk '$1 ~ /^N=[0-9]+$/ && $2 == "together" {
            n = substr($1, 3); one = ""
            for (i = 3; i < NF; i++) if ($i == "another") one = $(i + 1)
            r = $NF; sub(/^x/, "", r)
            print n, $3, one, r; found = 1
        }
        END { exit !found }' "$tmp/seqs.out" ||
        die "cannot read kdaserve bench --seqs's output: $(cat "$tmp/seqs.out")"
}

if [[ -n $seqs ]]; then
    echo
    echo "kdaserve batched decode (bench --seqs $seqs: 64-token prompts, $gen tokens each;"
    echo "aggregate tokens/s of N sequences together, one after another, and the ratio):"
    run_seqs >"$tmp/seqs.exact"
    ((nobf16)) || run_seqs --bf16 >"$tmp/seqs.bf16"
    echo
    if ((nobf16)); then
        echo "| N | exact together | one after another | x |"
        echo "|---|---|---|---|"
        awk '{printf "| %s | %.1f | %.1f | %.2fx |\n", $1, $2, $3, $4}' "$tmp/seqs.exact"
    else
        echo "| N | exact together | one after another | x | --bf16 together | one after another | x |"
        echo "|---|---|---|---|---|---|---|"
        paste -d' ' "$tmp/seqs.exact" "$tmp/seqs.bf16" |
            awk '{printf "| %s | %.1f | %.1f | %.2fx | %.1f | %.1f | %.2fx |\n", $1, $2, $3, $4, $6, $7, $8}'
    fi
fi
echo
echo "load average at end: $(loadavg)"
