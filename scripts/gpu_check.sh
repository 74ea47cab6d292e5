#!/usr/bin/env bash
# gpu_check.sh - the whole GPU check of the CUDA backend in one run (issue 7):
# the CUDA tests against the CPU references, the golden KDA files on the GPU
# and the CPU, a memory/race check, and the kernel benchmarks, with every
# result written to one output directory.
#
#   bash scripts/gpu_check.sh "$OUT"     # on the GPU machine; OUT: where results go
#   bash scripts/gpu_check.sh --bundle   # on a development machine, beforehand
#   bash scripts/gpu_check.sh --steps restore,profile "$OUT"   # some steps only
#
# Steps, in order: tests, k48 (48B whole-model bench), restore, wide (48B
# widths logits), bench (kernel benchmarks), model (tiny model, GPU and CPU),
# ncu, profile (each kernel of a 48B decode step timed by ncu), sanitizer.
#
# On the GPU machine the binaries come from a prebuilt bundle when there is
# one (.gpu-bundle/, made by --bundle here and carried along: the device
# tool's `carry: [".gpu-bundle"]`), because the GPU machine's image has nvcc
# and CMake but not this project's libraries (Criterion, OpenBLAS, cJSON,
# ...). Without a bundle it builds from source (needs those libraries).
#
# --bundle: configures build-gpu-bundle/ with CUDA for sm_90a only and
# without -march=native (the GPU host's CPU is unknown), builds
# kdaserve_tests, kds_cuda_bench and kdaserve, and packs them with the shared
# libraries they need (glibc and the CUDA driver excepted) and the golden
# KDA files into .gpu-bundle/bundle.tar.xz (~15 MB; the tree plus carried
# paths must stay under the tool's 64 MiB).
#
# Results (at most 8 files, as the device tool returns): gpu_check.log
# (everything), nvidia-smi.txt, tests.log, golden_cpu.log, sanitizer.log,
# ncu.txt (Nsight Compute: speed-of-light, occupancy and launch statistics
# of the prefill and decode kernels), bench.md (the kernel benchmarks, then
# `kdaserve bench --device cuda` and `--device cpu` on a generated tiny
# model: the whole-model GPU pass end to end), summary.txt. The last lines
# printed are the summary and the benchmark tables.
# Exit status: 0 all passed; 1 a test or check failed; 2 no GPU here;
# 3 no binaries (bundle unusable and the build failed).
# Budget: each step has a time limit; the whole check ends within 9 minutes
# (tests 180 s, the 48B whole-model and restore figures <= 200 s, kernel
# benchmarks <= 150 s, then the tiny-model bench, ncu and compute-sanitizer
# as time allows): call `run` with timeout_s 590.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bundle_dir=${KDS_GPU_BUNDLE:-$root/.gpu-bundle}

find_nvcc() {
    local c
    for c in "${CUDACXX:-}" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc 2>/dev/null)" \
        /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
        [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
    done
    return 1
}

cuda_tool() { # the CUDA toolkit's tool $1, on PATH or beside nvcc
    local c n
    c=$(command -v "$1" 2>/dev/null) && { echo "$c"; return 0; }
    n=$(find_nvcc) || return 1
    for c in "$(dirname "$n")/$1" "$(dirname "$n")/../$1/$1" /usr/local/cuda/bin/"$1" \
        /opt/nvidia/nsight-compute/*/"$1"; do
        [ -x "$c" ] && { echo "$c"; return 0; }
    done
    return 1
}

# ---------------------------------------------------------------------------
# --bundle: build here, pack for the GPU machine
# ---------------------------------------------------------------------------
if [ "${1:-}" = "--bundle" ]; then
    set -e
    nvcc=$(find_nvcc) || { echo "gpu_check --bundle: nvcc not found (set CUDA_HOME)" >&2; exit 3; }
    bdir=$root/build-gpu-bundle
    echo "gpu_check --bundle: configuring $bdir with $nvcc (sm_90a, no -march=native)"
    mkdir -p "$bdir"
    CUDACXX=$nvcc cmake -S . -B "$bdir" -DCMAKE_BUILD_TYPE=Release -DKDS_NATIVE=OFF \
        -DCMAKE_CUDA_ARCHITECTURES=90a >"$bdir/configure.log" 2>&1 || true
    grep -q "CUDA kernels ON" "$bdir/configure.log" ||
        { echo "gpu_check --bundle: CMake did not enable CUDA (see $bdir/configure.log)" >&2; exit 3; }
    cmake --build "$bdir" -j"${JOBS:-2}" --target kdaserve_tests kds_cuda_bench kdaserve
    stage=$bdir/stage
    rm -rf "$stage"
    mkdir -p "$stage/bin" "$stage/lib" "$stage/golden"
    cp "$bdir/kdaserve_tests" "$bdir/kds_cuda_bench" "$bdir/kdaserve" "$stage/bin/"
    # every shared library but glibc's own, the C++ runtime (any newer one
    # serves, and the GPU machine's tools need theirs) and the CUDA driver
    # (the GPU machine's must be used)
    ldd "$stage/bin/kdaserve_tests" "$stage/bin/kds_cuda_bench" "$stage/bin/kdaserve" | awk '/=> \//{print $3}' | sort -u |
        while read -r lib; do
            case $(basename "$lib") in
            libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | libresolv.so.* | \
                ld-linux*.so.* | libcuda.so.* | libutil.so.* | libstdc++.so.* | libgcc_s.so.*) ;;
            # cuBLAS is ~600 MB: the GPU machine's CUDA 13 image has its own
            # (toolkit or the nvidia-cublas wheel), found at check time
            libcublas.so.* | libcublasLt.so.*) ;;
            *) cp -L "$lib" "$stage/lib/" ;;
            esac
        done
    golden=${KDA_GOLDEN_DIR:-$root/../shared/golden/kda}
    [ -d "$golden" ] || { echo "gpu_check --bundle: no golden dir $golden" >&2; exit 3; }
    cp -r "$golden" "$stage/golden/kda"
    glibc_need=$(objdump -T "$stage"/bin/* "$stage"/lib/* 2>/dev/null |
        grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n -u | tail -1)
    {
        echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- kernels tests CMakeLists.txt 2>/dev/null || echo ' (+ uncommitted changes)')"
        echo "built $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -n), $(. /etc/os-release; echo "$PRETTY_NAME")"
        echo "nvcc $("$nvcc" --version | grep -o 'release [0-9.]*')"
        echo "needs $glibc_need"
    } >"$stage/MANIFEST"
    mkdir -p "$bundle_dir"
    rm -f "$bundle_dir/bundle.tar.xz"
    tar -C "$stage" -cJf "$bundle_dir/bundle.tar.xz" .
    cp "$stage/MANIFEST" "$bundle_dir/MANIFEST"
    echo "gpu_check --bundle: $(du -h "$bundle_dir/bundle.tar.xz" | cut -f1) in $bundle_dir"
    cat "$bundle_dir/MANIFEST"
    echo "On the GPU machine: bash scripts/gpu_check.sh \"\$OUT\"   (carry: [\".gpu-bundle\"])"
    exit 0
fi

# ---------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------
# --steps a,b,...: only these steps (a second run that repeats one part)
steps=
if [ "${1:-}" = "--steps" ]; then
    steps=${2:-}
    shift 2
fi
want() { [ -z "$steps" ] || [[ ",$steps," == *",$1,"* ]]; }
out=${1:-${OUT:-$root/build-gpu-check/out}}
mkdir -p "$out" || { echo "gpu_check: cannot create $out" >&2; exit 3; }
exec > >(tee "$out/gpu_check.log") 2>&1
t0=$SECONDS
say() { printf '[gpu_check %3ds] %s\n' $((SECONDS - t0)) "$*"; }
summary=()
note() { summary+=("$*"); say "$*"; }
failed=0
finish() {
    {
        echo "gpu_check summary ($((SECONDS - t0)) s, $(date -u '+%Y-%m-%d %H:%M UTC'))"
        printf '  %s\n' "${summary[@]}"
    } >"$out/summary.txt"
    echo
    cat "$out/summary.txt"
    [ -f "$out/bench.md" ] && { echo; grep -E '^\||^Device|^##' "$out/bench.md" | head -60; }
    sleep 0.2 # let tee flush
    exit "$1"
}

say "output in $out"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1 ||
    [ -z "$(nvidia-smi -L 2>/dev/null)" ]; then
    if [ -z "${KDS_GPU_CHECK_FORCE:-}" ]; then
        note "NO GPU: nvidia-smi is missing or lists no device, so there is nothing to check on this machine. Run it on the GPU machine: bash scripts/gpu_check.sh \"\$OUT\" (with .gpu-bundle carried)."
        finish 2
    fi
    note "no GPU, but KDS_GPU_CHECK_FORCE is set: running the steps anyway (GPU tests skip)"
else
    nvidia-smi >"$out/nvidia-smi.txt" 2>&1
    say "$(nvidia-smi -L | head -1)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>/dev/null | sed 's/^/  /'
fi

# Our programs run with BIN_LD as their library path (never exported: the
# bundle's libraries must not replace those of grep, tar, python3 ...): the
# bundle's libraries, then the driver's wherever the image keeps it.
BIN_LD=${LD_LIBRARY_PATH:-}
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    [ -d "$d" ] && ls "$d"/libcuda.so* >/dev/null 2>&1 && BIN_LD="${BIN_LD:+$BIN_LD:}$d"
done
# cuBLAS (not in the bundle): the toolkit's, else the one PyTorch's CUDA 13
# wheels bring (nvidia-cublas)
cublas_dir=
for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib \
    /opt/torch/.venv/lib/python3*/site-packages/nvidia/cublas/lib; do
    ls "$d"/libcublas.so.13* >/dev/null 2>&1 && { cublas_dir=$d; break; }
done
if [ -z "$cublas_dir" ]; then
    f=$(timeout 20 find /usr /opt -name 'libcublas.so.13*' 2>/dev/null | head -1)
    [ -n "$f" ] && cublas_dir=$(dirname "$f")
fi
if [ -n "$cublas_dir" ]; then BIN_LD="${BIN_LD:+$BIN_LD:}$cublas_dir"; else
    echo "(no libcublas.so.13 found on this machine: cuBLAS, opened at the first GEMM context, will not load)"
fi
run_bin() { env LD_LIBRARY_PATH="$BIN_LD" "$@"; }

# ---- binaries: the bundle, else a build here ---------------------------------
BIN=
if [ -f "$bundle_dir/bundle.tar.xz" ]; then
    ub=${TMPDIR:-/tmp}/kds-gpu-bundle
    rm -rf "$ub" && mkdir -p "$ub"
    if tar -C "$ub" -xJf "$bundle_dir/bundle.tar.xz" 2>/dev/null ||
        python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
            "$bundle_dir/bundle.tar.xz" "$ub"; then
        say "bundle: $(tr '\n' ';' <"$ub/MANIFEST")"
        here=$(git rev-parse HEAD 2>/dev/null || true)
        if [ -n "$here" ] && ! grep -q "commit $here" "$ub/MANIFEST"; then
            say "WARNING: the bundle was built from another commit than this tree's ($here)"
        fi
        BIN_LD="$ub/lib${BIN_LD:+:$BIN_LD}"
        if LD_BIND_NOW=1 run_bin "$ub/bin/kds_cuda_bench" --bad-option >/dev/null 2>&1; [ $? -eq 2 ]; then
            BIN=$ub/bin
            export KDA_GOLDEN_DIR=${KDA_GOLDEN_DIR:-$ub/golden/kda}
            note "binaries: prebuilt bundle ($(grep -o 'commit [0-9a-f]\{12\}' "$ub/MANIFEST"))"
        else
            say "the bundle's programs do not load here:"
            LD_BIND_NOW=1 run_bin "$ub/bin/kds_cuda_bench" --bad-option 2>&1 | head -5
            run_bin ldd "$ub/bin/kdaserve_tests" | grep -i "not found" | head
            BIN_LD=${BIN_LD#"$ub/lib"}
            BIN_LD=${BIN_LD#:}
            say "($(ldd --version 2>&1 | head -1); the bundle $(grep needs "$ub/MANIFEST"))"
        fi
    else
        say "cannot unpack $bundle_dir/bundle.tar.xz"
    fi
fi
if [ -z "$BIN" ]; then
    nvcc=$(find_nvcc) || { note "FAIL: no usable bundle and no nvcc to build with"; finish 3; }
    bdir=$root/build-gpu
    say "building in $bdir with $nvcc (sm_90a)"
    mkdir -p "$bdir"
    if CUDACXX=$nvcc timeout 300 cmake -S . -B "$bdir" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_ARCHITECTURES=90a >"$bdir/build.log" 2>&1 &&
        timeout 300 cmake --build "$bdir" -j"$(nproc)" --target kdaserve_tests kds_cuda_bench kdaserve \
            >>"$bdir/build.log" 2>&1; then
        BIN=$bdir
        note "binaries: built here ($((SECONDS - t0)) s)"
    else
        tail -25 "$bdir/build.log"
        note "FAIL: no bundle and the build failed (missing libraries? see above). On a development machine: bash scripts/gpu_check.sh --bundle, then carry .gpu-bundle"
        finish 3
    fi
fi
if [ -z "${KDA_GOLDEN_DIR:-}" ]; then
    for d in "$root/shared/golden/kda" "$root/../shared/golden/kda"; do
        [ -d "$d" ] && { export KDA_GOLDEN_DIR=$d; break; }
    done
fi
say "golden KDA files: ${KDA_GOLDEN_DIR:-none found (the golden tests will fail)}"

# ---- tests -----------------------------------------------------------------------
run_suite() { # name, filter, timeout, log
    local name=$1 filter=$2 limit=$3 log=$4 rc
    say "tests: $name ($filter)"
    timeout "$limit" env LD_LIBRARY_PATH="$BIN_LD" "$BIN/kdaserve_tests" --filter "$filter" \
        --jobs 4 --verbose >>"$log" 2>&1
    rc=$?
    local synth worst
    synth=$(grep 'Synthesis' "$log" | tail -1 | sed 's/.*Synthesis: //')
    # the largest error ratio the suite measured (all of them are in the log)
    worst=$(grep -E '^cuda check|^kda golden' "$log" | grep -o 'max|ref| = [0-9.e+-]*' |
        awk '{print $3}' | sort -g | tail -1)
    [ -n "$worst" ] && say "  largest max err / max|ref| measured: $worst"
    if [ $rc -eq 0 ]; then
        note "PASS $name: $synth"
    else
        failed=1
        grep -E 'FAIL|CRASH|Assertion|Warning!' "$log" | head -20
        note "FAIL $name (exit $rc${synth:+; $synth})"
    fi
}
: >"$out/tests.log"
: >"$out/golden_cpu.log"
: >"$out/bench.md"
if want tests; then
    run_suite "CUDA kernels vs CPU references and golden files" '@(cuda_*/*|genmodel_mem/*)' 180 "$out/tests.log"
    # the whole-model tests again with plain launches instead of CUDA graphs
    KDS_CUDA_GRAPHS=0 run_suite "whole model, graphs off (KDS_CUDA_GRAPHS=0)" 'cuda_model/*' 60 "$out/tests.log"
    run_suite "CPU golden KDA" 'kda_golden/*' 45 "$out/golden_cpu.log"
fi

# ---- Kimi-Linear-48B generated on the GPU (no 98 GB file): whole-model figures ----------
# (kdaserve bench --gen: prefill tokens/s at 4096, decode at B = 1, then at
# B = 64; and the restore of a 48B-sized state from the store onto the GPU)
if [ -x "$BIN/kdaserve" ] && [ $((SECONDS - t0)) -lt 240 ] && { want k48 || want restore; }; then
    k48_fail=0
    k48_specs=()
    want k48 && k48_specs=("--prompt-tokens 4096 --gen-tokens 128 --repeats 2"
        "--prompt-tokens 128 --gen-tokens 32 --repeats 2 --seqs 64"
        "--prompt-tokens 4096 --gen-tokens 16 --repeats 2 --gpu-bf16")
    for spec in "${k48_specs[@]}"; do
        lim=$((420 - (SECONDS - t0)))
        [ $lim -gt 90 ] && lim=90
        [ $lim -lt 30 ] && { say "48B bench: out of time for: $spec"; continue; }
        {
            echo
            echo "## kdaserve bench --gen kimi-linear-48b $spec (H200)"
            echo
            echo '```'
        } >>"$out/bench.md"
        say "48B bench: kdaserve bench --gen kimi-linear-48b $spec (limit $lim s)"
        timeout $lim env LD_LIBRARY_PATH="$BIN_LD" "$BIN/kdaserve" bench --gen kimi-linear-48b \
            --device cuda $spec >"$out/k48.txt" 2>&1 || k48_fail=1
        cat "$out/k48.txt" >>"$out/bench.md"
        echo '```' >>"$out/bench.md"
        say "  $(grep -E '^(prefill|decode) |N=|kdaserve bench:' "$out/k48.txt" | tr -s ' ' | cut -c1-90 | paste -sd';')"
    done
    sdir=${TMPDIR:-/tmp}/kds-gpu-check-state48b
    if want restore && [ $((SECONDS - t0)) -lt 400 ] &&
        timeout 30 env LD_LIBRARY_PATH="$BIN_LD" "$BIN/kdaserve" gen-model --preset state48b \
            --out "$sdir" >/dev/null 2>&1; then
        say "restore onto the GPU: kdaserve snap bench --device cuda (48B-sized state)"
        { echo; echo "## kdaserve snap bench --device cuda (state48b: the 48B's 42.8 MiB state)"; echo; echo '```'; } >>"$out/bench.md"
        timeout 60 env LD_LIBRARY_PATH="$BIN_LD" "$BIN/kdaserve" snap bench --model "$sdir" \
            --device cuda --tokens 1024 --repeats 5 --no-sync >>"$out/bench.md" 2>&1 || k48_fail=1
        echo '```' >>"$out/bench.md"
    fi
    rm -rf "$sdir" "$out/k48.txt"
    if [ $k48_fail -eq 0 ]; then note "48B bench + restore: done (bench.md)"; else
        failed=1
        note "FAIL 48B bench or restore bench (see bench.md)"
    fi
else
    note "48B bench: not run (no kdaserve, or out of time)"
fi

# ---- GPU against CPU logits at the 48B's widths (3.3 GB model written and read) ----
if ! want wide; then :; elif [ $((SECONDS - t0)) -lt 330 ]; then
    KDS_GPU_BIG_TESTS=1 run_suite "48B widths (wide preset), GPU vs CPU logits" 'cuda_model/wide*' 150 "$out/tests.log"
else
    note "48B-widths logits test: not run (out of time)"
fi

# ---- benchmarks ----------------------------------------------------------------------
left=$((470 - (SECONDS - t0)))
[ $left -gt 150 ] && left=150
if ! want bench; then :; elif [ $left -lt 60 ]; then
    note "bench: skipped, only $left s left of the budget"
else
    mode=
    [ $left -lt 150 ] && mode=--quick
    say "bench: $BIN/kds_cuda_bench $mode (limit $left s)"
    # appended: the 48B figures above are in bench.md already
    timeout "$left" env LD_LIBRARY_PATH="$BIN_LD" "$BIN/kds_cuda_bench" $mode >>"$out/bench.md"
    rc=$?
    if [ $rc -eq 0 ]; then note "bench: done (bench.md)"; elif [ $rc -eq 3 ]; then
        note "bench: no usable CUDA device"
    else
        failed=1
        note "FAIL bench: exit $rc (partial results in bench.md)"
    fi
fi
# ---- the whole model on the GPU: kdaserve bench --device cuda on a generated tiny model ----
# (tiny is a correctness run end to end, not a speed figure for real models;
# appended to bench.md; older bundles have no kdaserve and skip this)
if ! want model; then :; elif [ -x "$BIN/kdaserve" ] && [ $((SECONDS - t0)) -lt 440 ]; then
    mdir=${TMPDIR:-/tmp}/kds-gpu-check-tiny
    rm -rf "$mdir"
    say "model bench: kdaserve bench --device cuda / cpu on a generated tiny model"
    if timeout 30 env LD_LIBRARY_PATH="$BIN_LD" "$BIN/kdaserve" gen-model --preset tiny \
        --out "$mdir" >/dev/null 2>&1; then
        mb_fail=0
        for dev in cuda cpu; do
            {
                echo
                echo "## kdaserve bench --device $dev (generated tiny model)"
                echo
                echo '```'
            } >>"$out/bench.md"
            timeout 40 env LD_LIBRARY_PATH="$BIN_LD" "$BIN/kdaserve" bench --model "$mdir" \
                --device $dev --prompt-tokens 256 --gen-tokens 32 --repeats 2 --seqs 8 \
                >"$mdir.txt" 2>&1 || mb_fail=1
            cat "$mdir.txt" >>"$out/bench.md"
            echo '```' >>"$out/bench.md"
            say "  $dev: $(grep -E '^(prefill|decode) |N=' "$mdir.txt" | tr -s ' ' | cut -c1-60 | paste -sd';')"
        done
        if [ $mb_fail -eq 0 ]; then note "model bench: done (bench.md)"; else
            failed=1
            note "FAIL model bench: kdaserve bench exited non-zero (see bench.md)"
        fi
    else
        note "model bench: gen-model failed, not run"
    fi
    rm -rf "$mdir" "$mdir.txt"
else
    note "model bench: not run (no kdaserve in the binaries, or out of time)"
fi

# ---- Nsight Compute: where the prefill's and the decode's time goes --------------------
: >"$out/ncu.txt"
ncu=$(cuda_tool ncu || true)
if ! want ncu; then :; elif [ -n "$ncu" ] && [ -z "${KDS_GPU_CHECK_FORCE:-}" ] && [ $((SECONDS - t0)) -lt 460 ]; then
    say "ncu: one prefill (fp32, tensor cores) at T = 4096 and one decode step at B = 256"
    timeout $((520 - (SECONDS - t0) < 60 ? 520 - (SECONDS - t0) : 60)) "$ncu" --clock-control none --target-processes all \
        --kernel-name regex:'prefill|decode' --launch-count 5 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
        env LD_LIBRARY_PATH="$BIN_LD" "$BIN/kds_cuda_bench" --once 4096 >"$out/ncu.txt" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then note "ncu: done (ncu.txt)"; else note "ncu: exit $rc (see ncu.txt; not a failure)"; fi
else
    note "ncu: not run (not found, no GPU, or out of time)"
fi

# ---- where a 48B decode step's time goes: every kernel of the decode passes, timed by ncu ----
# (graphs off, so each launch is its own; the sum of kernel times per token
# against the bench's ms/token with graphs on is the time between kernels)
if want profile && [ -n "$ncu" ] && [ -x "$BIN/kdaserve" ] && [ -z "${KDS_GPU_CHECK_FORCE:-}" ] &&
    [ $((SECONDS - t0)) -lt 440 ]; then
    csv=${TMPDIR:-/tmp}/kds-decode-profile.csv
    rm -f "$csv"
    say "profile: each kernel of a 48B decode (ncu gpu__time_duration, KDS_CUDA_GRAPHS=0)"
    timeout 150 env KDS_CUDA_GRAPHS=0 "$ncu" --clock-control none --target-processes all \
        --kernel-name "regex:^(?!gen_normal)" --metrics gpu__time_duration.sum --csv --log-file "$csv" \
        env LD_LIBRARY_PATH="$BIN_LD" "$BIN/kdaserve" bench --gen kimi-linear-48b --device cuda \
        --prompt-tokens 16 --gen-tokens 3 --repeats 1 2>&1 | grep -E '^(prefill|decode) ' | sed 's/^/  /'
    {
        echo
        echo "## Where a 48B decode step's time goes (ncu gpu__time_duration, graphs off; kdaserve bench --gen kimi-linear-48b --prompt-tokens 16 --gen-tokens 3 --repeats 1)"
        echo
        python3 - "$csv" <<'PY'
import csv, re, sys
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
         "s": 1e6, "second": 1e6}
rows, header = [], None
with open(sys.argv[1], newline="") as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.reader(lines):
    if header is None:
        header = r
        continue
    d = dict(zip(header, r))
    if d.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = re.sub(r"\(.*", "", d["Kernel Name"]).replace("void ", "")
    rows.append((int(d["ID"]), name, float(d["Metric Value"].replace(",", "")) * scale.get(d["Metric Unit"], 1.0)))
rows.sort()
# forward passes start at the embedding lookup; the decode passes are those
# with a KDA decode step and no prefill kernel (each ends with the next
# token's sampling, the launches before the next embedding)
passes, cur = [], []
for r in rows:
    if r[1].endswith("embed_kernel") and cur:
        passes.append(cur)
        cur = []
    cur.append(r)
passes.append(cur)
dec_passes = [p for p in passes if any("decode_kernel" in n for _, n, _ in p)
              and not any("prefill" in n for _, n, _ in p)]
tokens = len(dec_passes) or 1
dec = [r for p in dec_passes for r in p]
total, per = 0.0, {}
for _, n, us in dec:
    c, t = per.get(n, (0, 0.0))
    per[n] = (c + 1, t + us)
    total += us
print(f"{len(rows)} kernels profiled; {len(dec_passes)} decode passes of {len(passes)} forward passes: "
      f"{len(dec) / tokens:.0f} launches and {total / tokens:.1f} µs of kernel time per token")
print()
print("| kernel | launches / token | µs / token | share | µs / launch |")
print("|---|---|---|---|---|")
for n, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1]):
    print(f"| {n[:70]} | {c / tokens:.0f} | {t / tokens:.1f} | {100 * t / total:.1f}% | {t / c:.2f} |")
PY
    } >>"$out/bench.md" 2>&1
    note "profile: done (bench.md: $(grep -m1 'decode passes of' "$out/bench.md" | cut -c1-120))"
    rm -f "$csv"
fi

# ---- memory and race checks on small cases ----------------------------------------
: >"$out/sanitizer.log"
sanitizer=$(cuda_tool compute-sanitizer || true)
if ! want sanitizer; then :; elif [ -n "$sanitizer" ] && [ -z "${KDS_GPU_CHECK_FORCE:-}" ]; then
    san_fail=0
    san_end=$((SECONDS + 100)) # all sanitizer runs together, and the whole
    [ $san_end -gt $((t0 + 540)) ] && san_end=$((t0 + 540)) # the check ends by 9 min
    for spec in "memcheck cuda_prefill/small_heads" "memcheck cuda_prefill/gva_k64_v32" \
        "memcheck cuda_ops/moe_route_grouped_with_ties" "memcheck cuda_ops/sample_top_p_min_p_penalty" \
        "memcheck cuda_kda/decode_gva_k64_lower_bound" "racecheck cuda_ops/sample_temperature_top_k" \
        "racecheck cuda_prefill/small_heads" "memcheck cuda_ops/rmsnorm_matches_cpu" \
        "racecheck cuda_ops/moe_route_kimi_router" "memcheck cuda_mla/decode_kimi_widths_matches_cpu" \
        "memcheck cuda_gemm/gemv_variants_match_default_bit_for_bit" "memcheck cuda_gen/rows_scatter"; do
        set -- $spec
        lim=$((san_end - SECONDS))
        [ $lim -gt 45 ] && lim=45
        [ $lim -lt 10 ] && { say "compute-sanitizer: out of time, $1 $2 not run"; continue; }
        say "compute-sanitizer --tool $1: $2"
        # the tool itself runs with the machine's libraries; only our
        # program gets the bundle's
        timeout $lim "$sanitizer" --tool "$1" --target-processes all --error-exitcode 9 \
            env LD_LIBRARY_PATH="$BIN_LD" "$BIN/kdaserve_tests" --filter "$2" -j1 >>"$out/sanitizer.log" 2>&1
        rc=$?
        if [ $rc -eq 124 ]; then say "  timed out after $lim s (not counted as a failure)"; elif [ $rc -ne 0 ]; then
            san_fail=1
            say "  exit $rc"
        fi
    done
    grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer.log" | sort | uniq -c | sed 's/^/    /'
    if [ $san_fail -eq 0 ]; then note "PASS compute-sanitizer (memcheck, racecheck)"; else
        failed=1
        note "FAIL compute-sanitizer: see sanitizer.log"
    fi
else
    note "compute-sanitizer: not run (not found${KDS_GPU_CHECK_FORCE:+, or no GPU})"
fi

finish $failed
