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


def test_usable_cpus_keep_to_a_cgroups_cpu_quota(tmp_path, monkeypatch):
    """The affinity mask's CPUs, or fewer where a cgroup over the process (its own or an ancestor's; v2's cpu.max,
    v1's cfs quota, v1's cpu controller mounted alone or with cpuacct) allows less time: whole CPUs of the quota,
    at least one. quota_threads gives a framework's default (0) that many only under a quota."""
    import shutil

    from transduce.runtime import devices

    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    root, membership = tmp_path / "cgroup", tmp_path / "self-cgroup"
    monkeypatch.setattr(devices, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(devices, "MEMBERSHIP", str(membership))

    def write(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    assert devices.usable_cpus() == 16 and devices.cpu_quota() is None  # no cgroup files, no membership
    assert devices.quota_threads(0) == 0 and devices.quota_threads(3) == 3
    membership.write_text("0::/kubepods/pod1/ctr\n")
    write(root / "cpu.max", "max 100000\n")
    assert devices.usable_cpus() == 16  # the root: no quota
    write(root / "kubepods" / "pod1" / "cpu.max", "250000 100000\n")  # a pod's limit of 2.5 CPUs
    assert devices.cpu_quota() == 2.5 and devices.usable_cpus() == 2
    assert devices.quota_threads(0) == 2 and devices.quota_threads(5) == 5  # threads given are the user's
    write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "50000 100000\n")  # half a CPU: one
    assert devices.usable_cpus() == 1
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "800000 100000\n")
    assert devices.usable_cpus() == 1  # the affinity mask allows fewer
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert devices.usable_cpus() == 2  # the pod's quota, below its container's

    # v1, the cpu controller co-mounted with cpuacct under their joined names (no "cpu" link beside it)
    for name in ("cpu.max", "kubepods/pod1/cpu.max", "kubepods/pod1/ctr/cpu.max"):
        (root / name).unlink()
    membership.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert devices.usable_cpus() == 16  # v1's "no quota"
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "300000\n")
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert devices.cpu_quota() == 3.0 and devices.usable_cpus() == 3
    membership.write_text("3:cpuacct,cpu:/docker/abc\n")  # CentOS 7 lists them unsorted; the mount is sorted
    assert devices.usable_cpus() == 3
    # Docker's usual view: "cpu" mounted (or linked) alone, its root the container's cgroup, which /proc names by
    # the host's path that the container's mount does not have
    shutil.rmtree(root / "cpu,cpuacct")
    membership.write_text("3:cpu,cpuacct:/docker/abc\n")
    write(root / "cpu" / "cpu.cfs_quota_us", "150000\n")
    write(root / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert devices.cpu_quota() == 1.5 and devices.usable_cpus() == 1


def test_available_memory_finds_a_v1_memory_controller_mounted_with_others(tmp_path):
    """A v1 memory controller mounted under the names of the controllers mounted with it is read as one mounted
    alone is."""
    from transduce.runtime import devices

    root, membership, meminfo = tmp_path / "cgroup", tmp_path / "self-cgroup", tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   20000000 kB\n")
    membership.write_text("5:memory,hugetlb:/job\n")
    job = root / "memory,hugetlb" / "job"
    job.mkdir(parents=True)
    (job / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    (job / "memory.usage_in_bytes").write_text(f"{1 << 29}\n")
    assert devices.available_memory(str(meminfo), str(root), str(membership)) == 1 << 29
