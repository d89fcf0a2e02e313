// The cuda stage's kernels: every op of one forward pass, on the device.
// stages/cuda.py compiles this file with PyCUDA's SourceModule (no_extern_c=True) and says why
// each kernel exists; this file says how each one works.
//
//   matmul_<type>_m1     decode: y = x W^T for one activation row; one warp per output row
//   matmul_<type>_m8     prefill: the same, 8 activation rows per weight-block load
//   embed_<type>         h[m] = token_embd[ids[m]], dequantized on the device
//   rms_norm rope kv_store attention swiglu add mul scale silu argmax
//
// Weights stay in their ggml blocks exactly as the GGUF file stores them (see
// common/quants.py for the layouts). A block is 18, 20, 22, 24, 34, 84, 110, 144, 176 or 210
// bytes long, so inside a row the blocks are NOT 4-byte aligned: every multi-byte field is
// read byte by byte (ld16, ld32), never through a cast to a wider pointer.
//
// Activations are float32, row-major [M, width], in a scratch arena whose buffers start on
// 256-byte boundaries; every width the float4 loads touch is a multiple of 4 (it is a multiple
// of the 32- or 256-value block), so those loads are 16-byte aligned.
//
// Everything marked __host__ __device__ also compiles for the CPU: the tests build this file
// with g++ around a small emulator of CUDA threads, blocks, __syncthreads and warp shuffles
// (app/cuda_emulator/) and check every kernel against numpy without a GPU.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

#define WARP 32
#define FULL_MASK 0xffffffffu
#define MM_WARPS 4           // matmul: warps (= output rows) per thread block
#define MM_THREADS (MM_WARPS * WARP)
#define MT_PREFILL 8         // matmul: activation rows per weight-block load on the prefill path
#define EMBED_THREADS 128
#define NORM_THREADS 256
#define EW_THREADS 256       // elementwise kernels
#define ATT_WARPS 8          // attention: warps per (query row, head)
#define ATT_THREADS (ATT_WARPS * WARP)
#define HD_MAX 256           // attention: largest head dimension supported
#define ARGMAX_THREADS 1024

// ---- reading the bytes of a block ------------------------------------------------------------

__host__ __device__ __forceinline__ u32 ld16(const u8* p) { return (u32)p[0] | ((u32)p[1] << 8); }

__host__ __device__ __forceinline__ u32 ld32(const u8* p)
{
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__host__ __device__ __forceinline__ float bits_to_f32(u32 bits)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
#endif
}

// IEEE binary16 -> float32, exact (subnormals, infinities and NaN included).
__host__ __device__ __forceinline__ float f16_to_f32(u32 h)
{
#ifdef __CUDA_ARCH__
    float f;
    const unsigned short hs = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(hs));
    return f;
#else
    const u32 sign = (h & 0x8000u) << 16;
    const u32 exp = (h >> 10) & 0x1fu;
    const u32 man = h & 0x3ffu;
    if (exp == 0) {                                    // zero or subnormal: man * 2^-24, exact
        const float mag = (float)man * 5.9604644775390625e-08f;
        return sign ? -mag : mag;
    }
    if (exp == 31) return bits_to_f32(sign | 0x7f800000u | (man << 13));
    return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

__host__ __device__ __forceinline__ float bf16_to_f32(u32 h) { return bits_to_f32(h << 16); }

__host__ __device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// ---- one struct per quantized type ---------------------------------------------------------
//
// A block of QK values (BYTES bytes) is decoded in CPB "chunks" of VPC values each; one thread
// (one lane of a warp) handles one chunk at a time, so the 32 lanes of a warp read neighbouring
// bytes of the same few blocks. decode(block, s, v) writes chunk s's values into v; they belong
// to VPC/4 runs of 4 consecutive columns: v[4r + i] is column base(s) + run(r) + i of the
// block. (Runs, because the formats interleave: Q4_0 byte j holds values j and j + 16.)
// Each decode computes exactly what common/quants.py computes, in the same order.

struct BlockQ4_0 {   // d:f16, qs[16]: value j = (qs[j] & 15) - 8, value j + 16 = (qs[j] >> 4) - 8; times d
    enum { QK = 32, BYTES = 18, VPC = 8, CPB = 4 };
    __host__ __device__ static int base(int s) { return 4 * s; }
    __host__ __device__ static int run(int r) { return 16 * r; }
    __host__ __device__ static void decode(const u8* b, int s, float* v)
    {
        const float d = f16_to_f32(ld16(b));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 q = b[2 + 4 * s + i];
            v[i] = (float)((int)(q & 15u) - 8) * d;
            v[4 + i] = (float)((int)(q >> 4) - 8) * d;
        }
    }
};

struct BlockQ4_1 {   // d:f16, m:f16, qs[16]: value = q * d + m
    enum { QK = 32, BYTES = 20, VPC = 8, CPB = 4 };
    __host__ __device__ static int base(int s) { return 4 * s; }
    __host__ __device__ static int run(int r) { return 16 * r; }
    __host__ __device__ static void decode(const u8* b, int s, float* v)
    {
        const float d = f16_to_f32(ld16(b)), m = f16_to_f32(ld16(b + 2));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 q = b[4 + 4 * s + i];
            v[i] = (float)(q & 15u) * d + m;
            v[4 + i] = (float)(q >> 4) * d + m;
        }
    }
};

struct BlockQ5_0 {   // d:f16, qh:u32 (bit j = 5th bit of value j), qs[16]: value = (q - 16) * d
    enum { QK = 32, BYTES = 22, VPC = 8, CPB = 4 };
    __host__ __device__ static int base(int s) { return 4 * s; }
    __host__ __device__ static int run(int r) { return 16 * r; }
    __host__ __device__ static void decode(const u8* b, int s, float* v)
    {
        const float d = f16_to_f32(ld16(b));
        const u32 qh = ld32(b + 2);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int j = 4 * s + i;
            const u32 q = b[6 + j];
            const u32 lo = (q & 15u) | (((qh >> j) & 1u) << 4);
            const u32 hi = (q >> 4) | (((qh >> (j + 16)) & 1u) << 4);
            v[i] = (float)((int)lo - 16) * d;
            v[4 + i] = (float)((int)hi - 16) * d;
        }
    }
};

struct BlockQ5_1 {   // d:f16, m:f16, qh:u32, qs[16]: value = q * d + m
    enum { QK = 32, BYTES = 24, VPC = 8, CPB = 4 };
    __host__ __device__ static int base(int s) { return 4 * s; }
    __host__ __device__ static int run(int r) { return 16 * r; }
    __host__ __device__ static void decode(const u8* b, int s, float* v)
    {
        const float d = f16_to_f32(ld16(b)), m = f16_to_f32(ld16(b + 2));
        const u32 qh = ld32(b + 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int j = 4 * s + i;
            const u32 q = b[8 + j];
            const u32 lo = (q & 15u) | (((qh >> j) & 1u) << 4);
            const u32 hi = (q >> 4) | (((qh >> (j + 16)) & 1u) << 4);
            v[i] = (float)lo * d + m;
            v[4 + i] = (float)hi * d + m;
        }
    }
};

struct BlockQ8_0 {   // d:f16, qs[32] int8: value = q * d
    enum { QK = 32, BYTES = 34, VPC = 8, CPB = 4 };
    __host__ __device__ static int base(int s) { return 8 * s; }
    __host__ __device__ static int run(int r) { return 4 * r; }
    __host__ __device__ static void decode(const u8* b, int s, float* v)
    {
        const float d = f16_to_f32(ld16(b));
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = (float)(i8)b[2 + 8 * s + i] * d;
    }
};

// The K-quants: 256 values per super-block. Their chunks are 16 values: 4 runs of 4.

// Q2_K and Q3_K pack 4 two-bit values per byte: byte qs[32n + l] holds values 128n + 32j + l
// in bits 2j..2j+1 (j = 0..3). Chunk s: half n = s / 8, l0 = 4 (s % 8); run j = column offset 32j.
struct BlockQ2_K {   // scales[16] (sc | m << 4), qs[64], d:f16, dmin:f16: value = d*sc*q - dmin*m
    enum { QK = 256, BYTES = 84, VPC = 16, CPB = 16 };
    __host__ __device__ static int base(int s) { return 128 * (s >> 3) + 4 * (s & 7); }
    __host__ __device__ static int run(int r) { return 32 * r; }
    __host__ __device__ static void decode(const u8* b, int s, float* v)
    {
        const int n = s >> 3, l0 = 4 * (s & 7);
        const float d = f16_to_f32(ld16(b + 80)), dmin = f16_to_f32(ld16(b + 82));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 sc = b[8 * n + 2 * j + (l0 >> 4)];           // sub-block of 16 values
            const float dl = d * (float)(sc & 15u), ml = dmin * (float)(sc >> 4);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 q = (b[16 + 32 * n + l0 + i] >> (2 * j)) & 3u;
                v[4 * j + i] = dl * (float)q - ml;
            }
        }
    }
};

struct BlockQ3_K {   // hmask[32], qs[64], scales[12] (16 six-bit scales, +32), d:f16
    enum { QK = 256, BYTES = 110, VPC = 16, CPB = 16 };
    __host__ __device__ static int base(int s) { return 128 * (s >> 3) + 4 * (s & 7); }
    __host__ __device__ static int run(int r) { return 32 * r; }
    __host__ __device__ static int scale(const u8* sc, int k)   // k = sub-block 0..15 -> -32..31
    {
        const u32 low = k < 8 ? (sc[k] & 15u) : (sc[k - 8] >> 4);
        const u32 high = (sc[8 + (k & 3)] >> (2 * (k >> 2))) & 3u;
        return (int)(low | (high << 4)) - 32;
    }
    __host__ __device__ static void decode(const u8* b, int s, float* v)
    {
        const int n = s >> 3, l0 = 4 * (s & 7);
        const float d = f16_to_f32(ld16(b + 108));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float dl = d * (float)scale(b + 96, 8 * n + 2 * j + (l0 >> 4));
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int l = l0 + i;
                const int q2 = (int)((b[32 + 32 * n + l] >> (2 * j)) & 3u);
                const int hbit = (int)((b[l] >> (4 * n + j)) & 1u);   // hmask bit 4n + j of byte l
                v[4 * j + i] = dl * (float)(q2 - (hbit ? 0 : 4));
            }
        }
    }
};

// Q4_K / Q5_K scales: 8 six-bit scales and 8 six-bit mins packed in 12 bytes (k4_scale_min).
__host__ __device__ __forceinline__ void k4_scale_min(const u8* sc, int k, u32* scale, u32* min)
{
    if (k < 4) {
        *scale = sc[k] & 63u;
        *min = sc[k + 4] & 63u;
    } else {
        *scale = (sc[k + 4] & 15u) | ((u32)(sc[k - 4] >> 6) << 4);
        *min = (u32)(sc[k + 4] >> 4) | ((u32)(sc[k] >> 6) << 4);
    }
}

// Q4_K/Q5_K: the scale and the offset of chunk c's two sub-blocks, 2c (low nibbles) and
// 2c + 1 (high nibbles): value = dl * q - ml.
__host__ __device__ inline void k4_chunk_scales(const u8* b, int c, float* dl0, float* ml0,
                                                float* dl1, float* ml1)
{
    const float d = f16_to_f32(ld16(b)), dmin = f16_to_f32(ld16(b + 2));
    u32 sc, m;
    k4_scale_min(b + 4, 2 * c, &sc, &m);
    *dl0 = d * (float)sc;
    *ml0 = dmin * (float)m;
    k4_scale_min(b + 4, 2 * c + 1, &sc, &m);
    *dl1 = d * (float)sc;
    *ml1 = dmin * (float)m;
}

// Q4_K: 64-value chunk c uses qs[32c .. 32c+31]: low nibbles are sub-block 2c (values
// 64c + l), high nibbles sub-block 2c + 1 (values 64c + 32 + l). Chunk s: c = s / 4,
// l0 = 8 (s % 4); runs at column offsets 0, 4 (low nibbles), 32, 36 (high nibbles).
struct BlockQ4_K {   // d:f16, dmin:f16, scales[12], qs[128]: value = d*sc*q - dmin*m
    enum { QK = 256, BYTES = 144, VPC = 16, CPB = 16 };
    __host__ __device__ static int base(int s) { return 64 * (s >> 2) + 8 * (s & 3); }
    __host__ __device__ static int run(int r) { return (r & 1) * 4 + (r >> 1) * 32; }
    __host__ __device__ static void decode(const u8* b, int s, float* v)
    {
        const int c = s >> 2, l0 = 8 * (s & 3);
        float dl0, ml0, dl1, ml1;
        k4_chunk_scales(b, c, &dl0, &ml0, &dl1, &ml1);
#pragma unroll
        for (int i = 0; i < 8; ++i) {              // i = l - l0: run i / 4, position i % 4
            const u32 q = b[16 + 32 * c + l0 + i];
            v[i] = dl0 * (float)(q & 15u) - ml0;
            v[8 + i] = dl1 * (float)(q >> 4) - ml1;
        }
    }
};

struct BlockQ5_K {   // d:f16, dmin:f16, scales[12], qh[32], qs[128]: Q4_K plus a 5th bit
    enum { QK = 256, BYTES = 176, VPC = 16, CPB = 16 };
    __host__ __device__ static int base(int s) { return BlockQ4_K::base(s); }   // Q4_K's layout
    __host__ __device__ static int run(int r) { return BlockQ4_K::run(r); }
    __host__ __device__ static void decode(const u8* b, int s, float* v)
    {
        const int c = s >> 2, l0 = 8 * (s & 3);
        float dl0, ml0, dl1, ml1;
        k4_chunk_scales(b, c, &dl0, &ml0, &dl1, &ml1);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int l = l0 + i;
            const u32 q = b[48 + 32 * c + l];
            const u32 qh = b[16 + l];                  // bit k of qh[l]: value l of sub-block k
            const u32 lo = (q & 15u) | (((qh >> (2 * c)) & 1u) << 4);
            const u32 hi = (q >> 4) | (((qh >> (2 * c + 1)) & 1u) << 4);
            v[i] = dl0 * (float)lo - ml0;
            v[8 + i] = dl1 * (float)hi - ml1;
        }
    }
};

// Q6_K: for the 128-value half n (ql[64n..], qh[32n..]) and l < 32, value 128n + 32k + l has
// low 4 bits  k=0: ql[l] & 15  k=1: ql[l+32] & 15  k=2: ql[l] >> 4  k=3: ql[l+32] >> 4
// high 2 bits: bits 2k..2k+1 of qh[l]. Chunk s: n = s / 8, l0 = 4 (s % 8); run k = offset 32k.
struct BlockQ6_K {   // ql[128], qh[64], scales[16] int8, d:f16: value = d * scale * (q - 32)
    enum { QK = 256, BYTES = 210, VPC = 16, CPB = 16 };
    __host__ __device__ static int base(int s) { return 128 * (s >> 3) + 4 * (s & 7); }
    __host__ __device__ static int run(int r) { return 32 * r; }
    __host__ __device__ static void decode(const u8* b, int s, float* v)
    {
        const int n = s >> 3, l0 = 4 * (s & 7);
        const float d = f16_to_f32(ld16(b + 208));
        const u8* ql = b + 64 * n;
        const u8* qh = b + 128 + 32 * n;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float dl = d * (float)(i8)b[192 + 8 * n + 2 * k + (l0 >> 4)];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int l = l0 + i;
                const u32 low = (k & 1) ? ql[l + 32] : ql[l];
                const u32 lo4 = (k & 2) ? (low >> 4) : (low & 15u);
                const u32 q = lo4 | (((qh[l] >> (2 * k)) & 3u) << 4);
                v[4 * k + i] = dl * (float)((int)q - 32);
            }
        }
    }
};

// The plain float types: one "block" is one value.
struct ElemF32 {
    __host__ __device__ static float get(const u8* row, int j) { return ((const float*)row)[j]; }
    enum { BYTES = 4 };
};
struct ElemF16 {
    __host__ __device__ static float get(const u8* row, int j) { return f16_to_f32(((const u16*)row)[j]); }
    enum { BYTES = 2 };
};
struct ElemBF16 {
    __host__ __device__ static float get(const u8* row, int j) { return bf16_to_f32(((const u16*)row)[j]); }
    enum { BYTES = 2 };
};

// ---- the matmul: y[m, n] = sum_k x[m, k] W[n, k] -------------------------------------------

__host__ __device__ __forceinline__ float4 load4(const float* p)
{
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const float4*>(p);        // 16-byte aligned: see the file header
#else
#ifdef CUDA_EMULATOR
    EMU_CHECK_ALIGNED(p, 16);                          // what would fault on the GPU
#endif
    return make_float4(p[0], p[1], p[2], p[3]);
#endif
}

// One chunk of a weight row against up to MT activation rows: decode the chunk once, then
// multiply it into every row's accumulator (the prefill path's weight reuse).
// x points at activation row m0; rows are K floats apart; rows >= mrows are skipped.
template <class T, int MT>
__host__ __device__ __forceinline__ void chunk_dot(const u8* row, int c, const float* x, int K, int mrows,
                                                   float* acc)
{
    const int blk = c / T::CPB, s = c % T::CPB;
    float v[T::VPC];
    T::decode(row + (size_t)blk * T::BYTES, s, v);
    const int col = blk * T::QK + T::base(s);
#pragma unroll
    for (int mm = 0; mm < MT; ++mm) {
        if (mm < mrows) {
            const float* xr = x + (size_t)mm * K + col;
            float a = 0.0f;
#pragma unroll
            for (int r = 0; r < T::VPC / 4; ++r) {
                const float4 xv = load4(xr + T::run(r));
                a += v[4 * r] * xv.x + v[4 * r + 1] * xv.y + v[4 * r + 2] * xv.z + v[4 * r + 3] * xv.w;
            }
            acc[mm] += a;
        }
    }
}

// Dequantize chunk c of a row into out (a float row of the block's width): the embedding lookup.
template <class T>
__host__ __device__ __forceinline__ void chunk_store(const u8* row, int c, float* out)
{
    const int blk = c / T::CPB, s = c % T::CPB;
    float v[T::VPC];
    T::decode(row + (size_t)blk * T::BYTES, s, v);
    float* o = out + blk * T::QK + T::base(s);
    for (int r = 0; r < T::VPC / 4; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[T::run(r) + i] = v[4 * r + i];
}

#if defined(__CUDACC__) || defined(CUDA_EMULATOR)

__device__ __forceinline__ float warp_sum(float a)
{
    for (int o = WARP / 2; o > 0; o >>= 1) a += __shfl_xor_sync(FULL_MASK, a, o);
    return a;
}

// Sum each of acc[0..MT-1] over the 32 lanes in MT - 1 + 5 - log2(MT) shuffles (9 for MT = 8,
// not 8 x 5): in each halving step a lane keeps one half of its values, sends the other half to
// the partner `offset` lanes away, and adds what the partner sent for the half it kept; then the
// one value left is summed over the lanes that share it. Lane l ends with row l / (32 / MT).
template <int MT>
__device__ __forceinline__ float warp_sum_rows(float* acc, int lane)
{
    static_assert(MT >= 1 && MT <= WARP && (MT & (MT - 1)) == 0, "MT must be a power of two <= 32");
    int offset = WARP / 2;
#pragma unroll
    for (int width = MT / 2; width >= 1; width /= 2, offset /= 2) {
        const bool upper = (lane & offset) != 0;
#pragma unroll
        for (int j = 0; j < width; ++j) {
            const float send = upper ? acc[j] : acc[j + width];
            const float keep = upper ? acc[j + width] : acc[j];
            acc[j] = keep + __shfl_xor_sync(FULL_MASK, send, offset);
        }
    }
    float a = acc[0];
    for (; offset > 0; offset /= 2) a += __shfl_xor_sync(FULL_MASK, a, offset);
    return a;
}

// Grid (ceil(N / MM_WARPS), ceil(M / MT)), MM_THREADS threads: warp w of block (bx, by) computes
// output column n = bx * MM_WARPS + w for activation rows by*MT .. by*MT + MT-1. Its 32 lanes
// walk the weight row chunk by chunk (lane l takes chunks l, l + 32, ...), so a warp reads a
// contiguous stretch of the row per step; a shuffle reduction adds the 32 partial sums.
template <class T, int MT>
__device__ __forceinline__ void matmul_q(const u8* __restrict__ W, const float* __restrict__ X,
                                         float* __restrict__ Y, int N, int K, int M, int row_bytes)
{
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int n = blockIdx.x * MM_WARPS + warp;
    const int m0 = blockIdx.y * MT;
    if (n >= N || m0 >= M) return;                 // the whole warp leaves together
    const int mrows = imin(MT, M - m0);
    const u8* row = W + (size_t)n * row_bytes;
    const float* x = X + (size_t)m0 * K;
    const int n_chunks = (K / T::QK) * T::CPB;
    float acc[MT];
#pragma unroll
    for (int mm = 0; mm < MT; ++mm) acc[mm] = 0.0f;
    for (int c = lane; c < n_chunks; c += WARP) chunk_dot<T, MT>(row, c, x, K, mrows, acc);
    const float total = warp_sum_rows<MT>(acc, lane);
    const int r = lane / (WARP / MT);
    if (lane % (WARP / MT) == 0 && r < mrows) Y[(size_t)(m0 + r) * N + n] = total;
}

// Float weights: lane l reads columns l, l + 32, ...: consecutive lanes, consecutive addresses.
template <class E, int MT>
__device__ __forceinline__ void matmul_f(const u8* __restrict__ W, const float* __restrict__ X,
                                         float* __restrict__ Y, int N, int K, int M, int row_bytes)
{
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int n = blockIdx.x * MM_WARPS + warp;
    const int m0 = blockIdx.y * MT;
    if (n >= N || m0 >= M) return;
    const int mrows = imin(MT, M - m0);
    const u8* row = W + (size_t)n * row_bytes;
    float acc[MT];
#pragma unroll
    for (int mm = 0; mm < MT; ++mm) acc[mm] = 0.0f;
    for (int k = lane; k < K; k += WARP) {
        const float w = E::get(row, k);
#pragma unroll
        for (int mm = 0; mm < MT; ++mm)
            if (mm < mrows) acc[mm] += w * X[(size_t)(m0 + mm) * K + k];
    }
    const float total = warp_sum_rows<MT>(acc, lane);
    const int r = lane / (WARP / MT);
    if (lane % (WARP / MT) == 0 && r < mrows) Y[(size_t)(m0 + r) * N + n] = total;
}

// Grid (ceil(chunks per row / EMBED_THREADS), M): one thread per chunk of row ids[m].
template <class T>
__device__ __forceinline__ void embed_q(const u8* __restrict__ W, const int* __restrict__ ids,
                                        float* __restrict__ out, int D, int row_bytes)
{
    const int m = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= (D / T::QK) * T::CPB) return;
    chunk_store<T>(W + (size_t)ids[m] * row_bytes, c, out + (size_t)m * D);
}

template <class E>
__device__ __forceinline__ void embed_f(const u8* __restrict__ W, const int* __restrict__ ids,
                                        float* __restrict__ out, int D, int row_bytes)
{
    const int m = blockIdx.y;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    out[(size_t)m * D + j] = E::get(W + (size_t)ids[m] * row_bytes, j);
}

// The entry points PyCUDA looks up by name: one per (op, type). Argument lists must match
// KERNEL_ARGS in stages/cuda.py.
#define MATMUL_ARGS const u8* W, const float* X, float* Y, int N, int K, int M, int row_bytes
#define EMBED_ARGS const u8* W, const int* ids, float* out, int D, int row_bytes

#define DEFINE_QUANT_KERNELS(name, T)                                                               \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) matmul_##name##_m1(MATMUL_ARGS)          \
    { matmul_q<T, 1>(W, X, Y, N, K, M, row_bytes); }                                                \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) matmul_##name##_m8(MATMUL_ARGS)          \
    { matmul_q<T, MT_PREFILL>(W, X, Y, N, K, M, row_bytes); }                                       \
    extern "C" __global__ void __launch_bounds__(EMBED_THREADS) embed_##name(EMBED_ARGS)              \
    { embed_q<T>(W, ids, out, D, row_bytes); }

#define DEFINE_FLOAT_KERNELS(name, E)                                                               \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) matmul_##name##_m1(MATMUL_ARGS)          \
    { matmul_f<E, 1>(W, X, Y, N, K, M, row_bytes); }                                                \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) matmul_##name##_m8(MATMUL_ARGS)          \
    { matmul_f<E, MT_PREFILL>(W, X, Y, N, K, M, row_bytes); }                                       \
    extern "C" __global__ void __launch_bounds__(EMBED_THREADS) embed_##name(EMBED_ARGS)              \
    { embed_f<E>(W, ids, out, D, row_bytes); }

#define FOR_EACH_QUANT_TYPE(X) \
    X(q4_0, BlockQ4_0) X(q4_1, BlockQ4_1) X(q5_0, BlockQ5_0) X(q5_1, BlockQ5_1) X(q8_0, BlockQ8_0) \
    X(q2_k, BlockQ2_K) X(q3_k, BlockQ3_K) X(q4_k, BlockQ4_K) X(q5_k, BlockQ5_K) X(q6_k, BlockQ6_K)
#define FOR_EACH_FLOAT_TYPE(X) X(f32, ElemF32) X(f16, ElemF16) X(bf16, ElemBF16)

FOR_EACH_QUANT_TYPE(DEFINE_QUANT_KERNELS)
FOR_EACH_FLOAT_TYPE(DEFINE_FLOAT_KERNELS)

// ---- rms_norm: out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w --------------------------------
// Grid M, NORM_THREADS threads. The sum of squares is accumulated in double, as ggml's CPU
// code and the CPU stages do.

__device__ __forceinline__ double warp_sum_double(double a)
{
    for (int o = WARP / 2; o > 0; o >>= 1) a += __shfl_xor_sync(FULL_MASK, a, o);
    return a;
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int D, double eps)
{
    __shared__ double partial[NORM_THREADS / WARP];
    __shared__ float inv_rms;
    const float* xr = x + (size_t)blockIdx.x * D;
    float* o = out + (size_t)blockIdx.x * D;
    double ss = 0.0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) ss += (double)xr[j] * (double)xr[j];
    ss = warp_sum_double(ss);
    if (threadIdx.x % WARP == 0) partial[threadIdx.x / WARP] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int i = 0; i < (int)(blockDim.x / WARP); ++i) total += partial[i];
        inv_rms = (float)(1.0 / sqrt(total / D + eps));
    }
    __syncthreads();
    const float r = inv_rms;
    for (int j = threadIdx.x; j < D; j += blockDim.x) o[j] = xr[j] * r * w[j];
}

// ---- rope ('NORM' mode): rotate adjacent pairs (x[2i], x[2i+1]) of every head ---------------
// x, out [M, n_heads * 2 * half]; cos_t, sin_t [n_ctx, half]; row m sits at position start + m.
// One thread per pair.

extern "C" __global__ void __launch_bounds__(EW_THREADS)
rope(const float* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
     float* __restrict__ out, int M, int n_heads, int half, int start)
{
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = n_heads * half;
    if (idx >= M * per_row) return;
    const int m = idx / per_row, rest = idx % per_row;
    const int i = rest % half;                        // pair index inside its head
    const size_t t = (size_t)(start + m) * half + i;
    const float c = cos_t[t], s = sin_t[t];
    const size_t at = (size_t)m * per_row * 2 + (size_t)rest * 2;   // head h's pair i: h*2*half + 2i
    const float x0 = x[at], x1 = x[at + 1];
    out[at] = x0 * c - x1 * s;
    out[at + 1] = x0 * s + x1 * c;
}

// ---- kv_store: this step's K and V rows into the cache (both in one launch) ------------------

extern "C" __global__ void __launch_bounds__(EW_THREADS)
kv_store(const float* __restrict__ k, const float* __restrict__ v, float* __restrict__ k_cache,
         float* __restrict__ v_cache, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        k_cache[i] = k[i];
        v_cache[i] = v[i];
    }
}

// ---- attention: causal, grouped KV heads, online softmax ------------------------------------
// Grid (H, M), ATT_THREADS threads: one block per (query head h, query row m). Query row m sits
// at position start + m and sees keys 0..start+m. k, v: [>= start+M, Hkv*hd] (the cache);
// q, out: [M, H*hd]. Head h reads KV head h / (H / Hkv).
//
// Each warp takes every ATT_WARPS-th key and keeps its own running softmax state over the keys
// it has seen: the largest score mx, the sum l of exp(score - mx), and acc = sum of
// exp(score - mx) * v (each lane holds hd/32 of acc's elements). A larger score rescales l and
// acc by exp(old mx - new mx). At the end the warps' states are merged the same way. No score
// is ever written to global memory, and the softmax never needs a second pass.

__host__ __device__ __forceinline__ void online_merge(float* mx, float* l, float s_mx, float s_l)
{
    // fold the state (s_mx, s_l) into (mx, l); returns nothing, see attention() for acc
    const float m_new = fmaxf(*mx, s_mx);
    const float a = (*mx == -INFINITY) ? 0.0f : expf(*mx - m_new);
    const float b = (s_mx == -INFINITY) ? 0.0f : expf(s_mx - m_new);
    *l = *l * a + s_l * b;
    *mx = m_new;
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attention(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
          float* __restrict__ out, int n_head, int n_head_kv, int hd, int start, float kq_scale)
{
    __shared__ float q_s[HD_MAX];
    __shared__ float mx_s[ATT_WARPS];
    __shared__ float l_s[ATT_WARPS];
    __shared__ float acc_s[ATT_WARPS][HD_MAX];
    const int h = blockIdx.x, m = blockIdx.y;
    const int kvh = h / (n_head / n_head_kv);
    const int q_dim = n_head * hd, kv_dim = n_head_kv * hd;
    const int n_keys = start + m + 1;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;

    const float* qr = q + (size_t)m * q_dim + (size_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) q_s[d] = qr[d] * kq_scale;
    __syncthreads();

    float mx = -INFINITY, l = 0.0f, acc[HD_MAX / WARP];
#pragma unroll
    for (int i = 0; i < HD_MAX / WARP; ++i) acc[i] = 0.0f;
    const float* kb = k + (size_t)kvh * hd;
    const float* vb = v + (size_t)kvh * hd;
    for (int t = warp; t < n_keys; t += ATT_WARPS) {
        const float* kr = kb + (size_t)t * kv_dim;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < HD_MAX / WARP; ++i) {
            const int d = lane + WARP * i;
            if (d < hd) s += q_s[d] * kr[d];
        }
        s = warp_sum(s);                              // every lane now holds the score
        const float m_new = fmaxf(mx, s);
        const float alpha = expf(mx - m_new);         // 0 for the first key (mx = -inf)
        const float p = expf(s - m_new);
        l = l * alpha + p;
        const float* vr = vb + (size_t)t * kv_dim;
#pragma unroll
        for (int i = 0; i < HD_MAX / WARP; ++i) {
            const int d = lane + WARP * i;
            if (d < hd) acc[i] = acc[i] * alpha + p * vr[d];
        }
        mx = m_new;
    }
    if (lane == 0) {
        mx_s[warp] = mx;
        l_s[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < HD_MAX / WARP; ++i) {
        const int d = lane + WARP * i;
        if (d < hd) acc_s[warp][d] = acc[i];
    }
    __syncthreads();

    float M_all = -INFINITY, L = 0.0f;               // merge the warps' states
    for (int w = 0; w < ATT_WARPS; ++w) online_merge(&M_all, &L, mx_s[w], l_s[w]);
    float* o = out + (size_t)m * q_dim + (size_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w)
            if (mx_s[w] != -INFINITY) sum += acc_s[w][d] * expf(mx_s[w] - M_all);
        o[d] = sum / L;
    }
}

// ---- elementwise ----------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(EW_THREADS)
swiglu(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ out, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];        // silu(gate) * up, one pass, no temporary
    }
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
silu(const float* __restrict__ x, float* __restrict__ out, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] / (1.0f + expf(-x[i]));
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
add(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
mul(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * b[i];
}

extern "C" __global__ void __launch_bounds__(EW_THREADS)
scale(const float* __restrict__ x, float* __restrict__ out, int n, float s)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * s;
}

// ---- argmax: the index of the largest of n values (the first on ties), one block -------------

__host__ __device__ __forceinline__ bool better(float v, int i, float best_v, int best_i)
{
    return best_i < 0 || (i >= 0 && (v > best_v || (v == best_v && i < best_i)));
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax(const float* __restrict__ x, int n, int* __restrict__ result)
{
    __shared__ float best_v[ARGMAX_THREADS / WARP];
    __shared__ int best_i[ARGMAX_THREADS / WARP];
    float bv = -INFINITY;
    int bi = -1;
    for (int i = threadIdx.x; i < n; i += blockDim.x)   // ascending: strict > keeps the first
        if (bi < 0 || x[i] > bv) {
            bv = x[i];
            bi = i;
        }
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if (threadIdx.x % WARP == 0) {
        best_v[threadIdx.x / WARP] = bv;
        best_i[threadIdx.x / WARP] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x / WARP); ++w)
            if (better(best_v[w], best_i[w], bv, bi)) {
                bv = best_v[w];
                bi = best_i[w];
            }
        result[0] = bi;
    }
}

#endif  // __CUDACC__ || CUDA_EMULATOR
