"""Run the ``lowbit`` command as if on an older x86 CPU: ``python tests/simulated_cpu.py CPU ARGS...``.

llvmlite is made to report CPU's name and the host's features less those CPU lacks (SIMULATED) before
numba builds its target machine, so numba compiles every kernel for that CPU and lowbit's feature checks
(lowbit.kernels.cpu._simd) pick that CPU's kernels; then ``lowbit ARGS`` runs. The kernels run on this host,
which must have every feature the simulated CPU keeps (simulatable). LLVM aborts the whole process when a
kernel holds an instruction its target lacks: this finds such a kernel without that CPU at hand.
"""

from __future__ import annotations

import runpy
import sys

_AVX512_BF16_AND_LATER = ["avx512bf16", "avx512fp16", "amx-bf16", "amx-tile", "amx-int8"]
_ICE_LAKE_ADDITIONS = ["avx512vbmi", "avx512vbmi2", "avx512bitalg", "avx512vpopcntdq", "avx512ifma", "gfni", "vaes",
                       "vpclmulqdq"]
_AVX512 = ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512vnni"]

# CPU name (LLVM's) -> (the features it lacks, among those lowbit's kernels test or LLVM may use for them;
# the features it must find on the host: the kernels it selects use them).
SIMULATED = {
    "icelake-server": (_AVX512_BF16_AND_LATER,  # Intel Xeon Ice Lake: AVX-512 with VNNI and VBMI, no BF16
                       ["avx512vbmi", "avx512bitalg", "avx512vnni", "avx512bw"]),
    "cascadelake": (_AVX512_BF16_AND_LATER + _ICE_LAKE_ADDITIONS, ["avx512vnni", "avx512bw"]),  # AVX-512 + VNNI
    "skylake-avx512": (_AVX512_BF16_AND_LATER + _ICE_LAKE_ADDITIONS + ["avx512vnni"], ["avx512bw"]),  # no VNNI
    "znver3": (_AVX512_BF16_AND_LATER + _ICE_LAKE_ADDITIONS + _AVX512, ["avx2", "fma", "f16c"]),  # AMD Zen 3
}


def simulatable(cpu: str) -> bool:
    """Whether this host can run CPU's kernels and has a feature CPU lacks (else it would simulate itself)."""
    from llvmlite import binding

    host = binding.get_host_cpu_features()
    lacks, needs = SIMULATED[cpu]
    return all(host.get(f) for f in needs) and any(host.get(f) for f in lacks)


def simulate(cpu: str) -> None:
    """Make llvmlite report ``cpu`` with the host's features less those it lacks (before numba compiles)."""
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    for name in SIMULATED[cpu][0]:
        if name in features:
            features[name] = False
    binding.get_host_cpu_features = lambda: features
    binding.get_host_cpu_name = lambda: cpu


if __name__ == "__main__":
    simulate(sys.argv[1])
    sys.argv = ["lowbit", *sys.argv[2:]]
    runpy.run_module("lowbit", run_name="__main__")
