"""Fast kernels, one sub-package per backend: cpu (numba), triton (CUDA), npu (vendor adapters)."""
