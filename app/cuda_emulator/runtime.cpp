// A CPU emulator of the CUDA execution model, strict enough to catch the bugs a GPU would show and a
// plain CPU run would hide: the runtime (this file). kernel_side.cpp defines the CUDA vocabulary for
// g++ and includes a kernel source (stages/kernels/cuda.cu, a learner's, or a test's); both are
// built into one shared library by emulator.py, which says how to use it.
//
// Threads. A launch runs its blocks one after another on the calling OS thread; the threads of a
// block are fibers (user-space stacks switched by hand), all of them, so that one thread can stop at
// any point and another go on. A schedule decides which runnable fiber goes next: "forward" (thread
// 0 first, each running up to its next barrier; after the barrier, thread 0 first again), "reverse",
// or "random": a seeded random runnable fiber, blocks in a random order, and (preempt > 0, checked
// build) a switch to another thread before a fraction of the kernel's loads and stores, so that a
// read-modify-write of shared memory can lose an update, as on a GPU. __syncthreads() is a barrier of the block's live threads (a thread that returns leaves
// it, as on a GPU); __shfl_xor_sync an exchange between the 32 lanes of a warp; a shuffle with a
// lane that has returned is an error (undefined on a GPU). When nothing can run and some threads
// have not finished, that is a deadlock, reported with the barrier.
//
// Memory. Device memory is poisoned when allocated (0xFF bytes: NaN as a float, -1 as an int; the
// Python side does it) and the block's __shared__ variables (one linker section, emu_shared) before
// every block, since neither starts zeroed on a GPU. A launch with more threads per block than the
// kernel's __launch_bounds__ is refused, as the GPU refuses it.
//
// Checks (the checked build: the kernel side compiled with -fsanitize=thread, whose only effect
// without the ThreadSanitizer runtime is a call to __tsan_read4(p), __tsan_write8(p), ... before
// every load and store; the definitions below are the checker). For every 4 bytes of device and
// shared memory a shadow cell records which of its bytes were ever written, the last writer and the
// readers (one thread, or "several"): which thread, and in which interval between barriers of which
// block (a "segment"). An access fails the launch when
//   - it reads bytes nothing has written (device memory: no copy from the host and no kernel
//     store yet; shared memory: no store in this block) - compute-sanitizer's initcheck;
//   - another thread wrote or read those bytes in the same segment, or another block of the same
//     launch did, and the two are not both atomics (a write-write or write-read pair) - the
//     hazards compute-sanitizer's racecheck reports for shared memory, here for device memory too;
//   - it falls outside its allocation (the guard bytes the Python side puts around each one).
// Warp shuffles exchange values, not memory: they order no memory access, as on a GPU.
//
// What it cannot see: code that only the GPU compiles (__CUDA_ARCH__ branches), timing, and
// memory ordering between blocks beyond "unordered" (no grid-wide synchronization is emulated).

#include <math.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)           // the AddressSanitizer build (see emulator.py)
#include <sanitizer/asan_interface.h>
#define EMU_UNPOISON(p, n) __asan_unpoison_memory_region((p), (n))
#else
#define EMU_UNPOISON(p, n) ((void)0)
#endif

#define EMU_API extern "C" __attribute__((visibility("default")))

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
extern "C" {
dim3 threadIdx, blockIdx, blockDim, gridDim;
}

// The kernel side's table (kernel_side.cpp): one entry per __global__ function.
struct EmuKernel {
    const char* name;
    long bound;                        // __launch_bounds__: most threads per block
    void (*thunk)(void**);             // calls the kernel with its arguments unpacked
    const char* signature;             // one letter per argument: P pointer, i int, I unsigned, f float, d double
};
extern "C" const EmuKernel emu_kernel_table[];
extern "C" const int emu_kernels_instrumented;

// The block's __shared__ variables: the linker puts the section's bounds here.
extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

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
    bool orders_memory = false;      // __syncthreads starts a new segment; a shuffle does not
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
unsigned n_done = 0;
const EmuKernel* kernel = nullptr;
void** kernel_args = nullptr;

// ---- the schedule ---------------------------------------------------------------------------------

enum Schedule { FORWARD = 0, REVERSE = 1, RANDOM = 2 };
Schedule schedule = FORWARD;
uint64_t rng_state = 1;
uint64_t preempt_below = 0;          // preempt before an access when rng() < this (0: never)
std::vector<Fiber*> ready;           // runnable fibers; [ready_head, size) are waiting their turn
size_t ready_head = 0;

uint64_t rng()
{
    rng_state ^= rng_state >> 12;    // xorshift64*
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}

void make_ready(Fiber* f)
{
    f->state = RUNNABLE;
    ready.push_back(f);
}

Fiber* next_ready()
{
    if (ready_head == ready.size()) return nullptr;
    if (schedule == RANDOM) std::swap(ready[ready_head], ready[ready_head + rng() % (ready.size() - ready_head)]);
    Fiber* f = ready[ready_head++];
    if (ready_head == ready.size()) {
        ready.clear();
        ready_head = 0;
    }
    return f;
}

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

// ---- segments: which accesses are ordered ---------------------------------------------------------
// A segment is one interval between barriers of one block. Blocks run one after another, so a
// block's segments are the numbers from block_first up; a launch's from launch_first up.

uint32_t segment = 0, block_first = 0, launch_first = 0;
bool hooked = false;                 // a launch of the checked build is running: the hooks are live
bool checks_on = true;               // ... and report what they find (see emu_set_checks)

void new_segment()
{
    if (++segment == 0xffffffffu) fail("the emulator's segment counter overflowed: start a new process");
}

// ---- barriers -------------------------------------------------------------------------------------

std::string thread_name(unsigned tid);

void release(Group& g)
{
    if (g.orders_memory) new_segment();
    for (Fiber* f : g.waiting) make_ready(f);
    g.waiting.clear();
    g.arrived = 0;
}

// Leave the fiber for good: the launch has failed and nothing of this thread may run on.
[[noreturn]] void abandon()
{
    Fiber* f = current;
    f->state = DONE;
    to_scheduler(f);
    __builtin_unreachable();
}

void arrive(Group& g, const char* what)
{
    Fiber* f = current;
    if (++g.arrived >= g.live) {
        release(g);                  // the last one in lets everybody go on, then queues behind them,
        make_ready(f);               // so that after a barrier the threads start again in schedule order
    } else {
        f->state = WAITING;
        f->waiting_at = what;
        g.waiting.push_back(f);
    }
    to_scheduler(f);
    if (failed) abandon();
}

void leave(Group& g)
{
    --g.live;
    if (g.arrived > 0 && !g.orders_memory) {      // a warp whose other lanes wait in a shuffle
        fail(thread_name(current->tid) + " returned while other lanes of its warp wait in __shfl_xor_sync for "
                                         "it (undefined on a GPU)");
        return;
    }
    if (g.arrived > 0 && g.arrived >= g.live) release(g);
}

void fiber_entry()
{
    Fiber* f = current;
    try {
        kernel->thunk(kernel_args);
    } catch (Abort&) {
    }
    leave(block_group);
    leave(warps[f->tid / 32].group);
    f->state = DONE;
    ++n_done;
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

void select(Fiber* f)
{
    current = f;
    threadIdx.x = f->tid % blockDim.x;
    threadIdx.y = (f->tid / blockDim.x) % blockDim.y;
    threadIdx.z = f->tid / (blockDim.x * blockDim.y);
}

std::string thread_name(unsigned tid)
{
    char buf[96];
    snprintf(buf, sizeof buf, "thread (%u,%u,%u) of block (%u,%u,%u)", tid % blockDim.x,
             (tid / blockDim.x) % blockDim.y, tid / (blockDim.x * blockDim.y), blockIdx.x, blockIdx.y, blockIdx.z);
    return buf;
}

// ---- shadow memory --------------------------------------------------------------------------------

enum Kind { READ, WRITE, ATOMIC };
const uint16_t MANY = 0xffff;        // a read cell read by two threads or more in its segment
const uint8_t ATOMIC_BIT = 0x10;     // in Cell::flags; bits 0-3 of a write cell: bytes initialized

struct Cell {                        // one per 4 bytes: the last write, or the reads, of a segment
    uint32_t seg;                    // 0: never accessed
    uint16_t tid;
    uint8_t mask;                    // which of the 4 bytes
    uint8_t flags;
};

struct Region {                      // a device allocation (with its guard bytes) or the shared section
    uintptr_t lo, start, end, hi;    // lo <= start <= end <= hi: [start, end) may be accessed
    Cell* writes = nullptr;
    Cell* reads = nullptr;
    size_t cells = 0;
    bool shared = false;
};

std::vector<Region> regions;         // device allocations, sorted by lo
Region shared_region;
bool shared_touched = false;         // the shadow of shared memory needs clearing before the next block
size_t last_hit = 0;

Cell* map_cells(size_t n)
{
    void* p = mmap(nullptr, n * sizeof(Cell), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    return p == MAP_FAILED ? nullptr : (Cell*)p;   // zero pages: never written, never read
}

void unmap_cells(Region& r)
{
    if (r.writes) munmap(r.writes, r.cells * sizeof(Cell));
    if (r.reads) munmap(r.reads, r.cells * sizeof(Cell));
    r.writes = r.reads = nullptr;
}

bool attach_cells(Region& r)
{
    r.cells = (r.end - r.start + 3) / 4;
    r.writes = map_cells(r.cells ? r.cells : 1);
    r.reads = map_cells(r.cells ? r.cells : 1);
    return r.writes && r.reads;
}

void clear_cells(Region& r)
{
    memset(r.writes, 0, r.cells * sizeof(Cell));
    memset(r.reads, 0, r.cells * sizeof(Cell));
}

Region* find(uintptr_t a)
{
    if (a - shared_region.start < shared_region.end - shared_region.start) return &shared_region;
    if (last_hit < regions.size() && a - regions[last_hit].lo < regions[last_hit].hi - regions[last_hit].lo)
        return &regions[last_hit];
    auto it = std::upper_bound(regions.begin(), regions.end(), a,
                               [](uintptr_t v, const Region& r) { return v < r.lo; });
    if (it == regions.begin()) return nullptr;
    --it;
    if (a >= it->hi) return nullptr;
    last_hit = (size_t)(it - regions.begin());
    return &*it;
}

std::string where(const Region& r, uintptr_t a)
{
    char buf[160];
    if (r.shared)
        snprintf(buf, sizeof buf, "__shared__ memory at {shared+%zu}", (size_t)(a - r.start));
    else
        snprintf(buf, sizeof buf, "device memory at byte %lld of the allocation at 0x%llx (%zu bytes)",
                 (long long)(a - r.start), (unsigned long long)r.start, (size_t)(r.end - r.start));
    return buf;
}

// Is the access recorded in c unordered with the running thread's access now?
bool unordered(const Cell& c)
{
    if (c.seg < launch_first) return false;                     // an earlier launch: stream order
    if (c.seg >= block_first) return c.seg == segment && c.tid != current->tid;   // no barrier between
    return true;                                                // another block of this launch
}

std::string other(const Cell& c)
{
    if (c.seg < block_first) return "another block of this launch";
    if (c.tid == MANY) return "other threads";
    return thread_name(c.tid);
}

void report(const std::string& what)
{
    if (!checks_on) return;
    fail(what);
    abandon();
}

void check(Region& r, uintptr_t a, unsigned n, Kind k)
{
    static const char* verb[] = {"reads", "writes", "updates atomically"};
    if (a < r.start || a + n > r.end) {
        char buf[64];
        snprintf(buf, sizeof buf, " %u bytes", n);
        report(thread_name(current->tid) + " " + verb[k] + buf + " outside its allocation: " + where(r, a));
        return;                                                 // checks off: nothing to record there
    }
    shared_touched |= r.shared;
    const size_t off = a - r.start;
    for (size_t g = off / 4; g <= (off + n - 1) / 4; ++g) {
        const size_t lo = std::max(off, 4 * g), hi = std::min(off + n, 4 * g + 4);
        const uint8_t m = (uint8_t)(((1u << (hi - lo)) - 1) << (lo - 4 * g));
        Cell& w = r.writes[g];
        Cell& rd = r.reads[g];
        const bool atomic = k == ATOMIC;
        if (k != WRITE) {
            if ((w.flags & m) != m)
                report(thread_name(current->tid) + " " + verb[k] + " " + where(r, 4 * g + r.start) +
                       " that nothing has written (uninitialized: garbage on a GPU)");
            if ((w.mask & m) && unordered(w) && !(atomic && (w.flags & ATOMIC_BIT)))
                report("race: " + thread_name(current->tid) + " " + verb[k] + " " + where(r, a) + ", which " +
                       other(w) + " wrote with no __syncthreads between them" +
                       (atomic ? "" : " (a stale or torn value on a GPU)"));
        }
        if (k != READ) {
            if ((w.mask & m) && unordered(w) && !(atomic && (w.flags & ATOMIC_BIT)))
                report("race: " + thread_name(current->tid) + " " + verb[k] + " " + where(r, a) + ", which " +
                       other(w) + " also wrote with no __syncthreads between them and not both atomically "
                                  "(a lost update on a GPU)");
            if ((rd.mask & m) && unordered(rd) && !(atomic && (rd.flags & ATOMIC_BIT)))
                report("race: " + thread_name(current->tid) + " " + verb[k] + " " + where(r, a) + ", which " +
                       other(rd) + " read with no __syncthreads between them (the read may see either value)");
        }
        if (k != WRITE) {
            if (rd.seg == segment) {
                if (rd.tid != current->tid) rd.tid = MANY;
                rd.mask |= m;
                if (!atomic) rd.flags &= (uint8_t)~ATOMIC_BIT;
            } else {
                rd = Cell{segment, (uint16_t)current->tid, m, (uint8_t)(atomic ? ATOMIC_BIT : 0)};
            }
        }
        if (k != READ) {
            if (w.seg == segment && w.tid == current->tid)
                w.mask |= m;
            else
                w.seg = segment, w.tid = (uint16_t)current->tid, w.mask = m;
            w.flags = (uint8_t)((w.flags & 0x0f) | m | (atomic ? ATOMIC_BIT : 0));
        }
    }
}

void access(const void* p, unsigned n, Kind k)
{
    if (!hooked || failed) return;
    const uintptr_t a = (uintptr_t)p;
    Region* r = find(a);
    if (!r) return;                                             // the fiber's stack, the emulator's own data
    check(*r, a, n, k);
    if (preempt_below && rng() < preempt_below) {               // let another thread run first
        Fiber* f = current;
        make_ready(f);
        to_scheduler(f);
        if (failed) abandon();
    }
}

void access_range(const void* p, size_t n, Kind k)
{
    for (size_t done = 0; done < n; done += 8) access((const char*)p + done, (unsigned)std::min<size_t>(8, n - done), k);
}

void reset_shared()
{
    const size_t n = (size_t)((uintptr_t)__stop_emu_shared - (uintptr_t)__start_emu_shared);
    if (n) memset(__start_emu_shared, 0xff, n);                 // no block finds another's values, nor zeros
    if (shared_touched && shared_region.writes) clear_cells(shared_region);
    shared_touched = false;
}

// ---- running a launch -----------------------------------------------------------------------------

void run_block(unsigned n)
{
    block_group = Group();
    block_group.live = (int)n;
    block_group.orders_memory = true;
    for (auto& w : warps) {
        w.group = Group();
        w.group.live = 32;
    }
    reset_shared();
    new_segment();
    block_first = segment;
    ready.clear();
    ready_head = 0;
    n_done = 0;
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = fibers[schedule == REVERSE ? n - 1 - i : i];
        f.tid = (unsigned)(&f - fibers.data());
        start_fiber(f);
        ready.push_back(&f);
    }
    while (!failed) {
        Fiber* f = next_ready();
        if (f == nullptr) {
            if (n_done == n) break;
            for (unsigned t = 0; t < n; ++t)
                if (fibers[t].state == WAITING) {
                    fail("deadlock: " + thread_name(t) + " waits at " + fibers[t].waiting_at +
                         " and nothing can run (a barrier some threads never reach: a hang on a GPU)");
                    break;
                }
            break;
        }
        select(f);
        to_fiber(f);
    }
}

void run(const dim3& grid, unsigned n)
{
    ensure_stacks(n);
    if (fibers.size() < n) {
        fail("cannot map the fiber stacks");
        return;
    }
    warps.assign(n / 32, Warp());
    const unsigned long long n_blocks = (unsigned long long)grid.x * grid.y * grid.z;
    std::vector<unsigned long long> order;
    if (schedule == RANDOM) {                                    // blocks in a random order too
        order.resize(n_blocks);
        for (unsigned long long i = 0; i < n_blocks; ++i) order[i] = i;
        for (unsigned long long i = n_blocks; i > 1; --i) std::swap(order[i - 1], order[rng() % i]);
    }
    hooked = emu_kernels_instrumented != 0;
    new_segment();
    launch_first = segment;
    for (unsigned long long i = 0; i < n_blocks && !failed; ++i) {
        unsigned long long b = schedule == RANDOM ? order[i] : schedule == REVERSE ? n_blocks - 1 - i : i;
        blockIdx = dim3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y), (unsigned)(b / grid.x / grid.y)};
        run_block(n);
    }
    hooked = false;
}

const EmuKernel* lookup(const char* name)
{
    for (const EmuKernel* k = emu_kernel_table; k->name; ++k)
        if (strcmp(k->name, name) == 0) return k;
    return nullptr;
}

}  // namespace emu

// ---- what the kernel side calls --------------------------------------------------------------------

extern "C" {

void emu_syncthreads() { emu::arrive(emu::block_group, "__syncthreads"); }

unsigned long long emu_shfl_xor(unsigned mask, unsigned long long bits, int lane_mask)
{
    const unsigned tid = emu::current->tid, lane = tid % 32;
    emu::Warp& w = emu::warps[tid / 32];
    if (mask != 0xffffffffu || w.group.live != 32) {
        emu::fail(emu::thread_name(tid) + ": __shfl_xor_sync without all 32 lanes (a partial mask, or a lane "
                                            "that has returned)");
        emu::abandon();
    }
    w.slot[lane] = bits;
    emu::arrive(w.group, "__shfl_xor_sync");
    bits = w.slot[lane ^ ((unsigned)lane_mask & 31u)];
    emu::arrive(w.group, "__shfl_xor_sync");
    return bits;
}

// Atomics: one OS thread runs every fiber and none is switched inside these, so the read-modify-write
// is indivisible; the checker records it as atomic.
#define EMU_ATOMIC(name, T, expr)                           \
    T name(T* p, T v)                                       \
    {                                                       \
        emu::access(p, sizeof(T), emu::ATOMIC);             \
        const T old = *p;                                   \
        *p = (expr);                                        \
        return old;                                         \
    }
EMU_ATOMIC(emu_atomic_add_f32, float, old + v)
EMU_ATOMIC(emu_atomic_add_i32, int, (int)((unsigned)old + (unsigned)v))
EMU_ATOMIC(emu_atomic_add_u32, unsigned, old + v)
EMU_ATOMIC(emu_atomic_max_i32, int, old > v ? old : v)
EMU_ATOMIC(emu_atomic_min_i32, int, old < v ? old : v)
EMU_ATOMIC(emu_atomic_exch_i32, int, v)
#undef EMU_ATOMIC

int emu_atomic_cas_i32(int* p, int compare, int v)
{
    emu::access(p, sizeof(int), emu::ATOMIC);
    const int old = *p;
    if (old == compare) *p = v;
    return old;
}

// The checker: g++'s -fsanitize=thread calls these before the kernel side's loads and stores.
#define EMU_HOOKS(n)                                                                    \
    void __tsan_read##n(void* p) { emu::access(p, n, emu::READ); }                      \
    void __tsan_write##n(void* p) { emu::access(p, n, emu::WRITE); }                    \
    void __tsan_unaligned_read##n(void* p) { emu::access(p, n, emu::READ); }            \
    void __tsan_unaligned_write##n(void* p) { emu::access(p, n, emu::WRITE); }          \
    void __tsan_volatile_read##n(void* p) { emu::access(p, n, emu::READ); }             \
    void __tsan_volatile_write##n(void* p) { emu::access(p, n, emu::WRITE); }
EMU_HOOKS(1)
EMU_HOOKS(2)
EMU_HOOKS(4)
EMU_HOOKS(8)
EMU_HOOKS(16)
#undef EMU_HOOKS
void __tsan_read_range(void* p, unsigned long n) { emu::access_range(p, n, emu::READ); }
void __tsan_write_range(void* p, unsigned long n) { emu::access_range(p, n, emu::WRITE); }
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}

// ---- the Python side's interface --------------------------------------------------------------------

EMU_API const char* emu_error() { return emu::error.c_str(); }

EMU_API int emu_instrumented() { return emu_kernels_instrumented; }

// mode: 0 forward, 1 reverse, 2 random (seeded); preempt: the chance of a switch before an access
// (random mode, checked build only: the plain and ASan builds have no hook to switch at).
EMU_API void emu_set_schedule(int mode, unsigned long long seed, double preempt)
{
    emu::schedule = mode == 1 ? emu::REVERSE : mode == 2 ? emu::RANDOM : emu::FORWARD;
    emu::rng_state = seed * 0x9e3779b97f4a7c15ull + 0x2545f4914f6cdd1dull;
    if (emu::rng_state == 0) emu::rng_state = 1;
    const double p = (mode == 2 && preempt > 0) ? std::min(preempt, 1.0) : 0.0;
    emu::preempt_below = p >= 1.0 ? ~0ull : (uint64_t)(p * 18446744073709551616.0);
}

// on = 0: the checked build's hooks still keep the shadow and switch threads (the schedule's preempt)
// but report nothing, so what a race does to the values can be seen; 1 (the default): they report.
EMU_API void emu_set_checks(int on) { emu::checks_on = on != 0; }

EMU_API int emu_has(const char* name) { return emu::lookup(name) ? 1 : 0; }

EMU_API const char* emu_signature(const char* name)
{
    const EmuKernel* k = emu::lookup(name);
    return k ? k->signature : nullptr;
}

EMU_API long emu_launch_bound(const char* name)
{
    const EmuKernel* k = emu::lookup(name);
    return k ? k->bound : 0;
}

// A device allocation: [start, start + size) may be accessed; [lo, hi) around it are its guard bytes.
// Whatever was tracked there before (an allocation since freed) is forgotten. 0 on success.
EMU_API int emu_track(unsigned long long lo, unsigned long long start, unsigned long long size,
                      unsigned long long hi)
{
    using emu::regions;
    auto overlaps = [&](const emu::Region& r) { return r.lo < hi && lo < r.hi; };
    for (auto& r : regions)
        if (overlaps(r)) emu::unmap_cells(r);
    regions.erase(std::remove_if(regions.begin(), regions.end(), overlaps), regions.end());
    emu::Region r;
    r.lo = lo, r.start = start, r.end = start + size, r.hi = hi;
    if (emu_kernels_instrumented && !emu::attach_cells(r)) return 1;
    regions.insert(std::upper_bound(regions.begin(), regions.end(), r.lo,
                                    [](uintptr_t v, const emu::Region& x) { return v < x.lo; }),
                   r);
    emu::last_hit = 0;
    return 0;
}

EMU_API void emu_untrack(unsigned long long lo)
{
    using emu::regions;
    for (size_t i = 0; i < regions.size(); ++i)
        if (regions[i].lo == lo) {
            emu::unmap_cells(regions[i]);
            regions.erase(regions.begin() + (long)i);
            emu::last_hit = 0;
            return;
        }
}

// The host wrote [p, p + n) (a copy to the device): those bytes are initialized.
EMU_API void emu_mark_written(unsigned long long p, unsigned long long n)
{
    if (!emu_kernels_instrumented || n == 0) return;
    emu::Region* r = emu::find(p);
    if (!r || p < r->start || p + n > r->end) return;
    for (uintptr_t a = p; a < p + n;) {
        const size_t g = (a - r->start) / 4;
        const uintptr_t cell_end = r->start + 4 * g + 4;
        const uintptr_t stop = std::min<uintptr_t>(cell_end, p + n);
        const unsigned first = (unsigned)((a - r->start) % 4);
        r->writes[g].flags |= (uint8_t)(((1u << (stop - a)) - 1) << first);
        a = stop;
    }
}

EMU_API int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, void** args)
{
    emu::failed = false;
    emu::error.clear();
    const EmuKernel* k = emu::lookup(name);
    if (!k) {
        emu::error = std::string("no kernel named ") + name;
        return 1;
    }
    const unsigned long long n = (unsigned long long)bx * by * bz;
    if (n == 0 || n > 1024 || n % 32 || gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535 ||
        bz > 64) {
        emu::error = "invalid launch configuration (threads per block must be 32..1024 in whole warps, "
                     "block.z at most 64, grid.y and grid.z at most 65535)";
        return 1;
    }
    if ((long)n > k->bound) {
        emu::error = std::to_string(n) + " threads per block, more than the kernel's __launch_bounds__(" +
                     std::to_string(k->bound) + "): the GPU refuses such a launch (too many resources requested)";
        return 1;
    }
    if (emu_kernels_instrumented && !emu::shared_region.writes && (uintptr_t)__stop_emu_shared > (uintptr_t)__start_emu_shared) {
        emu::shared_region.shared = true;
        emu::shared_region.lo = emu::shared_region.start = (uintptr_t)__start_emu_shared;
        emu::shared_region.end = emu::shared_region.hi = (uintptr_t)__stop_emu_shared;
        if (!emu::attach_cells(emu::shared_region)) {
            emu::error = "cannot map the shadow of shared memory";
            return 1;
        }
    }
    gridDim = dim3{gx, gy, gz};
    blockDim = dim3{bx, by, bz};
    emu::kernel = k;
    emu::kernel_args = args;
    emu::run(gridDim, (unsigned)n);
    return emu::failed ? 1 : 0;
}

}  // extern "C"
