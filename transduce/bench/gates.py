"""The gates before any timing: a quantized export is timed only if its BLEU on the demo task's held-out
sentences is close to fp32's (quality_gate), and CTranslate2 only if its greedy output equals ours token for
token (equality_checks)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from transduce.bench.config import BenchConfig
from transduce.bench.inputs import id_limit, random_sources
from transduce.errors import TransduceError

# A quantized export is timed only if its BLEU on the demo task's held-out sentences (beam 4) is within
# this much of the fp32 export's; sizes without reference translations (base: random weights) are timed
# when the demo size passed the gate in the same run.
QUALITY_GATE_BLEU = 0.5


def held_out_pairs(prepared, n: int) -> list[tuple[str, str]]:
    """The demo task's first n held-out (source, reference) sentence pairs."""
    valid_tsv = os.path.join(os.path.dirname(prepared.model_dir), "data", "valid.tsv")
    if os.path.isfile(valid_tsv):
        from transduce.io.parallel import read_parallel

        return read_parallel(valid_tsv)[:n]
    from transduce.models.corpus import demo_corpus

    _, pairs = demo_corpus(n_train=10, n_valid=max(n, 1), seed=1234)
    return pairs[:n]


def held_out_sources(prepared, n: int, lead: list[int] | None = None) -> list[list[int]]:
    """The demo task's held-out sentences, as ids of the model's tokenizer, each after `lead` (a multilingual
    model's source language code)."""
    from transduce.models.checkpoint import load_tokenizer

    pairs = held_out_pairs(prepared, n)
    tok = load_tokenizer(prepared.model_dir)
    lead = lead or []
    limit = prepared.config.max_positions - 1 - len(lead)
    return [lead + ids for ids in (tok.encode(src)[:limit] for src, _ in pairs) if ids]


@dataclass(frozen=True)
class Languages:
    """A multilingual model's language codes in the equality checks: the source's code begins each source, the
    target's is forced first in both systems' outputs (CTranslate2's target_prefix), as our Translator does."""
    source: str
    target: str
    source_lead: tuple[int, ...]
    target_prefix: tuple[int, ...]


def check_languages(model_dir: str) -> Languages | None:
    """The codes the checks use on a multilingual model (None for a model of one language pair): the model's
    default source and target languages, else its first code (source) and its first other one (target)."""
    from transduce.models.checkpoint import load_tokenizer
    from transduce.runtime import languages
    from transduce.runtime.decoding import DecodingOptions

    tok = load_tokenizer(model_dir)
    table = getattr(tok, "languages", None) or {}
    if not table:
        return None
    source = tok.default_source_lang or next(iter(table))
    target = tok.default_target_lang or next(code for code in table if code != source)
    opts = languages.resolve(tok, DecodingOptions(source_lang=source, target_lang=target))
    return Languages(opts.source_lang, opts.target_lang, tuple(languages.source_lead(tok, opts)),
                     tuple(languages.target_lead(tok, opts)))


def quality_gate(prepared, method: str, cfg: BenchConfig, log) -> dict[str, Any]:
    """BLEU of ONNX Runtime decoding (beam 4) with the fp32 and the `method` export on the demo task's
    held-out sentences; passed when the quantized one is at most QUALITY_GATE_BLEU below."""
    import sacrebleu

    from transduce.runtime.api import load

    pairs = held_out_pairs(prepared, cfg.check_sentences)
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    gate: dict[str, Any] = {"method": method, "sentences": len(pairs), "beam": 4, "max_drop": QUALITY_GATE_BLEU,
                            "size": prepared.size, "passed": False}
    if not prepared.trained:
        gate["reason"] = ("the demo model is untrained (random weights), so BLEU says nothing: run `transduce demo` "
                          "first")
    elif method in prepared.quantize_errors:
        gate["reason"] = f"its export failed: {prepared.quantize_errors[method]}"
    else:
        try:
            bleu = {}
            for label, path in (("fp32", prepared.artifact_dir), (method, prepared.quantized_dirs[method])):
                hyps = [r.text for r in load(path, threads=cfg.threads).translate(sources, beam_size=4, truncate=True)]
                bleu[label] = sacrebleu.corpus_bleu(hyps, [refs]).score
        except TransduceError as e:
            gate["reason"] = f"decoding the held-out sentences failed: {e}"
        else:
            gate.update({"bleu_fp32": round(bleu["fp32"], 2), f"bleu_{method}": round(bleu[method], 2),
                         "passed": bleu[method] >= bleu["fp32"] - QUALITY_GATE_BLEU})
            if not gate["passed"]:
                gate["reason"] = (f"its BLEU on the demo data is more than {QUALITY_GATE_BLEU} below fp32's "
                                  f"({gate[f'bleu_{method}']} vs {gate['bleu_fp32']})")
    measured = (f"BLEU {gate[f'bleu_{method}']:.2f} vs fp32 {gate['bleu_fp32']:.2f} on {len(pairs)} held-out demo "
                "sentences (beam 4): " if "bleu_fp32" in gate else "")
    log(f"[gate] {method}: " + measured + ("pass" if gate["passed"] else f"FAIL, not timed: {gate['reason']}"))
    return gate


def equality_checks(prepared, cfg: BenchConfig, log) -> list[dict[str, Any]]:
    """CTranslate2's greedy output against ours: the demo size's held-out sentences (natural stopping), and
    random inputs at the benchmark's shape (forced length) -> the reports, as dicts. On a multilingual model
    (check_languages) the sources begin with the source language's code and both outputs with the target's."""
    from transduce.bench.ctranslate2.check import check_greedy_equality
    from transduce.bench.ctranslate2.convert import load_translator
    from transduce.runtime.backends.torch_backend import TorchBackend

    backend = TorchBackend.from_model_dir(prepared.model_dir)
    translator = load_translator(prepared.ct2_dir, threads=1)
    langs = check_languages(prepared.model_dir)
    lead, prefix = (list(langs.source_lead), langs.target_prefix) if langs else ([], ())
    if langs:
        log(f"[check] a multilingual model: sources begin with {langs.source}'s code, outputs are forced to begin "
            f"with {langs.target}'s")
    reports = []
    if prepared.size == "demo":
        src = held_out_sources(prepared, cfg.check_sentences, lead)
        if src:
            reports.append(check_greedy_equality(prepared.model_dir, prepared.ct2_dir, src,
                                                 f"{prepared.size}: held-out demo sentences",
                                                 translator=translator, backend=backend, target_prefix=prefix))
    rng = np.random.default_rng(cfg.seed + 1)
    # the code takes the place of one random token: the benchmark's source length
    src = [lead + s[len(lead):] for s in random_sources(rng, cfg.check_inputs, cfg.src_len,
                                                         id_limit(prepared.config))]
    reports.append(check_greedy_equality(prepared.model_dir, prepared.ct2_dir, src,
                                         f"{prepared.size}: random inputs at the benchmark's shape",
                                         forced_steps=cfg.steps, translator=translator, backend=backend,
                                         target_prefix=prefix))
    for r in reports:
        log(f"[check] {r.summary()}")
    return [r.to_dict() for r in reports]


def divergence_text(check: dict[str, Any]) -> str:
    """A failed token-equality check in one line (why CTranslate2 is not timed)."""
    s = f"{check['label']}: {check['equal']}/{check['sentences']} equal"
    if check.get("logprob_tolerance_exceeded"):
        worst = max(check.get("max_abs_logprob_diff") or 0, check.get("max_abs_logprob_diff_random") or 0)
        s += (f", {check['logprob_tolerance_exceeded']} log-probs outside the tolerance (max |diff| "
              f"{worst:.1e})")
    if check["divergences"]:
        d = check["divergences"][0]
        s += (f", first at sentence {d['sentence']} position {d['position']} (ours {d['ours']}, "
              f"CTranslate2 {d['theirs']})")
    return s
