"""The benchmarked models, each prepared once into a cache directory and reused while its weights match.

  demo   the demo model (runs/demo/model, the trained `tiny` preset: 2+2 layers, d_model 128, 4 heads,
         d_ff 512, vocabulary ~372). If it is absent, a model of the same shape with seeded random
         weights and a BPE tokenizer learnt on the embedded corpus (vocabulary 400) stands in for it.
  base   the paper's base shape (6+6 layers, d_model 512, 8 heads, d_ff 2048) with vocabulary 8,000:
         seeded random weights and a synthetic word-level tokenizer of exactly 8,000 entries
         (specials <pad>=0 <s>=1 </s>=2 <unk>=3, then "w4" .. "w7999").
  opus-mt  an OPUS-MT-shaped Marian model (6+6 layers, d_model 512, 8 heads, d_ff 2048, swish, vocabulary
         58,101) with seeded random weights, built as a Hugging Face MarianMTModel directory and imported with
         transduce's Marian importer; CTranslate2 converts that Hugging Face directory with its own converter
         (bench.opus). Needs the `import` extra.
  tiny   (tests) any model directory given with --model-dir, benchmarked under the name of its size.

For each size: CACHE/<size>/model (unless an existing model directory is used), CACHE/<size>/artifact
(the ONNX export) and CACHE/<size>/ctranslate2 (the CTranslate2 conversion). Timing decodes random
source ids, so a model's content does not matter to the timings, only its shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from transduce.errors import TransduceError
from transduce.formats.artifact import quantization, read_manifest
from transduce.formats.model_config import ModelConfig

DEMO_MODEL_DIR = os.path.join("runs", "demo", "model")
BASE_VOCAB = 8000
RANDOM_DEMO_VOCAB = 400  # the stand-in demo model's BPE vocabulary (when runs/demo/model is absent)
SIZES = ("demo", "base", "opus-mt")


@dataclass
class PreparedModel:
    size: str  # "demo", "base", or the name given to an explicit model directory
    model_dir: str
    artifact_dir: str
    ct2_dir: str | None  # None when ctranslate2 is not installed, or its converter refused the model
    config: ModelConfig
    description: str
    trained: bool  # False for seeded random weights
    notes: list[str] = field(default_factory=list)
    quantized_dirs: dict[str, str] = field(default_factory=dict)  # method ("int8") -> its quantized export
    quantize_errors: dict[str, str] = field(default_factory=dict)  # method -> why its export failed
    ct2_error: str | None = None  # why the CTranslate2 conversion failed (CTranslate2 is then not timed)


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly vocab_size entries: the four specials, then "w4", "w5", ..."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from transduce.models.tokenizer import SPECIALS, Tokenizer

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    tok.add_special_tokens(list(SPECIALS))
    return Tokenizer(tok)


def _random_model_dir(path: str, preset: str, tokenizer, seed: int = 0, **overrides) -> None:
    import torch

    from transduce.models.checkpoint import save_model_dir
    from transduce.models.config import preset as make_preset
    from transduce.models.transformer import Transformer

    torch.manual_seed(seed)
    model = Transformer(make_preset(preset, tokenizer.vocab_size, overrides)).eval()
    save_model_dir(path, model, tokenizer, training={"note": f"random weights (seed {seed}) {BENCH_NOTE}"})


def _unusable(model_dir: str) -> str | None:
    """Why model_dir is not a complete model directory (None: it is): config, weights and tokenizer
    with their recorded sizes and hashes."""
    from transduce.formats.model_dir import verify_model_dir

    try:
        verify_model_dir(model_dir)
    except TransduceError as e:
        return e.args[0]
    return None


def check_model_dir(model_dir: str) -> dict[str, Any]:
    """A --model-dir given to the bench: a complete model directory (not an export of one) -> its config."""
    from transduce.formats.model_dir import verify_model_dir

    try:
        return verify_model_dir(model_dir)
    except TransduceError as e:  # an export given here is one of these (checkpoint._verify says so)
        raise TransduceError(f"--model-dir {model_dir}: {e.args[0]}",
                             hint="give the model directory (config.json, model.safetensors, tokenizer.json) "
                                  "of a transduce train; --artifact-dir takes its export") from None


BENCH_NOTE = "made by transduce bench"  # in the training record of the random models the bench makes


def _made_by_bench(path: str) -> bool:
    """Whether model directory `path` is one the bench made (its config.json says so), or is empty: only
    those are the bench's to replace. Read as plain JSON, so that a config this version cannot load still
    tells whose it is."""
    import json

    if not os.listdir(path):
        return True
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            note = json.load(f).get("training", {}).get("note", "")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(note, str) and BENCH_NOTE in note


def _own_model(path: str, make, log) -> str:
    """The bench's own model in the cache: made once, remade when it is incomplete or corrupt; a directory
    there that the bench did not make (a --cache-dir that holds a trained model) is never replaced. Under its
    lock, as every writer of a cached item (what a killed bench left half-written there goes then)."""
    from transduce.io.locks import output_lock

    with output_lock(path, "the bench's random model"):
        if os.path.isdir(path):
            why = _unusable(path)
            if why is None:
                return path
            if not _made_by_bench(path):
                raise TransduceError(f"{path} is where the bench keeps its random model, but holds a model it did "
                                     f"not make ({why}); the bench does not replace it",
                                     hint="choose another --cache-dir (the default is OUT/models), or move that "
                                          "directory away")
            log(f"remaking the cached model {path}: {why}")
        make(path)
    return path


def ensure_base_model(path: str, log=print) -> str:
    return _own_model(path, lambda p: _random_model_dir(p, "base", synthetic_tokenizer(BASE_VOCAB), seed=0), log)


def ensure_random_demo_model(path: str, log=print) -> str:
    """A model of the demo's shape (tiny preset) with random weights and a BPE tokenizer like the demo's."""
    def make(p: str) -> None:
        from transduce.models.corpus import demo_corpus
        from transduce.models.tokenizer import Tokenizer

        train, _ = demo_corpus(n_train=3000, n_valid=10, seed=1234)
        tok = Tokenizer.train((s for pair in train for s in pair), vocab_size=RANDOM_DEMO_VOCAB)
        _random_model_dir(p, "tiny", tok, seed=0)

    return _own_model(path, make, log)


def demo_model_dir(model_dir: str | None) -> str | None:
    """The model directory the demo size will use, known before anything is prepared: --model-dir, else the
    trained demo model if usable, else None (a random model of its shape, made in the cache)."""
    if model_dir is None and _unusable(DEMO_MODEL_DIR) is None:
        return DEMO_MODEL_DIR
    return model_dir


def max_positions(size: str, model_dir: str | None = None) -> int:
    """The longest source or target the size's model takes, known before anything is prepared."""
    from transduce.formats.model_dir import model_config
    from transduce.models.config import preset

    if size == "demo":
        model_dir = demo_model_dir(model_dir)
    if model_dir is not None:
        return model_config(model_dir).max_positions  # defaults filled in (a minimal config.json is valid)
    if size == "base":
        return preset("base", BASE_VOCAB).max_positions
    if size == "opus-mt":
        return 512  # bench.opus's max_position_embeddings
    return preset("tiny", RANDOM_DEMO_VOCAB).max_positions


def check_artifact(artifact_dir: str, model_dir: str) -> None:
    """An --artifact-dir given to the bench: an fp32, unquantized ONNX export of model_dir's weights."""
    from transduce.formats.model_dir import weights_sha256

    hint = "give the export of --model-dir (transduce export), or leave --artifact-dir out to export into the cache"
    try:
        manifest = read_manifest(artifact_dir)
    except TransduceError as e:
        raise TransduceError(f"--artifact-dir {artifact_dir}: {e.args[0]}", hint=hint) from None
    weights = weights_sha256(model_dir)
    if manifest.get("source_model", {}).get("weights_sha256") != weights:
        raise TransduceError(f"--artifact-dir {artifact_dir} is an export of other weights than {model_dir}'s",
                             hint=hint)
    if manifest.get("precision") != "fp32" or quantization(manifest):
        raise TransduceError(f"--artifact-dir {artifact_dir} is a {manifest.get('precision')}"
                             f"{' ' + quantization(manifest) if quantization(manifest) else ''} "
                             "export; the bench times fp32 (--quantize adds quantized rows)", hint=hint)


def ensure_artifact(model_dir: str, candidates: list[str], log=print, quantize: str | None = None) -> str:
    """An ONNX export of model_dir (quantized with `quantize`, or not at all): the first candidate that
    is a current such export of these weights (onnx_export.reuse_refusal), else a fresh export into the
    last candidate."""
    from transduce.exporter.onnx_export import export_artifact, reuse_refusal

    for cand in candidates:
        if os.path.isdir(cand):
            why = reuse_refusal(cand, model_dir, quantize=quantize)
            if why is None:
                return cand
            log(f"not timing {cand}: {why}")
    out = candidates[-1]
    log(f"exporting {model_dir} to ONNX{' (' + quantize + ')' if quantize else ''} in {out} (once; reused while the "
        "weights match)")
    export_artifact(model_dir, out, force=True, log=log, quantize=quantize)
    return out


def prepare(size: str, cache_dir: str, model_dir: str | None = None, with_ct2: bool = True,
            artifact_dir: str | None = None, log=print, quantize: list[str] | tuple[str, ...] = (),
            shape: dict[str, int] | None = None) -> PreparedModel:
    """Model directory, ONNX artifact and CTranslate2 conversion of one benchmarked size; `shape` overrides
    the opus-mt size's (bench.opus.OPUS_SHAPE keys; the tests build it small)."""
    from transduce.formats.model_dir import model_config

    root = os.path.join(cache_dir, size)
    notes: list[str] = []
    hf_dir = None  # the Hugging Face directory CTranslate2's own converter reads (opus-mt)
    if model_dir is not None:
        trained = bool(check_model_dir(model_dir).get("training", {}).get("step"))
        description = f"{model_dir}" + ("" if trained else " (untrained)")
    elif size == "demo":
        why = _unusable(DEMO_MODEL_DIR)
        if why is None:
            model_dir, trained, description = DEMO_MODEL_DIR, True, f"the trained demo model ({DEMO_MODEL_DIR})"
        else:
            model_dir = ensure_random_demo_model(os.path.join(root, "model"), log=log)
            trained = False
            description = "demo shape (tiny preset), random weights"
            why = "is absent" if not os.path.exists(DEMO_MODEL_DIR) else f"is not usable ({why})"
            notes.append(f"{DEMO_MODEL_DIR} {why} (run `transduce demo`): a same-shape random model stands in")
    elif size == "base":
        model_dir = ensure_base_model(os.path.join(root, "model"), log=log)
        trained, description = False, "base shape, random weights, synthetic 8,000-token vocabulary"
    elif size == "opus-mt":
        from transduce.bench.opus import OPUS_SHAPE, ensure_opus_model

        hf_dir, model_dir = ensure_opus_model(root, shape, log=log)
        s = {**OPUS_SHAPE, **(shape or {})}
        trained = False
        description = (f"OPUS-MT shape ({s['encoder_layers']}+{s['decoder_layers']} layers, d_model {s['d_model']}, "
                       f"{s['heads']} heads, d_ff {s['d_ff']}, swish, vocabulary {s['vocab_size']:,}), random "
                       "weights, a Hugging Face MarianMTModel imported with transduce import marian")
        notes.append(f"CTranslate2 converts the Hugging Face directory {hf_dir} with its own TransformersConverter")
    else:
        raise TransduceError(f"unknown model size {size!r}",
                             hint=f"choose from {', '.join(SIZES)} (or give --model-dir)")
    cfg = model_config(model_dir)  # every field, defaults filled in
    candidates = ([artifact_dir] if artifact_dir else []) + [
        os.path.join(os.path.dirname(os.path.abspath(model_dir)), "artifact"), os.path.join(root, "artifact")]
    artifact = ensure_artifact(model_dir, candidates, log=log)
    ct2_dir = ct2_error = None
    if with_ct2:
        from transduce.bench.ctranslate2.convert import convert_to_ctranslate2
        from transduce.bench.opus import convert_hf_to_ctranslate2

        try:
            ct2_dir = (convert_hf_to_ctranslate2(hf_dir, os.path.join(root, "ctranslate2")) if hf_dir
                       else convert_to_ctranslate2(model_dir, os.path.join(root, "ctranslate2")))
        except TransduceError as e:  # e.g. a pre-norm model: the other systems are still timed
            ct2_error = f"its conversion failed: {e}"
            log(f"CTranslate2 is NOT timed: {ct2_error}")
    quantized, errors = {}, {}
    for q in quantize:
        try:
            quantized[q] = os.path.abspath(ensure_artifact(model_dir, [os.path.join(root, f"artifact-{q}")], log=log,
                                                           quantize=q))
        except TransduceError as e:  # e.g. the model loses too much to int8: that row is not timed
            errors[q] = str(e)  # its hint included
            log(f"the {q} export failed: {errors[q]}")
    return PreparedModel(size, os.path.abspath(model_dir), os.path.abspath(artifact),
                         os.path.abspath(ct2_dir) if ct2_dir else None, cfg, description, trained, notes, quantized,
                         errors, ct2_error)
