"""The search's own time per step, with a backend whose step costs (almost) nothing: it hands back precomputed
top-k candidates drawn so that sentences end at realistic lengths (EOS among a row's candidates more often as
the step count grows). What is left is the search's bookkeeping, which a GPU's sub-millisecond step leaves
as the whole budget. Usage: python scripts/search_cost.py [--sentences 256] [--beam 4] [--decodes 5]."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from transduce.formats.model_config import ModelConfig
from transduce.runtime.backends.base import Backend
from transduce.runtime.decoding import DecodingOptions, decode


class NullBackend(Backend):
    """Candidates from a table of random draws: row r's k best at step t, EOS among them from step ~8 on."""

    name = "null"
    device = "cpu"
    precision = "fp32"

    def __init__(self, config: ModelConfig, seed: int = 0):
        self.config = config
        rng = np.random.default_rng(seed)
        self.table_vals = np.sort(np.log(rng.dirichlet(np.ones(64), size=(4096,)))[:, ::-1], axis=1).astype(np.float32)
        self.table_ids = rng.integers(4, config.vocab_size, size=(4096, 64))
        self.eos_at = rng.integers(6, 20, size=4096)  # the step from which a row's best candidate may be EOS

    def encode(self, src_ids, src_lengths):
        return len(src_ids)

    def begin(self, encoded, row_src, capacity):
        return {"t": 0}

    def step(self, state, tokens, k, ban_eos=False):
        t = state["t"]
        state["t"] = t + 1
        r = len(tokens)
        idx = (np.arange(r) * 7 + t * 13 + tokens) % 4096
        vals, ids = self.table_vals[idx, :k], self.table_ids[idx, :k].copy()
        if not ban_eos:
            ending = t >= self.eos_at[idx]
            ids[ending, (t + idx[ending]) % min(k, 3)] = self.config.eos_id
        return vals, ids

    def reorder(self, state, rows, row_src):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--decodes", type=int, default=5)
    ap.add_argument("--early-stopping", default="heuristic")
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=8000, max_positions=256)
    backend = NullBackend(cfg)
    src = np.full((args.sentences, 20), 5, np.int64)
    lens = np.full(args.sentences, 20, np.int64)
    opts = DecodingOptions(beam_size=args.beam, early_stopping=args.early_stopping)
    steps, inside = [0], [0.0]  # backend.step calls and the seconds spent in them (taken off the search's)
    inner = backend.step

    def counted(*a, **k):
        t = time.perf_counter()
        steps[0] += 1
        try:
            return inner(*a, **k)
        finally:
            inside[0] += time.perf_counter() - t

    backend.step = counted
    times = []
    for _ in range(args.decodes + 1):
        steps[0], inside[0] = 0, 0.0
        t = time.perf_counter()
        decode(backend, src, lens, opts)
        times.append((time.perf_counter() - t - inside[0]) / steps[0])
    print(f"{args.sentences} sentences x beam {args.beam}: {steps[0]} steps a decode, search "
          f"{statistics.median(times[1:]) * 1e3:.3f} ms a step (median of {args.decodes})")


if __name__ == "__main__":
    main()
