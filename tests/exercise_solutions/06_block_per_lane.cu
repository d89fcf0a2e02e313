// Chapter 06, as the starting file describes it and not as the stage does: a lane takes whole
// blocks (the stage's takes quarter blocks), and sums them by the algebra
// sum_j x_j (d q_j + m) = d * sum_j x_j q_j + m * sum_j x_j, one multiply by d and m per block.

#include "cuda.cu"

extern "C" __global__ void __launch_bounds__(128)
    matvec_q4_1(const u8* W, const float* x, float* y, int N, int K, int row_bytes)
{
    const int n = blockIdx.x * 4 + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (n >= N) return;                 // the whole warp leaves: no shuffle waits for it
    const u8* row = W + (size_t)n * row_bytes;
    float acc = 0.0f;
    for (int b = lane; b < K / 32; b += WARP) {
        const u8* block = row + 20 * b;
        const float* xb = x + 32 * b;
        float xq = 0.0f, xs = 0.0f;
        for (int j = 0; j < 16; ++j) {
            const u32 q = block[4 + j];
            xq += xb[j] * (float)(q & 15u) + xb[j + 16] * (float)(q >> 4);
            xs += xb[j] + xb[j + 16];
        }
        acc += f16_to_f32(ld16(block)) * xq + f16_to_f32(ld16(block + 2)) * xs;
    }
    for (int offset = WARP / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(FULL_MASK, acc, offset);
    if (lane == 0) y[n] = acc;
}
