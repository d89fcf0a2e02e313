// Chapter 06 · cuda: write the decode matvec for Q4_1 weights as a CUDA kernel, y = W x for ONE
// activation row.
//
// Run the check:   make exercise ch=06
// (or: .venv/bin/python -m exercises.check 06)
//
// No GPU is needed: the check builds this file with g++ around the repository's CPU emulator of
// CUDA (app/cuda_emulator/), which runs every CUDA thread of a launch (warps, shuffles, barriers,
// memory that starts as garbage) and stops the launch on a read of memory nothing wrote, on two
// threads racing for the same bytes, and on an access outside an array. It runs your kernel and
// the cuda stage's own (matmul_q4_1_m1 in stages/kernels/cuda.cu) on the same seeded cases. Where
// a GPU and PyCUDA are there, it then times both on the GPU.
// The first check of each version of this file builds it with g++ (a few seconds).
//
// ---- what the check launches ----------------------------------------------------------------
//
//   matvec_q4_1<<<ceil(N / 4), 128>>>(W, x, y, N, K, row_bytes)
//
//   W          u8 [N, row_bytes]   the weight as the GGUF file holds it: row n is K / 32 blocks
//                                  of 20 bytes, one after another (row_bytes = K / 32 * 20)
//   x          float [K]           the activation row (K a multiple of 32)
//   y          float [N]           yours to write: y[n] = sum over k of W[n, k] x[k]
//
// Every one of the 128 threads of every thread block runs the whole function below, each with
// its own threadIdx.x (t, 0 .. 127) and blockIdx.x (b, 0 .. ceil(N / 4) - 1). They come in warps
// of 32 that run in step: thread t is lane t % 32 of warp t / 32. One warp per output row, 4 per
// thread block: warp w of block b computes row n = 4 b + w.
//
// One Q4_1 block (20 bytes, 32 values), starting at byte 20 * i of its row, values 32 i .. 32 i + 31:
//   bytes 0-1   d, a float16: f16_to_f32(ld16(block)) is its value
//   bytes 2-3   m, a float16: f16_to_f32(ld16(block + 2))
//   bytes 4-19  16 bytes of 4-bit q: value j < 16 is the low nibble of byte 4 + j (q & 15),
//               value j >= 16 the high nibble of byte 4 + j - 16 (q >> 4)
//   weight j = d * q_j + m
//
// ---- what to write ------------------------------------------------------------------------------
//
// Each warp walks its row's blocks: lane l takes blocks l, l + 32, l + 64, ... and adds, for
// each, the sum of its 32 weights times the matching 32 values of x into a float of its own (or
// uses the algebra: sum_j x_j (d q_j + m) = d * sum_j x_j q_j + m * sum_j x_j). The 32 lanes
// then hold 32 partial sums: add them with a shuffle reduction, five steps of
//     sum += __shfl_xor_sync(FULL_MASK, sum, offset);   offset = 16, 8, 4, 2, 1
// (each lane adds the sum of the lane `offset` away; after the fifth, every lane holds the total),
// and lane 0 writes y[n]. The decoded weights live only in registers.
//
// The edges: N not a multiple of 4 (the last block's extra warps have no row: they must read and
// write nothing, and leave together, so that no shuffle waits for a lane that has gone); a row of
// one block (31 lanes have nothing to add: their 0 still goes into the reduction); more blocks
// than lanes (K = 1536 is 48 blocks: lanes 0 .. 15 take two); blocks whose d and m are 0.
//
// Why: decode reads every weight once per token, so its time is the weights' bytes over the
// bandwidth. The 32 lanes of a warp read 32 neighbouring blocks at each step, 640 bytes in a row,
// so the GPU serves each of the warp's loads from 5 or 6 cache lines of 128 bytes, not 32
// scattered ones. The stage's kernel goes one step further: a lane takes a quarter of a block
// (8 values), so neighbouring lanes read neighbouring 4-byte pieces of the same block.
//
// You have, from the stage's own file (included below): u8 (unsigned char), u32, WARP (32),
// FULL_MASK, ld16(p) (two bytes as an integer, little-endian: the blocks are not 2-byte
// aligned, so never cast to a wider pointer), f16_to_f32(h) (a float16's bits to its value).
// The rest is C: loops, ifs, float and int. extern "C" keeps the kernel's name as written, so
// the check finds it; __launch_bounds__(128) promises at most 128 threads per block. g++ treats
// a warning as an error (an unused variable too), as the stage's tests do.
//
// Hint: notebooks/06_cuda.ipynb, "The kernels"; notebooks/05_quantized.ipynb for the blocks. Try
// it before you read stages/kernels/cuda.cu (matmul_q, warp_sum_rows, BlockQ4_1).

#include "cuda.cu"

extern "C" __global__ void __launch_bounds__(128)
    matvec_q4_1(const u8* W, const float* x, float* y, int N, int K, int row_bytes)
{
    // Your kernel here: it does nothing yet, so y keeps the garbage fresh device memory holds.
}
