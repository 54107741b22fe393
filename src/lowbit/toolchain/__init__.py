"""The tool chain around the operators: the CANN ops-nn WeightQuantBatchMatmul sample's data flow
(:mod:`lowbit.toolchain.wqbmm`), its verification (:mod:`lowbit.toolchain.verify`), atomic file writes
(:mod:`lowbit.toolchain.files`) and benchmark timing (:mod:`lowbit.toolchain.timing`).

The ``lowbit`` command (:mod:`lowbit.cli`) is argument parsing and printing on top of these modules.
"""
