"""The CPU emulator of CUDA (emulator.py, its runtime and kernel side in C++): the cuda stage's
kernels, or a learner's, run on any machine with g++, every memory access checked."""
