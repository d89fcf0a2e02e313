"""The stages' compiled code: numba kernels per stage (quantized, threads, int8, fused, repack,
prefill), the CUDA C source and its runtime, and the toolkit they share. A stage file tells the
story; its kernel file here holds the loops."""
