/*
 * emu.cpp - the scheduler and runtime of the CUDA emulation (cuda_runtime.h
 * beside it): each GPU thread of a block is a ucontext coroutine that runs
 * until it reaches a barrier, a warp collective or its end; the scheduler
 * releases a barrier once every thread it concerns has arrived, and aborts
 * with a message when that can never happen (divergent barrier, shuffle
 * from an exited lane, ...). Blocks of a grid run one after the other.
 */
#include "cuda_runtime.h"

#include <stdarg.h>
#include <time.h>
#include <ucontext.h>

#include <vector>

namespace emu {

thread_local thread_ctx *cur = nullptr;

namespace {

enum { ST_RUN, ST_BLOCK_BAR, ST_WARP_BAR, ST_DONE };

struct thr {
    ucontext_t ctx;
    thread_ctx tc;
    int st;
    int bop, bpred, bres;
    int wop, wparam, wwidth;
    unsigned wmask;
    uint64_t wval, wres;
};

const size_t kStack = 256 * 1024;
ucontext_t sched_ctx;
std::vector<thr> T;
std::vector<char *> stacks;
std::function<void()> *g_body;
int cur_idx = -1;
const char *g_name = "";
std::vector<unsigned char> smem;
cudaError_t last_err = cudaSuccess;

void entry() {
    int me = cur_idx;
    (*g_body)();
    T[me].st = ST_DONE;
    /* returns to uc_link: the scheduler */
}

void yield_to_scheduler() {
    int me = cur_idx;
    swapcontext(&T[me].ctx, &sched_ctx);
}

/* Release the warp collectives that can be released; true if any was. */
bool release_warps(int n) {
    bool any = false;
    for (int w0 = 0; w0 < n; w0 += 32) {
        int nl = n - w0 < 32 ? n - w0 : 32;
        for (int l = 0; l < nl; l++) {
            thr &a = T[w0 + l];
            if (a.st != ST_WARP_BAR) continue;
            unsigned m = a.wmask;
            if (!((m >> l) & 1u)) fail("%s: lane %d calls a warp collective with a mask (0x%08x) that leaves it out", g_name, w0 + l, m);
            bool ready = true;
            for (int j = 0; j < 32; j++) {
                if (!((m >> j) & 1u)) continue;
                if (j >= nl) fail("%s: warp collective mask 0x%08x names lane %d past the block", g_name, m, j);
                thr &b = T[w0 + j];
                if (b.st == ST_DONE)
                    fail("%s: thread %d waits in a warp collective (op %d) for lane %d, which has exited",
                         g_name, w0 + l, a.wop, j);
                if (b.st != ST_WARP_BAR) {
                    ready = false;
                    break;
                }
                if (b.wmask != m || b.wop != a.wop)
                    fail("%s: lanes %d and %d of one warp meet in different collectives (op %d/%d, mask 0x%08x/0x%08x)",
                         g_name, w0 + l, w0 + j, a.wop, b.wop, a.wmask, b.wmask);
            }
            if (!ready) continue;
            /* compute every participant's result, then release them */
            for (int j = 0; j < 32; j++) {
                if (!((m >> j) & 1u)) continue;
                thr &b = T[w0 + j];
                int w = b.wwidth, src = j;
                switch (b.wop) {
                case OP_SHFL: src = (j / w) * w + ((b.wparam % w) + w) % w; break;
                case OP_SHFL_XOR: src = j ^ b.wparam; if (src / w != j / w || src > 31) src = j; break;
                case OP_SHFL_DOWN: src = (j % w) + b.wparam < w ? j + b.wparam : j; break;
                case OP_SHFL_UP: src = (j % w) >= b.wparam ? j - b.wparam : j; break;
                default: break;
                }
                if (b.wop == OP_BALLOT) {
                    unsigned r = 0;
                    for (int i = 0; i < 32; i++)
                        if (((m >> i) & 1u) && T[w0 + i].wval) r |= 1u << i;
                    b.wres = r;
                } else if (b.wop == OP_MATCH_ANY) {
                    unsigned r = 0;
                    for (int i = 0; i < 32; i++)
                        if (((m >> i) & 1u) && T[w0 + i].wval == b.wval) r |= 1u << i;
                    b.wres = r;
                } else if (b.wop == OP_SYNCWARP) {
                    b.wres = 0;
                } else {
                    if (!((m >> src) & 1u))
                        fail("%s: lane %d reads lane %d in a shuffle, but the mask 0x%08x leaves it out",
                             g_name, w0 + j, src, m);
                    b.wres = T[w0 + src].wval;
                }
            }
            for (int j = 0; j < 32; j++)
                if ((m >> j) & 1u) T[w0 + j].st = ST_RUN;
            any = true;
        }
    }
    return any;
}

void run_block(int n) {
    for (int i = 0; i < n; i++) {
        thr &t = T[i];
        t.st = ST_RUN;
        getcontext(&t.ctx);
        t.ctx.uc_stack.ss_sp = stacks[i];
        t.ctx.uc_stack.ss_size = kStack;
        t.ctx.uc_link = &sched_ctx;
        makecontext(&t.ctx, entry, 0);
    }
    /* Threads run in a fresh random order after every barrier (a fixed
     * seed, so runs repeat): a read of shared memory that another thread
     * writes without a barrier in between then shows up as a wrong result,
     * whichever of the two a real GPU happens to run first. */
    static std::vector<int> order;
    order.resize((size_t)n);
    for (int i = 0; i < n; i++) order[(size_t)i] = i;
    static uint64_t rs = 0x9E3779B97F4A7C15ull;
    for (;;) {
        for (int i = n - 1; i > 0; i--) {
            rs ^= rs << 13;
            rs ^= rs >> 7;
            rs ^= rs << 17;
            const int j = (int)(rs % (uint64_t)(i + 1));
            const int t = order[(size_t)i];
            order[(size_t)i] = order[(size_t)j];
            order[(size_t)j] = t;
        }
        for (int oi = 0; oi < n; oi++) {
            const int i = order[(size_t)oi];
            if (T[i].st != ST_RUN) continue;
            cur_idx = i;
            cur = &T[i].tc;
            swapcontext(&sched_ctx, &T[i].ctx);
        }
        int done = 0, at_block = 0, at_warp = 0;
        for (int i = 0; i < n; i++) {
            done += T[i].st == ST_DONE;
            at_block += T[i].st == ST_BLOCK_BAR;
            at_warp += T[i].st == ST_WARP_BAR;
        }
        if (done == n) break;
        if (at_warp && release_warps(n)) continue;
        if (at_block + done == n) {
            int op = -1, cnt = 0, orv = 0, andv = 1;
            for (int i = 0; i < n; i++) {
                if (T[i].st != ST_BLOCK_BAR) continue;
                if (op < 0) op = T[i].bop;
                if (T[i].bop != op)
                    fail("%s: threads meet at different block barriers (ops %d and %d)", g_name, op,
                         T[i].bop);
                cnt += T[i].bpred;
                orv |= T[i].bpred;
                andv &= T[i].bpred;
            }
            for (int i = 0; i < n; i++) {
                if (T[i].st != ST_BLOCK_BAR) continue;
                T[i].bres = op == BOP_COUNT ? cnt : op == BOP_OR ? orv : andv;
                T[i].st = ST_RUN;
            }
            continue;
        }
        /* nothing can move */
        int first_w = -1, first_b = -1;
        for (int i = 0; i < n; i++) {
            if (T[i].st == ST_WARP_BAR && first_w < 0) first_w = i;
            if (T[i].st == ST_BLOCK_BAR && first_b < 0) first_b = i;
        }
        fail("%s: deadlock in block (%u,%u,%u): %d threads at __syncthreads (first %d), %d in warp "
             "collectives (first %d), %d exited",
             g_name, T[0].tc.bid.x, T[0].tc.bid.y, T[0].tc.bid.z, at_block, first_b, at_warp,
             first_w, done);
    }
    cur = nullptr;
    cur_idx = -1;
}

} // namespace

[[noreturn]] void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "CUDA emulation: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    abort();
}

void block_barrier(int op, int pred, int *result) {
    if (cur_idx < 0) fail("__syncthreads outside a kernel");
    thr &t = T[cur_idx];
    t.st = ST_BLOCK_BAR;
    t.bop = op;
    t.bpred = pred;
    yield_to_scheduler();
    if (result) *result = T[cur_idx].bres;
}

uint64_t warp_collective(int op, unsigned mask, uint64_t val, int param, int width) {
    if (cur_idx < 0) fail("warp collective outside a kernel");
    if (width < 1 || width > 32 || (width & (width - 1))) fail("%s: shuffle width %d", g_name, width);
    thr &t = T[cur_idx];
    t.st = ST_WARP_BAR;
    t.wop = op;
    t.wmask = mask;
    t.wval = val;
    t.wparam = param;
    t.wwidth = width;
    yield_to_scheduler();
    return T[cur_idx].wres;
}

unsigned char *dyn_smem(void) { return smem.data(); }

void launch(dim3 grid, dim3 block, size_t smem_bytes, std::function<void()> body, const char *name) {
    const long n = (long)block.x * block.y * block.z;
    if (n < 1 || n > 1024 || grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.y > 65535 ||
        grid.z > 65535 || smem_bytes > 227 * 1024) {
        fprintf(stderr, "CUDA emulation: %s: bad launch grid (%u,%u,%u) block (%u,%u,%u) smem %zu\n",
                name, grid.x, grid.y, grid.z, block.x, block.y, block.z, smem_bytes);
        last_err = cudaErrorInvalidValue;
        return;
    }
    if (T.size() < (size_t)n) T.resize((size_t)n);
    while (stacks.size() < (size_t)n) stacks.push_back((char *)malloc(kStack));
    g_body = &body;
    g_name = name;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                /* poison dynamic shared memory: NaN floats, so reads of
                 * unwritten smem show up in the results */
                smem.assign(smem_bytes + 16, 0xff);
                for (long i = 0; i < n; i++) {
                    thread_ctx &c = T[i].tc;
                    c.tid = dim3((unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                                 (unsigned)(i / ((long)block.x * block.y)));
                    c.bid = dim3(bx, by, bz);
                    c.bdim = block;
                    c.gdim = grid;
                }
                run_block((int)n);
            }
}

} // namespace emu

/* ---- runtime API ---------------------------------------------------------- */

cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int) {
    switch (a) {
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
    case cudaDevAttrMultiProcessorCount: *v = 132; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = 227 * 1024; break;
    case cudaDevAttrL2CacheSize: *v = 50 * 1024 * 1024; break;
    }
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int) {
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CUDA emulation on the CPU");
    p->major = 9;
    p->multiProcessorCount = 132;
    p->l2CacheSize = 50 << 20;
    p->sharedMemPerBlockOptin = 227 * 1024;
    p->totalGlobalMem = (size_t)8 << 30;
    return cudaSuccess;
}
cudaError_t cudaMalloc(void **p, size_t n) {
    *p = aligned_alloc(256, (n + 255) & ~(size_t)255);
    if (!*p) return cudaErrorMemoryAllocation;
    memset(*p, 0xff, n); /* like fresh device memory: garbage, here NaNs */
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
/* pinned host memory is ordinary memory here */
cudaError_t cudaMallocHost(void **p, size_t n) {
    *p = aligned_alloc(256, (n + 255) & ~(size_t)255);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
/* ---- stream capture (CUDA graphs) ---------------------------------------- */
struct emu_graph { std::vector<std::function<void()>> ops; };
struct emu_graph_exec { std::vector<std::function<void()>> ops; };
namespace emu {
static cudaStream_t capturing;       /* the stream being captured, or null */
static emu_graph *capture_graph;
static bool capture_broken;          /* a synchronous call happened during the capture */
void enqueue(cudaStream_t s, std::function<void()> op, const char *what) {
    if (capture_graph && s == capturing && s) {
        capture_graph->ops.push_back(std::move(op));
        return;
    }
    if (capture_graph && !capture_broken) { /* other-stream work during a capture */
        fprintf(stderr, "CUDA emulation: %s on another stream during a capture: capture invalidated\n",
                what);
        capture_broken = true;
    }
    op();
}
/* A synchronous call: refused while a capture is in progress. */
static cudaError_t sync_call(const char *what) {
    if (!capture_graph) return cudaSuccess;
    if (!capture_broken)
        fprintf(stderr, "CUDA emulation: %s during a capture: capture invalidated\n", what);
    capture_broken = true;
    return cudaErrorStreamCaptureUnsupported;
}
} // namespace emu
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
    if (!s || emu::capture_graph) return cudaErrorInvalidValue;
    emu::capturing = s;
    emu::capture_graph = new emu_graph;
    emu::capture_broken = false;
    return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    *g = nullptr;
    if (!emu::capture_graph || s != emu::capturing) return cudaErrorInvalidValue;
    emu_graph *graph = emu::capture_graph;
    emu::capture_graph = nullptr;
    emu::capturing = nullptr;
    if (emu::capture_broken) {
        delete graph;
        return cudaErrorStreamCaptureInvalidated;
    }
    *g = graph;
    return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long) {
    *e = g ? new emu_graph_exec{g->ops} : nullptr;
    return g ? cudaSuccess : cudaErrorInvalidValue;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
    if (!e) return cudaErrorInvalidValue;
    emu::enqueue(s, [e]() {
        for (auto &op : e->ops) op();
    });
    return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) { delete g; return cudaSuccess; }
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) { delete e; return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { return cudaStreamCreate(s); }

cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t st) {
    emu::enqueue(st, [=]() { memmove(d, s, n); }, "cudaMemcpyAsync");
    return cudaSuccess;
}
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind) {
    if (cudaError_t e = emu::sync_call("cudaMemcpy")) return e;
    memmove(d, s, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st) {
    emu::enqueue(st, [=]() { memset(d, v, n); }, "cudaMemsetAsync");
    return cudaSuccess;
}
cudaError_t cudaMemset(void *d, int v, size_t n) {
    if (cudaError_t e = emu::sync_call("cudaMemset")) return e;
    memset(d, v, n);
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return emu::sync_call("cudaStreamSynchronize"); }
cudaError_t cudaDeviceSynchronize(void) { return emu::sync_call("cudaDeviceSynchronize"); }
cudaError_t cudaGetLastError(void) {
    cudaError_t e = emu::last_err;
    emu::last_err = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return emu::last_err; }
const char *cudaGetErrorString(cudaError_t e) {
    return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument"
         : e == cudaErrorMemoryAllocation ? "out of memory" : "emulated error";
}
const char *cudaGetErrorName(cudaError_t e) {
    return e == cudaSuccess ? "cudaSuccess" : e == cudaErrorInvalidValue ? "cudaErrorInvalidValue"
         : e == cudaErrorMemoryAllocation ? "cudaErrorMemoryAllocation" : "cudaErrorUnknown";
}
struct emu_event { double t; };
struct emu_stream { int unused; };
static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = new emu_event{0}; return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) { e->t = now_ms(); return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = (float)(b->t - a->t);
    return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t *s) { *s = new emu_stream{0}; return cudaSuccess; }
cudaError_t cudaStreamDestroy(cudaStream_t s) { delete s; return cudaSuccess; }
cudaError_t cudaRuntimeGetVersion(int *v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaDriverGetVersion(int *v) { *v = 0; return cudaSuccess; }
cudaError_t cudaFuncGetAttributes_(cudaFuncAttributes *a) {
    memset(a, 0, sizeof *a);
    a->maxThreadsPerBlock = 1024;
    return cudaSuccess;
}
