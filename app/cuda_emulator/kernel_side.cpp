// The kernel side of the CPU emulator (the runtime is runtime.cpp, beside it): the CUDA vocabulary a
// kernel source uses, defined for g++, then the kernel source itself and the table of its kernels.
//
// emulator.py compiles this file with
//   -DEMU_KERNEL_SOURCE="<the .cu>"   stages/kernels/cuda.cu, a learner's kernel, or a test's
//   -DEMU_KERNEL_TABLE="<a header>"   EMU_KERNEL(name, bound) per __global__ function, read from the
//                                     preprocessed source with its __launch_bounds__
// and, in the checked build, -fsanitize=thread: g++ then calls __tsan_read4(p), __tsan_write4(p), ...
// before every load and store of the kernels, and the runtime's definitions of those are the checker.
// The runtime is compiled without it, so only the kernels' own accesses are seen.

#include <math.h>
#include <string.h>

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)           // read from the source by emulator.py, checked at launch
// One linker section holds every __shared__ variable: the runtime poisons it before each block and
// keeps its shadow (a kernel with two __shared__ variables has them both there).
#define __shared__ static __attribute__((section("emu_shared"), aligned(16)))

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct float4 {
    float x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

extern "C" {
extern dim3 threadIdx, blockIdx, blockDim, gridDim;
void emu_syncthreads();
unsigned long long emu_shfl_xor(unsigned mask, unsigned long long bits, int lane_mask);
float emu_atomic_add_f32(float* p, float v);
int emu_atomic_add_i32(int* p, int v);
unsigned emu_atomic_add_u32(unsigned* p, unsigned v);
int emu_atomic_max_i32(int* p, int v);
int emu_atomic_min_i32(int* p, int v);
int emu_atomic_exch_i32(int* p, int v);
int emu_atomic_cas_i32(int* p, int compare, int v);
}

namespace emu {                          // what a kernel source may call under #ifdef CUDA_EMULATOR
struct Abort {};
void fail(const std::string& what);
}

static inline void __syncthreads() { emu_syncthreads(); }

template <class V>
V __shfl_xor_sync(unsigned mask, V v, int lane_mask)
{
    static_assert(sizeof(V) <= 8, "shuffle of a value wider than 8 bytes");
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(V));
    bits = emu_shfl_xor(mask, bits, lane_mask);
    V out;
    memcpy(&out, &bits, sizeof(V));
    return out;
}

static inline float atomicAdd(float* p, float v) { return emu_atomic_add_f32(p, v); }
static inline int atomicAdd(int* p, int v) { return emu_atomic_add_i32(p, v); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return emu_atomic_add_u32(p, v); }
static inline int atomicMax(int* p, int v) { return emu_atomic_max_i32(p, v); }
static inline int atomicMin(int* p, int v) { return emu_atomic_min_i32(p, v); }
static inline int atomicExch(int* p, int v) { return emu_atomic_exch_i32(p, v); }
static inline int atomicCAS(int* p, int compare, int v) { return emu_atomic_cas_i32(p, compare, v); }

#define EMU_CHECK_ALIGNED(p, n)                                                               \
    do {                                                                                      \
        if ((unsigned long long)(p) % (n)) {                                                  \
            emu::fail("a misaligned " #n "-byte load (a float4 load would fault on the GPU)"); \
            throw emu::Abort();                                                               \
        }                                                                                     \
    } while (0)

#include EMU_KERNEL_SOURCE

// ---- the table of kernels ----------------------------------------------------------------------------

namespace emu_table {

template <class T>
constexpr char code()
{
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) return 'P';
    else if constexpr (std::is_same_v<U, int>) return 'i';
    else if constexpr (std::is_same_v<U, unsigned>) return 'I';
    else if constexpr (std::is_same_v<U, float>) return 'f';
    else if constexpr (std::is_same_v<U, double>) return 'd';
    else return '?';
}

template <class... A>
struct Signature {
    static constexpr char text[] = {code<A>()..., '\0'};
};

template <class... A>
constexpr const char* signature(void (*)(A...)) { return Signature<A...>::text; }

template <class... A, size_t... I>
void call_with(void (*k)(A...), void** args, std::index_sequence<I...>)
{
    k(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

template <class... A>
void call(void (*k)(A...), void** args) { call_with(k, args, std::index_sequence_for<A...>{}); }

}  // namespace emu_table

#define EMU_FIRST(a, ...) (a)
#define EMU_KERNEL(name, ...) static void emu_thunk_##name(void** args) { emu_table::call(name, args); }
#include EMU_KERNEL_TABLE
#undef EMU_KERNEL

struct EmuKernel {
    const char* name;
    long bound;
    void (*thunk)(void**);
    const char* signature;
};

#define EMU_KERNEL(name, ...) {#name, (long)EMU_FIRST(__VA_ARGS__), emu_thunk_##name, emu_table::signature(name)},
extern "C" const EmuKernel emu_kernel_table[] = {
#include EMU_KERNEL_TABLE
    {nullptr, 0, nullptr, nullptr}};
#undef EMU_KERNEL

#if defined(__SANITIZE_THREAD__)
extern "C" const int emu_kernels_instrumented = 1;
#else
extern "C" const int emu_kernels_instrumented = 0;
#endif

// ---- the host side of the block decoders (stages/kernels/cuda.cu only) --------------------------------

// n_values of type `type` (a kernel suffix) -> float32; 0 on success.
extern "C" __attribute__((visibility("default"))) int emu_dequantize(const char* type, const unsigned char* raw,
                                                                    long long n_values, float* out)
{
#if defined(FOR_EACH_QUANT_TYPE) && defined(FOR_EACH_FLOAT_TYPE)
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
#endif
    (void)type, (void)raw, (void)n_values, (void)out;
    return 1;
}
