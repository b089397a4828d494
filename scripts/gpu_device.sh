#!/usr/bin/env bash
# scripts/gpu_check.sh on a lent device machine as its image is: Python 3.12 with a CUDA build of torch and
# onnxruntime for the CPU, no internet, no setup.sh. The small packages its image lacks travel as wheels in .whl
# (scripts/gpu_wheels.sh fetches them here); transduce runs from this tree; a demo model in runs/demo/model that
# travelled with the call is reused (else trained on the GPU). Everything lands under $OUT: the log, nvidia-smi,
# the summary table and one archive of the results (at most 8 files come back). LIMIT (default 480) seconds bound
# gpu_check.sh so that the archive is written even when the expensive last steps run out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -m transduce.cli "$@"\n' > /tmp/bin/transduce
chmod +x /tmp/bin/transduce
export PATH=/tmp/bin:$PATH
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, onnxruntime, onnx; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'onnxruntime', onnxruntime.__version__, 'onnx', onnx.__version__)" | tee "$OUT/versions.txt"
WORKDIR=${WORKDIR:-runs/demo}
timeout -k 10 "${LIMIT:-480}" env SKIP_SETUP=1 PYTHON=python3 TRANSDUCE=transduce WORKDIR="$WORKDIR" CPU_TESTS=0 \
    BENCH_REPEATS=${BENCH_REPEATS:-3} DEMO_STEPS=${DEMO_STEPS:-300} bash scripts/gpu_check.sh 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
cp "$WORKDIR/gpu_check/steps.tsv" "$OUT/" 2>/dev/null
# the bench's models and exports stay behind (a file over 16 MiB does not come back)
tar czf "$OUT/results.tgz" -C "$WORKDIR" --exclude='gpu_check/*/models' gpu_check 2>/dev/null
exit "$rc"
