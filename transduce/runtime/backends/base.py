"""The backend protocol: what the search needs from a framework, and the capabilities some backends add.

The core (Backend), what decoding needs of every backend; a backend owns the device memory of one run:
  encode(src_ids, src_lengths)        -> an opaque encoder result (cross K/V per decoder layer)
  begin(encoded, row_src, capacity)   -> a state: the self-attention cache preallocated to `capacity`
                                         positions for len(row_src) rows; row r decodes source row_src[r]
  step(state, tokens, k, ban_eos)     -> top-k (log-probs, token ids) of the next token for every row,
                                         as numpy (R, k); the step's K/V are written into the cache in place
  reorder(state, rows, row_src)       -> keep/duplicate rows: row i of the new state is row rows[i] of the
                                         old one (beam selection, finished rows dropped); row_src is the
                                         new rows' source index, cross K/V are re-gathered only if it changed
  end(state)                          -> the run is over, its buffers may be reused by the next run (the
                                         state is not used again); decoding calls it after every run
and what it is: `name` (its registry name), `config` (the ModelConfig), `device`, `precision` (the dtype its
weights run in), `cuda_graph` (whether it replays CUDA graphs), `quantization` (of its weights, None: none),
`artifact` (the Artifact it loaded; None for an eager model made from a model object).

Capabilities, each a protocol of its own; callers ask with isinstance and do without where it is missing:
  AdmitsRows     admit(state, encoded): one new row per source of `encoded`, after the state's rows, at
                 position 0 beside rows further on; the state's sources become those its rows decode,
                 ascending, then encoded's (renumbered_sources); cross K/V of every width share the state,
                 padded and masked by source length. Without it a running batch admits only when empty.
  AdmitsWithin   admits(state, rows, src_len): whether admit can take `rows` more sources of src_len tokens
                 into `state` now (a backend whose engines have fixed ranges); where not, a running batch
                 keeps them until it is empty, as one without AdmitsRows does.
  Shards         shards(batch, beam): None, or backends (views of this one) that decode parts of a batch
                 faster at the same time than this one decodes it whole; decoding then deals the sentences
                 out to them, one search per part, each in its own thread. Offered only where a sentence's
                 results do not depend on the sentences decoded beside it.
  SharesCores    limit_threads(n): meanwhile run on at most n intra-op threads (None: the budget it loaded
                 with), as several engines sharing the CPU's cores do while more than one of them decodes;
                 results do not depend on it. threaded_steps: whether its steps run on more than one thread
                 where it has them (a small model's run on one: lending it cores gains nothing)
  EncodesAside   encode_aside(src_ids, src_lengths): encode's result, made on one thread from a thread of the
                 caller's own while another thread steps a state (they share no buffer), so that a running
                 batch's steps go on while arriving sentences are encoded on a spare core; encodes_aside:
                 whether it can now (ONNX Runtime on the CPU)
  FullOutputs    step_log_probs(state, tokens): the full (R, vocab) fp32 log-probs, with step's side
                 effects; encoder_outputs(encoded): the encoder's outputs as fp32 numpy (parity, tests)
  KeepsLogProbs  last_log_probs(state): the full (R, vocab) fp32 log-probs of the state's last `step`, on the
                 host, valid until its next step (the ids a step bans may or may not read -inf): what a search
                 that forces or adjusts some rows reads beside the top-k, without a second kind of step
  StepGraphs     step_graphs() and only_step_graph(g): the step graph files a backend decodes with, and a
                 context in which it runs every step on one of them (parity checks each)
  Tuned          tuning(): what the backend chose when it loaded (threads, sessions, parts), JSON-ready
  ReturnsAttention  step_attention(state, tokens): a step with step's side effects -> the full (R, vocab) fp32
                 log-probs and every decoder layer's cross-attention weights averaged over the heads,
                 (R, layers, S) fp32 over the state's source positions (0 past each row's source length);
                 attention_problem(): why it cannot now (an artifact exported without the attention step
                 graph), or None. Decoding calls it only for steps where a cohort asks for alignments.

Tokens and token ids cross the protocol as numpy int64 arrays; everything else stays on the backend's
device. PAD and BOS are never proposed by `step` (their log-probs are excluded from the top-k: topk.py), and
EOS is excluded when ban_eos is set (minimum length).
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from transduce.formats.model_config import ModelConfig

# Cache slots a decoding run allocates first where its capacity is larger; twice as many each time positions
# reach them (docs/design/onnxruntime-cpu.md, "Cache slots on demand"). A server's runs take the model's
# max_positions as capacity.
FIRST_CACHE_SLOTS = 64


class Backend(Protocol):
    name: ClassVar[str]
    config: ModelConfig
    device: Any  # where its buffers are: "cpu", "cuda:N" or a torch.device
    precision: str  # fp32, fp16 or bf16: the dtype its weights run in
    cuda_graph: bool = False  # whether its steps are replayed from CUDA graphs
    quantization: str | None = None  # the quantization of its weights ("int8": transduce export --quantize)
    artifact: Any = None  # the formats.artifact.Artifact it loaded (an engine directory's copy); None: eager model

    def encode(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> Any: ...

    def begin(self, encoded: Any, row_src: np.ndarray, capacity: int) -> Any: ...

    def step(self, state: Any, tokens: np.ndarray, k: int, ban_eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        ...

    def reorder(self, state: Any, rows: np.ndarray, row_src: np.ndarray) -> None: ...

    def end(self, state: Any) -> None:
        """The run is over (its state is not used again). By default nothing to hand back."""


@runtime_checkable
class AdmitsRows(Protocol):
    def admit(self, state: Any, encoded: Any) -> None: ...


@runtime_checkable
class AdmitsWithin(Protocol):
    def admits(self, state: Any, rows: int, src_len: int) -> bool: ...


@runtime_checkable
class Shards(Protocol):
    def shards(self, batch: int, beam: int) -> list[Backend] | None: ...


@runtime_checkable
class SharesCores(Protocol):
    threaded_steps: bool

    def limit_threads(self, n: int | None) -> None: ...


@runtime_checkable
class EncodesAside(Protocol):
    encodes_aside: bool

    def encode_aside(self, src_ids: np.ndarray, src_lengths: np.ndarray) -> Any: ...


@runtime_checkable
class FullOutputs(Protocol):
    def step_log_probs(self, state: Any, tokens: np.ndarray) -> np.ndarray: ...

    def encoder_outputs(self, encoded: Any) -> dict[str, np.ndarray]: ...


@runtime_checkable
class KeepsLogProbs(Protocol):
    def last_log_probs(self, state: Any) -> np.ndarray: ...


@runtime_checkable
class StepGraphs(Protocol):
    def step_graphs(self) -> list[str]: ...

    def only_step_graph(self, graph: str | None) -> contextlib.AbstractContextManager[None]: ...


@runtime_checkable
class Tuned(Protocol):
    def tuning(self) -> dict[str, Any]: ...


@runtime_checkable
class ReturnsAttention(Protocol):
    def step_attention(self, state: Any, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def attention_problem(self) -> str | None: ...


CAPABILITIES = (AdmitsRows, AdmitsWithin, Shards, EncodesAside, FullOutputs, KeepsLogProbs, StepGraphs, Tuned,
                ReturnsAttention)
CORE = ("name", "config", "device", "precision", "encode", "begin", "step", "reorder", "end")


def missing_members(backend: Any) -> list[str]:
    """The members of the core protocol that `backend` lacks (one written without subclassing Backend, which
    gives `end`, `cuda_graph` and `artifact` their defaults)."""
    return sorted(n for n in CORE if not hasattr(backend, n))


_HAS: dict[tuple[type, type], bool] = {}  # (backend class, capability) -> isinstance's answer


def has_capability(backend: Any, capability: type) -> bool:
    """isinstance(backend, capability), asked once per backend class: a protocol's isinstance looks up each of
    its members (~5 us cold), and decoding asks on every call."""
    if hasattr(type(backend), "__getattr__"):  # a wrapper answers for whatever it wraps: asked each time
        return isinstance(backend, capability)
    key = (type(backend), capability)
    got = _HAS.get(key)
    if got is None:
        got = _HAS[key] = isinstance(backend, capability)
    return got


def capabilities(backend: Any) -> list[str]:
    """The names of the capabilities `backend` has, for messages and reports."""
    return [c.__name__ for c in CAPABILITIES if isinstance(backend, c)]


def step_graphs(backend: Any) -> list[str]:
    """The step graph files a backend decodes with where it has several to check (StepGraphs), else none."""
    return backend.step_graphs() if isinstance(backend, StepGraphs) else []


def only_step_graph(backend: Any, graph: str | None) -> contextlib.AbstractContextManager[None]:
    """Meanwhile run every step of `backend` on `graph`, one of its step_graphs() (None: as it chooses)."""
    if isinstance(backend, StepGraphs):
        return backend.only_step_graph(graph)
    if graph is not None:
        raise ValueError(f"{graph!r} is not one of this backend's step graphs []")
    return contextlib.nullcontext()


def alignment_layer(layer: int, layers: int) -> int:
    """The decoder layer (0-based) that option alignment_layer names in a decoder of `layers` layers: negative
    counts from the last, and a negative one past the first is the first (-2 on a one-layer decoder: layer 0)."""
    from transduce.errors import InputError

    if layer >= layers:
        raise InputError(f"alignment_layer {layer} is past this model's {layers} decoder layers (0..{layers - 1})",
                         hint="negative values count from the last layer (-1: the last)", params=("alignment_layer",))
    return layer if layer >= 0 else max(layers + layer, 0)


def require_attention(backend: Any) -> None:
    """BackendUnavailable unless `backend` can give the attention alignments are read from (ReturnsAttention)."""
    from transduce.errors import BackendUnavailable

    if not has_capability(backend, ReturnsAttention):
        raise BackendUnavailable(f"the {backend.name} backend does not give attention weights, which alignments "
                                 "(return_attention) are read from",
                                 hint="decode with the torch or onnxruntime backend", params=("return_attention",))
    problem = backend.attention_problem()
    if problem:
        hint = backend.artifact.rebuild_hint() if backend.artifact is not None else "decode with the torch backend"
        raise BackendUnavailable(problem, hint=hint, params=("return_attention",))


def renumbered_sources(row_src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sources a state's rows decode, ascending (the state's sources after an admit, before the new
    ones), and each row's index among them."""
    row_src = np.asarray(row_src, np.int64).reshape(-1)
    if not row_src.size:
        return row_src, row_src
    # a table over the source numbers instead of np.unique's sort: a few times faster on a running batch's rows
    rank = np.zeros(int(row_src.max()) + 1, np.int64)
    rank[row_src] = 1
    kept = np.flatnonzero(rank)
    rank[kept] = np.arange(len(kept))
    return kept, rank[row_src]
