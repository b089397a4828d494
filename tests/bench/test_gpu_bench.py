"""transduce bench's GPU side, checked on the CPU: the torch-cuda system names, the GPU ceilings' measuring code
(run on "cpu" at tiny sizes), the per-precision floors, the report's GPU rows, and a run without CUDA. No timing
assertions: these only check the instrument."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from transduce.bench import ceilings
from transduce.bench.config import TORCH_COMPILE_SYSTEMS, TORCH_CUDA_SYSTEMS, BenchConfig, compiled_system, system_spec
from transduce.bench.gpu_ceilings import GpuCeilings, add_gpu_ceilings, gpu_floor, measure_gpu_ceilings
from transduce.bench.report_gpu import precision_of
from transduce.errors import TransduceError

BASE = {"encoder_layers": 6, "decoder_layers": 6, "d_model": 512, "n_heads": 8, "d_ff": 2048, "vocab_size": 8000}


def test_torch_cuda_system_names_are_the_names_of_their_backend_specs():
    def parsed(name):
        spec = system_spec(name)
        return (spec.backend, spec.device, spec.cuda_graph, spec.precision or "fp32")

    assert parsed("torch-cuda") == ("torch", "cuda", False, "fp32")
    assert parsed("torch-cuda-fp16") == ("torch", "cuda", False, "fp16")
    assert parsed("torch-cuda-bf16") == ("torch", "cuda", False, "bf16")
    assert parsed("torch-cuda-graph") == ("torch", "cuda", True, "fp32")
    assert parsed("torch-cuda-graph-fp16") == ("torch", "cuda", True, "fp16")
    assert parsed("torch-cuda-graph-bf16") == ("torch", "cuda", True, "bf16")
    assert [system_spec(n).name for n in TORCH_CUDA_SYSTEMS] == list(TORCH_CUDA_SYSTEMS)
    assert parsed("torch") == ("torch", "cpu", False, "fp32") and parsed("tensorrt")[0] == "tensorrt"
    assert system_spec("onnxruntime-int8").name == "onnxruntime"  # the onnxruntime system on the quantized export
    for bad in ("torch-cuda-fp32", "torch-cuda-graph-int8", "torch-cuda-fp8", "torch-cuda-graphs", "ctranslate2"):
        with pytest.raises(TransduceError, match="unknown backend name"):
            system_spec(bad)


def test_a_torch_compile_system_is_the_eager_system_it_compiles():
    assert TORCH_COMPILE_SYSTEMS == ("torch-cuda-compile", "torch-cuda-compile-fp16", "torch-cuda-compile-bf16")
    assert compiled_system("torch-cuda-compile-fp16") == "torch-cuda-fp16" and compiled_system("torch-cuda") is None
    assert system_spec("torch-cuda-compile-bf16") == system_spec("torch-cuda-bf16")
    assert [precision_of(n) for n in TORCH_COMPILE_SYSTEMS] == ["fp32", "fp16", "bf16"]
    assert BenchConfig(backends=list(TORCH_COMPILE_SYSTEMS)).backends == list(TORCH_COMPILE_SYSTEMS)


def test_config_accepts_the_torch_cuda_systems_and_refuses_unknown_ones():
    cfg = BenchConfig(backends=["torch", *TORCH_CUDA_SYSTEMS])
    assert cfg.backends == ["torch", *TORCH_CUDA_SYSTEMS]
    with pytest.raises(TransduceError) as e:
        BenchConfig(backends=["torch", "torch-cuda-graph-fp8", "cuda-graph"])
    text = str(e.value)
    assert "unknown backend 'torch-cuda-graph-fp8'" in text and "torch-cuda-graph-bf16" in text
    assert "unknown backend 'cuda-graph'" in text


def test_gpu_ceilings_measure_on_the_cpu_at_tiny_sizes():
    g = measure_gpu_ceilings("cpu", ("fp32", "fp16", "bf16"), copy_mib=1, matmul_n=32, repeats=2)
    assert g.device == "cpu" and set(g.matmul_gflops) == {"fp32", "fp16", "bf16"}
    assert math.isfinite(g.bandwidth_gbs) and g.bandwidth_gbs > 0
    assert all(math.isfinite(x) and x > 0 for x in g.matmul_gflops.values())
    d = g.to_dict()
    assert d["detail"] == {"copy_mib": 1, "matmul_n": 32, "repeats": 2, "tf32": False}
    assert json.loads(json.dumps(d)) == d  # goes into bench.json as it is
    assert g.at("fp16").matmul_gflops == g.matmul_gflops["fp16"] and g.at("fp16").bandwidth_gbs == g.bandwidth_gbs


def test_two_byte_weights_halve_the_floors_bytes_term():
    c = ceilings.Ceilings(bandwidth_gbs=3000.0, matmul_gflops=1e9, threads=0, detail={})  # memory-bound throughout
    four = ceilings.step_floor(BASE, c, rows=1, src_len=32, position=16)
    two = ceilings.step_floor(BASE, c, rows=1, src_len=32, position=16, bytes_per_element=2)
    assert two["bytes"] == pytest.approx(four["bytes"] / 2) and two["flops"] == four["flops"]
    assert two["seconds"] == pytest.approx(four["seconds"] / 2) and two["bound"] == "memory"
    assert ceilings.step_floor(BASE, c, 1, 32, 16, ceilings.FP32) == four  # the CPU's floor as before
    gpu = GpuCeilings("H100", 3000.0, {"fp32": 5e4, "fp16": 7e5}, {})
    f32, f16 = (gpu_floor(BASE, gpu, p, 1, 1, 32, 32) for p in ("fp32", "fp16"))
    assert f16["precision"] == "fp16" and f16["decode_ms"] == pytest.approx(f16["seconds"] * 1e3)
    assert f16["step_seconds"] == pytest.approx(f32["step_seconds"] / 2, rel=0.05)


def test_gpu_ceilings_and_floors_only_where_a_gpu_system_ran(monkeypatch):
    from transduce.bench import gpu_ceilings

    calls = []

    def fake(device, dtypes, copy_mib, matmul_n):
        calls.append((device, dtypes))
        return GpuCeilings("fake GPU", 2000.0, {p: 1e5 for p in dtypes}, {})

    monkeypatch.setattr(gpu_ceilings, "measure_gpu_ceilings", fake)
    cell = {"mode": "greedy", "batch": 1, "beam": 1}
    size = {"model": {"config": BASE}, "cells": [cell],
            "systems": {"torch": {"status": "ok"}, "torch-cuda-graph-fp16": {"status": "skipped", "reason": "no GPU"}}}
    result = {"sizes": [size]}
    add_gpu_ceilings(result, 32, 32, True, lambda m: None)
    assert calls == [] and "gpu_ceilings" not in result and "gpu_floors" not in cell
    size["systems"].update({"torch-cuda-graph-fp16": {"status": "ok"}, "torch-cuda": {"status": "ok"},
                            "torch-cuda-bf16": {"status": "ok"}})
    add_gpu_ceilings(result, 32, 32, True, lambda m: None)
    assert calls == [("cuda", ("fp32", "fp16", "bf16"))]
    assert result["gpu_ceilings"]["device"] == "fake GPU" and set(cell["gpu_floors"]) == {"fp32", "fp16", "bf16"}

    def broken(*args):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(gpu_ceilings, "measure_gpu_ceilings", broken)
    fresh = {"mode": "greedy", "batch": 1, "beam": 1}
    size["cells"] = [fresh]
    add_gpu_ceilings(result, 32, 32, True, lambda m: None)  # the run's timings stand without them
    assert result["gpu_ceilings"] == {"error": "RuntimeError: CUDA out of memory"} and "gpu_floors" not in fresh


def _stats(decode_ms: float, step_ms: float) -> dict:
    one = {"median": decode_ms, "min": decode_ms, "max": decode_ms, "n": 1}
    tps = {"median": 32 / decode_ms * 1e3, "min": 32 / decode_ms * 1e3, "max": 32 / decode_ms * 1e3, "n": 1}
    return {"stats": {"decode_ms": one, "tokens_per_s": tps, "sentences_per_s": tps, "first_ms": one,
                      "step_ms_derived": step_ms}, "raw": {}}


def _gpu_result() -> dict:
    """A synthetic bench.json: one base cell with a CPU row and eager and graph rows on the GPU."""
    floor = {"decode_ms": 100.0, "seconds": 0.1, "step_seconds": 0.003, "step_bound": "memory",
             "encoder_seconds": 0.004}
    gpu = GpuCeilings("NVIDIA H100", 3000.0, {"fp32": 5e4, "fp16": 7e5}, {"copy_mib": 1024, "matmul_n": 8192,
                                                                           "repeats": 5, "tf32": False})
    gpu_floors = {p: gpu_floor(BASE, gpu, p, 1, 1, 32, 32) for p in ("fp32", "fp16")}
    cell = {"mode": "greedy", "beam": 1, "batch": 1, "src_len": 32, "steps": 32, "ratios": {}, "ct2_best": None,
            "ct2_settings_ratio": {}, "foreign_cpu_share": 0.0, "floor": floor, "gpu_floors": gpu_floors,
            "systems": {"torch": _stats(200.0, 6.0), "torch-cuda": _stats(150.0, 4.5),
                        "torch-cuda-fp16": _stats(140.0, 4.0), "torch-cuda-graph-fp16": _stats(14.0, 0.4),
                        "tensorrt": _stats(5.0, 0.1)}}
    size = {"size": "base", "model": {"config": BASE, "description": "random"},
            "systems": {n: {"status": "ok", "info": {}} for n in cell["systems"]}, "cells": [cell]}
    return {"config": asdict(BenchConfig(threads=2)), "machine": {}, "date": "2026-11-26",
            "ceilings": {"runs": [], "bandwidth_gbs": 20.0, "matmul_gflops": 100.0, "threads": 2},
            "gpu_ceilings": gpu.to_dict(), "sizes": [size]}


def _rows(text: str) -> dict[str, list[str]]:
    """The main table's rows of the cell, by system (its 12 columns, not the graph table's 7)."""
    return {line.split("|")[3].strip(): [x.strip() for x in line.split("|")] for line in text.splitlines()
            if line.startswith("| greedy | 1 |") and line.count("|") == 13}


def test_the_report_holds_gpu_rows_to_the_gpu_floor_of_their_precision():
    from transduce.bench.report import markdown

    result = _gpu_result()
    text = markdown(result)
    assert "## GPU ceilings" in text and "| NVIDIA H100 | 3000 | 50000 | 700000 |" in text
    rows = _rows(text)
    floors = result["sizes"][0]["cells"][0]["gpu_floors"]
    assert rows["torch"][10] == "50%"  # the CPU row against the CPU floor
    # one decimal below 10%: these floors are a small share of eager decoding's time
    assert rows["torch-cuda"][10] == f"{100 * floors['fp32']['decode_ms'] / 150.0:.1f}%"
    assert rows["torch-cuda-fp16"][10] == f"{100 * floors['fp16']['decode_ms'] / 140.0:.1f}%"
    assert rows["torch-cuda-graph-fp16"][10] == f"{100 * floors['fp16']['decode_ms'] / 14.0:.1f}%"
    assert float(rows["torch-cuda"][10][:-1]) > 0 and float(rows["torch-cuda-fp16"][10][:-1]) > 0
    assert rows["tensorrt"][10] == "GPU§"  # its engine's precision is not known: no floor at all
    assert all(rows[n][11] == "GPU§" for n in ("torch-cuda", "torch-cuda-graph-fp16", "tensorrt"))
    assert "*GPU floor fp16*" in rows and "*GPU floor fp32*" in rows and "*floor*" in rows
    assert "against the GPU floor of its precision" in text and "the floors are this CPU's" not in text
    # CUDA graphs against eager CUDA at the same precision: fp16 only (no fp32 graph row ran)
    step = floors["fp16"]["step_seconds"] * 1e3
    assert f"| greedy | 1 | torch-cuda-graph-fp16 | 4.000 | 0.400 | 10.0× | {0.4 / step:.1f}× |" in text
    assert "| greedy | 1 | torch-cuda-graph |" not in text


def test_the_report_without_gpu_ceilings_keeps_gpu_rows_off_every_floor():
    from transduce.bench.report import markdown

    result = _gpu_result()
    del result["gpu_ceilings"]
    for c in result["sizes"][0]["cells"]:
        del c["gpu_floors"]
    text = markdown(result)
    rows = _rows(text)
    assert all(rows[n][10] == "GPU§" for n in ("torch-cuda", "torch-cuda-graph-fp16", "tensorrt"))
    assert "GPU ceilings" not in text and "*GPU floor" not in text
    assert "§ on the GPU: the floors are this CPU's" in text
    assert "| greedy | 1 | torch-cuda-graph-fp16 | 4.000 | 0.400 | 10.0× | – |" in text
    result["gpu_ceilings"] = {"error": "RuntimeError: CUDA out of memory"}
    assert "Not measured: RuntimeError: CUDA out of memory" in markdown(result)


def test_a_run_without_cuda_skips_the_graph_systems_and_times_the_cpu_ones(tmp_path, tiny_model_dir,
                                                                            tiny_artifact_dir):
    import torch
    from click.testing import CliRunner

    from transduce.cli import main

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the graph systems would be timed, not skipped")
    out = tmp_path / "bench"
    res = CliRunner().invoke(main, ["bench", "--quick", "--model-dir", tiny_model_dir, "--artifact-dir",
                                    tiny_artifact_dir, "--out", str(out), "--threads", "1", "--batches", "1",
                                    "--modes", "greedy", "--repeats", "1", "--steps", "3", "--src-len", "5",
                                    "--backends", "torch,torch-cuda-graph,torch-cuda-graph-fp16"])
    assert res.exit_code == 0, res.output
    with open(out / "bench.json", encoding="utf-8") as f:
        result = json.load(f)
    (size,) = result["sizes"]
    assert size["systems"]["torch"]["status"] == "ok"
    for name in ("torch-cuda-graph", "torch-cuda-graph-fp16"):
        assert size["systems"][name]["status"] == "skipped"
        assert "sees no usable CUDA GPU" in size["systems"][name]["reason"]
    assert [set(c["systems"]) for c in size["cells"]] == [{"torch"}]
    assert "gpu_ceilings" not in result and all("gpu_floors" not in c for c in size["cells"])
    md = (out / "bench.md").read_text(encoding="utf-8")
    skipped = [line for line in md.splitlines() if line.startswith("- torch-cuda-graph not timed: ")]
    assert len(skipped) == 1 and "sees no usable CUDA GPU" in skipped[0], skipped


def test_the_worker_opens_the_spec_of_its_system_name(monkeypatch):
    """A torch-cuda system opens the BackendSpec its name stands for (fp32 left as the torch backend's default);
    without CUDA every torch-cuda system is refused by the same device check, before anything loads."""
    import torch

    from transduce.bench import worker
    from transduce.errors import BackendUnavailable
    from transduce.runtime import api

    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="sees no usable CUDA GPU"):
            worker._Ours("torch-cuda-graph-fp16", "nowhere", None, 1)
    opened = []
    monkeypatch.setattr("transduce.runtime.devices.torch_device", lambda *a, **k: "cuda:0")
    monkeypatch.setattr(api, "open_backend", lambda path, spec: opened.append(spec) or (_ for _ in ()).throw(
        RuntimeError("stop here")))
    for name in ("torch-cuda", "torch-cuda-bf16", "torch-cuda-graph", "torch-cuda-graph-fp16"):
        with pytest.raises(RuntimeError, match="stop here"):
            worker._Ours(name, "nowhere", "model", 1)
    assert [(s.device, s.cuda_graph, s.precision, s.threads, s.model_dir) for s in opened] == [
        ("cuda", False, None, 1, "model"), ("cuda", False, "bf16", 1, "model"), ("cuda", True, None, 1, "model"),
        ("cuda", True, "fp16", 1, "model")]
