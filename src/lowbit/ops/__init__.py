"""Public operators, registered as torch.library custom ops under ``torch.ops.lowbit``."""
