"""The eager PyTorch backend: the reference model itself, on CPU or CUDA, under the same cache contract.

Opened over an artifact (open_backend), it decodes the model directory the artifact was exported from,
checked to hold the same weights and config; made from a model, it has no artifact. It has one step
function rather than step graphs, nothing to hand back at `end`, no parts. Capabilities: it admits rows
into a running batch (their own positions; cross K/V padded to the widest source), gives full log-probs
and encoder outputs, the cross-attention alignments are read from, and reports its precision (tuning)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from transduce.errors import ArtifactError, BackendUnavailable, ConfigError
from transduce.formats.artifact import Artifact
from transduce.formats.model_config import ModelConfig
from transduce.formats.model_dir import ModelDir
from transduce.runtime.backends.base import Backend, renumbered_sources
from transduce.runtime.backends.topk import banned_ids


@dataclass
class _Encoded:
    memory: Any  # (B, S, D)
    cross_k: list  # per layer (B, H, S, Dh)
    cross_v: list
    src_lengths: Any  # (B,)


@dataclass
class _State:
    enc: _Encoded
    row_src: np.ndarray  # (R,) source row of each decoding row
    cross_k: list  # per layer (R, H, S, Dh), gathered from enc by row_src
    cross_v: list
    src_lengths: Any  # (R,)
    cache_k: list  # per layer (R, H, C, Dh), preallocated
    cache_v: list
    position: int = 0  # filled slots: every row's while row_pos is None, else the most any row has
    row_pos: np.ndarray | None = None  # (R,) each row's position once rows differ (admit)
    last_lp: Any = None  # (R, V) the last step's log-probs (last_log_probs)


def merge_padded(a, keep, b, dim: int):
    """Rows `keep` of a (an index tensor) then every row of b, along axis 0, both zero-padded along `dim`
    to the wider of the two (an admitted batch's encoder results beside the running ones)."""
    import torch

    width = max(a.shape[dim], b.shape[dim])
    pad = [0, 0] * (a.dim() - 1 - dim)
    a = torch.nn.functional.pad(a.index_select(0, keep), pad + [0, width - a.shape[dim]])
    return torch.cat([a, torch.nn.functional.pad(b, pad + [0, width - b.shape[dim]])])


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, model, device: str = "cpu", precision: str = "fp32"):
        """precision: the weights' dtype, fp32, fp16 or bf16 (the model keeps softmax, LayerNorm, the residual
        sums and the log-softmax in fp32); another than the model's own runs on a copy of it."""
        import torch

        from transduce.formats.dtypes import PRECISION_DTYPES
        from transduce.runtime.devices import torch_device

        if precision not in PRECISION_DTYPES:
            raise BackendUnavailable(f"the torch backend has no precision {precision!r}",
                                     hint=f"one of {', '.join(PRECISION_DTYPES)}", params=("precision",))
        self.torch = torch
        self.device = torch.device(torch_device(device, unavailable=BackendUnavailable))
        self.precision = precision
        self.dtype = getattr(torch, PRECISION_DTYPES[precision])
        if next(model.parameters()).dtype != self.dtype:  # the caller's model keeps its weights
            model = copy.deepcopy(model).to(self.dtype)
        self.model = model.to(self.device).eval()
        self.config: ModelConfig = model.cfg

    @classmethod
    def from_model_dir(cls, path: str | ModelDir, device: str = "cpu", precision: str = "fp32",
                       **options) -> TorchBackend:
        from transduce.models.checkpoint import load_model_dir

        model, _, _ = load_model_dir(path, device="cpu")
        return cls(model, device, precision, **options)

    def tuning(self) -> dict[str, Any]:
        return {"precision": self.precision, "cuda_graph": False}

    def _long(self, a: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> _Encoded:
        lengths = self._long(src_lengths)
        with self.torch.inference_mode():
            memory, ck, cv = self.model.encode(self._long(src_ids), lengths)
        return _Encoded(memory, ck, cv, lengths)

    def encoder_outputs(self, enc: _Encoded) -> dict[str, np.ndarray]:
        out = {"memory": enc.memory.float().cpu().numpy()}
        for i, (k, v) in enumerate(zip(enc.cross_k, enc.cross_v, strict=True)):
            out[f"cross_key_{i}"] = k.float().cpu().numpy()
            out[f"cross_value_{i}"] = v.float().cpu().numpy()
        return out

    def begin(self, enc: _Encoded, row_src: np.ndarray, capacity: int) -> _State:
        torch = self.torch
        cfg = self.config
        rows = len(row_src)
        shape = (rows, cfg.n_heads, max(int(capacity), 1), cfg.head_dim)  # (R, H, C, Dh)
        n = cfg.decoder_layers
        state = _State(enc, np.array([-1]), [], [], None,
                       [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)],
                       [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)])
        self._gather_cross(state, np.asarray(row_src, dtype=np.int64))
        return state

    def _gather_cross(self, state: _State, row_src: np.ndarray) -> None:
        if np.array_equal(row_src, state.row_src):
            return
        enc = state.enc
        if np.array_equal(row_src, np.arange(len(enc.src_lengths))):
            state.cross_k, state.cross_v, state.src_lengths = enc.cross_k, enc.cross_v, enc.src_lengths
        else:
            idx = self._long(row_src)
            state.cross_k = [k.index_select(0, idx) for k in enc.cross_k]
            state.cross_v = [v.index_select(0, idx) for v in enc.cross_v]
            state.src_lengths = enc.src_lengths.index_select(0, idx)
        state.row_src = row_src.copy()

    def _run(self, state: _State, tokens: np.ndarray, attention: bool = False):
        torch = self.torch
        rows = len(tokens)
        p = state.position if state.row_pos is None else int(state.row_pos.max())
        if p >= state.cache_k[0].shape[2]:
            raise IndexError(f"cache capacity {state.cache_k[0].shape[2]} exhausted at position {p}")
        if state.row_pos is None:
            positions = torch.full((rows,), p, dtype=torch.long, device=self.device)
        else:
            positions = self._long(state.row_pos)
        with torch.inference_mode():
            got = self.model.decode_step(
                self._long(tokens), positions, state.src_lengths, state.cache_k, state.cache_v,
                state.cross_k, state.cross_v, return_attention=attention,
            )
            lp, nk, nv = got[:3]
            every = torch.arange(rows, device=self.device)
            for i in range(len(nk)):
                if state.row_pos is None:
                    state.cache_k[i][:, :, p : p + 1].copy_(nk[i])  # write slot p in place
                    state.cache_v[i][:, :, p : p + 1].copy_(nv[i])
                else:  # each row's own slot
                    state.cache_k[i][every, :, positions] = nk[i][:, :, 0]
                    state.cache_v[i][every, :, positions] = nv[i][:, :, 0]
        state.position = p + 1
        if state.row_pos is not None:
            state.row_pos = state.row_pos + 1
        return got if attention else lp

    def step(self, state: _State, tokens: np.ndarray, k: int, ban_eos: bool = False):
        lp = self._run(state, tokens)
        banned = banned_ids(self.config, ban_eos)
        with self.torch.inference_mode():
            lp[:, banned] = float("-inf")
            vals, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
        state.last_lp = lp
        return vals.cpu().numpy(), ids.cpu().numpy()

    def last_log_probs(self, state: _State) -> np.ndarray:
        """The last step's full log-probs (its banned ids at -inf), on the host."""
        return state.last_lp.float().cpu().numpy()

    def step_log_probs(self, state: _State, tokens: np.ndarray) -> np.ndarray:
        return self._run(state, tokens).cpu().numpy()

    def step_attention(self, state: _State, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step's full log-probs and every layer's head-averaged cross-attention (R, layers, S)."""
        lp, _, _, attention = self._run(state, tokens, attention=True)
        return lp.cpu().numpy(), attention.float().cpu().numpy()

    def attention_problem(self) -> str | None:
        return None  # the model's own step gives its attention

    def reorder(self, state: _State, rows: np.ndarray, row_src: np.ndarray) -> None:
        idx = self._long(rows)
        p = state.position
        with self.torch.inference_mode():
            for cache in (state.cache_k, state.cache_v):
                for i, c in enumerate(cache):
                    new = c.new_zeros((len(rows),) + tuple(c.shape[1:]))
                    new[:, :, :p] = c[:, :, :p].index_select(0, idx)  # only the filled slots
                    cache[i] = new
        if state.row_pos is not None:
            state.row_pos = state.row_pos[np.asarray(rows, np.int64)]
            if state.row_pos.size and (state.row_pos == state.row_pos[0]).all():  # in step again
                state.position, state.row_pos = int(state.row_pos[0]), None
        self._gather_cross(state, np.asarray(row_src, dtype=np.int64))

    def admit(self, state: _State, enc: _Encoded) -> None:
        """New rows at position 0 for `enc`'s sources after the state's; the encoder results merged into one,
        padded to the widest source (masked by src_lengths, as a padded batch's are)."""
        torch = self.torch
        kept, inverse = renumbered_sources(state.row_src)
        old, n_new = state.enc, len(enc.src_lengths)
        keep = self._long(kept)
        with torch.inference_mode():
            state.enc = _Encoded(merge_padded(old.memory, keep, enc.memory, 1),
                                 [merge_padded(a, keep, b, 2) for a, b in zip(old.cross_k, enc.cross_k, strict=True)],
                                 [merge_padded(a, keep, b, 2) for a, b in zip(old.cross_v, enc.cross_v, strict=True)],
                                 torch.cat([old.src_lengths.index_select(0, keep), enc.src_lengths]))
            p = state.position
            for cache in (state.cache_k, state.cache_v):
                for i, c in enumerate(cache):
                    new = c.new_zeros((c.shape[0] + n_new,) + tuple(c.shape[1:]))
                    new[: c.shape[0], :, :p] = c[:, :, :p]  # only the filled slots
                    cache[i] = new
        rows = len(inverse)
        before = state.row_pos if state.row_pos is not None else np.full(rows, state.position, np.int64)
        state.row_pos = np.concatenate([before, np.zeros(n_new, np.int64)])
        if (state.row_pos == 0).all():
            state.position, state.row_pos = 0, None
        state.row_src = np.array([-1])  # the merged results: gathered again
        self._gather_cross(state, np.concatenate([inverse, len(kept) + np.arange(n_new)]))


def open_backend(path: str, spec) -> TorchBackend:
    """The registry's loader: the eager model the artifact at `path` was exported from (spec.model_dir: another
    copy of it), at spec.precision, under CUDA graphs with spec.cuda_graph."""
    from transduce.runtime.checks import check_artifact

    artifact = check_artifact(path, verify_hashes=spec.verify)  # what load() reads the tokenizer from
    model_dir = source_model(artifact, spec.model_dir)
    if spec.threads:  # torch's thread count is process-wide: it holds for every torch model in this process
        import torch

        torch.set_num_threads(spec.threads)
    precision = spec.precision or "fp32"
    if spec.cuda_graph:
        from transduce.runtime.backends.torch_graph_backend import TorchGraphBackend

        backend = TorchGraphBackend.from_model_dir(model_dir, device=spec.device, precision=precision)
    else:
        backend = TorchBackend.from_model_dir(model_dir, device=spec.device, precision=precision)
    backend.artifact = artifact
    return backend


def source_model(artifact: Artifact, model_dir: str | None = None) -> ModelDir:
    """The model directory an artifact was exported from (for the torch backend and parity), checked to hold the
    weights (by the sha256 config.json records) and the model config the artifact was exported with."""
    src = artifact.manifest.get("source_model", {})
    path = model_dir or src.get("path")
    if model_dir and not os.path.isdir(model_dir):
        raise ArtifactError(f"model_dir {model_dir!r} is not a directory",
                            hint=f"pass the model directory {artifact.path!r} was exported from"
                                 + (f" (its manifest names {src['path']!r})" if src.get("path") else ""),
                            params=("model_dir",))
    if not path or not os.path.isdir(path):
        raise ArtifactError(
            f"the eager model that {artifact.path!r} was exported from is not available"
            + (f" (manifest says {path!r})" if path else ""),
            hint="pass model_dir MODEL_DIR", params=("model_dir",),
        )
    source = ModelDir.load(path)
    want = src.get("weights_sha256")
    if want and source.weights_sha256 != want:  # a config that records no weights is a CheckpointError
        raise ArtifactError(f"{path!r} holds other weights than the ones {artifact.path!r} was exported from",
                            hint="pass model_dir with the model directory the artifact was exported from, or "
                                 "re-export", params=("model_dir",))
    theirs, ours = _full_config(source.description.get("model")), artifact.config.to_dict()
    if theirs is not None and theirs != ours:  # same weights, edited config
        diff = [f"{k} {ours.get(k)!r} vs {theirs.get(k)!r}" for k in sorted(set(ours) | set(theirs))
                if ours.get(k) != theirs.get(k)]
        raise ArtifactError(f"{path!r} has the weights {artifact.path!r} was exported from but another model config "
                            f"(artifact vs model: {'; '.join(diff[:4])})",
                            hint="restore the model directory's config.json, or re-export from it")
    return source


def _full_config(model: object) -> dict | None:
    """A model config with its defaults filled in (a minimal config.json and the manifest's full one compare
    equal), or None if it is not a valid one (loading reports that)."""
    if not isinstance(model, dict):
        return None
    try:
        return ModelConfig.from_dict(model).to_dict()
    except ConfigError:
        return None
