#!/usr/bin/env bash
# The whole GPU path on a machine with an NVIDIA GPU, end to end, with one summary table at the end:
#   install the gpu extra -> demo model (trained on the GPU once, then reused) -> fp32 and fp16 artifacts ->
#   eager PyTorch on CUDA checked against the CPU -> the same with its step in CUDA graphs at fp32, fp16 and
#   bf16 (each held to its precision's parity policy) and a decode smoke test of it -> TensorRT engines ->
#   decode smoke test -> parity against eager PyTorch (fp32: identical greedy and beam tokens; fp16: >= 99%
#   identical, the parity policy) -> the server on the GPU under closed-loop load (1 and 64 connections) -> the
#   CUDA-graph bookkeeping tests -> pytest -m gpu -> transduce bench (eager and CUDA-graph torch on CUDA at
#   fp32/fp16/bf16, ONNX Runtime, TensorRT) -> last, the fp16 step under torch.compile(mode="reduce-overhead")
#   beside eager and the hand-made graphs (its compilation is the slowest step).
# Without TensorRT its steps are listed as skipped and the rest runs: CUDA eager and graphs, the GPU tests (those
# of the TensorRT backend run against its test double on the GPU), the benchmark.
# Without CUDA every GPU step is listed as skipped with the reason, and what runs on a CPU still runs: the demo
# model (trained on the CPU), the exports, the CUDA-graph bookkeeping tests, the summary table.
# Exit status: 0 when every gating check that ran passed, 1 otherwise (the table says which).
#
# Environment: WORKDIR (default runs/demo), SENTENCES (parity sample, default 200), SKIP_SETUP=1 to use the
# Python environment as it is, PYTHON (default .venv/bin/python) and TRANSDUCE (default .venv/bin/transduce)
# to use another one, SKIP_PYTEST=1 to skip the test suites, CPU_TESTS=0 to skip only those that run on CPUs too,
# SKIP_BENCH=1 to skip the benchmark, BENCH_BACKENDS and BENCH_REPEATS (default 5) to choose its systems and
# repeats, SKIP_SERVE=1 to skip the server's load test (LOAD_SECONDS per connection count, default 20), DEMO_STEPS
# (training steps of a demo model trained here; default: the demo's). scripts/gpu_device.sh runs it on a lent
# device machine.
set -uo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${WORKDIR:-runs/demo}
SENTENCES=${SENTENCES:-200}
PY=${PYTHON:-.venv/bin/python}
T=${TRANSDUCE:-.venv/bin/transduce}
RESULTS="$WORKDIR/gpu_check"
mkdir -p "$RESULTS"
: > "$RESULTS/steps.tsv"
rm -f "$RESULTS"/parity-*.json "$RESULTS"/decode-*.txt  # an earlier run's: the table reads this run's only

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

skipped() {  # skipped NAME GATING WHY: a step that cannot run here, listed with the reason (one line)
    local why=${3//$'\n'/ }
    printf '%s\t%s\tskipped\t0\t%s\n' "$1" "$2" "${why//$'\t'/ }" >> "$RESULTS/steps.tsv"
}

if [ "${SKIP_SETUP:-0}" != 1 ]; then
    EXTRAS=gpu,dev bash scripts/setup.sh || { echo "setup failed" >&2; exit 1; }
fi
# "yes" where torch sees a GPU, else why not in a few words (the GPU steps' reason in the table; the hint on stderr)
CUDA=$("$PY" - <<'EOF'
import sys
import torch
if torch.cuda.is_available():
    print("yes")
else:
    print(f"no CUDA GPU (torch {torch.__version__})")
    print(f"PyTorch {torch.__version__} sees no CUDA GPU, the GPU steps are skipped: install a CUDA build of torch "
          "(TORCH_VERSION=... with the CUDA index) and check nvidia-smi", file=sys.stderr)
EOF
) || { echo "$PY cannot import torch" >&2; exit 1; }
# "yes" where TensorRT imports, else why not (without CUDA: why there is none); the GPU's description on stderr
TRT=$CUDA
if [ "$CUDA" = yes ]; then
TRT=$("$PY" - <<'EOF'
import sys
import torch
p = torch.cuda.get_device_properties(0)
try:
    import tensorrt
    trt = f"TensorRT {tensorrt.__version__}"
except Exception as e:
    trt = f"no TensorRT here ({type(e).__name__}: {e})"
print(f"GPU {p.name} (sm {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB), torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), {trt}", file=sys.stderr)
print("yes" if trt.startswith("TensorRT") else trt)
EOF
) || exit 1
fi

gpu_step() {  # gpu_step NAME GATING COMMAND...: a step that needs CUDA, listed as skipped where it is missing
    if [ "$CUDA" = yes ]; then
        step "$@"
    else
        skipped "$1" "$2" "$CUDA"
    fi
}

MODEL="$WORKDIR/model"
if [ ! -f "$MODEL/config.json" ]; then
    DEVICE=cpu
    [ "$CUDA" = yes ] && DEVICE=cuda
    step demo 1 "$T" demo --workdir "$WORKDIR" --show 0 --device "$DEVICE" ${DEMO_STEPS:+--steps "$DEMO_STEPS"} \
        || exit 1
fi

for p in fp32 fp16; do
    step "export-$p" 1 "$T" export "$MODEL" --out "$WORKDIR/artifact-$p" --precision "$p" --force
done
# eager PyTorch on the GPU against itself on the CPU (fp32 weights: the fp32 parity policy)
gpu_step parity-torch-cuda 1 "$T" parity "$WORKDIR/artifact-fp32" --backend torch --device cuda --beam-size 4 \
    -n "$SENTENCES" --out "$RESULTS/parity-torch-cuda.json" --force
# its step in CUDA graphs, at each precision: the torch backend runs the source model at --precision, so the
# fp32 artifact serves all three, each held to its precision's parity policy (fp32: identical)
for p in fp32 fp16 bf16; do
    gpu_step "parity-torch-cuda-graph-$p" 1 "$T" parity "$WORKDIR/artifact-fp32" --backend torch --device cuda \
        --cuda-graph --precision "$p" --beam-size 4 -n "$SENTENCES" --out "$RESULTS/parity-torch-cuda-graph-$p.json" \
        --force
done
gpu_step decode-torch-cuda-graph 1 bash -c "printf 'three hundred and twelve\nforty-one\n' | '$T' decode \
    '$WORKDIR/artifact-fp32' --backend torch --device cuda --cuda-graph --precision fp16 --beam-size 4 \
    > '$RESULTS/decode-torch-cuda-graph.txt'"
for p in fp32 fp16; do
    if [ "$TRT" != yes ]; then
        for s in build decode parity-trt; do skipped "$s-$p" 1 "$TRT"; done
    else
        step "build-$p" 1 "$T" build "$WORKDIR/artifact-$p" --out "$WORKDIR/engine-$p" \
            --timing-cache "$WORKDIR/timing.cache" --force
        step "decode-$p" 1 bash -c "printf 'three hundred and twelve\nforty-one\n' | '$T' decode '$WORKDIR/engine-$p' \
            --backend tensorrt --device cuda --beam-size 4 > '$RESULTS/decode-$p.txt'"
        step "parity-trt-$p" 1 "$T" parity "$WORKDIR/engine-$p" --backend tensorrt --device cuda --beam-size 4 \
            -n "$SENTENCES" --out "$RESULTS/parity-trt-$p.json" --force
    fi
    # informational: the same artifact through ONNX Runtime's CUDA execution provider (onnxruntime-gpu)
    if [ "$CUDA" != yes ]; then
        skipped "parity-ort-cuda-$p" 0 "$CUDA"
    elif "$PY" -c "import onnxruntime, sys; sys.exit('CUDAExecutionProvider' not in onnxruntime.get_available_providers())"; then
        step "parity-ort-cuda-$p" 0 "$T" parity "$WORKDIR/artifact-$p" --backend onnxruntime --device cuda --beam-size 4 \
            -n "$SENTENCES" --out "$RESULTS/parity-ort-cuda-$p.json" --force
    else
        skipped "parity-ort-cuda-$p" 0 "onnxruntime has no CUDAExecutionProvider here (onnxruntime-gpu)"
    fi
done

# the server on the GPU: the torch backend's fp16 step in CUDA graphs, under closed-loop load
serve_load() {
    local port=${SERVE_PORT:-8123} pid rc=1
    "$T" serve "$WORKDIR/artifact-fp32" --backend torch --device cuda --cuda-graph --precision fp16 --port "$port" \
        --quiet > "$RESULTS/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do
        "$PY" -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$port/readyz', timeout=2)" \
            2>/dev/null && { rc=0; break; }
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    if [ $rc = 0 ]; then
        "$T" loadtest "http://127.0.0.1:$port" --connections 1,64 --duration "${LOAD_SECONDS:-20}" \
            --out "$RESULTS/loadtest" --force --quiet
        rc=$?
    else
        echo "the server did not become ready (its log: $RESULTS/serve.log)" >&2
    fi
    kill -TERM $pid 2>/dev/null
    wait $pid
    return $rc
}
if [ "${SKIP_SERVE:-0}" = 1 ]; then
    skipped serve-loadtest 0 "SKIP_SERVE=1"
else
    gpu_step serve-loadtest 0 serve_load
fi

if [ "${SKIP_PYTEST:-0}" != 1 ]; then
    # the CUDA-graph bookkeeping and the bench's GPU side, checked on the CPU: they run with or without a GPU
    # (those of these files that exist here)
    TESTS=()
    for f in tests/runtime/test_cuda_graphs.py tests/runtime/test_backends.py tests/bench; do
        [ -e "$f" ] && TESTS+=("$f")
    done
    if [ "${CPU_TESTS:-1}" = 0 ]; then
        skipped pytest-cuda-graph 1 "CPU_TESTS=0"
    elif [ ${#TESTS[@]} -gt 0 ]; then
        step pytest-cuda-graph 1 "$PY" -m pytest -q -m "not slow" "${TESTS[@]}"
    else
        skipped pytest-cuda-graph 1 "none of its test files is here"
    fi
    export TRANSDUCE_TEST_DEMO_MODEL="$PWD/$MODEL"  # the demo model's tests reuse this one
    gpu_step pytest-gpu 1 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --continue-on-collection-errors tests
else
    skipped pytest-cuda-graph 1 "SKIP_PYTEST=1"
    skipped pytest-gpu 1 "SKIP_PYTEST=1"
fi

if [ "${SKIP_BENCH:-0}" = 1 ]; then
    skipped bench 0 "SKIP_BENCH=1"
else
    # the trained demo model and its fp32 export, and the base shape: every system side by side, eager and
    # CUDA-graph torch on the GPU at fp32 and the half precisions
    BACKENDS=torch,torch-cuda,torch-cuda-fp16,torch-cuda-bf16,torch-cuda-graph,torch-cuda-graph-fp16
    BACKENDS=$BACKENDS,torch-cuda-graph-bf16,onnxruntime
    "$PY" -c "import ctranslate2" 2>/dev/null && BACKENDS=$BACKENDS,ctranslate2
    BACKENDS=${BENCH_BACKENDS:-$BACKENDS}
    ENGINES=()
    [ "$TRT" = yes ] && ENGINES=(--engine "demo=$WORKDIR/engine-fp32")
    gpu_step bench 0 "$T" bench --model-dir "$MODEL" --artifact-dir "$WORKDIR/artifact-fp32" --sizes demo,base \
        --backends "$BACKENDS" ${ENGINES[@]+"${ENGINES[@]}"} --repeats "${BENCH_REPEATS:-5}" --out "$RESULTS/bench" \
        --force
    # torch.compile(mode="reduce-overhead") of the same fp16 step, beside eager and the hand-made graphs
    gpu_step bench-compile 0 "$T" bench --model-dir "$MODEL" --artifact-dir "$WORKDIR/artifact-fp32" --sizes demo,base \
        --backends torch-cuda-fp16,torch-cuda-graph-fp16,torch-cuda-compile-fp16 --repeats "${BENCH_REPEATS:-5}" \
        --cache-dir "$RESULTS/bench/models" --out "$RESULTS/bench-compile" --force
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
lines = open(os.path.join(results, "steps.tsv")).read().splitlines()
# the step names whole (parity-torch-cuda-graph-bf16 ...): the details column wraps instead
t.add_column("step", min_width=max([len(line.split("\t")[0]) for line in lines] + [4]), no_wrap=True)
for col in ("gating", "result", "seconds", "details"):
    t.add_column(col)
for line in lines:
    name, gating, rc, secs, *why = line.split("\t")
    details = why[0] if why else ""  # a skipped step's reason
    if rc == "skipped":
        pass
    elif name.startswith("parity-"):
        path = os.path.join(results, f"{name}.json")
        if os.path.isfile(path):
            r = json.load(open(path))
            seqs = ", ".join(f"{s['mode']} {s['identical']}/{s['sentences']}" for s in r.get("sequences", []))
            # "log_probs", or one per graph ("log_probs [decoder_step.onnx]"): the largest
            lp = [s["max_abs"] for s in r.get("teacher_forced", []) if s.get("name", "").startswith("log_probs")]
            details = (f"{r['precision']} policy: " if r.get("precision") else "") + seqs
            details += f", log_probs max abs {max(lp):.1e}" if lp else ""
    elif name.startswith("build-"):
        path = os.path.join(workdir, f"engine-{name.split('-')[1]}", "engine.json")
        if os.path.isfile(path):
            m = json.load(open(path))
            details = (f"TensorRT {m['tensorrt']['version']}, {len(m['profiles']['decoder_step'])} step profile(s), "
                       f"plans {sum(m['files'][n]['bytes'] for n in ('encoder.plan', 'decoder_step.plan')) / 2**20:.1f} MiB")
    elif name.startswith("bench") and rc == "0":
        details = f"{results}/{name}/bench.md"
    elif name == "serve-loadtest" and os.path.isfile(os.path.join(results, "loadtest", "loadtest.json")):
        rows = json.load(open(os.path.join(results, "loadtest", "loadtest.json")))["rows"]
        details = ", ".join(f"{r['connections']} conn: {r['throughput']:.0f}/s p50 {r['latency_p50'] * 1e3:.1f} ms "
                            f"p99 {r['latency_p99'] * 1e3:.1f} ms" for r in rows if r["latency_p50"] is not None)
    elif name.startswith("decode-"):
        path = os.path.join(results, f"{name}.txt")
        if os.path.isfile(path):
            details = " | ".join(open(path).read().splitlines())[:80]
    passed = rc == "0"
    if gating == "1" and not passed and rc != "skipped":
        ok = False
    result = "skipped" if rc == "skipped" else ("pass" if passed else f"FAIL ({rc})")
    t.add_row(name, "yes" if gating == "1" else "no", result, secs, details)
console.print(t)
console.print("[green]every gating check that ran passed[/]" if ok else "[red]some gating checks failed[/]")
sys.exit(0 if ok else 1)
EOF
