#!/usr/bin/env bash
# The whole GPU path on a machine with an NVIDIA GPU, end to end, with one summary table at the end:
#   install the gpu extra -> demo model (trained once, then reused) -> fp32 and fp16 artifacts ->
#   TensorRT engines -> decode smoke test -> parity against eager PyTorch (fp32: identical greedy and beam
#   tokens; fp16: >= 99% identical, the parity policy) -> pytest -m gpu -> benchmark if `transduce bench` exists.
# Exit status: 0 when every gating check passed, 1 otherwise (the table says which).
#
# Environment: WORKDIR (default runs/demo), SENTENCES (parity sample, default 200), SKIP_SETUP=1 to reuse
# the current .venv, SKIP_PYTEST=1 to skip the GPU test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${WORKDIR:-runs/demo}
SENTENCES=${SENTENCES:-200}
PY=.venv/bin/python
T=.venv/bin/transduce
RESULTS="$WORKDIR/gpu_check"
mkdir -p "$RESULTS"
: > "$RESULTS/steps.tsv"

step() {  # step NAME GATING(1/0) COMMAND...: run, time, record "name<TAB>gating<TAB>status<TAB>seconds"
    local name=$1 gating=$2
    shift 2
    echo "== $name: $*" >&2
    local t0=$SECONDS
    "$@"
    local rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$gating" "$rc" "$((SECONDS - t0))" >> "$RESULTS/steps.tsv"
    return $rc
}

if [ "${SKIP_SETUP:-0}" != 1 ]; then
    EXTRAS=gpu,dev bash scripts/setup.sh || { echo "setup failed" >&2; exit 1; }
fi
"$PY" - <<'EOF' || exit 1
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"PyTorch {torch.__version__} sees no CUDA GPU: install a CUDA build of torch (TORCH_VERSION=... "
             "with the CUDA index) and check nvidia-smi")
try:
    import tensorrt
except Exception as e:
    sys.exit(f"TensorRT does not import: {e}")
p = torch.cuda.get_device_properties(0)
print(f"GPU {p.name} (sm {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB), torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), TensorRT {tensorrt.__version__}")
EOF

MODEL="$WORKDIR/model"
if [ ! -f "$MODEL/config.json" ]; then
    step demo 1 "$T" demo --workdir "$WORKDIR" --show 0 || exit 1
fi

for p in fp32 fp16; do
    step "export-$p" 1 "$T" export "$MODEL" "$WORKDIR/artifact-$p" --precision "$p" --force
    step "build-$p" 1 "$T" build "$WORKDIR/artifact-$p" --out "$WORKDIR/engine-$p" \
        --timing-cache "$WORKDIR/timing.cache" --force
    step "decode-$p" 1 bash -c "printf 'three hundred and twelve\nforty-one\n' | '$T' decode '$WORKDIR/engine-$p' \
        --backend tensorrt --device cuda --beam 4 > '$RESULTS/decode-$p.txt'"
    step "parity-trt-$p" 1 "$T" parity "$WORKDIR/engine-$p" --backend tensorrt --device cuda --beam 4 \
        -n "$SENTENCES" --json "$RESULTS/parity-tensorrt-$p.json"
    # informational: the same artifact through ONNX Runtime's CUDA execution provider
    step "parity-ort-cuda-$p" 0 "$T" parity "$WORKDIR/artifact-$p" --backend onnxruntime --device cuda --beam 4 \
        -n "$SENTENCES" --json "$RESULTS/parity-onnxruntime-$p.json"
done

if [ "${SKIP_PYTEST:-0}" != 1 ]; then
    step pytest-gpu 1 "$PY" -m pytest -q -m gpu tests
fi

if "$T" bench --help > "$RESULTS/bench-help.txt" 2>&1; then
    for p in fp32 fp16; do
        step "bench-$p" 0 bash -c "'$T' bench '$WORKDIR/engine-$p' --backend tensorrt --device cuda \
            > '$RESULTS/bench-tensorrt-$p.txt' 2>&1"
    done
else
    printf 'bench\t0\tabsent\t0\n' >> "$RESULTS/steps.tsv"
fi

"$PY" - "$RESULTS" "$WORKDIR" <<'EOF'
import json
import os
import sys

from rich.console import Console
from rich.table import Table

results, workdir = sys.argv[1], sys.argv[2]
console = Console()
ok = True
t = Table(title=f"GPU check ({workdir})")
for col in ("step", "gating", "result", "seconds", "details"):
    t.add_column(col)
for line in open(os.path.join(results, "steps.tsv")):
    name, gating, rc, secs = line.rstrip("\n").split("\t")
    details = ""
    if name.startswith("parity-"):
        precision = name.rsplit("-", 1)[1]
        backend = "tensorrt" if name.startswith("parity-trt") else "onnxruntime"
        path = os.path.join(results, f"parity-{backend}-{precision}.json")
        if os.path.isfile(path):
            r = json.load(open(path))
            seqs = ", ".join(f"{s['mode']} {s['identical']}/{s['sentences']}" for s in r["sequences"])
            lp = [s for s in r["teacher_forced"] if s["name"] == "log_probs"]
            details = seqs + (f", log_probs max abs {lp[0]['max_abs']:.1e}" if lp else "")
    elif name.startswith("build-"):
        path = os.path.join(workdir, f"engine-{name.split('-')[1]}", "engine.json")
        if os.path.isfile(path):
            m = json.load(open(path))
            details = (f"TensorRT {m['tensorrt']['version']}, {len(m['profiles']['decoder_step'])} step profile(s), "
                       f"plans {sum(m['files'][n]['bytes'] for n in ('encoder.plan', 'decoder_step.plan')) / 2**20:.1f} MiB")
    elif name.startswith("decode-"):
        path = os.path.join(results, f"{name}.txt")
        if os.path.isfile(path):
            details = " | ".join(open(path).read().splitlines())[:80]
    passed = rc == "0"
    if gating == "1" and not passed:
        ok = False
    result = "absent" if rc == "absent" else ("pass" if passed else f"FAIL ({rc})")
    t.add_row(name, "yes" if gating == "1" else "no", result, secs, details)
console.print(t)
console.print("[green]all gating checks passed[/]" if ok else "[red]some gating checks failed[/]")
sys.exit(0 if ok else 1)
EOF
