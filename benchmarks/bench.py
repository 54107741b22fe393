"""Run lowbit's benchmarks from a source tree: ``python benchmarks/bench.py OP|all [options]``.

The same as ``lowbit bench``; each operator's benchmark lives in src/lowbit/cli/bench/<op>.py and measures
its baselines (memcpy, torch's own casts and matmuls) in the same run. Figures: benchmarks/RESULTS.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lowbit.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
