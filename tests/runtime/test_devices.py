"""transduce.runtime.devices: one device check for training, parity and every backend. Its messages name the
parameter (`device`); a command line spells it as its flag (--device: tests/runtime/test_cli.py)."""

import pytest
import torch

from transduce.errors import BackendUnavailable, ConfigError, InputError
from transduce.runtime.devices import parse_device, torch_device


def test_device_names_are_parsed_without_a_framework():
    assert parse_device("cpu") == ("cpu", None) and parse_device("cpu:0") == ("cpu", None)
    assert parse_device("cuda") == ("cuda", None) and parse_device("cuda:3") == ("cuda", 3)
    assert parse_device(torch.device("cuda", 2)) == ("cuda", 2) and torch_device(torch.device("cpu")) == "cpu"
    for bad in ("gpu", "meta", "mps", "CUDA", "cuda:", "cuda:x", "cpu:1", " cpu", ""):
        with pytest.raises(InputError, match="this runs on cpu or cuda") as e:
            parse_device(bad)
        assert e.value.hint == "device cpu, cuda or cuda:N" and e.value.params == ("device",)
        assert e.value.spelled({"device": "--device"}).endswith("hint: --device cpu, cuda or cuda:N")
    with pytest.raises(ConfigError, match="--x 'meta': training runs on cpu or cuda"):
        parse_device("meta", "--x", ConfigError, runs="training runs")


def test_torch_devices_are_ones_this_torch_sees():
    assert torch_device("cpu") == "cpu"
    with pytest.raises(InputError, match="device 'bogus': eager PyTorch runs on cpu or cuda"):
        torch_device("bogus")
    if torch.cuda.is_available():
        assert torch_device("cuda") == f"cuda:{torch.cuda.current_device()}"
        with pytest.raises(BackendUnavailable, match="there are"):
            torch_device(f"cuda:{torch.cuda.device_count()}", unavailable=BackendUnavailable)
    else:
        with pytest.raises(BackendUnavailable, match="device cuda:1: this torch sees no usable CUDA GPU") as e:
            torch_device("cuda:1", unavailable=BackendUnavailable)
        assert e.value.hint == "device cpu"


def test_every_backend_checks_its_device(tiny_model_dir, tiny_artifact_dir, monkeypatch):
    from transduce.runtime.api import make_backend
    from transduce.runtime.backends.torch_backend import TorchBackend

    assert str(TorchBackend.from_model_dir(tiny_model_dir, device="cpu").device) == "cpu"
    with pytest.raises(InputError, match="'gpu': eager PyTorch runs on cpu or cuda"):
        TorchBackend.from_model_dir(tiny_model_dir, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="no usable CUDA GPU"):
            TorchBackend.from_model_dir(tiny_model_dir, device="cuda")
    for backend in ("onnxruntime", "torch", "tensorrt"):  # before anything is loaded
        with pytest.raises(InputError, match=f"device 'gpu': the {backend} backend runs on cpu or cuda"):
            make_backend(tiny_artifact_dir, backend, device="gpu")
    # the onnxruntime backend's CUDA buffers and providers are on the GPU --device names ("cuda": the first)
    from transduce.runtime.backends import onnxruntime_backend as orb

    seen = []
    monkeypatch.setattr(orb, "OnnxRuntimeBackend", lambda *a, **k: seen.append(k))
    for device in ("cuda:1", "cuda", "cpu"):
        make_backend(tiny_artifact_dir, "onnxruntime", device=device)
    make_backend(tiny_artifact_dir, "onnxruntime", device="cuda:0", provider="tensorrt")
    assert [(k["provider"], k.get("device_index")) for k in seen] == [("cuda", 1), ("cuda", 0), ("cpu", None),
                                                                         ("tensorrt", 0)]
