#!/usr/bin/env bash
# build.sh - build the CUDA tests against the CPU emulation of the CUDA
# kernels (README.md beside this file), for machines without a GPU.
#
#   kernels/cuda/emu/build.sh [OUTDIR]        # default: build-emu
#   OUTDIR/emu_tests --filter 'cuda_*/*' -j1  # Criterion, as kdaserve_tests
#
# Every kernels/cuda/*.cu is compiled by g++ as C++ after its launches
# (`kernel<<<grid, block, smem, stream>>>(args);`) are rewritten into
# EMU_LAUNCH(...); the CPU kernels and tests/test_cuda_*.c are compiled as
# in the real build (with KDS_HAVE_CUDA=1), so the very same test code runs
# against the emulated kernels. Slow (one coroutine switch per barrier per
# thread): use small shapes; the test files mark the big cases.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
out=${1:-$root/build-emu}
mkdir -p "$out/src" "$out/obj"
cd "$root"

python3 - "$out/src" kernels/cuda/*.cu <<'EOF'
import re, sys, os
out = sys.argv[1]
launch = re.compile(r'([\w:]+(?:<[^;<>]*(?:<[^;<>]*>[^;<>]*)*>)?)\s*<<<(.*?)>>>\s*\((.*?)\)\s*;', re.S)
def sub(m):
    name, args = m.group(1), m.group(3)
    cfg, depth, cur = [], 0, ''
    for ch in m.group(2):  # split the launch configuration at top-level commas
        depth += ch in '([{'
        depth -= ch in ')]}'
        if ch == ',' and depth == 0:
            cfg.append(cur.strip())
            cur = ''
        else:
            cur += ch
    cfg.append(cur.strip())
    while len(cfg) < 4:
        cfg.append('0')
    return 'EMU_LAUNCH(%s, %s, %s, %s, (%s)%s);' % (cfg[0], cfg[1], cfg[2], cfg[3], name,
                                                 (', ' + args) if args.strip() else '')
for path in sys.argv[2:]:
    src = open(path).read()
    dst = os.path.join(out, os.path.basename(path)[:-3] + '.cpp')
    new = launch.sub(sub, src)
    if '<<<' in new:
        sys.exit('%s: a launch the rewriter does not understand' % path)
    open(dst, 'w').write('#line 1 "%s"\n' % os.path.abspath(path) + new)
EOF

CXX=${CXX:-g++}
CC=${CC:-gcc}
inc="-I kernels/cuda/emu -I kernels -I kernels/cuda -I engine -I tests"
cxxflags="-std=c++17 -O1 -g -Wall -Wno-unused-function -Wno-unused-variable -Wno-unknown-pragmas"
cflags="-std=c11 -O2 -g -march=native -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Wno-unused-parameter"
defs="-DKDS_HAVE_CUDA=1 -DKDS_SOURCE_DIR=\"$root\" -DKDS_BINARY_DIR=\"$out\""

objs=()
pids=()
compile() { # obj, then the command
    local obj=$1
    shift
    objs+=("$obj")
    "$@" -o "$obj" &
    pids+=($!)
    if ((${#pids[@]} >= ${JOBS:-2})); then
        wait "${pids[0]}"
        pids=("${pids[@]:1}")
    fi
}
compile "$out/obj/emu.o" $CXX $cxxflags $inc -c kernels/cuda/emu/emu.cpp
for f in "$out"/src/*.cpp; do
    compile "$out/obj/$(basename "$f" .cpp).o" $CXX $cxxflags $inc -c "$f"
done
# the whole engine too: test_cuda_model.c runs whole models (engine/eng_cuda.c)
# (one rank: the MPI and NCCL communicators are left out, as CMake leaves
# them out of a build without MPI; eng_comm.c then has the single rank only)
for f in kernels/*.c kernels/cpu/*.c engine/*.c tests/test_cuda_*.c tests/test_model_util.c; do
    case $f in engine/eng_comm_mpi.c|engine/eng_comm_nccl.c) continue ;; esac
    compile "$out/obj/c_$(basename "$f" .c).o" $CC $cflags $inc $defs \
        $(pkg-config --cflags openblas libcjson libxxhash libpcre2-8 criterion) -c "$f"
done
for p in "${pids[@]}"; do wait "$p"; done
$CXX -o "$out/emu_tests" "${objs[@]}" \
    $(pkg-config --libs openblas libcjson libxxhash libpcre2-8 criterion) -lpthread -lm
echo "built $out/emu_tests"
# the benchmark program too (C compiled as C++ against the emulated runtime):
# `emu_cuda_bench --tiny` smoke-tests its control flow
kobjs=()
for o in "${objs[@]}"; do
    case $o in */c_test_*|*/c_eng_*.o) ;; *) kobjs+=("$o") ;; esac
done
$CXX -std=c++20 -fpermissive -w -O1 -x c++ $inc -DKDS_HAVE_CUDA=1 -c tests/bench/cuda_bench.c \
    -o "$out/obj/bench.o"
$CXX -o "$out/emu_cuda_bench" "$out/obj/bench.o" "${kobjs[@]}" $(pkg-config --libs openblas) -lm
echo "built $out/emu_cuda_bench"
