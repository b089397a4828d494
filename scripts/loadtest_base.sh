#!/usr/bin/env bash
# The load test at the paper's base shape (random weights, synthetic 8,000-word vocabulary): three servers on one
# artifact (continuous, static, single), interleaved, greedy; sentences of 6-20 words. RATES and DURATION override.
set -eu
cd "$(dirname "$0")/.." && source .venv/bin/activate
W=runs/loadtest-base; mkdir -p $W
python - <<'PY'
import random
from transduce.bench.models import ensure_base_model
ensure_base_model("runs/loadtest-base/model", log=print)
rng = random.Random(0)
with open("runs/loadtest-base/sentences.txt", "w") as f:
    for _ in range(400):
        f.write(" ".join(f"w{rng.randrange(4, 8000)}" for _ in range(rng.randint(6, 20))) + "\n")
PY
[ -f $W/artifact/manifest.json ] || transduce export $W/model --out $W/artifact --quiet
for s in continuous:8101 static:8102 single:8103; do
  sch=${s%%:*}; port=${s##*:}
  extra=""; [ $sch = static ] && extra="--max-wait-ms 20"
  transduce serve $W/artifact --port $port --scheduler $sch $extra --quiet > $W/$sch.log 2>&1 &
done
for port in 8101 8102 8103; do
  for i in $(seq 1 120); do curl -sf localhost:$port/readyz >/dev/null && break; sleep 1; done
done
transduce loadtest http://127.0.0.1:8101 http://127.0.0.1:8102 http://127.0.0.1:8103 --rates ${RATES:-1,2,4,8} \
  --duration ${DURATION:-8} --data $W/sentences.txt --artifact $W/artifact --out $W/report --force --timeout 120
kill $(jobs -p) 2>/dev/null || true
wait
