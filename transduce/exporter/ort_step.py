"""The ONNX Runtime CPU step graph (decoder_step.ort.onnx): the decoder step built from the weights
with ONNX Runtime's fused contrib ops, for fp32 post-norm models of every size.

Why a second step graph: ONNX Runtime's CPU provider spends a small model's step mostly per node, and
this graph has a third of the standard one's nodes, picks the search's top-k itself and reads each
source's cross K/V once for all its beams (measurements: docs/design/exporter.md).

What it is. Per decoder layer (post-norm, fp32; `unsupported_reason` says why not otherwise):
  self-attention   Gemm(x, [Wq|Wk|Wv]) -> com.microsoft.GroupQueryAttention with the packed QKV,
                   past_key/past_value = the runtime's cache (batch, heads, cache_len, head_dim),
                   seqlens_k = positions, total_sequence_length = max(positions) + 1. Bound with
                   present_key/present_value on the same buffers, the op writes this position's K/V
                   into slot `positions[b]` itself and attends over slots <= positions[b] only.
  cross-attention  Gemm(x, Wq) -> com.microsoft.MultiHeadAttention over cross_key/cross_value
                   (sources, heads, src_len, head_dim), the rows' queries grouped by source as a
                   (sources, rows / sources, d) query sequence, key_padding_mask = src_lengths (keys
                   past a source's length score -1e9; eager uses float32's lowest: both give 0 after
                   the softmax, and a fully padded row a uniform average). Beam search passes each
                   sentence's K/V once for its k beams: k times less K/V read per step, none gathered
                   per reorder.
  residual + norm  Gemm (the sublayer's output projection, with its bias) + Add (the residual) +
                   LayerNormalization (not SkipLayerNormalization: docs/design/exporter.md).
  FFN              Gemm + Relu (ONNX Runtime fuses them), Gemm, Add, LayerNormalization (gelu: Gelu;
                   swish: Sigmoid and Mul).
Then logits = x E^T (or the output projection, plus final_logits_bias where the model has one) and
LogSoftmax, as in the standard graph, and the search's candidates: TopK(log_probs + topk_bias, topk_k),
so a step needs no second kernel launch (and no second pass over log_probs from Python) to pick them.

IO (contract.ort_step_inputs / ort_step_outputs): the standard step's inputs, with src_lengths and
cross_* per source (sources = rows gives exactly the standard step), plus topk_k and topk_bias
(required: ONNX Runtime warns at every session about inputs with default values); outputs
log_probs, present_key_i/present_value_i instead of new_key_i/new_value_i (the cache with slot
`positions[b]` written, in place: they must be bound onto the past_* input buffers, as the runtime
and the validator bind them; unbound, only the slots up to each row's position are filled and the
rest is undefined), and
topk_values/topk_ids. Contrib ops run on ONNX Runtime only (not TensorRT), so the standard graph
stays the artifact's portable step graph; export validates this one against eager PyTorch like the
others (transduce/verify/validate.py), the grouped cross-attention, the top-k and the in-place
cache write (run with present bound onto past, as the runtime runs it) included.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transduce.formats import contract
from transduce.formats.model_config import ModelConfig

CONTRIB = "com.microsoft"
MASKED = -1e9  # attention score at padded source positions (eager: float32's lowest; both give 0)
# The graph's revision, recorded in the manifest (graphs -> decoder_step.ort.onnx -> revision; absent: 1). 2: residual
# + norm as Add + LayerNormalization (1: SkipLayerNormalization). Older revisions still decode; the bench and the
# demo export again rather than time or show them (stale_reason).
REVISION = 2


def unsupported_reason(config: ModelConfig, precision: str) -> str | None:
    """Why this graph cannot be built for a model config and precision (None when it can)."""
    if precision != "fp32":
        return f"the ONNX Runtime step graph is built for fp32 artifacts only, not {precision}"
    if config.norm_first:
        return "the ONNX Runtime step graph is built for post-norm models only (norm_first is set)"
    if config.positions != "sinusoidal" or config.layernorm_embedding:
        return "the ONNX Runtime step graph is built for sinusoidal positions without an embedding layer norm only"
    head = config.head_dim
    if head % 8:  # GroupQueryAttention's CPU kernel refuses it when it runs, not when it loads
        return (f"the ONNX Runtime step graph's attention kernels need a head size that is a multiple of 8, "
                f"and this model's is {head} (d_model {config.d_model} / n_heads {config.n_heads})")
    size = weight_bytes(config)
    if size > MAX_INLINE_BYTES:
        return (f"the ONNX Runtime step graph keeps its weights inline, and this model's ({size / 1e9:.1f} GB) pass "
                f"what one ONNX file holds ({MAX_INLINE_BYTES / 1e9:.1f} GB of its 2 GB)")
    return None


def stale_reason(manifest: dict[str, Any]) -> str | None:
    """Why an artifact lacks the ONNX Runtime step graph this exporter would build for it (None: it has it, or
    the model cannot have one): left out (--no-ort-step), or of an older REVISION."""
    if unsupported_reason(ModelConfig.from_dict(manifest["model"]), manifest["precision"]) is not None:
        return None
    if contract.ORT_STEP_FILE not in manifest["files"]:
        return f"it has no {contract.ORT_STEP_FILE} (exported with --no-ort-step)"
    revision = manifest.get("graphs", {}).get(contract.ORT_STEP_FILE, {}).get("revision", 1)
    if revision < REVISION:
        return f"its {contract.ORT_STEP_FILE} is revision {revision}, older than this exporter's {REVISION}"
    return None


MAX_INLINE_BYTES = 1.8e9  # protobuf's 2 GB limit on one ONNX file, less room for the graph itself


def weight_bytes(config: ModelConfig) -> int:
    """The step graph's initializer bytes (fp32): the decoder layers, the embedding twice (the pre-scaled
    copy) and the positional table."""
    d, ff, n = config.d_model, config.d_ff, config.decoder_layers
    # self-attention Q/K/V/out and cross-attention Q/out (its K/V are the encoder's), FFN, their biases,
    # three LayerNorms
    per_layer = 6 * d * d + 2 * d * ff + 13 * d + ff
    return 4 * (n * per_layer + 2 * config.vocab_size * d + config.max_positions * d)


class _Graph:
    """The nodes and initializers of the graph being built, from the model's fp32 weights (`sd`)."""

    def __init__(self, sd: dict[str, np.ndarray], eps: float):
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.sd, self.eps = sd, eps
        self.inits: list = []
        self.nodes: list = []

    def weight(self, name: str, array: np.ndarray) -> str:
        self.inits.append(self.numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name))
        return name

    def const(self, name: str, array: np.ndarray) -> str:
        self.inits.append(self.numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], output: str, domain: str = "", **attrs) -> str:
        self.nodes.append(self.helper.make_node(op, inputs, [output], name=output, domain=domain, **attrs))
        return output

    def linear_t(self, prefix: str) -> np.ndarray:  # nn.Linear weight (out, in) -> (in, out)
        return self.sd[f"{prefix}.weight"].T

    def linear(self, x: str, prefix: str, output: str) -> str:  # nn.Linear on (rows, in)
        return self.node("Gemm", [x, self.weight(f"{prefix}.weight_t", self.linear_t(prefix)),
                                  self.weight(f"{prefix}.bias", self.sd[f"{prefix}.bias"])], output)

    def project_add_norm(self, x: str, sub: str, proj: str, norm: str, output: str) -> str:
        """LayerNorm(x + sub W + b) for the nn.Linear `proj` and the LayerNorm `norm` (post-norm): Gemm, Add and
        LayerNormalization, not com.microsoft.SkipLayerNormalization (slower on the CPU: docs/design/exporter.md);
        the sessions keep ONNX Runtime from fusing them back."""
        y = self.linear(sub, proj, f"{proj}.out")
        y = self.node("Add", [y, x], f"{proj}.residual")
        return self.node("LayerNormalization", [y, self.weight(f"{norm}.weight", self.sd[f"{norm}.weight"]),
                                                self.weight(f"{norm}.bias", self.sd[f"{norm}.bias"])],
                         output, axis=-1, epsilon=self.eps)


def _activation(g: _Graph, activation: str, x: str, output: str) -> str:
    """The FFN's nonlinearity (ModelConfig.activation) on `x`: Relu, Gelu (com.microsoft's, the erf form: the
    default domain's needs opset 20) or x * Sigmoid(x)."""
    if activation == "gelu":
        return g.node("Gelu", [x], output, domain=CONTRIB)
    if activation == "swish":
        return g.node("Mul", [x, g.node("Sigmoid", [x], f"{output}_sigmoid")], output)
    return g.node("Relu", [x], output)


def _decoder_layer(g: _Graph, i: int, x: str, n_heads: int, d: int, lengths: dict[str, str],
                   activation: str = "relu") -> str:
    """Decoder layer i on the rows' hidden states `x`: fused self-attention writing the cache, cross-attention
    grouped by source, FFN; -> the layer's output."""
    from onnx import helper

    p = f"decoder_layers.{i}"
    a, c, f = f"{p}.self_attn", f"{p}.cross_attn", f"{p}.ffn"
    sd = g.sd
    w_qkv = np.concatenate([g.linear_t(f"{a}.q_proj"), g.linear_t(f"{a}.k_proj"), g.linear_t(f"{a}.v_proj")], axis=1)
    b_qkv = np.concatenate([sd[f"{a}.q_proj.bias"], sd[f"{a}.k_proj.bias"], sd[f"{a}.v_proj.bias"]])
    qkv = g.node("Gemm", [x, g.weight(f"{a}.qkv.weight", w_qkv), g.weight(f"{a}.qkv.bias", b_qkv)], f"{a}.qkv")
    qkv = g.node("Reshape", [qkv, lengths["rows_1_3d"]], f"{a}.qkv_3d")  # (rows, 1, 3d): Q | K | V, heads-major
    gqa_out = f"{a}.attended_3d"
    g.nodes.append(helper.make_node(
        "GroupQueryAttention", [qkv, "", "", f"past_key_{i}", f"past_value_{i}", lengths["seqlens"], lengths["total"]],
        [gqa_out, f"present_key_{i}", f"present_value_{i}"], name=gqa_out, domain=CONTRIB,
        num_heads=n_heads, kv_num_heads=n_heads))
    att = g.node("Reshape", [gqa_out, lengths["rows_d"]], f"{a}.attended")
    x = g.project_add_norm(x, att, f"{a}.out_proj", f"{p}.norm1", f"{p}.x1")

    q = g.node("Reshape", [g.linear(x, f"{c}.q_proj", f"{c}.q"), lengths["q_shape"]],
               f"{c}.q_3d")  # (sources, beams, d)
    att = g.node("MultiHeadAttention", [q, f"cross_key_{i}", f"cross_value_{i}", "", lengths["src_lengths"]],
                 f"{c}.attended_3d", domain=CONTRIB, num_heads=n_heads, mask_filter_value=MASKED)
    att = g.node("Reshape", [att, lengths["rows_d"]], f"{c}.attended")
    x = g.project_add_norm(x, att, f"{c}.out_proj", f"{p}.norm2", f"{p}.x2")

    hid = _activation(g, activation, g.linear(x, f"{f}.w1", f"{f}.hidden_linear"), f"{f}.hidden")
    return g.project_add_norm(x, hid, f"{f}.w2", f"{p}.norm3", f"{p}.x3")


def _lengths(g: _Graph, d: int) -> dict[str, str]:
    """The shapes and lengths every layer uses, made once."""
    from onnx import TensorProto

    # GroupQueryAttention's lengths: slots <= positions[b] are attended, slot positions[b] is written
    seqlens = g.node("Cast", ["positions"], "seqlens_k", to=TensorProto.INT32)
    total = g.node("ReduceMax", [seqlens], "max_position", keepdims=1)
    total = g.node("Add", [total, g.const("one_i32", np.array([1], np.int32))], "total_sequence_length")
    # cross-attention: the rows' queries grouped by source, (sources, rows / sources, d), against each
    # source's K/V once; key_padding_mask = the source lengths (MultiHeadAttention masks keys >= it)
    q_shape = g.node("Concat", [g.node("Shape", ["src_lengths"], "sources"),
                                g.const("minus_one_d", np.array([-1, d], np.int64))], "shape_sources_beams_d", axis=0)
    return {"rows_d": g.const("shape_rows_d", np.array([-1, d], np.int64)),
            "rows_1_3d": g.const("shape_rows_1_3d", np.array([-1, 1, 3 * d], np.int64)),
            "seqlens": seqlens, "total": total, "q_shape": q_shape,
            "src_lengths": g.node("Cast", ["src_lengths"], "src_lengths_i32", to=TensorProto.INT32)}


def build_ort_step(model, opset: int) -> Any:
    """The ONNX Runtime step graph (an onnx.ModelProto) of an fp32, post-norm Transformer."""
    import onnx
    from onnx import TensorProto, helper

    cfg = model.cfg
    reason = unsupported_reason(cfg, "fp32")
    assert reason is None, reason
    d, n = cfg.d_model, cfg.decoder_layers
    g = _Graph({k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}, float(cfg.layer_norm_eps))

    # embedding: (E * sqrt(d_model))[tokens] + PE[positions]  (rows, d); the scaled table is a second
    # initializer (E itself stays the output projection's), one Mul less per step
    scale = np.float32(np.sqrt(d)) if cfg.scale_embedding else np.float32(1.0)
    scaled = g.weight("embed.weight_scaled", g.sd["embed.weight"] * scale)
    x = g.node("Gather", [scaled, "tokens"], "embedded_scaled")
    pe = g.node("Gather", [g.weight("pe", model.pe.float().numpy()), "positions"], "positional")
    x = g.node("Add", [x, pe], "x_embed")
    lengths = _lengths(g, d)
    for i in range(n):
        x = _decoder_layer(g, i, x, cfg.n_heads, d, lengths, cfg.activation)

    out = "embed.weight" if cfg.output_tied else "out_proj.weight"
    bias = [g.weight("final_logits_bias", g.sd["final_logits_bias"])] if cfg.final_logits_bias else []
    logits = g.node("Gemm", [x, g.weight(out, g.sd[out]), *bias], "logits", transB=1)
    log_probs = g.node("LogSoftmax", [logits], "log_probs", axis=-1)
    # the search's candidates: top-k of log_probs + topk_bias
    biased = g.node("Add", [log_probs, "topk_bias"], "log_probs_biased")
    g.nodes.append(helper.make_node("TopK", [biased, "topk_k"], ["topk_values", "topk_ids"], name="topk",
                                    axis=-1, largest=1, sorted=1))

    def value_info(spec: contract.TensorSpec):
        elem = {"int64": TensorProto.INT64, "float32": TensorProto.FLOAT, "float": TensorProto.FLOAT}[spec.dtype]
        return helper.make_tensor_value_info(spec.name, elem, list(contract.axis_dims(spec, cfg)))

    inputs, outputs = contract.graph_io(contract.ORT_STEP_FILE, n)
    graph = helper.make_graph(g.nodes, "transduce_decoder_step_ort", [value_info(s) for s in inputs],
                              [value_info(s) for s in outputs], g.inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(CONTRIB, 1)],
                              producer_name="transduce")
    proto.ir_version = 8  # what every supported onnxruntime reads
    proto.doc_string = (f"transduce decoder step for ONNX Runtime (contrib ops), IO contract version "
                        f"{contract.CONTRACT_VERSION}, fp32")
    proto.metadata_props.add(key="transduce.graph", value="decoder_step.ort")
    onnx.checker.check_model(proto)
    return proto
