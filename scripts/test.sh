#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
# bench: CTranslate2, for the converter's token-equality test; import: the importers' tokenizers and test models;
# serve: FastAPI, uvicorn, Ray Serve
EXTRAS=${EXTRAS:-cpu,dev,bench,import,serve} bash scripts/setup.sh
# wrk: the load test's cross-check (tests/serve/test_loadtest.py runs scripts/wrk_translate.lua; skipped without it)
if ! command -v wrk >/dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq wrk; } >/dev/null 2>&1 \
        || echo "wrk could not be installed: its test is skipped" >&2
fi
.venv/bin/python -m ruff check transduce tests scripts
# two workers (pytest-xdist), each module's tests on one of them (its fixtures built once): the suite waits on
# subprocesses, servers and sockets much of the time; TEST_WORKERS=0 runs it in one process
.venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadscope "$@"
