#!/usr/bin/env bash
# The wheels scripts/gpu_device.sh installs on a device machine: what `transduce serve` and the demo corpus need
# that its image lacks (versions as this machine's .venv has them), for Python 3.12 on x86-64, into .whl.
set -euo pipefail
cd "$(dirname "$0")/.."
PINS=$(.venv/bin/python - <<'PY'
import importlib.metadata as m
names = ["fastapi", "starlette", "uvicorn", "httptools", "pydantic", "pydantic_core", "annotated-types",
         "typing-inspection", "typing_extensions", "opentelemetry-api", "num2words"]
print(" ".join(f"{n}=={m.version(n)}" for n in names))
PY
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
# shellcheck disable=SC2086
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl $PINS
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
ls .whl
