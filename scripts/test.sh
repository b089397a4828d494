#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-cpu,dev,bench,serve} bash scripts/setup.sh  # bench: CTranslate2, for the converter's token-equality test; serve: FastAPI, uvicorn, Ray Serve
.venv/bin/python -m ruff check transduce tests scripts
.venv/bin/python -m pytest -q "$@"
