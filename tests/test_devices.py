"""transduce._devices: one --device check for training, the eager backend and parity."""

import pytest
import torch

from transduce._devices import torch_device
from transduce.errors import BackendUnavailable, ConfigError, InputError


def test_device_names_are_checked_and_normalised():
    assert torch_device("cpu") == "cpu"
    with pytest.raises(InputError, match="--device 'bogus' is not a torch device") as e:
        torch_device("bogus")
    assert e.value.hint == "--device cpu, cuda or cuda:N"
    with pytest.raises(ConfigError, match="--x meta: training runs on cpu or cuda"):
        torch_device("meta", "--x", ConfigError, runs="training runs")
    if torch.cuda.is_available():
        assert torch_device("cuda") == f"cuda:{torch.cuda.current_device()}"
        with pytest.raises(BackendUnavailable, match="there are"):
            torch_device(f"cuda:{torch.cuda.device_count()}", unavailable=BackendUnavailable)
    else:
        with pytest.raises(BackendUnavailable, match="--device cuda: this torch sees no usable CUDA GPU") as e:
            torch_device("cuda", unavailable=BackendUnavailable)
        assert e.value.hint == "--device cpu"


def test_the_eager_backend_checks_its_device(tiny_model_dir):
    from transduce.runtime.backends.torch_backend import TorchBackend

    assert str(TorchBackend.from_model_dir(tiny_model_dir, device="cpu").device) == "cpu"
    with pytest.raises(InputError, match="is not a torch device"):
        TorchBackend.from_model_dir(tiny_model_dir, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="no usable CUDA GPU"):
            TorchBackend.from_model_dir(tiny_model_dir, device="cuda")
