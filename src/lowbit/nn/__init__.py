"""Drop-in modules built on lowbit's operators."""
