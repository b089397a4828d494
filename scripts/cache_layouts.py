"""Measure the decoder-step cost of two self-attention cache designs on ONNX Runtime (CPU).

  ours    the contract's design: the whole preallocated cache (batch, heads, capacity, head_dim) goes
          in every step, only the new position's K/V (batch, heads, 1, head_dim) come out, and the
          caller writes them into slot t of its buffer
  concat  the Optimum / CTranslate2 design: the past (batch, heads, t, head_dim) goes in, the graph
          concatenates the new K/V and returns the present (batch, heads, t+1, head_dim), which is
          fed back at the next step

Both graphs are exported from the same random-weight model with the same exporter (torch.onnx,
dynamo) and differ only in the self-attention cache; everything else (embedding, cross-attention
over a 20-token source, FFN, log_softmax over the vocabulary) is shared code. Each measurement
steps the decoder 40 times from an empty cache (ours: capacity 40, then also 80 to show the cost
of masked slots) and reports ms/step; the designs are interleaved and repeated, the median and the
minimum of the repeats are printed.

    python scripts/cache_layouts.py [--workdir runs/cache_layouts] [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

MODELS = {
    "tiny": dict(vocab_size=400, encoder_layers=2, decoder_layers=2, d_model=128, n_heads=4, d_ff=512),
    "base": dict(vocab_size=8000, encoder_layers=6, decoder_layers=6, d_model=512, n_heads=8, d_ff=2048),
}
SRC_LEN = 20
STEPS = 40


def concat_step_graph(model):
    """The concat design as a module: past (B, H, t, Dh) per layer in, present (B, H, t+1, Dh) out."""
    import torch
    from torch import nn

    from transduce.models.transformer import length_mask

    class ConcatStepGraph(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, tokens, positions, src_lengths, past, cross):
            m = self.model
            x = m._embed(m.embed, tokens[:, None], positions[:, None])  # (B, 1, D)
            src_mask = length_mask(src_lengths, cross[0].shape[2])[:, None, None, :]  # (B, 1, 1, S)
            presents = []
            for i, layer in enumerate(m.decoder_layers):
                h = layer._pre(x, layer.norm1)
                q = layer.self_attn.query(h)  # (B, H, 1, Dh)
                k_new, v_new = layer.self_attn.key_value(h)
                k = torch.cat([past[2 * i], k_new], dim=2)  # (B, H, t+1, Dh): a full copy per step
                v = torch.cat([past[2 * i + 1], v_new], dim=2)
                mask = torch.ones_like(k[:, :1, :1, :1], dtype=torch.bool)  # (B, 1, 1, 1): every slot is real
                a, _ = layer.self_attn.attend(q, k, v, mask)
                x = layer._post(x, a, layer.norm1)
                x, _ = layer._cross_and_ffn(x, cross[2 * i], cross[2 * i + 1], src_mask)
                presents += [k, v]
            if m.cfg.norm_first:
                x = m.decoder_norm(x)
            log_probs = torch.log_softmax(m._logits(x[:, 0]).float(), dim=-1)
            return (log_probs, *presents)

    return ConcatStepGraph(model)


def export_both(name: str, workdir: str) -> tuple[str, str, dict]:
    """Export (once; cached in workdir) our step graph and the concat one for a random-weight model."""
    import torch
    from torch.export import Dim

    from transduce.exporter import graphs
    from transduce.exporter.onnx_export import DEFAULT_OPSET, export_graph
    from transduce.formats import contract
    from transduce.models.config import ModelConfig
    from transduce.models.transformer import Transformer

    cfg = ModelConfig(**MODELS[name])
    ours, concat = os.path.join(workdir, f"{name}_ours.onnx"), os.path.join(workdir, f"{name}_concat.onnx")
    if os.path.exists(ours) and os.path.exists(concat):
        return ours, concat, cfg
    os.makedirs(workdir, exist_ok=True)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    n = cfg.decoder_layers
    _, step_args = graphs.example_inputs(cfg, "fp32")
    _, step_shapes = graphs.dynamic_shapes(cfg)
    ins, outs = [s.name for s in contract.step_inputs(n)], [s.name for s in contract.step_outputs(n)]
    print(f"exporting {name}: ours", flush=True)
    export_graph(graphs.StepGraph(model), step_args, step_shapes, ins, outs, ours, DEFAULT_OPSET)
    past_len = Dim("past_len", min=1, max=cfg.max_positions - 1)
    concat_shapes = dict(step_shapes, past=[{0: d[0], 2: past_len} for d in step_shapes["past"]])
    present = [o.replace("new_", "present_") for o in outs]
    print(f"exporting {name}: concat", flush=True)
    export_graph(concat_step_graph(model), step_args, concat_shapes, ins, present, concat, DEFAULT_OPSET)
    return ours, concat, cfg


def session(path: str, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def fixed_feeds(cfg, batch: int, rng) -> dict[str, np.ndarray]:
    h, dh = cfg.n_heads, cfg.head_dim
    feeds = {"src_lengths": np.full(batch, SRC_LEN, np.int64)}
    for i in range(cfg.decoder_layers):
        for kv in ("key", "value"):
            feeds[f"cross_{kv}_{i}"] = rng.standard_normal((batch, h, SRC_LEN, dh), dtype=np.float32)
    return feeds


def run_ours(sess, cfg, feeds: dict, tokens: np.ndarray, capacity: int) -> float:
    """STEPS steps with a preallocated cache; -> seconds."""
    b, n = tokens.shape[0], cfg.decoder_layers
    h, dh = cfg.n_heads, cfg.head_dim
    names = [f"{kv}_{i}" for i in range(n) for kv in ("key", "value")]
    cache = {f"past_{nm}": np.zeros((b, h, capacity, dh), np.float32) for nm in names}
    out_names = ["log_probs"] + [f"new_{nm}" for nm in names]
    t0 = time.perf_counter()
    for t in range(STEPS):
        outs = sess.run(out_names, {**feeds, **cache, "tokens": tokens[:, t], "positions": np.full(b, t, np.int64)})
        for nm, new in zip(names, outs[1:]):
            cache[f"past_{nm}"][:, :, t] = new[:, :, 0]  # write slot t in place
    return time.perf_counter() - t0


def run_concat(sess, cfg, feeds: dict, tokens: np.ndarray) -> float:
    """STEPS steps feeding each step's presents back as the next past; -> seconds."""
    b, n = tokens.shape[0], cfg.decoder_layers
    h, dh = cfg.n_heads, cfg.head_dim
    names = [f"{kv}_{i}" for i in range(n) for kv in ("key", "value")]
    past = {f"past_{nm}": np.zeros((b, h, 0, dh), np.float32) for nm in names}
    out_names = ["log_probs"] + [f"present_{nm}" for nm in names]
    t0 = time.perf_counter()
    for t in range(STEPS):
        outs = sess.run(out_names, {**feeds, **past, "tokens": tokens[:, t], "positions": np.full(b, t, np.int64)})
        past = {f"past_{nm}": p for nm, p in zip(names, outs[1:])}
    return time.perf_counter() - t0


def check_same(ours, concat, cfg, rng) -> float:
    """Both designs give the same log_probs over STEPS steps (max abs difference)."""
    feeds = fixed_feeds(cfg, 2, rng)
    tokens = rng.integers(4, cfg.vocab_size, (2, STEPS))
    b, n = 2, cfg.decoder_layers
    h, dh = cfg.n_heads, cfg.head_dim
    names = [f"{kv}_{i}" for i in range(n) for kv in ("key", "value")]
    cache = {f"past_{nm}": np.zeros((b, h, STEPS, dh), np.float32) for nm in names}
    past = {f"past_{nm}": np.zeros((b, h, 0, dh), np.float32) for nm in names}
    worst = 0.0
    for t in range(STEPS):
        common = {**feeds, "tokens": tokens[:, t], "positions": np.full(b, t, np.int64)}
        a = ours.run(None, {**common, **cache})
        c = concat.run(None, {**common, **past})
        worst = max(worst, float(np.abs(a[0] - c[0]).max()))
        for i, nm in enumerate(names):
            cache[f"past_{nm}"][:, :, t] = a[1 + i][:, :, 0]
        past = {f"past_{nm}": p for nm, p in zip(names, c[1:])}
    return worst


def measure(ours, concat, cfg, batch: int, repeats: int, rng) -> dict[str, list[float]]:
    """ms/step of each variant, `repeats` times, interleaved in alternating order after one warm-up."""
    feeds = fixed_feeds(cfg, batch, rng)
    tokens = rng.integers(4, cfg.vocab_size, (batch, STEPS))
    runs = {
        f"ours C={STEPS}": lambda: run_ours(ours, cfg, feeds, tokens, STEPS),
        f"ours C={2 * STEPS}": lambda: run_ours(ours, cfg, feeds, tokens, 2 * STEPS),
        "concat": lambda: run_concat(concat, cfg, feeds, tokens),
    }
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(repeats):
        for k in list(runs) if r % 2 == 0 else reversed(list(runs)):
            times[k].append(runs[k]() / STEPS * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="runs/cache_layouts")
    ap.add_argument("--models", default="tiny,base")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    print(f"onnxruntime {ort.__version__} CPU, {args.threads} threads, {STEPS} steps, source length {SRC_LEN}, "
          f"{args.repeats} interleaved repeats, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name in args.models.split(","):
        ours_path, concat_path, cfg = export_both(name, args.workdir)
        ours, concat = session(ours_path, args.threads), session(concat_path, args.threads)
        print(f"{name}: max |log_probs difference| between the designs over {STEPS} steps: "
              f"{check_same(ours, concat, cfg, rng):.2e}", flush=True)
        for batch in (int(b) for b in args.batches.split(",")):
            for k, ts in measure(ours, concat, cfg, batch, args.repeats, rng).items():
                print(f"{name:<5} batch {batch:>3}  {k:<10} {statistics.median(ts):8.3f} ms/step (median)"
                      f"  {min(ts):8.3f} (min)", flush=True)
        print(f"load average now {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
