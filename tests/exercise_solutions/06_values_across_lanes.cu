// Chapter 06, written otherwise than the stage: the lanes split a block's values, not the row's
// blocks (lane l decodes value l of every block, so a warp reads 32 neighbouring floats of x at
// each step), and the 32 partial sums are added in __shared__ memory by halving, with a barrier
// between halvings, instead of by shuffles.

#include "cuda.cu"

#define ROWS 4                          // warps, and rows, per thread block

extern "C" __global__ void __launch_bounds__(ROWS * WARP)
    matvec_q4_1(const u8* W, const float* x, float* y, int N, int K, int row_bytes)
{
    __shared__ float part[ROWS][WARP];
    const int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int n = blockIdx.x * ROWS + w;
    const bool live = n < N;            // a warp past the last row adds zeros: every thread meets every barrier
    const int byte = 4 + lane % 16, shift = 4 * (lane / 16);
    float sum = 0.0f;
    for (int b = 0; live && b < K / 32; ++b) {
        const u8* block = W + (size_t)n * row_bytes + 20 * b;
        const float d = f16_to_f32(ld16(block)), m = f16_to_f32(ld16(block + 2));
        const u32 q = (block[byte] >> shift) & 15u;
        sum += x[32 * b + lane] * (d * (float)q + m);
    }
    part[w][lane] = sum;
    __syncthreads();
    for (int half = WARP / 2; half > 0; half /= 2) {
        if (lane < half) part[w][lane] += part[w][lane + half];
        __syncthreads();                // the next halving reads what this one wrote
    }
    if (live && lane == 0) y[n] = part[w][0];
}
