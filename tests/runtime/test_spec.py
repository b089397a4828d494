"""BackendSpec and the backend registry: one typed description of a backend, parsed once from keywords, a config's
strings or a bench system name, checked when made; the registry opens what it names."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys

import pytest

from transduce.errors import BackendUnavailable, InputError
from transduce.runtime.backends.registry import BACKENDS, REGISTRY, OnnxRuntimeOptions
from transduce.runtime.spec import BackendSpec


def test_the_registry_names_each_backend_and_imports_no_framework_until_one_is_opened():
    assert BACKENDS == ("onnxruntime", "torch", "tensorrt")
    for entry in REGISTRY.values():
        module, function = entry.loader.split(":")
        assert callable(getattr(importlib.import_module(module), function)), entry.name
    code = ("import sys; import transduce.runtime.spec, transduce.runtime.backends.registry; "
            "print(sorted(m for m in ('torch', 'onnxruntime', 'tensorrt') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_a_spec_is_checked_when_made_and_names_its_parameters():
    assert BackendSpec() == BackendSpec("onnxruntime", device="cpu", threads=0)
    cases = [(dict(backend="tvm"), BackendUnavailable, "unknown backend 'tvm'", "backend"),
             (dict(threads=-1), InputError, "threads must be between 0 and 1024, got -1", "threads"),
             (dict(threads=100_000), InputError, "threads must be between 0 and 1024, got 100000", "threads"),
             (dict(threads=1.5), InputError, "threads must be an integer, got 1.5", "threads"),
             (dict(device="gpu"), InputError, "device 'gpu': the onnxruntime backend runs on cpu or cuda", "device"),
             (dict(precision="fp8", backend="torch"), InputError, "precision must be one of fp32, fp16, bf16",
              "precision"),
             (dict(precision="fp16"), InputError, "precision fp16: the onnxruntime backend runs the precision its "
                                                  "artifact was exported with", "precision"),
             (dict(cuda_graph=True), InputError, "cuda_graph: the onnxruntime backend does not capture", "cuda_graph"),
             (dict(backend="torch", options=OnnxRuntimeOptions()), InputError,
              "the torch backend's options must be None, got OnnxRuntimeOptions", "options")]
    for given, error, message, param in cases:
        with pytest.raises(error, match=message) as e:
            BackendSpec(**given)
        assert e.value.params[0] == param, given
    e = pytest.raises(InputError, BackendSpec, precision="fp16").value
    assert e.spelled({"precision": "--precision"}) == (
        "--precision fp16: the onnxruntime backend runs the precision its artifact was exported with\n"
        "  hint: give --precision with the torch backend only, or export at that precision (transduce export "
        "--precision)")  # the parameter is spelled where it is named, not where the word is prose


def test_keywords_split_into_the_spec_and_the_backends_own_typed_options():
    spec = BackendSpec.of("onnxruntime", threads=2, wide_steps="rows", fused=False)
    assert spec.threads == 2 and spec.options == OnnxRuntimeOptions(wide_steps="rows", fused=False)
    assert BackendSpec.of("torch", precision="bf16", cuda_graph=True).options is None
    with pytest.raises(BackendUnavailable, match="the torch backend takes no option fused") as e:
        BackendSpec.of("torch", fused=False)
    assert "those are the onnxruntime backend's" in e.value.hint
    with pytest.raises(BackendUnavailable, match="the onnxruntime backend takes no option colour"):
        BackendSpec.of("onnxruntime", colour="red")


def test_a_configs_strings_make_the_same_spec_and_back():
    spec = BackendSpec.from_mapping({"backend": "torch", "device": "cuda:1", "threads": "4", "cuda_graph": "true",
                                     "precision": "fp16", "model_dir": "none"})
    assert spec == BackendSpec("torch", device="cuda:1", threads=4, cuda_graph=True, precision="fp16")
    assert BackendSpec.from_mapping(spec.to_mapping()) == spec
    ort = BackendSpec.of("onnxruntime", threads=1, provider_options={"CPUExecutionProvider": {"a": "1"}}, shards=False)
    assert BackendSpec.from_mapping(ort.to_mapping()) == ort  # the backend's own options as a dict
    with pytest.raises(InputError, match="unknown backend setting 'thread'") as e:
        BackendSpec.from_mapping({"thread": "2"})
    assert "threads" in e.value.hint
    with pytest.raises(InputError, match="cuda_graph must be true or false, got 'maybe'"):
        BackendSpec.from_mapping({"cuda_graph": "maybe"})
    with pytest.raises(InputError, match="threads must be an integer, got 'two'"):
        BackendSpec.from_mapping({"threads": "two"})


def test_a_spec_has_one_name_and_the_name_its_spec():
    for backend in BACKENDS:
        for device in ("cpu", "cuda"):
            for graph in (False, True):
                for precision in (None, "fp32", "fp16", "bf16"):
                    try:
                        spec = BackendSpec(backend, device=device, cuda_graph=graph, precision=precision)
                    except InputError:  # a combination no backend takes
                        continue
                    again = BackendSpec.from_name(spec.name)
                    assert dataclasses.replace(again, precision=again.precision or None) == dataclasses.replace(
                        spec, precision=None if spec.precision == "fp32" else spec.precision,
                        device=spec.device if backend == "torch" else "cpu"), spec.name
    assert BackendSpec.from_name("torch-cuda-graph-fp16", threads=2) == BackendSpec(
        "torch", device="cuda", cuda_graph=True, precision="fp16", threads=2)
    for bad in ("torch-fp32", "torch-cuda-fp8", "onnx", "torch-graph-cuda", "tensorrt-cuda", ""):
        with pytest.raises(InputError, match="unknown backend name"):
            BackendSpec.from_name(bad)


def test_the_ray_application_reads_its_settings_by_the_specs_and_options_fields(monkeypatch):
    from transduce.serve import ray
    from transduce.serve.service import ServiceOptions

    monkeypatch.setattr(ray, "build_app", lambda *args, **kwargs: (args, kwargs))
    args, kwargs = ray.app({"artifact": "a", "backend": "torch", "threads": "2", "cuda_graph": "false",
                            "max_rows": "8", "max_wait_ms": "1.5", "scheduler": "static", "replicas": "3"})
    assert args == ("a", BackendSpec("torch", threads=2),
                    ServiceOptions(max_rows=8, max_wait_ms=1.5, scheduler="static")) and kwargs == {"replicas": 3}
    with pytest.raises(InputError, match="unknown setting 'bogus'"):
        ray.app({"artifact": "a", "bogus": "1"})
    with pytest.raises(BackendUnavailable, match="needs artifact=DIR"):
        ray.app({})
