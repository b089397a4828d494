"""The machine's ceilings, measured in the same run as the benchmark, and the floors they imply.

- Memory bandwidth: the best of a few large copies (default 256 MiB: far beyond any cache), counted as
  bytes read + bytes written per second; numpy's copy (one thread) and torch's (its thread pool, set to
  the benchmark's thread count) are both timed and the faster one is the ceiling.
- fp32 matmul rate: the best of a few square fp32 matmuls (default 1024) with the benchmark's thread
  count, torch's and numpy's; 2 n^3 FLOPs each. numpy's BLAS sizes its thread pool once, when it
  loads (OPENBLAS_NUM_THREADS ...), so its matmul is timed in a child process started with that many.

Floors (a lower bound on a step's time; no real implementation reaches it):
- bytes: every weight a decoder step reads (self-attention Q/K/V/out, cross-attention Q/out -- cross
  K/V are computed once per source --, FFN, LayerNorms, the output projection), once per step, plus the
  self-attention cache and cross-attention K/V it reads;
- FLOPs: 2 x those weights' elements x rows (rows = batch x beam), plus attention's 4 x D x keys per row;
- floor = max(bytes / bandwidth, FLOPs / matmul rate). At batch 1 the bytes term dominates (a step is a
  matrix-vector product); at batch 16 x beam 4 the FLOPs term can.
The encoder floor is 2 x encoder weights x source tokens FLOPs (and its weights read once).
The GPU's ceilings and floors (gpu_ceilings.py) reuse this accounting at 2 bytes per element for fp16/bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

FP32 = 4
# the thread counts numpy's BLAS libraries read when they load (OpenBLAS, MKL, BLIS, OpenMP ones)
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "OMP_NUM_THREADS")
_NUMPY_MATMUL = """
import sys, time
import numpy as np
n, repeats = int(sys.argv[1]), int(sys.argv[2])
a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
a @ b
best = float("inf")
for _ in range(repeats):
    t = time.perf_counter()
    a @ b
    best = min(best, time.perf_counter() - t)
print(2 * n**3 / best / 1e9)
"""


@dataclass
class Ceilings:
    bandwidth_gbs: float  # GB/s (1e9 bytes), read + write
    matmul_gflops: float  # GFLOP/s, fp32
    threads: int
    detail: dict[str, float]  # each measurement

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _best(fn, repeats: int) -> float:
    fn()  # warm-up (page faults, thread pool start)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_ceilings(threads: int = 2, copy_mib: int = 256, matmul_n: int = 1024, repeats: int = 5) -> Ceilings:
    import numpy as np

    detail: dict[str, float] = {}
    n = copy_mib * 2**20 // FP32
    src = np.ones(n, dtype=np.float32)
    dst = np.empty_like(src)
    t = _best(lambda: np.copyto(dst, src), repeats)
    detail["numpy_copy_gbs"] = 2 * src.nbytes / t / 1e9

    rate = numpy_matmul_gflops(threads, matmul_n, repeats)
    if rate is not None:
        detail["numpy_matmul_gflops"] = rate
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            ts, td = torch.from_numpy(src), torch.from_numpy(dst)
            t = _best(lambda: td.copy_(ts), repeats)
            detail["torch_copy_gbs"] = 2 * src.nbytes / t / 1e9
            ta, tb = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
            t = _best(lambda: torch.mm(ta, tb), repeats)
            detail["torch_matmul_gflops"] = 2 * matmul_n**3 / t / 1e9
        finally:
            torch.set_num_threads(previous)
    bw = max(v for k, v in detail.items() if k.endswith("_gbs"))
    if not any(k.endswith("_gflops") for k in detail):
        raise RuntimeError("no matmul rate could be measured: neither torch nor numpy's child process gave one")
    fl = max(v for k, v in detail.items() if k.endswith("_gflops"))
    return Ceilings(bandwidth_gbs=bw, matmul_gflops=fl, threads=threads, detail=detail)


def numpy_matmul_gflops(threads: int, n: int, repeats: int) -> float | None:
    """numpy's best n x n fp32 matmul rate on `threads` BLAS threads, in a child process (None if it fails)."""
    env = {**os.environ, **{var: str(threads) for var in BLAS_THREAD_VARS}}
    try:
        done = subprocess.run([sys.executable, "-c", _NUMPY_MATMUL, str(n), str(repeats)], env=env,
                              capture_output=True, text=True, timeout=600)
        return float(done.stdout.strip()) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


# -- model arithmetic -------------------------------------------------------------------------------
def decoder_step_weights(cfg: dict[str, Any]) -> int:
    """Weight elements one decoder step reads: not the cross K/V projections (computed once per source)."""
    d, f, v, n = cfg["d_model"], cfg["d_ff"], cfg["vocab_size"], cfg["decoder_layers"]
    per_layer = (4 * d * d + 4 * d)  # self-attention q, k, v, out (+ biases)
    per_layer += 2 * d * d + 2 * d  # cross-attention q, out
    per_layer += d * f + f + f * d + d  # FFN
    per_layer += 3 * 2 * d  # three LayerNorms
    return n * per_layer + v * d  # + the (shared) output projection


def encoder_weights(cfg: dict[str, Any]) -> int:
    d, f, n = cfg["d_model"], cfg["d_ff"], cfg["encoder_layers"]
    per_layer = 4 * d * d + 4 * d + d * f + f + f * d + d + 2 * 2 * d
    cross_kv = cfg["decoder_layers"] * (2 * d * d + 2 * d)  # the decoder's cross K/V, computed with the encoder
    return n * per_layer + cross_kv


def step_floor(cfg: dict[str, Any], ceilings: Ceilings, rows: int, src_len: int, position: int,
               bytes_per_element: int = FP32) -> dict[str, float]:
    """Lower bound on one decoder step's seconds at `rows` rows, `position` cached target tokens; weights and
    caches held at `bytes_per_element` (fp32 4, fp16/bf16 2), FLOPs at the ceilings' matmul rate."""
    d, n = cfg["d_model"], cfg["decoder_layers"]
    w = decoder_step_weights(cfg)
    cache = n * rows * 2 * d * (position + src_len)  # self K/V up to position + cross K/V
    nbytes = bytes_per_element * (w + cache)
    flops = 2 * w * rows + n * rows * 4 * d * (position + 1 + src_len)
    t_bytes = nbytes / (ceilings.bandwidth_gbs * 1e9)
    t_flops = flops / (ceilings.matmul_gflops * 1e9)
    return {"seconds": max(t_bytes, t_flops), "bytes": float(nbytes), "flops": float(flops),
            "bound": "memory" if t_bytes >= t_flops else "compute"}


def decode_floor(cfg: dict[str, Any], ceilings: Ceilings, batch: int, beam: int, src_len: int,
                 steps: int, bytes_per_element: int = FP32) -> dict[str, float]:
    """Lower bound on a whole forced-length decode: the encoder once, then `steps` steps at batch x beam rows
    (`ceilings`: the CPU's, or the GPU's at one precision with its bytes per element)."""
    we = encoder_weights(cfg)
    enc = max(bytes_per_element * we / (ceilings.bandwidth_gbs * 1e9),
              2 * we * batch * src_len / (ceilings.matmul_gflops * 1e9))
    rows = batch * beam
    mid = step_floor(cfg, ceilings, rows, src_len, steps // 2, bytes_per_element)
    first = step_floor(cfg, ceilings, batch, src_len, 0, bytes_per_element)  # step 0 runs on one beam per sentence
    total = enc + first["seconds"] + (steps - 1) * mid["seconds"]
    return {"seconds": total, "encoder_seconds": enc, "step_seconds": mid["seconds"], "step_bound": mid["bound"]}
