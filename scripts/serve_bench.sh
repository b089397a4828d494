#!/usr/bin/env bash
# `transduce serve` on one artifact, measured two ways at the same connection counts: `transduce loadtest
# --connections` (closed loop, generator processes) and wrk (scripts/wrk_translate.lua), side by side with offline
# decoding of the same sentences, in $OUT/serve_bench.md and serve_bench.json (docs/serving.md, "Load testing").
# The cases, "connections:sentences_per_request:beam" each, default to the serving targets: one sentence per
# request at 64 connections greedy and beam 4, 16 sentences per request at 8 connections, one connection.
# Overrides: ARTIFACT, OUT, PORT, DURATION and WARMUP (seconds per case), PROCESSES (loadtest's generator
# processes), WRK_THREADS, CASES, SERVE_ARGS (more `transduce serve` flags), API_KEY_FILE, PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
ARTIFACT=${ARTIFACT:-runs/demo/artifact-fp32}
OUT=${OUT:-runs/serve-bench}
PORT=${PORT:-8124}
DURATION=${DURATION:-20}
WARMUP=${WARMUP:-3}
WRK_THREADS=${WRK_THREADS:-2}
CASES=${CASES:-"64:1:1 64:1:4 8:16:1 1:1:1"}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
URL="http://127.0.0.1:$PORT"

if ! command -v wrk >/dev/null; then  # the cross-check needs it: install it where it is missing
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq wrk
fi
[ -d "$ARTIFACT" ] || { echo "error: no artifact at $ARTIFACT (ARTIFACT=DIR; transduce demo makes one)" >&2; exit 2; }
mkdir -p "$OUT"
KEY_ARGS=()
if [ -n "${API_KEY_FILE:-}" ]; then
    KEY_ARGS=(--api-key-file "$API_KEY_FILE")
    WRK_API_KEY=$(tr -d '[:space:]' < "$API_KEY_FILE"); export WRK_API_KEY
fi

# the held-out sentences both clients send: the demo corpus's validation sources (loadtest's default)
"$PY" -c "from transduce.serve.loadtest import sentences_from; print('\n'.join(sentences_from(None)))" \
    > "$OUT/sentences.txt"

# shellcheck disable=SC2086
"$PY" -m transduce.cli serve "$ARTIFACT" --port "$PORT" --quiet "${KEY_ARGS[@]}" ${SERVE_ARGS:-} \
    > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
    "$PY" -c "import urllib.request; urllib.request.urlopen('$URL/readyz', timeout=2)" 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "error: the server exited (its log: $OUT/serve.log)" >&2; exit 1; }
    sleep 1
done

for case in $CASES; do
    IFS=: read -r conns per beam <<< "$case"
    name="c$conns-s$per-b$beam"
    echo "== $conns connection(s), $per sentence(s) per request, beam $beam" >&2
    "$PY" -m transduce.cli loadtest "$URL" --connections "$conns" --sentences-per-request "$per" --beam-size "$beam" \
        --duration "$DURATION" --warmup "$WARMUP" ${PROCESSES:+--processes "$PROCESSES"} --data "$OUT/sentences.txt" \
        --artifact "$ARTIFACT" "${KEY_ARGS[@]}" --timeout 120 --out "$OUT/loadtest-$name" --force
    threads=$(( conns < WRK_THREADS ? conns : WRK_THREADS ))
    export WRK_SENTENCES="$OUT/sentences.txt" WRK_BEAM_SIZE="$beam" WRK_SENTENCES_PER_REQUEST="$per"
    wrk -t "$threads" -c "$conns" -d "${WARMUP}s" --timeout 120s -s scripts/wrk_translate.lua "$URL" > /dev/null
    wrk -t "$threads" -c "$conns" -d "${DURATION}s" --timeout 120s --latency -s scripts/wrk_translate.lua "$URL" \
        | tee "$OUT/wrk-$name.txt" >&2
done

"$PY" - "$OUT" "$CASES" <<'PY'
import json, os, sys

from transduce.io.atomic import write_json_atomic, write_text_atomic

out, cases = sys.argv[1], sys.argv[2].split()
ms = lambda s: "-" if s is None else f"{s * 1000:.1f} ms"  # noqa: E731
rows = []
for case in cases:
    conns, per, beam = (int(x) for x in case.split(":"))
    name = f"c{conns}-s{per}-b{beam}"
    report = json.load(open(os.path.join(out, f"loadtest-{name}", "loadtest.json")))
    [lt] = report["rows"]
    wrk_line = [x for x in open(os.path.join(out, f"wrk-{name}.txt")) if x.startswith("wrk-json ")]
    wrk = json.loads(wrk_line[0][len("wrk-json "):]) if wrk_line else None
    rows.append({"connections": conns, "sentences_per_request": per, "beam_size": beam, "loadtest": lt, "wrk": wrk,
                 "offline": report.get("offline")})
head = ["connections", "sentences/request", "beam", "loadtest requests/s", "loadtest sentences/s", "loadtest p50",
        "loadtest p99", "loadtest errors", "wrk requests/s", "wrk sentences/s", "wrk p50", "wrk p99", "wrk errors",
        "server CPU/sentence", "offline sentences/s", "offline request p50", "server ÷ offline sentences/s",
        "server ÷ offline p50"]
lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
for r in rows:
    lt, wrk, off = r["loadtest"], r["wrk"] or {}, r["offline"] or {}
    errors = ", ".join(f"{k}: {v}" for k, v in lt["errors"].items()) or "none"
    wrk_errors = f"non-2xx {wrk.get('non_2xx', '-')}, socket {wrk.get('socket_errors', '-')}"
    lines.append("| " + " | ".join([
        str(r["connections"]), str(r["sentences_per_request"]), str(r["beam_size"]), f"{lt['requests_per_s']:.1f}",
        f"{lt['sentences_per_s']:.1f}", ms(lt["latency_p50"]), ms(lt["latency_p99"]), errors,
        f"{wrk.get('requests_per_s', 0):.1f}", f"{wrk.get('sentences_per_s', 0):.1f}", ms(wrk.get("latency_p50_s")),
        ms(wrk.get("latency_p99_s")), wrk_errors, ms(lt["cpu_s_per_sentence"]), f"{off.get('throughput', 0):.1f}",
        ms(off.get("request_latency_p50")), f"{lt.get('sentences_per_s_vs_offline') or 0:.3f}",
        f"{lt.get('latency_p50_vs_offline') or 0:.2f}"]) + " |")
write_json_atomic(os.path.join(out, "serve_bench.json"), rows)
write_text_atomic(os.path.join(out, "serve_bench.md"), "\n".join(lines) + "\n")
print("\n".join(lines))
print(f"wrote {out}/serve_bench.md and serve_bench.json", file=sys.stderr)
PY
