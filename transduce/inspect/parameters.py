"""Parameter counts of `transduce inspect`: weights (or ONNX initializers) by component, layer kind and layer.

A tensor is classified by its name: the module path of the weight ("encoder_layers.0.ffn.w1.weight"), or, for
an ONNX initializer whose own name says nothing, the scope of the node that consumes it
("/encoder_layers.0/ffn/w1/MatMul"; see transduce.inspect.graphs).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

_SEP = r"[./]"  # module paths appear as "encoder_layers.0.ffn" in weights, "/encoder_layers.0/ffn/" in node names
_LAYER = re.compile(rf"(encoder|decoder)_layers{_SEP}(\d+){_SEP}([A-Za-z_]+\d*)")
_SUBLAYER = {"self_attn": "self-attention", "cross_attn": "cross-attention", "ffn": "feed-forward"}


def _names_module(name: str, module: str) -> bool:
    """Whether `module` appears in `name` as a whole path component."""
    return re.search(rf"(?:^|{_SEP}){module}(?:{_SEP}|$)", name) is not None


def classify_parameter(name: str) -> tuple[str, str, tuple[str, int] | None]:
    """A weight name (or an ONNX node name holding the module path) -> (component, kind, (stack, layer)).

    component is embeddings, encoder, decoder or other; kind names the layer kind, e.g. "decoder cross-attention".
    """
    m = _LAYER.search(name)
    if m:
        stack, layer, sub = m.group(1), int(m.group(2)), m.group(3)
        kind = "layer norm" if sub.startswith("norm") else _SUBLAYER.get(sub, sub)
        return stack, f"{stack} {kind}", (stack, layer)
    if m := re.search(rf"(?:^|{_SEP})(encoder|decoder)_norm(?:{_SEP}|$)", name):
        return m.group(1), f"{m.group(1)} final layer norm", None
    if m := re.search(rf"(?:^|{_SEP})(encoder|decoder)_positions(?:{_SEP}|$)", name):
        return "embeddings", f"{m.group(1)} positional embedding (learned)", None
    if m := re.search(rf"(?:^|{_SEP})(encoder|decoder)_embed_norm(?:{_SEP}|$)", name):
        return "embeddings", f"{m.group(1)} embedding layer norm", None
    if _names_module(name, "src_embed"):
        return "embeddings", "source embedding", None
    if _names_module(name, "embed"):
        return "embeddings", "embedding (target, or shared)", None
    if _names_module(name, "out_proj"):
        return "embeddings", "output projection", None
    if _names_module(name, "final_logits_bias"):  # an imported Marian model's bias on the projection
        return "embeddings", "output projection bias", None
    # the buffer `pe`, by its module path or as torch.export lifts it into a graph (b_pe, b_model_pe)
    if _names_module(name, "pe") or re.search(r"(?:^|[^\w])b_(?:model_)?pe\b", name):
        return "embeddings", "positional encoding table", None
    return "other", "other", None


def count_parameters(tensors: Iterable[tuple[str, list[int], str]]) -> dict[str, Any]:
    """(name, shape, dtype) triples -> total, per component with its layer kinds, per layer, and by dtype.

    {"total": n, "components": {"encoder": {"parameters": n, "kinds": {"encoder self-attention": n, ...}}, ...},
     "layers": {"encoder": [n per layer], "decoder": [...]}, "dtypes": {"float32": n}}
    """
    total, components, dtypes = 0, Counter(), Counter()
    kinds: dict[str, Counter] = {}
    layers: dict[str, Counter] = {"encoder": Counter(), "decoder": Counter()}
    for name, shape, dtype in tensors:
        n = 1
        for d in shape:
            n *= int(d)
        component, kind, layer = classify_parameter(name)
        total += n
        components[component] += n
        kinds.setdefault(component, Counter())[kind] += n
        dtypes[dtype] += n
        if layer is not None:
            layers[layer[0]][layer[1]] += n
    return {
        "total": total,
        "components": {c: {"parameters": n, "kinds": dict(kinds[c].most_common())}
                       for c, n in components.most_common()},
        "layers": {stack: [c[i] for i in range(max(c) + 1)] if c else [] for stack, c in layers.items()},
        "dtypes": dict(dtypes.most_common()),
    }
