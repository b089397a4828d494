"""The GPU's own ceilings, measured in a run that timed a GPU system, and the floors they imply per precision.

- Device memory bandwidth: the best of a few device-to-device copies of one large buffer (default 1 GiB, far
  beyond the GPU's caches), counted as bytes read + bytes written per second.
- Matmul rate per dtype (those of the run's GPU systems: fp32 with TF32 disabled, fp16, bf16): the best of a
  few square matmuls (default n = 8192), 2 n^3 FLOPs each.
On CUDA the work is timed with CUDA events after a synchronize; on "cpu" (the tests' small sizes) with
perf_counter, so the same code runs without a GPU.

The floors are ceilings.decode_floor's accounting at the precision's bytes per element (fp32 4, fp16/bf16 2:
weights and caches alike) against the GPU's bandwidth and that dtype's matmul rate. A GPU row is held against
the GPU floor of its own precision, never the CPU's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from transduce.bench.ceilings import Ceilings, decode_floor

BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass
class GpuCeilings:
    device: str  # the GPU's name ("cpu" where measured there)
    bandwidth_gbs: float  # GB/s (1e9 bytes), read + write
    matmul_gflops: dict[str, float]  # dtype ("fp32", "fp16", "bf16") -> GFLOP/s
    detail: dict[str, Any]  # the sizes and repeats used

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def at(self, precision: str) -> Ceilings:
        """These ceilings at one precision, in the form decode_floor takes."""
        return Ceilings(self.bandwidth_gbs, self.matmul_gflops[precision], threads=0, detail={})


def _timer(torch, device):
    """A function timing fn() once on `device` -> seconds: CUDA events on a GPU (its queue drained first)."""
    if device.type != "cuda":
        def once(fn) -> float:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        return once

    def once_cuda(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return once_cuda


def measure_gpu_ceilings(device: str = "cuda", dtypes: tuple[str, ...] = ("fp32",), copy_mib: int = 1024,
                         matmul_n: int = 8192, repeats: int = 5) -> GpuCeilings:
    """Memory bandwidth and the matmul rate of each dtype on `device` (best of `repeats` after a warm-up)."""
    import torch

    dev = torch.device(device)
    once = _timer(torch, dev)

    def best(fn) -> float:
        once(fn)  # warm-up: allocator, kernel selection, clocks ramping up
        return min(once(fn) for _ in range(repeats))

    src = torch.ones(copy_mib * 2**20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / best(lambda src=src, dst=dst: dst.copy_(src)) / 1e9
    del src, dst
    rates = {}
    torch_dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    precision = torch.get_float32_matmul_precision()
    try:  # fp32 as fp32: TF32 would time a lower-precision matmul under fp32's name
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        for name in dict.fromkeys(dtypes):
            a = torch.randn(matmul_n, matmul_n, device=dev).to(torch_dtypes[name])
            b = torch.randn(matmul_n, matmul_n, device=dev).to(torch_dtypes[name])
            rates[name] = 2 * matmul_n**3 / best(lambda a=a, b=b: torch.mm(a, b)) / 1e9
            del a, b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.set_float32_matmul_precision(precision)
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the buffers back to the GPU, not held by this process's allocator
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    return GpuCeilings(device=name, bandwidth_gbs=bandwidth, matmul_gflops=rates,
                       detail={"copy_mib": copy_mib, "matmul_n": matmul_n, "repeats": repeats, "tf32": False})


def gpu_floor(cfg: dict[str, Any], gpu: GpuCeilings, precision: str, batch: int, beam: int, src_len: int,
              steps: int) -> dict[str, Any]:
    """A decode's floor on the GPU at `precision` (decode_floor's accounting at its bytes per element)."""
    floor = decode_floor(cfg, gpu.at(precision), batch, beam, src_len, steps, BYTES_PER_ELEMENT[precision])
    return {**floor, "decode_ms": floor["seconds"] * 1e3, "precision": precision}


def timed_gpu_precisions(result: dict[str, Any]) -> list[str]:
    """The precisions of the GPU systems that loaded in any size (fp32 for TensorRT, whose engine's precision
    the bench does not know: it gets the ceilings, not a floor); [] where no GPU system ran."""
    from transduce.bench.config import GPU_SYSTEMS, system_spec

    found = []
    for s in result["sizes"]:
        for name, info in s["systems"].items():
            if name in GPU_SYSTEMS and info.get("status") == "ok":
                found.append(system_spec(name).precision or "fp32")
    return sorted(set(found), key=list(BYTES_PER_ELEMENT).index)


def add_gpu_ceilings(result: dict[str, Any], src_len: int, steps: int, quick: bool, log) -> None:
    """Where a GPU system ran: the GPU's ceilings into result["gpu_ceilings"] and each cell's GPU floor per
    precision into cell["gpu_floors"]. A failed measurement is recorded as such; the run's timings stand."""
    precisions = timed_gpu_precisions(result)
    if not precisions:
        return
    copy_mib, matmul_n = (128, 2048) if quick else (1024, 8192)
    log(f"[ceilings] measuring the GPU's memory bandwidth and matmul rate ({', '.join(precisions)})")
    try:
        gpu = measure_gpu_ceilings("cuda", tuple(precisions), copy_mib, matmul_n)
    except Exception as e:  # out of memory, a GPU gone: the timings are still worth their report
        result["gpu_ceilings"] = {"error": f"{type(e).__name__}: {e}"}
        log(f"[ceilings] the GPU's ceilings could not be measured: {e}")
        return
    result["gpu_ceilings"] = gpu.to_dict()
    for s in result["sizes"]:
        for c in s.get("cells", []):
            c["gpu_floors"] = {p: gpu_floor(s["model"]["config"], gpu, p, c["batch"], c["beam"], src_len, steps)
                               for p in precisions}
