// A CPU emulator of the CUDA execution model, just large enough for stages/kernels/cuda.cu, so that
// the kernels the GPU compiles can be run and checked on a machine without one.
//
// A launch runs its blocks one after another, on the calling OS thread. The threads of a block
// are fibers (user-space stacks, switched by hand): a fiber runs until it reaches a barrier or
// returns, then the next one runs. __syncthreads() is a barrier over the block's threads;
// __shfl_xor_sync is an exchange between the 32 threads of a warp fenced by a barrier of that
// warp; a thread that returns leaves __syncthreads' count, as on a GPU, but a shuffle with a lane
// that has returned is an error (undefined on a GPU). __shared__ variables become function statics.
// When no fiber can run and some have not finished, that is a deadlock, reported with the barrier.
//
// Running the threads in order, each up to its next barrier, is the most adversarial schedule for
// a missing __syncthreads: thread 0 reads shared memory before thread 1 has written anything.
// emu_set_reverse(1) runs them in the opposite order, for the other half of that argument.
// Kernels registered as barrier-free run their threads one after another without fibers; if
// such a kernel reaches a barrier, that is an error.
//
// Built by scripts/cuda_emulator.py:
//   g++ -std=c++20 -O1 -shared -fPIC -DCUDA_EMULATOR -I stages/kernels scripts/cuda_emulator.cpp

#include <math.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)           // CUDA_EMULATOR_ASAN=1 (see cuda_emulator.py)
#include <sanitizer/asan_interface.h>
#define EMU_UNPOISON(p, n) __asan_unpoison_memory_region((p), (n))
#else
#define EMU_UNPOISON(p, n) ((void)0)
#endif

// ---- the CUDA vocabulary the kernels use --------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct float4 {
    float x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {

struct Abort {};

bool failed = false;
std::string error;

void fail(const std::string& what)
{
    if (!failed) error = what;
    failed = true;
}

// ---- fibers ---------------------------------------------------------------------------------------

enum State { RUNNABLE, WAITING, DONE };

struct Fiber {
    void* sp = nullptr;              // saved stack pointer (x86-64) ...
#if !defined(__x86_64__)
    ucontext_t ctx;                  // ... or context (elsewhere)
#endif
    char* stack = nullptr;
    State state = RUNNABLE;
    unsigned tid = 0;
    const char* waiting_at = "";
};

struct Group {                       // a barrier: the block's threads, or one warp's
    int live = 0, arrived = 0;
    std::vector<Fiber*> waiting;
};

struct Warp {
    Group group;
    unsigned long long slot[32];
};

const size_t kStack = 64 * 1024;     // per fiber, with a guard page below it
std::vector<Fiber> fibers;
std::vector<Warp> warps;
Group block_group;
Fiber* current = nullptr;
bool threaded = false;               // false: a barrier-free kernel is running
bool reverse_order = false;
const std::function<void(void**)>* kernel = nullptr;
void** kernel_args = nullptr;

#if defined(__x86_64__)
// Save the callee-saved registers and the stack pointer in *from, load `to`'s and return into it.
extern "C" void emu_switch(void** from, void* to);
asm(R"(
    .text
    .p2align 4
    .globl emu_switch
    .hidden emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");
void* scheduler_sp = nullptr;
#else
ucontext_t scheduler_ctx;
#endif

void to_scheduler(Fiber* f)
{
#if defined(__x86_64__)
    emu_switch(&f->sp, scheduler_sp);
#else
    swapcontext(&f->ctx, &scheduler_ctx);
#endif
}

void to_fiber(Fiber* f)
{
#if defined(__x86_64__)
    emu_switch(&scheduler_sp, f->sp);
#else
    swapcontext(&scheduler_ctx, &f->ctx);
#endif
}

void release(Group& g)
{
    for (Fiber* f : g.waiting) f->state = RUNNABLE;
    g.waiting.clear();
    g.arrived = 0;
}

void arrive(Group& g, const char* what)
{
    if (++g.arrived >= g.live) {
        release(g);                  // the last one in lets everybody go on
        return;
    }
    Fiber* f = current;
    f->state = WAITING;
    f->waiting_at = what;
    g.waiting.push_back(f);
    to_scheduler(f);
    if (failed) throw Abort();
}

void leave(Group& g)
{
    --g.live;
    if (g.arrived > 0 && g.arrived >= g.live) release(g);
}

void fiber_entry()
{
    Fiber* f = current;
    try {
        (*kernel)(kernel_args);
    } catch (...) {
    }
    leave(block_group);
    leave(warps[f->tid / 32].group);
    f->state = DONE;
    to_scheduler(f);
    __builtin_unreachable();
}

void ensure_stacks(size_t n)
{
    static char* region = nullptr;
    static size_t have = 0;
    if (have >= n) return;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t each = kStack + page;
    if (region) munmap(region, have * each);
    region = (char*)mmap(nullptr, n * each, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED) {
        region = nullptr;
        have = 0;
        fibers.clear();
        return;
    }
    fibers.assign(n, Fiber());
    for (size_t i = 0; i < n; ++i) {
        mprotect(region + i * each, page, PROT_NONE);          // an overflow faults instead of corrupting
        fibers[i].stack = region + i * each + page;
    }
    have = n;
}

void start_fiber(Fiber& f)
{
    f.state = RUNNABLE;
    EMU_UNPOISON(f.stack, kStack);          // frames abandoned by the previous block's fibers
#if defined(__x86_64__)
    void** sp = (void**)(f.stack + kStack);                     // 16-byte aligned top
    *--sp = nullptr;                                            // fiber_entry's (unused) return address
    *--sp = (void*)&fiber_entry;                                // where emu_switch's ret goes
    for (int i = 0; i < 6; ++i) *--sp = nullptr;                // rbp rbx r12 r13 r14 r15
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
#endif
}

void select(Fiber* f, const dim3& block)
{
    current = f;
    threadIdx.x = f->tid % block.x;
    threadIdx.y = (f->tid / block.x) % block.y;
    threadIdx.z = f->tid / (block.x * block.y);
}

}  // namespace emu

void __syncthreads()
{
    if (!emu::threaded) {
        emu::fail("__syncthreads in a kernel registered as barrier-free");
        throw emu::Abort();
    }
    emu::arrive(emu::block_group, "__syncthreads");
}

#define EMU_CHECK_ALIGNED(p, n)                                                        \
    do {                                                                              \
        if ((unsigned long long)(p) % (n)) {                                          \
            emu::fail("a misaligned " #n "-byte load (a float4 load would fault on the GPU)"); \
            throw emu::Abort();                                                       \
        }                                                                             \
    } while (0)

template <class V>
V __shfl_xor_sync(unsigned mask, V v, int lane_mask)
{
    static_assert(sizeof(V) <= 8, "shuffle of a value wider than 8 bytes");
    if (!emu::threaded) {
        emu::fail("__shfl_xor_sync in a kernel registered as barrier-free");
        throw emu::Abort();
    }
    const unsigned tid = emu::current->tid, lane = tid % 32;
    emu::Warp& w = emu::warps[tid / 32];
    if (mask != 0xffffffffu || w.group.live != 32) {
        emu::fail("__shfl_xor_sync without all 32 lanes (a partial mask, or a lane that has returned)");
        throw emu::Abort();
    }
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(V));
    w.slot[lane] = bits;
    emu::arrive(w.group, "__shfl_xor_sync");
    bits = w.slot[lane ^ ((unsigned)lane_mask & 31u)];
    emu::arrive(w.group, "__shfl_xor_sync");
    V out;
    memcpy(&out, &bits, sizeof(V));
    return out;
}

#include "cuda.cu"

// ---- launching ------------------------------------------------------------------------------------

namespace emu {

using Kernel = std::function<void(void**)>;

template <class... A, size_t... I>
void call_with(void (*k)(A...), void** args, std::index_sequence<I...>)
{
    k(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

template <class... A>
Kernel wrap(void (*k)(A...))
{
    return [k](void** args) { call_with(k, args, std::index_sequence_for<A...>{}); };
}

struct Entry {
    Kernel fn;
    bool barrier_free;
};

std::map<std::string, Entry>& registry()
{
    static std::map<std::string, Entry> r;
    if (r.empty()) {
#define REG_TYPE(name, T)                                                  \
    r["matmul_" #name "_m1"] = Entry{wrap(matmul_##name##_m1), false};     \
    r["matmul_" #name "_m8"] = Entry{wrap(matmul_##name##_m8), false};     \
    r["embed_" #name] = Entry{wrap(embed_##name), true};
        FOR_EACH_QUANT_TYPE(REG_TYPE)
        FOR_EACH_FLOAT_TYPE(REG_TYPE)
#undef REG_TYPE
        r["rms_norm"] = Entry{wrap(rms_norm), false};
        r["rope"] = Entry{wrap(rope), true};
        r["kv_store"] = Entry{wrap(kv_store), true};
        r["attention"] = Entry{wrap(attention), false};
        r["swiglu"] = Entry{wrap(swiglu), true};
        r["silu"] = Entry{wrap(silu), true};
        r["add"] = Entry{wrap(add), true};
        r["mul"] = Entry{wrap(mul), true};
        r["scale"] = Entry{wrap(scale), true};
        r["argmax"] = Entry{wrap(argmax), false};
    }
    return r;
}

void run_barrier_free(const Kernel& fn, const dim3& grid, const dim3& block, void** args)
{
    threaded = false;
    const unsigned n = block.x * block.y * block.z;
    Fiber f;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = dim3{bx, by, bz};
                for (unsigned t = 0; t < n; ++t) {
                    f.tid = reverse_order ? n - 1 - t : t;
                    select(&f, block);
                    fn(args);
                }
            }
}

void run_fibers(const Kernel& fn, const dim3& grid, const dim3& block, void** args)
{
    const unsigned n = block.x * block.y * block.z;
    ensure_stacks(n);
    if (fibers.size() < n) {
        fail("cannot map the fiber stacks");
        return;
    }
    warps.assign(n / 32, Warp());
    threaded = true;
    kernel = &fn;
    kernel_args = args;
    for (unsigned bz = 0; bz < grid.z && !failed; ++bz)
        for (unsigned by = 0; by < grid.y && !failed; ++by)
            for (unsigned bx = 0; bx < grid.x && !failed; ++bx) {
                blockIdx = dim3{bx, by, bz};
                block_group = Group();
                block_group.live = (int)n;
                for (auto& w : warps) {
                    w.group = Group();
                    w.group.live = 32;
                }
                for (unsigned t = 0; t < n; ++t) {
                    fibers[t].tid = t;
                    start_fiber(fibers[t]);
                }
                for (;;) {
                    bool ran = false, all_done = true;
                    for (unsigned i = 0; i < n && !failed; ++i) {
                        Fiber* f = &fibers[reverse_order ? n - 1 - i : i];
                        if (f->state == RUNNABLE) {
                            ran = true;
                            select(f, block);
                            to_fiber(f);
                        }
                        if (f->state != DONE) all_done = false;
                    }
                    if (failed || all_done) break;
                    if (!ran) {
                        for (unsigned t = 0; t < n; ++t)
                            if (fibers[t].state == WAITING) {
                                char buf[256];
                                snprintf(buf, sizeof buf,
                                         "deadlock in block (%u,%u,%u): thread %u waits at %s and nothing can run",
                                         bx, by, bz, t, fibers[t].waiting_at);
                                fail(buf);
                                break;
                            }
                        break;
                    }
                }
            }
    threaded = false;
}

}  // namespace emu

extern "C" {

const char* emu_error() { return emu::error.c_str(); }

void emu_set_reverse(int reverse) { emu::reverse_order = reverse != 0; }

int emu_has(const char* name) { return emu::registry().count(name) ? 1 : 0; }

// 0 on success; else emu_error() says what went wrong.
int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
               void** args)
{
    emu::failed = false;
    emu::error.clear();
    auto it = emu::registry().find(name);
    if (it == emu::registry().end()) {
        emu::error = std::string("no kernel named ") + name;
        return 1;
    }
    const dim3 grid{gx, gy, gz}, block{bx, by, bz};
    const unsigned n = bx * by * bz;
    if (n == 0 || n > 1024 || n % 32 || gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535) {
        emu::error = "invalid launch configuration (threads per block must be 32..1024 in whole warps, "
                     "grid.y and grid.z at most 65535)";
        return 1;
    }
    gridDim = grid;
    blockDim = block;
    if (it->second.barrier_free) {
        try {
            emu::run_barrier_free(it->second.fn, grid, block, args);
        } catch (emu::Abort&) {
        }
    } else {
        emu::run_fibers(it->second.fn, grid, block, args);
    }
    return emu::failed ? 1 : 0;
}

// The host side of the block decoders: n_values of type `type` (a kernel suffix) -> float32.
int emu_dequantize(const char* type, const unsigned char* raw, long long n_values, float* out)
{
    const std::string t = type;
#define DEQ_QUANT(name, T)                                                            \
    if (t == #name) {                                                                 \
        const long long chunks = n_values / T::QK * T::CPB;                           \
        for (long long c = 0; c < chunks; ++c) chunk_store<T>(raw, (int)c, out);      \
        return 0;                                                                     \
    }
    FOR_EACH_QUANT_TYPE(DEQ_QUANT)
#undef DEQ_QUANT
#define DEQ_FLOAT(name, E)                                                            \
    if (t == #name) {                                                                 \
        for (long long j = 0; j < n_values; ++j) out[j] = E::get(raw, (int)j);        \
        return 0;                                                                     \
    }
    FOR_EACH_FLOAT_TYPE(DEQ_FLOAT)
#undef DEQ_FLOAT
    return 1;
}

}  // extern "C"
