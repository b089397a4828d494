#!/usr/bin/env bash
# Create .venv (if missing) and install transduce into it: torch first (pinned), then the package.
# TORCH_VERSION overrides the pin; TORCH_INDEX_URL, if set, is where torch comes from (PyPI's Linux wheel
# is the CUDA build: https://download.pytorch.org/whl/cpu has the CPU one; this project's machines
# resolve the pin to a local CPU wheel without it); EXTRAS picks the extras (default: cpu,dev,import).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${EXTRAS:-cpu,dev,import}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    .venv/bin/python -m pip install -q --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"
else
    .venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
fi
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
