"""The eager PyTorch backend: the reference model itself, on CPU or CUDA, under the same cache contract.

Opened over an artifact (open_backend), it decodes the model directory the artifact was exported from,
checked to hold the same weights and config; made from a model, it has no artifact. It has one step
function rather than step graphs, nothing to hand back at `end`, no parts. Capabilities: it admits rows
into a running batch (their own positions; each source's cross K/V written once into a slot pool,
torch_slots.CrossSlots; beams reordered in place within the cache's rows; cache slots allocated as positions reach
them, each step reading the filled ones only), gives full log-probs
and encoder outputs, the cross-attention alignments are read from, and reports its precision (tuning)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transduce.errors import ArtifactError, BackendUnavailable, ConfigError
from transduce.formats.artifact import Artifact
from transduce.formats.model_config import ModelConfig
from transduce.formats.model_dir import ModelDir
from transduce.runtime.backends.base import FIRST_CACHE_SLOTS, Backend
from transduce.runtime.backends.topk import banned_ids
from transduce.runtime.backends.torch_slots import CrossSlots
from transduce.runtime.devices import quota_threads


@dataclass
class _Encoded:
    memory: Any  # (B, S, D)
    cross_k: list  # per layer (B, H, S, Dh)
    cross_v: list
    src_lengths: Any  # (B,)


@dataclass
class _State:
    cross: CrossSlots  # the sources' cross K/V (a slot pool) and the per-row views the step reads
    cache_k: list  # per layer (row capacity, H, slots, Dh); rows [:rows] are the state's; the slots grow (doubled,
    cache_v: list  # within `capacity`) as positions reach them
    spare: Any  # a flat buffer of one layer's cache size: a reorder gathers the moved rows into it
    rows: int  # the state's rows
    capacity: int  # cache slots the run may fill: a row at this position cannot step
    past_k: list = field(default_factory=list)  # the step's views cache_k[i][:rows]
    past_v: list = field(default_factory=list)
    position: int = 0  # filled slots: every row's while row_pos is None, else the most any row has
    row_pos: np.ndarray | None = None  # (R,) each row's position once rows differ (admit)
    last_lp: Any = None  # (R, V) the last step's log-probs (last_log_probs)

    @property
    def src_lengths(self):
        return self.cross.src_lengths

    def view_rows(self) -> None:
        """The step's views of the cache's first `rows` rows (after the row count changed)."""
        self.past_k = [c[: self.rows] for c in self.cache_k]
        self.past_v = [c[: self.rows] for c in self.cache_v]


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
        capacity = max(int(capacity), 1)
        # a few slots first, more as positions reach them: a server's runs take the model's max_positions as
        # their capacity, and most sentences end long before it
        shape = (rows, cfg.n_heads, min(capacity, FIRST_CACHE_SLOTS), cfg.head_dim)  # (R, H, slots, Dh)
        n = cfg.decoder_layers
        cross = CrossSlots(torch, enc.cross_k, enc.cross_v, enc.src_lengths, cfg.max_positions)
        state = _State(cross, [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)],
                       [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)],
                       torch.empty(int(np.prod(shape)), dtype=self.dtype, device=self.device), rows, capacity)
        state.view_rows()
        cross.bind(np.asarray(row_src, dtype=np.int64), rows)
        return state

    def _run(self, state: _State, tokens: np.ndarray, attention: bool = False):
        torch = self.torch
        rows = len(tokens)
        p = state.position if state.row_pos is None else int(state.row_pos.max())
        if p >= state.capacity:
            raise IndexError(f"cache capacity {state.capacity} exhausted at position {p}")
        if p >= state.cache_k[0].shape[2]:
            slots = min(state.capacity, max(2 * state.cache_k[0].shape[2], p + 1))
            self._reallocate(state, state.cache_k[0].shape[0], slots)
        if state.row_pos is None:
            positions = torch.full((rows,), p, dtype=torch.long, device=self.device)
        else:
            positions = self._long(state.row_pos)
        seen = max(p, 1)  # the step reads the filled slots only: its attention costs O(position), not O(slots)
        with torch.inference_mode():
            got = self.model.decode_step(
                self._long(tokens), positions, state.src_lengths, [c[:, :, :seen] for c in state.past_k],
                [c[:, :, :seen] for c in state.past_v], state.cross.cross_k, state.cross.cross_v,
                return_attention=attention,
            )
            lp, nk, nv = got[:3]
            every = torch.arange(rows, device=self.device)
            for i in range(len(nk)):
                if state.row_pos is None:
                    state.past_k[i][:, :, p : p + 1].copy_(nk[i])  # write slot p in place
                    state.past_v[i][:, :, p : p + 1].copy_(nv[i])
                else:  # each row's own slot
                    state.past_k[i][every, :, positions] = nk[i][:, :, 0]
                    state.past_v[i][every, :, positions] = nv[i][:, :, 0]
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
        """Row i continues row rows[i], in place: only the rows whose content changes move, and only their
        filled slots (gathered into the spare buffer first: a source may be a destination too); rows that
        leave compact the cache within its row capacity, which grows (doubled) only for more rows."""
        rows = np.asarray(rows, np.int64)
        n, p = len(rows), state.position if state.row_pos is None else int(state.row_pos.max())
        if n > state.cache_k[0].shape[0]:
            self._reallocate(state, max(n, 2 * state.cache_k[0].shape[0]), state.cache_k[0].shape[2])
        moved = np.flatnonzero(rows != np.arange(n))
        if moved.size and p:
            self._move_rows(state, moved, rows[moved], p)
        state.rows = n
        state.view_rows()
        if state.row_pos is not None:
            state.row_pos = state.row_pos[rows]
            if state.row_pos.size and (state.row_pos == state.row_pos[0]).all():  # in step again
                state.position, state.row_pos = int(state.row_pos[0]), None
        state.cross.bind(np.asarray(row_src, dtype=np.int64), state.cache_k[0].shape[0])

    def _move_rows(self, state: _State, dst: np.ndarray, src: np.ndarray, p: int) -> None:
        """Rows dst of the cache take the first p slots of rows src, every layer, through the spare buffer."""
        torch = self.torch
        d, s = self._long(dst), self._long(src)
        shape = (len(src),) + tuple(state.cache_k[0].shape[1:2]) + (p,) + tuple(state.cache_k[0].shape[3:])
        spare = state.spare[: int(np.prod(shape))].view(shape)  # contiguous: index_select writes it as is
        with torch.inference_mode():
            for c in state.cache_k + state.cache_v:
                filled = c[:, :, :p]  # a view: index_copy_ writes through it
                torch.index_select(filled, 0, s, out=spare)
                filled.index_copy_(0, d, spare)

    def _reallocate(self, state: _State, rows: int, slots: int) -> None:
        """The cache and the spare reallocated for `rows` rows (more rows: doubled, rarely) of `slots` slots (doubled
        as positions reach them), the state's rows' filled slots kept, the rest zeroed."""
        with self.torch.inference_mode():
            for cache in (state.cache_k, state.cache_v):
                for i, c in enumerate(cache):
                    new = c.new_zeros((rows, c.shape[1], slots, c.shape[3]))
                    new[: state.rows, :, : c.shape[2]].copy_(c[: state.rows])
                    cache[i] = new
        state.spare = state.cache_k[0].new_empty(state.cache_k[0].numel())
        state.view_rows()

    def admit(self, state: _State, enc: _Encoded) -> None:
        """New rows at position 0 for `enc`'s sources after the state's: their cross K/V written into free
        slots of the state's pool (torch_slots.CrossSlots), the cache grown only past its row capacity."""
        n_new = len(enc.src_lengths)
        rows = state.rows + n_new
        if rows > state.cache_k[0].shape[0]:  # doubled: rows admitted one request at a time copy the cache rarely
            self._reallocate(state, max(rows, 2 * state.cache_k[0].shape[0]), state.cache_k[0].shape[2])
        row_src = state.cross.admit(enc.cross_k, enc.cross_v, enc.src_lengths)
        before = state.row_pos if state.row_pos is not None else np.full(state.rows, state.position, np.int64)
        state.row_pos = np.concatenate([before, np.zeros(n_new, np.int64)])
        if (state.row_pos == 0).all():
            state.position, state.row_pos = 0, None
        state.rows = rows
        state.view_rows()
        state.cross.bind(row_src, state.cache_k[0].shape[0])


def open_backend(path: str, spec) -> TorchBackend:
    """The registry's loader: the eager model the artifact at `path` was exported from (spec.model_dir: another
    copy of it), at spec.precision, under CUDA graphs with spec.cuda_graph."""
    from transduce.runtime.checks import check_artifact

    artifact = check_artifact(path, verify_hashes=spec.verify)  # what load() reads the tokenizer from
    model_dir = source_model(artifact, spec.model_dir)
    threads = quota_threads(spec.threads) if spec.device == "cpu" else spec.threads
    if threads:  # torch's thread count is process-wide: it holds for every torch model in this process
        import torch

        torch.set_num_threads(threads)
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
