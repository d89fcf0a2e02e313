// Kernels with one planted bug each, beside the correct version, for tests/test_emulator.py: the CPU
// emulator (tests/emulator/cuda_emulator.*) must fail every buggy one, saying what is wrong, and pass every
// correct one. Each bug is one a plain CPU run hides: threads that run one at a time see no race,
// and memory that starts zeroed hides a read of nothing.
//
// Launch every kernel here with one block of 128 threads unless its comment says otherwise.

#define THREADS 128

// ---- a shared accumulator: every thread adds its value ------------------------------------------

// BUG: acc += x is a load and a store; two threads in between lose an update on a GPU.
extern "C" __global__ void __launch_bounds__(THREADS) sum_racy(const float* x, float* out)
{
    __shared__ float acc;
    if (threadIdx.x == 0) acc = 0.0f;
    __syncthreads();
    acc += x[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) out[0] = acc;
}

extern "C" __global__ void __launch_bounds__(THREADS) sum_atomic(const float* x, float* out)
{
    __shared__ float acc;
    if (threadIdx.x == 0) acc = 0.0f;
    __syncthreads();
    atomicAdd(&acc, x[threadIdx.x]);
    __syncthreads();
    if (threadIdx.x == 0) out[0] = acc;
}

// ---- a shared table nobody filled ---------------------------------------------------------------

// BUG: table is read but never written (garbage on a GPU; zeros where memory starts zeroed).
extern "C" __global__ void __launch_bounds__(THREADS) read_unwritten(const float* x, float* out)
{
    __shared__ float table[THREADS];
    out[threadIdx.x] = table[threadIdx.x] + x[threadIdx.x];
}

extern "C" __global__ void __launch_bounds__(THREADS) read_written(const float* x, float* out)
{
    __shared__ float table[THREADS];
    table[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = table[(threadIdx.x + 1) % THREADS];
}

// ---- the issue's kernel: both bugs at once --------------------------------------------------------

// BUG: out[0] = the racy sum; out[1 + t] = an element of a table nobody wrote.
extern "C" __global__ void __launch_bounds__(THREADS) sum_then_unwritten(const float* x, float* out)
{
    __shared__ float acc;
    __shared__ float table[THREADS];
    if (threadIdx.x == 0) acc = 0.0f;
    __syncthreads();
    acc += x[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) out[0] = acc;
    out[1 + threadIdx.x] = table[threadIdx.x];
}

// ---- a value broadcast through shared memory ------------------------------------------------------

// BUG: no __syncthreads between thread 0's store and the others' loads.
extern "C" __global__ void __launch_bounds__(THREADS) broadcast_unsynced(const float* x, float* out)
{
    __shared__ float v;
    if (threadIdx.x == 0) v = x[0] * 2.0f;
    out[threadIdx.x] = v;
}

extern "C" __global__ void __launch_bounds__(THREADS) broadcast_synced(const float* x, float* out)
{
    __shared__ float v;
    if (threadIdx.x == 0) v = x[0] * 2.0f;
    __syncthreads();
    out[threadIdx.x] = v;
}

// ---- a rotation in place: read the neighbour, then overwrite your own -----------------------------

// BUG: no __syncthreads between the reads of s[t + 1] and the writes of s[t] (write after read).
extern "C" __global__ void __launch_bounds__(THREADS) rotate_unsynced(const float* x, float* out)
{
    __shared__ float s[THREADS];
    s[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    const float next = s[(threadIdx.x + 1) % THREADS];
    s[threadIdx.x] = next;
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x];
}

extern "C" __global__ void __launch_bounds__(THREADS) rotate_synced(const float* x, float* out)
{
    __shared__ float s[THREADS];
    s[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    const float next = s[(threadIdx.x + 1) % THREADS];
    __syncthreads();
    s[threadIdx.x] = next;
    __syncthreads();
    out[threadIdx.x] = s[threadIdx.x];
}

// ---- device memory --------------------------------------------------------------------------------

// Launched with several blocks. BUG: every block writes the same THREADS outputs.
extern "C" __global__ void __launch_bounds__(THREADS) blocks_share_output(const float* x, float* out)
{
    out[threadIdx.x] = x[blockIdx.x * THREADS + threadIdx.x];
}

extern "C" __global__ void __launch_bounds__(THREADS) blocks_own_output(const float* x, float* out)
{
    out[blockIdx.x * THREADS + threadIdx.x] = x[blockIdx.x * THREADS + threadIdx.x];
}

// n values in x. BUG: thread t reads x[t + 1], one past the end for the last thread.
extern "C" __global__ void __launch_bounds__(THREADS) read_past_end(const float* x, float* out, int n)
{
    const int i = threadIdx.x;
    if (i < n) out[i] = x[i + 1];
}

extern "C" __global__ void __launch_bounds__(THREADS) read_in_bounds(const float* x, float* out, int n)
{
    const int i = threadIdx.x;
    if (i < n) out[i] = i + 1 < n ? x[i + 1] : 0.0f;
}

// ---- launch bounds, barriers, shuffles, arguments ---------------------------------------------------

// Compiled for at most 64 threads per block: a launch of 128 must be refused.
extern "C" __global__ void __launch_bounds__(64) bounded_64(const float* x, float* out)
{
    out[threadIdx.x] = x[threadIdx.x];
}

// BUG: half of each warp waits in a shuffle for lanes that wait at __syncthreads (a hang on a GPU).
extern "C" __global__ void __launch_bounds__(THREADS) shuffle_in_branch(const float* x, float* out)
{
    float v = x[threadIdx.x];
    if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}

// BUG: lanes 16..31 have returned when the rest of the warp shuffles with them.
extern "C" __global__ void __launch_bounds__(THREADS) shuffle_after_return(const float* x, float* out)
{
    if (threadIdx.x % 32 >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 16);
}

// The scale is a double: Python must pass it as one ('d'), not as a float ('f').
extern "C" __global__ void __launch_bounds__(THREADS) scale_by(const float* x, float* out, double s)
{
    out[threadIdx.x] = (float)(x[threadIdx.x] * s);
}

// ---- no bug: which thread got there first, for the schedules' own test -----------------------------

// out[t] = the order in which thread t took its ticket (an atomic counter: no race).
extern "C" __global__ void __launch_bounds__(THREADS) arrival_order(const float* x, float* out)
{
    __shared__ int next;
    if (threadIdx.x == 0) next = 0;
    __syncthreads();
    out[threadIdx.x] = (float)atomicAdd(&next, 1) + 0.0f * x[threadIdx.x];
}
