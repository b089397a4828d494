#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
# bench: CTranslate2, for the converter's token-equality test; import: the importers' tokenizers and test models;
# serve: FastAPI, uvicorn, Ray Serve
EXTRAS=${EXTRAS:-cpu,dev,bench,import,serve} bash scripts/setup.sh
.venv/bin/python -m ruff check transduce tests scripts
.venv/bin/python -m pytest -q "$@"
