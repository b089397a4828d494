"""A transduce model directory -> a CTranslate2 model directory with the same weights, and decoding our ids
with it (the check that it decodes exactly like we do is check.py).

The mapping (checked against CTranslate2 4.x's own OpenNMT-py and Fairseq converters,
ctranslate2/converters/{opennmt_py,fairseq}.py, and ctranslate2/specs/transformer_spec.py):

  ours                                   CTranslate2 TransformerSpec (pre_norm=norm_first)
  embed.weight                           encoder.embeddings[0].weight, decoder.embeddings.weight and
                                         decoder.projection.weight (no bias): shared; CTranslate2 aliases
                                         identical variables when saving, so it is stored once
  x * sqrt(d_model)                      scale_embeddings = True (CTranslate2 multiplies by sqrt(depth))
  pe[0..max_positions) (sin even dims,   position_encodings.encodings = our exact table. CTranslate2's
  cos odd dims, first position 0)        built-in table is [sin | cos] halves, and Fairseq's starts at
                                         padding_idx + 1: neither matches, so the table is given explicitly
  q/k/v_proj (self-attention)            self_attention.linear[0] = concat(q, k, v) (weights and biases)
  q_proj, k/v_proj (cross-attention)     attention.linear[0] = q, attention.linear[1] = concat(k, v)
  out_proj                               linear[-1]
  1/sqrt(d_k) on q                       CTranslate2 scales queries by 1/sqrt(head_dim) itself
  norm1 / norm2 / norm3 (post-norm:      self_attention.layer_norm / attention.layer_norm / ffn.layer_norm;
  LayerNorm(x + Sublayer(x)))            with pre_norm=False CTranslate2 normalises after the residual
                                         sum; post-norm has no final stack norm, and none is declared
  ffn.w1 / ffn.w2, ReLU                  ffn.linear_0 / ffn.linear_1, Activation.RELU
  layer_norm_eps (1e-5)                  config.layer_norm_epsilon (CTranslate2's default is 1e-6)
  specials <pad>=0 <s>=1 </s>=2 <unk>=3  the vocabulary in our id order (shared source/target), so a
                                         token's CTranslate2 index is its transduce id;
                                         decoder_start_token "<s>" (our BOS), eos "</s>", unk "<unk>";
                                         add_source_eos=True: CTranslate2 appends </s> to each source as
                                         our Translator does

Our backends never propose <pad> or <s>; CTranslate2 is told the same with
suppress_sequences=[["<pad>"], ["<s>"]] (`SUPPRESS`; an imported model's own pad and start tokens, recorded in
SOURCE_FILE: `suppressed`).

Imported models' deviations (ModelConfig): activation -> Activation.SWISH / GELU; the position table as the
config lays it out ([sin | cos] halves, fairseq's frequencies and offset), given explicitly as ours is;
scale_embedding -> scale_embeddings; final_logits_bias -> decoder.projection.bias; bos_id (EOS or pad) ->
decoder_start_token. Pre-norm (norm_first; M2M100, NLLB-200, mBART-50): x + Sublayer(LayerNorm(x)) is
CTranslate2's pre_norm with the same layer norms, and encoder_norm / decoder_norm are the stacks' final
layer_norm. Learned positions (mBART-50): {encoder,decoder}_positions are each stack's position_encodings as
they are (row p is position p in both: the importer dropped Hugging Face's offset rows, which CTranslate2's own
converter slices off too). layernorm_embedding: {encoder,decoder}_embed_norm are the stacks' layernorm_embedding,
applied to embeddings + positions in both. Separate source and target vocabularies are not converted here.

Only numpy, safetensors and ctranslate2 are needed here (no torch).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from transduce.errors import BackendUnavailable, CheckpointError, TransduceError

SOURCE_FILE = "transduce_source.json"  # written beside CTranslate2's files: which weights, which converter
CONVERTER_VERSION = 2  # 2: imported models' deviations, the suppressed tokens recorded
SUPPRESS = [["<pad>"], ["<s>"]]


def import_ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise BackendUnavailable("the CTranslate2 peer needs the ctranslate2 package",
                                 hint="pip install 'transduce[bench]' (or pip install ctranslate2)") from None
    return ctranslate2


def sinusoidal_table_np(n_positions: int, d_model: int) -> np.ndarray:
    """Our PE table (transduce.models.transformer.sinusoidal_table) in numpy: float64 math, fp32 result."""
    pos = np.arange(n_positions, dtype=np.float64)[:, None]
    two_i = np.arange(0, d_model, 2, dtype=np.float64)
    angle = pos / np.power(10000.0, two_i / d_model)
    pe = np.zeros((n_positions, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle)
    return pe.astype(np.float32)


def position_table_np(cfg) -> np.ndarray:
    """The model's table (transduce.models.transformer.positional_table) in numpy: float64 math, fp32 result."""
    n, d, offset = cfg.max_positions, cfg.d_model, cfg.position_offset
    if (cfg.position_layout, cfg.position_frequencies, offset) == ("interleaved", "paper", 0):
        return sinusoidal_table_np(n, d)
    half = d // 2
    pos = np.arange(offset, offset + n, dtype=np.float64)[:, None]
    i = np.arange(half, dtype=np.float64)
    if cfg.position_frequencies == "fairseq":
        angle = pos * np.exp(i * -(np.log(10000.0) / (half - 1)))
    else:
        angle = pos / np.power(10000.0, 2 * i / d)
    if cfg.position_layout == "halves":
        return np.concatenate([np.sin(angle), np.cos(angle)], axis=1).astype(np.float32)
    pe = np.zeros((n, d), dtype=np.float64)
    pe[:, 0::2], pe[:, 1::2] = np.sin(angle), np.cos(angle)
    return pe.astype(np.float32)


def suppressed_ids(cfg) -> list[int]:
    """The ids our search never proposes (runtime.backends.base.banned_ids without EOS): PAD, and the start token
    unless it is PAD or EOS."""
    return [cfg.pad_id] + ([cfg.bos_id] if cfg.bos_id not in (cfg.pad_id, cfg.eos_id) else [])


def vocabulary(tokenizer) -> list[str]:
    """Our tokens in id order; CTranslate2 needs them unique (a token string is its lookup key)."""
    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
    if any(t is None for t in tokens):
        raise CheckpointError("the tokenizer's ids are not contiguous: cannot build a CTranslate2 vocabulary")
    if len(set(tokens)) != len(tokens):
        raise CheckpointError("the tokenizer has duplicate token strings: CTranslate2 could not tell them apart")
    return tokens


def build_spec(model_dir: str):
    """The CTranslate2 TransformerSpec of a transduce model directory (weights as numpy fp32)."""
    ct2 = import_ctranslate2()
    from ctranslate2.converters import utils
    from ctranslate2.specs import common_spec, transformer_spec
    from safetensors.numpy import load_file

    from transduce.formats.kinds import WEIGHTS_FILE
    from transduce.formats.model_dir import ModelDir
    from transduce.models.checkpoint import load_tokenizer

    directory = ModelDir.load(model_dir)
    cfg = directory.config
    if cfg.source_vocab_size != cfg.vocab_size:
        raise TransduceError("only models with one vocabulary for source and target are converted to CTranslate2 "
                             "here (this one has separate ones)",
                             hint="the bench times the other systems without CTranslate2; a model with one shared "
                                  "vocabulary converts")
    w = load_file(directory.verified(WEIGHTS_FILE))
    w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}
    tokenizer = load_tokenizer(directory)
    del ct2

    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers), cfg.n_heads, pre_norm=cfg.norm_first,
        activation=getattr(common_spec.Activation, {"relu": "RELU", "gelu": "GELU", "swish": "SWISH"}[cfg.activation]),
        layernorm_embedding=cfg.layernorm_embedding,
    )

    def linear(ls, name, with_bias=True):
        ls.weight = w[f"{name}.weight"]
        if with_bias and f"{name}.bias" in w:
            ls.bias = w[f"{name}.bias"]

    def fused(ls, names):
        parts = []
        for n in names:
            p = common_spec.LinearSpec()
            linear(p, n)
            parts.append(p)
        utils.fuse_linear(ls, parts)

    def norm(ns, name):
        ns.gamma = w[f"{name}.weight"]
        ns.beta = w[f"{name}.bias"]

    emb = w["embed.weight"]
    pe = position_table_np(cfg) if cfg.positions == "sinusoidal" else None  # one array: stored once
    for stack, name in ((spec.encoder, "encoder"), (spec.decoder, "decoder")):
        stack.scale_embeddings = cfg.scale_embedding
        # row p is position p in ours and in CTranslate2's table (it adds no offset of its own)
        stack.position_encodings.encodings = pe if pe is not None else w[f"{name}_positions.weight"]
        if cfg.layernorm_embedding:
            norm(stack.layernorm_embedding, f"{name}_embed_norm")
        if cfg.norm_first:  # pre-norm stacks end in a LayerNorm of their own
            norm(stack.layer_norm, f"{name}_norm")
    spec.encoder.embeddings[0].weight = w.get("src_embed.weight", emb)
    spec.decoder.embeddings.weight = emb
    spec.decoder.projection.weight = w.get("out_proj.weight", emb)  # logits = x @ E^T (+ final_logits_bias)
    if cfg.final_logits_bias:
        spec.decoder.projection.bias = w["final_logits_bias"]

    def self_attention_and_ffn(ls, p, ffn_norm):
        """What encoder and decoder layers share: self-attention (norm1) and the FFN (ffn_norm)."""
        fused(ls.self_attention.linear[0], [f"{p}.self_attn.{n}_proj" for n in "qkv"])
        linear(ls.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(ls.self_attention.layer_norm, f"{p}.norm1")
        linear(ls.ffn.linear_0, f"{p}.ffn.w1")
        linear(ls.ffn.linear_1, f"{p}.ffn.w2")
        norm(ls.ffn.layer_norm, f"{p}.{ffn_norm}")

    for i, ls in enumerate(spec.encoder.layer):
        self_attention_and_ffn(ls, f"encoder_layers.{i}", "norm2")
    for i, ls in enumerate(spec.decoder.layer):
        p = f"decoder_layers.{i}"
        self_attention_and_ffn(ls, p, "norm3")
        linear(ls.attention.linear[0], f"{p}.cross_attn.q_proj")
        fused(ls.attention.linear[1], [f"{p}.cross_attn.{n}_proj" for n in "kv"])
        linear(ls.attention.linear[2], f"{p}.cross_attn.out_proj")
        norm(ls.attention.layer_norm, f"{p}.norm2")

    specials = {"pad": cfg.pad_id, "bos": cfg.bos_id, "eos": cfg.eos_id, "unk": cfg.unk_id}
    vocab = vocabulary(tokenizer)
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    spec.config.unk_token = vocab[specials["unk"]]
    spec.config.bos_token = vocab[specials["bos"]]
    spec.config.eos_token = vocab[specials["eos"]]
    spec.config.decoder_start_token = vocab[specials["bos"]]
    spec.config.add_source_bos = False
    spec.config.add_source_eos = True
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    return spec


def _converter_class():
    import_ctranslate2()
    from ctranslate2.converters.converter import Converter

    class TransduceConverter(Converter):
        """CTranslate2's converter base class over `build_spec` (validate, optimize, save)."""

        def __init__(self, model_dir: str):
            self.model_dir = model_dir

        def _load(self):
            return build_spec(self.model_dir)

    return TransduceConverter


def _converted_files(ct2_dir: str) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file CTranslate2 wrote (model.bin, the vocabulary, config.json)."""
    from transduce.io.files import file_entry

    return {name: file_entry(os.path.join(ct2_dir, name)) for name in sorted(os.listdir(ct2_dir))
            if name != SOURCE_FILE and os.path.isfile(os.path.join(ct2_dir, name))}


def is_current(ct2_dir: str, model_dir: str) -> bool:
    """True if ct2_dir is a complete conversion of exactly these weights by this converter version and this
    ctranslate2 version (a model.bin from another one may not load: a cache shared by two environments):
    every file it recorded is there with its size and sha256 (a truncated model.bin or a lost vocabulary
    made CTranslate2 fail at load on every later run)."""
    import ctranslate2 as ct2

    from transduce.formats.model_dir import weights_sha256

    path = os.path.join(ct2_dir, SOURCE_FILE)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(ct2_dir, "model.bin")):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            src = json.load(f)
        return (src.get("weights_sha256") == weights_sha256(model_dir)
                and src.get("converter_version") == CONVERTER_VERSION and src.get("ctranslate2") == ct2.__version__
                and isinstance(src.get("files"), dict) and src["files"] == _converted_files(ct2_dir))
    except (OSError, ValueError, TransduceError):
        return False


def _suppressed_tokens(model_dir: str) -> list[str]:
    from transduce.formats.model_dir import model_config
    from transduce.models.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return [tokenizer.id_to_token(i) for i in suppressed_ids(model_config(model_dir))]


def suppressed(ct2_dir: str) -> list[list[str]]:
    """The suppress_sequences of a conversion: the tokens its conversion recorded, [] for none to ban (SUPPRESS
    where it recorded nothing)."""
    try:
        with open(os.path.join(ct2_dir, SOURCE_FILE), encoding="utf-8") as f:
            found = json.load(f).get("suppress")
    except (OSError, ValueError):
        found = None
    return found if isinstance(found, list) else SUPPRESS  # [] where the conversion has nothing to ban


def convert_to_ctranslate2(model_dir: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False) -> str:
    """Write a CTranslate2 (fp32) model of `model_dir` into `out_dir`, atomically, under out_dir's lock (another
    conversion into it is refused at once). Reused if current."""
    from transduce.formats.model_dir import weights_sha256
    from transduce.io.atomic import atomic_directory
    from transduce.io.locks import output_lock

    model_dir, out_dir = os.fspath(model_dir), os.fspath(out_dir)
    with output_lock(out_dir, "the CTranslate2 conversion"):
        if not force and is_current(out_dir, model_dir):
            return out_dir
        ct2 = import_ctranslate2()
        converter = _converter_class()(model_dir)
        with atomic_directory(out_dir) as tmp:
            converter.convert(tmp, quantization="float32", force=True)
            with open(os.path.join(tmp, SOURCE_FILE), "w", encoding="utf-8") as f:
                json.dump({"model_dir": os.path.abspath(model_dir), "weights_sha256": weights_sha256(model_dir),
                           "converter_version": CONVERTER_VERSION, "ctranslate2": ct2.__version__,
                           "suppress": [[t] for t in _suppressed_tokens(model_dir)],
                           "files": _converted_files(tmp)}, f, indent=2)
    return out_dir


# -- decoding with CTranslate2 ----------------------------------------------------------------------
def load_translator(ct2_dir: str, threads: int = 2):
    ct2 = import_ctranslate2()
    try:
        return ct2.Translator(ct2_dir, device="cpu", compute_type="float32", inter_threads=1, intra_threads=threads)
    except RuntimeError as e:  # a model.bin it cannot read (another version's): the caller may skip CTranslate2
        raise BackendUnavailable(f"CTranslate2 cannot load its conversion {ct2_dir}: {e}",
                                 hint=f"delete {ct2_dir} to have it converted again") from None


def ct2_vocab(ct2_dir: str) -> list[str]:
    for name in ("shared_vocabulary.json", "target_vocabulary.json"):
        path = os.path.join(ct2_dir, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
    raise TransduceError(f"{ct2_dir} has no CTranslate2 vocabulary file")


def ct2_translate_ids(translator, vocab: list[str], sources: list[list[int]], beam_size: int = 1,
                      max_length: int = 256, min_length: int = 0, length_penalty: float = 0.0,
                      suppress: list[list[str]] | None = None, target_prefix: Sequence[int] = (),
                      **options) -> list[list[int]]:
    """Sources as our ids (without EOS: CTranslate2 appends it) -> best hypothesis ids (EOS not included).
    target_prefix: ids every hypothesis is forced to begin with (a target language's code), part of the result."""
    index = {t: i for i, t in enumerate(vocab)}
    if target_prefix:
        options["target_prefix"] = [[vocab[i] for i in target_prefix] for _ in sources]
    results = translator.translate_batch(
        [[vocab[i] for i in src] for src in sources], beam_size=beam_size, max_decoding_length=max_length,
        min_decoding_length=min_length, length_penalty=length_penalty,
        suppress_sequences=SUPPRESS if suppress is None else suppress or None,
        max_batch_size=0, **options,
    )
    return [[index[t] for t in r.hypotheses[0]] for r in results]
