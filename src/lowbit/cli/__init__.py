"""The ``lowbit`` command line."""
