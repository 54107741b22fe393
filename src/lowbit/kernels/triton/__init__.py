"""Triton kernels for CUDA tensors; tested on the CPU under TRITON_INTERPRET=1."""
