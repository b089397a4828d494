#!/usr/bin/env bash
# Create .venv (if missing) and install transduce into it: torch first (pinned CPU build), then the package.
# TORCH_VERSION overrides the pin; EXTRAS picks the extras (default: cpu,dev).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${EXTRAS:-cpu,dev}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
