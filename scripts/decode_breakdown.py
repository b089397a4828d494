"""Where one decode's time goes: the encoder, the step runs, the backend's work around them, the
beam reorders (of which the cache moves) and the search's own bookkeeping (transduce/runtime/decoding/offline.py).

    python scripts/decode_breakdown.py ARTIFACT [--backend onnxruntime] [--batch 1] [--beam 1]
        [--steps 32] [--src-len 32] [--threads 2] [--repeats 20]

`transduce bench` says how fast each backend decodes; this says why, for one cell of its table. It
decodes random source ids (--src-len tokens, EOS included) with the length forced to --steps tokens
(EOS banned until then, as the bench does), so every decode does the same work, and times the parts
by wrapping the backend's methods with perf_counter:

  encoder        backend.encode
  begin / end    backend.begin and backend.end (buffers, the cross K/V gathered for the rows)
  step           backend.step, of which (ONNX Runtime only)
    run            the step sessions' run_with_iobinding: the graph itself
    around         the rest of step(): filling inputs, bindings, the cache slot write, the top-k copy
  reorder        backend.reorder, of which (ONNX Runtime on CPU only) `moves`, the cache rows moved
  search         everything else: the search's numpy bookkeeping between the steps

A profiler: it wraps the ONNX Runtime backend's sessions and memory, internals no other caller reads. Each
wrapper adds about a microsecond per call. The decodes run back to back (as in the bench), after
three untimed ones; printed are ms per decode and us per step, the medians over --repeats decodes.

Where the backend decodes the batch in parts at the same time (a small model's larger batches on ONNX
Runtime: backend.shards), each part's calls are timed apart (by the part, not by the thread that ran it):
the figures are then per part, averaged over the parts (their sum over all parts is CPU time, not the
decode's), `search` is each part's decode less its backend calls, and `total` is the decode's wall time.
--whole decodes the batch whole instead.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from collections import defaultdict

import numpy as np


class Timer:
    """Accumulates seconds per (part, label); wrap(obj, name, label) times every call of obj.name. A part is one
    call of the method wrapped with opens_part=True (decoding._decode_one: one part of a batch decoded in parts,
    or the whole batch) and everything timed in its thread while it runs; time outside every part goes to part
    0. sync: called before each clock is read (a GPU backend's calls only queue work: without it the wait for
    one part's kernels is counted in the next part that reads a result)."""

    def __init__(self, sync=None):
        self.total: dict[tuple[int, str], float] = defaultdict(float)
        self.sync = sync or (lambda: None)
        self.lock = threading.Lock()  # the parts of a batch decoded at once add up from their own threads
        self.current = threading.local()  # .part: the part running in this thread
        self.parts = itertools.count(1)

    def wrap(self, obj, name: str, label: str, opens_part: bool = False) -> None:
        inner = getattr(obj, name)
        total, sync, lock, current, parts = self.total, self.sync, self.lock, self.current, self.parts

        def timed(*args, **kwargs):
            outer = getattr(current, "part", 0)
            if opens_part:
                with lock:
                    current.part = next(parts)
            sync()
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                sync()
                dt = time.perf_counter() - t
                with lock:
                    total[getattr(current, "part", 0), label] += dt
                current.part = outer

        setattr(obj, name, timed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="an artifact directory (transduce export), or an engine directory for tensorrt")
    ap.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch", "tensorrt"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32, help="target tokens per sentence (forced)")
    ap.add_argument("--src-len", type=int, default=32, help="source tokens per sentence, EOS included")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--whole", action="store_true", help="decode the batch whole where the backend would decode it "
                    "in parts at the same time (backend.shards)")
    args = ap.parse_args(argv)
    if min(args.batch, args.beam, args.steps, args.repeats) < 1 or args.src_len < 2:
        ap.error("--batch, --beam, --steps and --repeats must be >= 1, --src-len >= 2")

    from transduce.runtime.api import open_backend
    from transduce.runtime.backends.base import Shards
    from transduce.runtime.backends.registry import OnnxRuntimeOptions
    from transduce.runtime.decoding import DecodingOptions, decode
    from transduce.runtime.decoding import offline as decoding
    from transduce.runtime.spec import BackendSpec

    options = OnnxRuntimeOptions(shards=False) if args.whole and args.backend == "onnxruntime" else None
    be = open_backend(args.artifact, BackendSpec(args.backend, device=args.device, threads=args.threads,
                                                 options=options))
    cfg = be.config
    rng = np.random.default_rng(0)
    src = rng.integers(4, cfg.vocab_size, size=(args.batch, args.src_len - 1))
    ids = np.concatenate([src, np.full((args.batch, 1), cfg.eos_id)], axis=1).astype(np.int64)
    lens = np.full(args.batch, args.src_len, np.int64)
    opts = DecodingOptions.forced(args.steps, beam_size=args.beam)

    from transduce.runtime.devices import parse_device

    sync = None
    kind, index = parse_device(args.device)
    if args.backend == "tensorrt" or kind == "cuda":  # the device's queued work, waited for at each clock
        import torch

        gpu = index if kind == "cuda" else None  # tensorrt's --device cpu: the default GPU

        def sync():
            torch.cuda.synchronize(gpu)
    timer = Timer(sync)
    views = (be.shards(args.batch, args.beam) if isinstance(be, Shards) else None) or [be]  # the parts' backends
    for view in views:
        for name, part in (("encode", "encoder"), ("begin", "begin / end"), ("end", "begin / end"),
                           ("step", "step"), ("reorder", "reorder")):
            timer.wrap(view, name, part)
    timer.wrap(decoding, "_decode_one", "decode", opens_part=True)  # each part's whole decode
    inner = []  # parts measured inside another one: (part, the part it is in, the label of the rest)
    if args.backend == "onnxruntime":
        for session in {id(s): s for v in views for s in (v.decoder, v.decoder_wide)}.values():
            timer.wrap(session, "run_with_iobinding", "run")
        inner.append(("run", "step", "step: around run"))
        if hasattr(be._mem, "move_rows"):
            timer.wrap(be._mem, "move_rows", "moves")  # one memory, shared by the views
            inner.append(("moves", "reorder", "reorder: other"))

    for _ in range(3):
        decode(be, ids, lens, opts)
    per_decode: dict[str, list[float]] = defaultdict(list)
    n_parts = 1
    for _ in range(args.repeats):
        timer.total.clear()
        t = time.perf_counter()
        results = decode(be, ids, lens, opts)
        total = time.perf_counter() - t
        assert all(len(r.best.tokens) == args.steps for r in results), "forced length not reached"
        assert not any(p == 0 for p, _ in timer.total), "a backend call outside every part"
        part_ids = sorted({p for p, _ in timer.total})
        n_parts = len(part_ids)
        parts: dict[str, float] = defaultdict(float)
        for i in part_ids:  # each part's own times, then averaged over the parts
            mine = {part: v for (p, part), v in timer.total.items() if p == i}
            outer = ("encoder", "begin / end", "step", "reorder")
            # one part: everything but the backend's calls, decode()'s own checks included (as before parts)
            whole = total if n_parts == 1 else mine.get("decode", 0.0)
            mine.pop("decode", None)
            mine["search"] = whole - sum(mine.get(p, 0.0) for p in outer)
            for part, of, rest in inner:
                if of not in mine:  # never called (greedy search does not reorder)
                    continue
                mine.setdefault(part, 0.0)
                mine[rest] = mine[of] - mine[part]
            for k, v in mine.items():
                parts[k] += v / n_parts
        parts["total"] = total
        for k, v in parts.items():
            per_decode[k].append(v)

    print(f"{args.artifact}  backend {args.backend} ({args.device}), batch {args.batch}, beam {args.beam}, "
          f"{args.steps} steps, {args.src_len} source tokens, {args.threads} threads, median of {args.repeats}")
    if n_parts > 1:
        print(f"  the batch decoded in {n_parts} parts at the same time: the parts below are per part (averaged over "
              f"the {n_parts}), the total is wall time (--whole: the batch whole)")
    order = ["total", "encoder", "begin / end", "step", "run", "step: around run", "reorder", "moves",
             "reorder: other", "search"]
    total = statistics.median(per_decode["total"])
    for k in order:
        if k not in per_decode:
            continue
        ms = statistics.median(per_decode[k]) * 1e3
        indent = "    " if k in ("run", "step: around run", "moves", "reorder: other") else "  "
        print(f"{indent}{k:<18s} {ms:9.3f} ms  {ms * 1e3 / args.steps:9.1f} us/step  {ms / (total * 1e3):6.1%}")


if __name__ == "__main__":
    main()
