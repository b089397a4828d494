"""`transduce.runtime.load`: an artifact directory (or an engine directory) -> a Translator."""

from __future__ import annotations

import os

from transduce.errors import ArtifactError, BackendUnavailable, InputError
from transduce.formats.artifact import rebuild_hint
from transduce.formats.model_dir import TOKENIZER_FILE
from transduce.runtime.backends.base import Backend
from transduce.runtime.checks import check_artifact

BACKENDS = ("onnxruntime", "torch", "tensorrt")
TORCH_OPTIONS = ("cuda_graph", "precision")  # what the torch backend takes besides device and threads


def source_model_dir(artifact_dir: str, manifest: dict, model_dir: str | None = None) -> str:
    """The model directory an artifact was exported from (for the torch backend and parity), checked by hash."""
    from transduce.formats.model_dir import read_config, weights_sha256

    src = manifest.get("source_model", {})
    path = model_dir or src.get("path")
    if model_dir and not os.path.isdir(model_dir):
        raise ArtifactError(f"--model {model_dir!r} is not a directory",
                            hint=f"pass the model directory {artifact_dir!r} was exported from"
                                 + (f" (its manifest names {src['path']!r})" if src.get("path") else ""))
    if not path or not os.path.isdir(path):
        raise ArtifactError(
            f"the eager model that {artifact_dir!r} was exported from is not available"
            + (f" (manifest says {path!r})" if path else ""),
            hint="pass --model MODEL_DIR",
        )
    want = src.get("weights_sha256")
    config = read_config(path)
    if want and weights_sha256(path) != want:  # a config that records no weights is a CheckpointError
        raise ArtifactError(f"{path!r} holds other weights than the ones {artifact_dir!r} was exported from",
                            hint="pass --model with the model directory the artifact was exported from, or re-export")
    theirs, ours = _full_config(config.get("model")), _full_config(manifest.get("model"))
    if theirs is not None and ours is not None and theirs != ours:  # same weights, edited config
        diff = [f"{k} {ours.get(k)!r} vs {theirs.get(k)!r}" for k in sorted(set(ours) | set(theirs))
                if ours.get(k) != theirs.get(k)]
        raise ArtifactError(f"{path!r} has the weights {artifact_dir!r} was exported from but another model config "
                            f"(artifact vs model: {'; '.join(diff[:4])})",
                            hint="restore the model directory's config.json, or re-export from it")
    return path


def _full_config(model: object) -> dict | None:
    """A model config with its defaults filled in (a minimal config.json and the manifest's full one
    compare equal), or None if it is not a valid one (loading reports that)."""
    from transduce.errors import ConfigError
    from transduce.models.config import ModelConfig

    if not isinstance(model, dict):
        return None
    try:
        return ModelConfig.from_dict(model).to_dict()
    except ConfigError:
        return None


def backend_options(backend: str, cuda_graph: bool = False, precision: str | None = None) -> dict:
    """The options `--cuda-graph` and `--precision` give make_backend, refused where the backend has no use for
    them (an exported graph's precision was fixed by `transduce export`)."""
    options: dict = {}
    if cuda_graph:
        if backend not in ("torch", "tensorrt"):
            raise InputError(f"--cuda-graph: the {backend} backend does not capture CUDA graphs",
                             hint="--backend torch --device cuda, or --backend tensorrt")
        options["cuda_graph"] = True
    if precision is not None:
        if backend != "torch":
            raise InputError(f"--precision {precision}: the {backend} backend runs the precision its artifact was "
                             "exported with", hint="export at that precision (transduce export --precision), or "
                                                   "give --precision with --backend torch only")
        options["precision"] = precision
    return options


def make_backend(artifact_dir: str, backend: str = "onnxruntime", device: str = "cpu", threads: int = 0,
                 model_dir: str | None = None, **options) -> Backend:
    """Build one backend over an artifact. torch uses the source model the manifest names (or model_dir)."""
    from transduce.runtime.devices import parse_device

    if backend not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {backend!r}", hint=f"choose one of {', '.join(BACKENDS)}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise InputError(f"threads must be an integer >= 0, got {threads!r}", hint="0: the framework's default")
    kind, index = parse_device(device, runs=f"the {backend} backend runs")
    if backend == "tensorrt":
        # artifact_dir is an engine directory (transduce build); TensorRT runs on CUDA only, so the CLI's
        # default --device cpu means the default GPU here (parity keeps its torch reference on the CPU).
        from transduce.runtime.backends.tensorrt_backend import TensorRTBackend

        return TensorRTBackend(artifact_dir, device="cuda" if index is None else f"cuda:{index}", **options)
    if backend == "torch":
        manifest = check_artifact(artifact_dir)  # the onnxruntime backend checks it itself (verify option)
        unknown = sorted(set(options) - set(TORCH_OPTIONS))
        if unknown:  # onnxruntime's or tensorrt's: silently dropped, they would change nothing
            raise BackendUnavailable(f"the torch backend takes no option {', '.join(unknown)}",
                                     hint=f"those are the onnxruntime or tensorrt backend's; torch takes "
                                          f"{' and '.join(TORCH_OPTIONS)}")
        if threads:  # torch's thread count is process-wide: it holds for every torch model in this process
            import torch

            torch.set_num_threads(threads)
        model_path = source_model_dir(artifact_dir, manifest, model_dir)
        precision = options.get("precision") or "fp32"
        if options.get("cuda_graph"):
            from transduce.runtime.backends.torch_graph_backend import TorchGraphBackend

            return TorchGraphBackend.from_model_dir(model_path, device=device, precision=precision)
        from transduce.runtime.backends.torch_backend import TorchBackend

        return TorchBackend.from_model_dir(model_path, device=device, precision=precision)
    from transduce.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    provider = options.pop("provider", None) or kind
    if provider != "cpu":  # its CUDA buffers, stream and providers on that GPU ("cuda": the first, as ORT's default)
        options.setdefault("device_index", index or 0)
    return OnnxRuntimeBackend(artifact_dir, provider=provider, threads=threads, **options)


def load(artifact_dir: str | os.PathLike, backend: str = "onnxruntime", device: str = "cpu", threads: int = 0,
         model_dir: str | None = None, max_batch_tokens: int = 4096, **options):
    """A Translator over an exported artifact (or, for backend="tensorrt", an engine directory)."""
    from transduce.models.tokenizer import Tokenizer
    from transduce.runtime.translator import Translator

    artifact_dir = os.fspath(artifact_dir)
    be = make_backend(artifact_dir, backend, device, threads, model_dir, **options)
    tok_dir = be.artifact_dir or artifact_dir  # the eager model's backend loaded no artifact
    tok_path = os.path.join(tok_dir, TOKENIZER_FILE)
    tokenizer = Tokenizer.from_file(tok_path)
    if tokenizer.vocab_size != be.config["vocab_size"]:  # another model's tokenizer.json put in its place
        raise ArtifactError(f"{tok_path} has {tokenizer.vocab_size} tokens, the model {be.config['vocab_size']}: it is "
                            "not the tokenizer this model was trained with", hint=rebuild_hint(tok_dir, be.manifest))
    return Translator(be, tokenizer, max_batch_tokens=max_batch_tokens)
