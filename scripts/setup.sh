#!/usr/bin/env bash
# Set up a virtual environment for lowbit: create it, install a CPU build of torch when none is
# present, then install lowbit (editable, with the test extra, by default).
#
#   LOWBIT_VENV          where the environment goes (default: .venv in the repository)
#   LOWBIT_INSTALL       what to install after torch (default: -e ".[test]"; CI passes a wheel)
#   LOWBIT_TORCH         torch requirement used only when torch is missing (default: torch==2.13.0,
#                        a CPU wheel on this project's machines)
#   LOWBIT_TORCH_INDEX   optional index URL for it, e.g. https://download.pytorch.org/whl/cpu elsewhere
# lowbit itself requires only torch>=2.5; the pin above just avoids pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${LOWBIT_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
if ! "$py" -c "import torch" >/dev/null 2>&1; then
    "$py" -m pip install -q "${LOWBIT_TORCH:-torch==2.13.0}" ${LOWBIT_TORCH_INDEX:+--index-url "$LOWBIT_TORCH_INDEX"}
fi
if [ -n "${LOWBIT_INSTALL:-}" ]; then
    "$py" -m pip install -q $LOWBIT_INSTALL
else
    "$py" -m pip install -q -e ".[test]"
fi
