"""numba CPU kernels. Each module has private ``@njit`` kernels and public wrappers on torch tensors."""
