"""The CPU emulator of the CUDA kernels (cuda_emulator.py, its runtime and kernel side in C++) and
the kernels with bugs planted on purpose that it must catch (cuda_emulator_planted.cu): what the
cuda stage's tests run where there is no GPU (tests/test_cuda.py, tests/test_emulator.py)."""
