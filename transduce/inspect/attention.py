"""Attention maps of the eager model, drawn like the paper's Figures 3-5.

The weights are the ones the model itself computes in `Transformer.forward(..., return_attention=True)`
(a teacher-forced pass in eval mode); nothing here recomputes attention. Without a given target the
sentence is first decoded greedily, and the greedy output is then fed back teacher-forced, which
reproduces the weights the decoder used at each step.

Axes:
- encoder self-attention: the source tokens (EOS appended, as the model sees them) on both axes;
- decoder position t holds the input token (BOS, y1, y2, ...) and predicts the next token. Rows of the
  decoder maps (decoder self-attention, encoder-decoder attention) are labelled by the token predicted
  at that position (y1, y2, ..., EOS); the columns of decoder self-attention by the decoder's input
  tokens (BOS, y1, ...), so the subsequent mask is the upper triangle: row t sees columns 0..t.
Special tokens are labelled <bos>, <eos>, <pad>, <unk>. Other tokens are the tokenizer's BPE pieces
without their word-start mark "▁"; a piece that continues a word is shown with a leading "·"
("thousand" is a word, "·teen" the end of one).

Files written by `write_attention_figures` (layers counted from 1, as in the paper):
  encoder_layer{L}.png, decoder_self_layer{L}.png, cross_layer{L}.png   all heads of one layer in a grid
  token_{kind}_layer{L}_pos{i}.png                                        Figure 3: one query token,
                                                                          every head in its own colour
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from transduce.errors import InputError, TransduceError
from transduce.formats.model_config import ModelConfig
from transduce.io.paths import make_writable_dir
from transduce.runtime.decoding.batch import pad_ids

ATTENTION_KINDS = ("encoder", "decoder_self", "cross")
KIND_TITLES = {
    "encoder": "encoder self-attention",
    "decoder_self": "decoder self-attention (masked)",
    "cross": "encoder-decoder attention",
}
SPECIAL_LABELS = {"pad_id": "<pad>", "bos_id": "<bos>", "eos_id": "<eos>", "unk_id": "<unk>"}
WORD_START = "\u2581"  # the Metaspace word-boundary mark of the tokenizer's pieces
CONTINUATION = "\u00b7"  # shown before a piece that continues a word (the word-initial mark is dropped)


@dataclass(frozen=True)
class AttentionMaps:
    """One sentence's attention weights, trimmed to its real tokens, with the tokens of every axis.

    encoder[l] is (H, S, S), decoder_self[l] (H, T, T), cross[l] (H, T, S), float32, for layer l (0-based);
    S counts the source EOS, T the predicted tokens (EOS included when the sentence finished).
    """

    source_ids: tuple[int, ...]  # source ids + EOS
    source_labels: tuple[str, ...]
    decoder_input_ids: tuple[int, ...]  # BOS + predicted[:-1]
    decoder_input_labels: tuple[str, ...]
    predicted_ids: tuple[int, ...]  # the token predicted at each decoder position
    predicted_labels: tuple[str, ...]
    target_text: str  # the greedy translation, or the given target
    teacher_forced: bool  # True when the target was given, False when it was decoded greedily
    encoder: list[np.ndarray]
    decoder_self: list[np.ndarray]
    cross: list[np.ndarray]

    def layers(self, kind: str) -> list[np.ndarray]:
        """The per-layer (H, queries, keys) weights of one kind of attention."""
        _check_kind(kind)
        return getattr(self, kind)

    def axes(self, kind: str) -> tuple[tuple[str, ...], tuple[str, ...], str, str]:
        """-> (query labels, key labels, query axis name, key axis name) of one kind of attention."""
        _check_kind(kind)
        if kind == "encoder":
            return self.source_labels, self.source_labels, "source (query)", "source (key)"
        predicting = "decoder position, by the token it predicts"
        if kind == "decoder_self":
            return self.predicted_labels, self.decoder_input_labels, predicting, "decoder input (key)"
        return self.predicted_labels, self.source_labels, predicting, "source (key)"


def _check_kind(kind: str) -> None:
    if kind not in ATTENTION_KINDS:
        raise InputError(f"unknown attention kind {kind!r}", hint=f"choose one of {', '.join(ATTENTION_KINDS)}")


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """Eval mode (no dropout) inside the block; the model's own mode (train or eval) afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


# -- weights from the model ------------------------------------------------------------------------


def attention_weights(model, src_ids, src_lengths, tgt_in) -> dict[str, list[np.ndarray]]:
    """Run the model's teacher-forced forward in eval mode, without gradients, and return its weights.

    src_ids (B, S), src_lengths (B,), tgt_in (B, T) int arrays (numpy or torch; tgt_in starts with BOS).
    Returns {"encoder": [(B,H,S,S)], "decoder_self": [(B,H,T,T)], "cross": [(B,H,T,S)]} as float32 numpy,
    one array per layer. Padded source keys get exactly zero weight (the model's masking).
    """
    import torch

    device = next(model.parameters()).device

    def as_long(a):
        return torch.as_tensor(np.asarray(a), dtype=torch.long).to(device)

    src, lengths, tgt = as_long(src_ids), as_long(src_lengths), as_long(tgt_in)
    if src.dim() != 2 or tgt.dim() != 2 or lengths.shape != (src.shape[0],) or tgt.shape[0] != src.shape[0]:
        raise InputError(f"expected src_ids (B,S), src_lengths (B,), tgt_in (B,T); got {tuple(src.shape)}, "
                         f"{tuple(lengths.shape)}, {tuple(tgt.shape)}")
    if bool((lengths < 1).any()) or bool((lengths > src.shape[1]).any()):
        raise InputError(f"src_lengths must be between 1 and {src.shape[1]}, got {lengths.tolist()}")
    with eval_mode(model), torch.inference_mode():
        _, weights = model(src, lengths, tgt, return_attention=True)
    return {kind: [w.float().cpu().numpy() for w in weights[kind]] for kind in ATTENTION_KINDS}


def token_label(tokenizer, config: ModelConfig, token_id: int) -> str:
    """A token's label on a plot: <bos>/<eos>/<pad>/<unk> for the specials, else the BPE piece."""
    for key, label in SPECIAL_LABELS.items():
        if token_id == getattr(config, key):
            return label
    piece = tokenizer.id_to_token(token_id)
    if piece.startswith(WORD_START):
        return piece[len(WORD_START):] or WORD_START
    return CONTINUATION + piece


def token_labels(tokenizer, config: ModelConfig, ids: Sequence[int]) -> tuple[str, ...]:
    return tuple(token_label(tokenizer, config, i) for i in ids)


def _source_ids(tokenizer, config: ModelConfig, text: str, n: int) -> list[int]:
    """Source text -> ids + EOS, checked against the model's maximum positions."""
    if not text.strip():
        raise InputError(f"source sentence {n} is empty", hint="give a sentence to look at")
    ids = tokenizer.encode(text) + [config.eos_id]
    if len(ids) > config.max_positions:
        raise InputError(f"source sentence {n} has {len(ids)} tokens with EOS; the model takes at most "
                         f"{config.max_positions}", hint="use a shorter sentence")
    return ids


def _target_ids(tokenizer, config: ModelConfig, text: str, n: int) -> list[int]:
    """Given target text -> the tokens predicted at each decoder position: ids + EOS (the target vocabulary's)."""
    ids = tokenizer.encode_target(text) + [config.eos_id]
    if len(ids) > config.max_positions:
        raise InputError(f"target sentence {n} has {len(ids)} tokens with EOS; the model takes at most "
                         f"{config.max_positions}", hint="use a shorter target")
    return ids


def _greedy_ids(model, sources: list[list[int]], config: ModelConfig) -> list[list[int]]:
    """Greedy decoding with the runtime's decoder -> each sentence's predicted tokens (EOS if it finished)."""
    from transduce.runtime.backends.torch_backend import TorchBackend
    from transduce.runtime.decoding import DecodingOptions, decode

    src, lengths = pad_ids(sources, config.pad_id)
    device = str(next(model.parameters()).device)
    with eval_mode(model):  # the backend puts the model in eval mode; give it back as it was
        results = decode(TorchBackend(model, device), src, lengths, DecodingOptions(beam_size=1))
    return [list(r.best.tokens) + ([config.eos_id] if r.best.finished else []) for r in results]


def sentences_attention(model, tokenizer, sources: Sequence[str],
                        targets: Sequence[str] | None = None) -> list[AttentionMaps]:
    """Attention maps of several sentences, run as one padded batch, each trimmed to its own tokens.

    Without targets each sentence is decoded greedily first; with targets the model is teacher-forced on
    them (target i + EOS is what the decoder predicts). Dropout is off (eval mode) whatever the model's mode.
    """
    if isinstance(sources, str) or (targets is not None and isinstance(targets, str)):
        raise InputError("sentences_attention() takes lists of sentences", hint="use sentence_attention() for one")
    if not sources:
        raise InputError("no source sentence given")
    if targets is not None and len(targets) != len(sources):
        raise InputError(f"{len(sources)} sources but {len(targets)} targets")
    config = model.cfg
    src_rows = [_source_ids(tokenizer, config, s, n) for n, s in enumerate(sources, 1)]
    if targets is None:
        predicted = _greedy_ids(model, src_rows, config)
    else:
        predicted = [_target_ids(tokenizer, config, t, n) for n, t in enumerate(targets, 1)]
    tgt_rows = [[config.bos_id] + p[:-1] for p in predicted]
    src, src_lengths = pad_ids(src_rows, config.pad_id)
    tgt_in, _ = pad_ids(tgt_rows, config.pad_id)
    weights = attention_weights(model, src, src_lengths, tgt_in)
    out = []
    for b, (s_ids, t_in, pred) in enumerate(zip(src_rows, tgt_rows, predicted, strict=True)):
        s, t = len(s_ids), len(t_in)
        out.append(AttentionMaps(
            source_ids=tuple(s_ids), source_labels=token_labels(tokenizer, config, s_ids),
            decoder_input_ids=tuple(t_in), decoder_input_labels=token_labels(tokenizer, config, t_in),
            predicted_ids=tuple(pred), predicted_labels=token_labels(tokenizer, config, pred),
            target_text=tokenizer.decode(pred) if targets is None else targets[b],
            teacher_forced=targets is not None,
            encoder=[w[b, :, :s, :s] for w in weights["encoder"]],
            decoder_self=[w[b, :, :t, :t] for w in weights["decoder_self"]],
            cross=[w[b, :, :t, :s] for w in weights["cross"]],
        ))
    return out


def sentence_attention(model, tokenizer, source: str, target: str | None = None) -> AttentionMaps:
    """Attention maps of one sentence: greedy decoding, or teacher forcing on `target` if given."""
    return sentences_attention(model, tokenizer, [source], None if target is None else [target])[0]


# -- choosing the query token of the line figure -------------------------------------------------------


def resolve_token(token: int | str | None, labels: Sequence[str]) -> int:
    """The position of the query token: an index (negative counts from the end; a string of digits is an
    index) or a token as labelled (first occurrence; "·" of a word's continuation optional). None -> 0."""
    if token is None:
        return 0
    if isinstance(token, str) and re.fullmatch(r"\s*-?\d+\s*", token):
        token = int(token)
    if isinstance(token, int):
        if not -len(labels) <= token < len(labels):
            raise InputError(f"token index {token} is out of range: the sequence has {len(labels)} tokens "
                             f"({_listing(labels)})")
        return token % len(labels)
    for i, label in enumerate(labels):
        if token.strip() in (label, label.lstrip(CONTINUATION), WORD_START + label):
            return i
    raise InputError(f"token {token!r} is not in the sequence", hint=f"give an index or one of: {_listing(labels)}")


def _listing(labels: Sequence[str]) -> str:
    return " ".join(f"{i}:{label}" for i, label in enumerate(labels))


# -- figures ----------------------------------------------------------------------------------------


def _new_figure(width: float, height: float):
    """A matplotlib Figure drawn by Agg, without pyplot (no global state, no GUI backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    fig.get_layout_engine().set(h_pad=0.07, w_pad=0.05)  # inches: room between the title, panels and labels
    FigureCanvasAgg(fig)
    return fig


def plot_heads(weights: np.ndarray, query_labels: Sequence[str], key_labels: Sequence[str], title: str,
               query_axis: str, key_axis: str, max_cols: int = 4):
    """All heads of one layer as heatmaps in a grid, token labels on both axes, one shared colour scale [0, 1].

    weights (H, Q, K). Returns the matplotlib Figure.
    """
    h, q, k = weights.shape
    cols = min(h, max_cols)
    rows = math.ceil(h / cols)
    cell = min(0.24, 7.0 / max(q, k))  # inches per token; long sentences shrink to keep the figure bounded
    fontsize = max(4.0, min(8.0, cell * 33))
    char = 0.075 * fontsize / 8  # inches per character of a tick label
    y_labels = char * max(map(len, query_labels)) + 0.2  # left of the first column only
    x_labels = char * max(map(len, key_labels)) + 0.2  # under the last row only
    fig = _new_figure(cols * (k * cell + 0.35) + y_labels + 1.4, rows * (q * cell + 0.45) + x_labels + 0.8)
    axes = fig.subplots(rows, cols, squeeze=False)
    image = None
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.set_axis_off()
            continue
        image = ax.imshow(weights[i], cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(f"head {i + 1}", fontsize=9)
        ax.tick_params(length=0)
        bottom_of_column = i + cols >= h
        ax.set_xticks(range(k), key_labels if bottom_of_column else [], rotation=90, fontsize=fontsize)
        ax.set_yticks(range(q), query_labels if i % cols == 0 else [], fontsize=fontsize)
    fig.colorbar(image, ax=axes, shrink=0.8 if rows == 1 else 0.5, label="attention weight")
    fig.suptitle(title, fontsize=10)
    fig.supxlabel(key_axis, fontsize=9)
    fig.supylabel(query_axis, fontsize=9)
    return fig


def head_colours(n: int) -> list:
    """One distinct colour per head (tab10, tab20 beyond 10 heads, evenly spaced hues beyond 20)."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["hsv"](i / n) for i in range(n)]


def _spread(n: int, width: float) -> np.ndarray:
    """x positions of n tokens spread evenly over [0, width]."""
    return np.linspace(0.0, width, n) if n > 1 else np.array([width / 2])


def plot_token_lines(weights: np.ndarray, query_labels: Sequence[str], key_labels: Sequence[str],
                     query_index: int, title: str, min_weight: float = 0.005):
    """The paper's Figure 3: one query token (top row) joined to every key token (bottom row) by one line
    per head, each head in its own colour, opacity = the attention weight.

    weights (H, Q, K). Lines of different heads to the same key are spread a little apart so that they
    do not hide each other; weights below `min_weight` are not drawn (they would be invisible).
    """
    from matplotlib.lines import Line2D

    h, q, k = weights.shape
    width = float(max(q, k) - 1) or 1.0
    xq, xk = _spread(q, width), _spread(k, width)
    slot = width / max(k - 1, 1)
    offsets = (np.arange(h) - (h - 1) / 2) * min(0.6 * slot / h, 0.12 * slot)
    colours = head_colours(h)
    longest = max(len(s) for s in (*query_labels, *key_labels))
    fig = _new_figure(max(6.0, 0.42 * (width + 1) + 1.0), 3.2 + 2 * 0.075 * longest)
    ax = fig.add_subplot()
    for head in range(h):
        for j in range(k):
            w = float(weights[head, query_index, j])
            if w >= min_weight:
                ax.plot([xq[query_index], xk[j] + offsets[head]], [1.0, 0.0], color=colours[head],
                        alpha=min(w, 1.0), linewidth=2.4, solid_capstyle="butt")
    for i, label in enumerate(query_labels):
        chosen = i == query_index
        ax.text(xq[i], 1.03, label, rotation=90, ha="center", va="bottom", fontsize=9,
                color="black" if chosen else "0.55", fontweight="bold" if chosen else "normal",
                bbox=dict(boxstyle="round,pad=0.2", fc="#fff2a8", ec="none") if chosen else None)
    for j, label in enumerate(key_labels):
        ax.text(xk[j], -0.03, label, rotation=90, ha="center", va="top", fontsize=9)
    ax.set_xlim(-0.6 * slot, width + 0.6 * slot)
    ax.set_ylim(-0.02, 1.02)
    ax.set_axis_off()
    handles = [Line2D([], [], color=colours[i], linewidth=3, label=f"head {i + 1}") for i in range(h)]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(h, 8), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig


# -- writing the files --------------------------------------------------------------------------------


def _save(fig, path: str, dpi: int) -> str:
    """The figure as a PNG at `path`, whole or not at all."""
    from transduce.io.atomic import write_png_atomic

    try:
        write_png_atomic(fig, path, dpi, facecolor="white")
    except OSError as e:
        raise TransduceError(f"cannot write {path}: {e.strerror or e}",
                             hint="choose an --out directory you can write to") from None
    return path


def write_heatmaps(maps: AttentionMaps, out_dir: str, dpi: int = 110) -> list[str]:
    """One PNG per layer and kind of attention (all heads in a grid). Returns the paths written."""
    paths = []
    for kind in ATTENTION_KINDS:
        layers = maps.layers(kind)
        query_labels, key_labels, query_axis, key_axis = maps.axes(kind)
        for layer, weights in enumerate(layers):
            title = f"{KIND_TITLES[kind]}, layer {layer + 1} of {len(layers)}"
            fig = plot_heads(weights, query_labels, key_labels, title, query_axis, key_axis)
            paths.append(_save(fig, os.path.join(out_dir, f"{kind}_layer{layer + 1}.png"), dpi))
    return paths


def token_query(maps: AttentionMaps, token: int | str | None, kind: str, layer: int) -> tuple[int, int]:
    """Check the line figure's choice -> (layer, query position), both 0-based and non-negative."""
    layers = maps.layers(kind)
    if not -len(layers) <= layer < len(layers):
        which = f"layer {layer + 1} (counted from 1)" if layer >= 0 else f"layer {layer} (counted from the last)"
        raise InputError(f"{which} is out of range: the model has {len(layers)} layers of {KIND_TITLES[kind]}",
                         hint=f"choose --layer 1 to {len(layers)}")
    return layer % len(layers), resolve_token(token, maps.axes(kind)[0])


def write_token_figure(maps: AttentionMaps, out_dir: str, token: int | str | None = None, kind: str = "encoder",
                       layer: int = -1, dpi: int = 110) -> str:
    """The Figure 3 line figure of one query token in one layer (0-based; negative counts from the last).

    For "encoder" the token is a source token; for "decoder_self" and "cross" it is a decoder position,
    named by the token it predicts. Returns the path written.
    """
    layer, index = token_query(maps, token, kind, layer)
    layers = maps.layers(kind)
    query_labels, key_labels, _, _ = maps.axes(kind)
    title = (f"{KIND_TITLES[kind]}, layer {layer + 1} of {len(layers)}\n"
             f"query \"{query_labels[index]}\" (position {index}); one colour per head, opacity = weight")
    fig = plot_token_lines(layers[layer], query_labels, key_labels, index, title)
    return _save(fig, os.path.join(out_dir, f"token_{kind}_layer{layer + 1}_pos{index}.png"), dpi)


def write_attention_figures(maps: AttentionMaps, out_dir: str | os.PathLike, token: int | str | None = None,
                            token_kind: str = "encoder", token_layer: int = -1, dpi: int = 110) -> list[str]:
    """Write every heatmap and the line figure of `token` into out_dir (created if needed). Returns the paths."""
    out_dir = os.fspath(out_dir)
    token_query(maps, token, token_kind, token_layer)  # a bad choice fails before anything is written
    make_writable_dir(out_dir, "the output directory", hint="choose a directory you can write to")
    paths = write_heatmaps(maps, out_dir, dpi)
    paths.append(write_token_figure(maps, out_dir, token, token_kind, token_layer, dpi))
    _remove_stale_heatmaps(maps, out_dir)
    return paths


_HEATMAP_NAME = re.compile(r"^(" + "|".join(ATTENTION_KINDS) + r")_layer([0-9]+)\.png$")


def _remove_stale_heatmaps(maps: AttentionMaps, out_dir: str) -> None:
    """Heatmaps of layers this model does not have, left in out_dir by an earlier run on a deeper model, would
    read as this model's: they are removed, with a warning that names them."""
    stale = []
    for name in sorted(os.listdir(out_dir)):
        match = _HEATMAP_NAME.match(name)
        if match and int(match.group(2)) > len(maps.layers(match.group(1))):
            stale.append(name)
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, name))
    if stale:
        warnings.warn(f"removed {len(stale)} heatmap(s) of layers this model does not have, left in {out_dir} "
                      f"by an earlier run: {', '.join(stale)}", stacklevel=3)
