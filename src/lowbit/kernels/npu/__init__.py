"""Thin adapters to Ascend vendor paths (torch_npu, amct_ops); import-guarded, unverified off an NPU."""
