"""Parity: does a deployed backend still say what the eager PyTorch model says?

Three checks on a sample of real inputs, each against a reference backend (eager PyTorch):
1. teacher-forced, step by step: the encoder's outputs and every step's log-probs on the same target
   prefixes, with max / mean / p99 absolute and relative errors per output, and a tolerance per output
   and per precision (transduce.verify.tolerances: an element fails where |d| > atol + rtol * |ref|);
2. greedy decoding: token-identical sequences;
3. beam search: identical n-best lists, scores within tolerance.
Scores of identical sequences are compared per token: |difference of their log-prob sums| / length <=
score_atol, so that a long sentence may carry the per-token error a short one may.
Where sequences diverge, the report gives the first divergent step and the reference model's margin
between its own output and the candidate's: for greedy search, its log-prob of its own token minus that
of the candidate's at that step; for beam search, whose choice is made by whole-sequence scores, its
score (length-penalised log-prob sum, as the search scores) of its own hypothesis minus that of the
candidate's, or its log-prob margin at the step where the two part when that is a near-tie (a pruning
decision there can flip, after which the searches may end far apart). A margin <= tie_margin is a near-tie
that explains a divergence; a larger one is a bug. A NaN anywhere fails. The report is JSON-serialisable
(non-finite numbers as the strings "inf", "-inf", "nan") and prints as a table.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from transduce.errors import ArtifactError, InputError
from transduce.formats.artifact import Artifact
from transduce.formats.model_dir import TOKENIZER_FILE
from transduce.runtime import languages
from transduce.runtime.backends.base import Backend, FullOutputs, only_step_graph, step_graphs
from transduce.runtime.decoding import DecodingOptions, decode, teacher_forced_log_probs
from transduce.runtime.decoding.batch import pad_ids
from transduce.runtime.spec import BackendSpec
from transduce.verify.tolerances import POLICIES, Tolerance, within


@dataclass(frozen=True)
class ErrorStats:
    name: str
    count: int
    max_abs: float
    mean_abs: float
    p99_abs: float
    max_rel: float
    mean_rel: float
    p99_rel: float
    failing: int  # elements outside the tolerance
    atol: float
    rtol: float

    @property
    def passed(self) -> bool:
        return self.failing == 0


def error_stats(name: str, ref: np.ndarray, got: np.ndarray, tol: Tolerance) -> ErrorStats:
    ref = np.asarray(ref, np.float64).ravel()
    got = np.asarray(got, np.float64).ravel()
    assert ref.shape == got.shape, (name, ref.shape, got.shape)
    finite = np.isfinite(ref) & np.isfinite(got)
    # equal infinities match (a log-prob of -inf on both sides); a NaN on either side fails, on both too:
    # a reference that computes NaN checks nothing
    bad_nonfinite = int((~finite & ((ref != got) | np.isnan(ref) | np.isnan(got))).sum())
    ref, got = ref[finite], got[finite]
    if ref.size == 0:
        worst = math.inf if bad_nonfinite else 0.0
        return ErrorStats(name, 0, worst, worst, worst, worst, worst, worst, bad_nonfinite, tol.atol, tol.rtol)
    d = np.abs(ref - got)
    rel = d / np.maximum(np.abs(ref), 1e-12)
    failing = int((~within(d, ref, tol)).sum()) + bad_nonfinite
    max_abs, max_rel = (math.inf, math.inf) if bad_nonfinite else (float(d.max()), float(rel.max()))
    return ErrorStats(name, int(ref.size), max_abs, float(d.mean()), float(np.percentile(d, 99)),
                      max_rel, float(rel.mean()), float(np.percentile(rel, 99)), failing, tol.atol, tol.rtol)


@dataclass(frozen=True)
class Divergence:
    sentence: int  # index in the sentences given to run_parity, from 0
    step: int  # first position where the tokens differ
    reference_token: int | None  # None: the end of the sequence (EOS, or no token: cut at its maximum length)
    candidate_token: int | None
    margin: float  # the reference model's own output minus the candidate's, by `measure`
    near_tie: bool
    rank: int = 0  # the n-best entry (0: the best) where the lists part
    measure: str = "step"  # "step": log-probs at `step` (greedy; beam search when a near-tie there explains it);
    #                        "sequence": the search's scores of the two hypotheses (beam search);
    #                        "count": the candidate returned another number of hypotheses (always a bug)


@dataclass(frozen=True)
class SequenceCheck:
    mode: str  # "greedy" or "beam4" etc.
    sentences: int
    identical: int
    max_score_diff: float  # over identical sequences, |score difference| (length-penalised, as searched)
    divergences: tuple[Divergence, ...]
    min_agreement: float
    score_atol: float
    max_token_score_diff: float = 0.0  # the same per token: |log-prob sum difference| / length; held to score_atol

    @property
    def agreement(self) -> float:
        return self.identical / max(self.sentences, 1)

    @property
    def passed(self) -> bool:
        bugs = [d for d in self.divergences if not d.near_tie]
        return not bugs and self.agreement >= self.min_agreement and self.max_token_score_diff <= self.score_atol


@dataclass
class ParityReport:
    candidate: str
    reference: str
    precision: str
    sentences: int
    teacher_forced: list[ErrorStats] = field(default_factory=list)
    sequences: list[SequenceCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.teacher_forced) and all(s.passed for s in self.sequences)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite numbers (a NaN output, an infinite error) as the strings "inf", "-inf", "nan"."""
        return _json_ready({
            "passed": self.passed, "candidate": self.candidate, "reference": self.reference,
            "precision": self.precision, "sentences": self.sentences,
            "teacher_forced": [{**asdict(s), "passed": s.passed} for s in self.teacher_forced],
            "sequences": [{**asdict(s), "agreement": s.agreement, "passed": s.passed} for s in self.sequences],
        })

    def print(self, console=None) -> None:
        from rich.markup import escape
        from rich.table import Table

        from transduce._console import console as default_console

        console = console or default_console()
        t = Table(title=f"parity: {self.candidate} vs {self.reference} ({self.precision}, {self.sentences} sentences)")
        for col in ("output", "max abs", "mean abs", "p99 abs", "max rel", "p99 rel", "atol / rtol", "result"):
            t.add_column(col, justify="right" if col not in ("output", "result") else "left")
        for s in self.teacher_forced:
            # escape: the brackets of "log_probs [decoder_step.onnx]" are text, not rich markup
            t.add_row(escape(s.name), f"{s.max_abs:.2e}", f"{s.mean_abs:.2e}", f"{s.p99_abs:.2e}", f"{s.max_rel:.2e}",
                      f"{s.p99_rel:.2e}", f"{s.atol:.2g} / {s.rtol:.2g}",
                      "[green]pass[/]" if s.passed else f"[red]FAIL ({s.failing} elements)[/]")
        console.print(t)
        t2 = Table(title="decoded sequences")
        for col in ("search", "identical", "max score diff", "per token / tol", "divergences (near-tie / bug)",
                    "result"):
            t2.add_column(col)
        for s in self.sequences:
            ties = sum(d.near_tie for d in s.divergences)
            t2.add_row(s.mode, f"{s.identical}/{s.sentences} ({100 * s.agreement:.1f}%)", f"{s.max_score_diff:.2e}",
                       f"{s.max_token_score_diff:.2e} / {s.score_atol:.2g}", f"{ties} / {len(s.divergences) - ties}",
                       "[green]pass[/]" if s.passed else "[red]FAIL[/]")
        console.print(t2)
        for s in self.sequences:
            for d in s.divergences[:10]:
                console.print(f"  {s.mode}: {_describe(d)}")
        console.print("[green]PARITY PASSED[/]" if self.passed else "[red]PARITY FAILED[/]")


def _describe(d: Divergence) -> str:
    where = f"sentence {d.sentence}" + (f", n-best entry {d.rank}" if d.rank else "")
    if d.measure == "count":
        return f"{where}: the candidate returned another number of hypotheses (BUG)"
    margin = ("its log-prob of its own token minus the candidate's there" if d.measure == "step"
              else "its score of its own hypothesis minus the candidate's")
    verdict = "near-tie" if d.near_tie else "BUG: large margin"
    return (f"{where} diverges at step {d.step}: reference token {d.reference_token}, candidate {d.candidate_token}; "
            f"the reference model's margin ({margin}) {d.margin:.2e} ({verdict})")


def _json_ready(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
    return obj


def _margin(reference, src: np.ndarray, length: int, prefix: tuple[int, ...], ref_tok: int | None,
            cand_tok: int | None, bos: int, eos: int) -> float:
    """Reference log-prob of its token minus the candidate's, after the common prefix."""
    tgt = np.array([[bos] + list(prefix)], dtype=np.int64)
    lp = teacher_forced_log_probs(reference, src[None], np.array([length]), tgt)[0, -1]
    a = lp[eos if ref_tok is None else ref_tok]
    b = lp[eos if cand_tok is None else cand_tok]
    return float(a - b)


def _reference_scores(reference, src: np.ndarray, length: int, hyps, options: DecodingOptions, bos: int,
                      eos: int) -> list[float]:
    """The reference model's score of each hypothesis, as beam search scores it: the log-prob sum of its
    tokens (and of EOS when finished) over the length penalty of that many tokens."""
    rows = [list(h.tokens) + ([eos] if h.finished else []) for h in hyps]
    tgt, _ = pad_ids([r[:-1] for r in rows], eos, lead=bos)  # the inputs: BOS, then every token but the last
    lp = teacher_forced_log_probs(reference, np.repeat(src[None], len(rows), 0), np.full(len(rows), length), tgt)
    scores = []
    for i, r in enumerate(rows):
        chosen = lp[i, np.arange(len(r)), r]
        if options.target_lang and r:  # the forced target language code counts 0, as the search counts it
            chosen[0] = 0.0
        raw = float(chosen.sum()) if r else 0.0
        scores.append(raw / float(options.penalty(max(len(r), 1))))
    return scores


def _score_diffs(ref_h, cand_h) -> tuple[float, float]:
    """Identical n-best lists -> (max |score difference|, max |log-prob sum difference| / length); a
    non-finite difference (a NaN or infinite score on either side, in any entry) is infinite."""
    def worst(values):
        return max((v if math.isfinite(v) else math.inf for v in values), default=0.0)

    pairs = list(zip(ref_h, cand_h, strict=False))
    score = worst(0.0 if a.score == b.score else abs(a.score - b.score) for a, b in pairs)
    per_token = worst(0.0 if a.log_prob == b.log_prob else abs(a.log_prob - b.log_prob) / max(len(a.token_log_probs), 1)
                      for a, b in pairs)
    return score, per_token


def _compare_sequences(mode, reference, src_batches, ref_results, cand_results, policy, cfg,
                       options: DecodingOptions | None = None, indices: list[int] | None = None) -> SequenceCheck:
    """Compare decoded results sentence by sentence. `options` are the beam search's (None: greedy, whose
    divergences are judged at their first differing step; beam search's by the two hypotheses' scores, or by a
    near-tie at that step); `indices` number the sentences in the report."""
    assert len(ref_results) == len(cand_results), (len(ref_results), len(cand_results))
    identical, max_diff, max_token_diff, divs = 0, 0.0, 0.0, []
    for i, (ref, cand) in enumerate(zip(ref_results, cand_results, strict=True)):
        sentence = indices[i] if indices is not None else i
        ref_h, cand_h = ref.hypotheses, cand.hypotheses
        if [h.tokens for h in ref_h] == [h.tokens for h in cand_h]:
            identical += 1
            diff, token_diff = _score_diffs(ref_h, cand_h)
            max_diff, max_token_diff = max(max_diff, diff), max(max_token_diff, token_diff)
            continue
        k = next((j for j, (x, y) in enumerate(zip(ref_h, cand_h, strict=False)) if x.tokens != y.tokens), None)
        if k is None:  # one list is the other's beginning
            divs.append(Divergence(sentence, 0, None, None, math.inf, False, min(len(ref_h), len(cand_h)), "count"))
            continue
        a, b = ref_h[k].tokens, cand_h[k].tokens
        step = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        rt = a[step] if step < len(a) else None
        ct = b[step] if step < len(b) else None
        src, length = src_batches[i]
        step_margin = _margin(reference, src, length, a[:step], rt, ct, cfg.bos_id, cfg.eos_id)
        margin, measure = step_margin, "step"
        near_tie = abs(step_margin) <= policy.tie_margin
        if options is not None:
            ref_score, cand_score = _reference_scores(reference, src, length, (ref_h[k], cand_h[k]), options,
                                                      cfg.bos_id, cfg.eos_id)
            # negative: the candidate's hypothesis is the better one by the reference's own score (its search
            # pruned it); explained when the candidate's is no worse than by tie_margin. Or by a near-tie where
            # the two branch (a pruning decision there can flip, after which the two searches keep different
            # beams and may end far apart); otherwise the whole-sequence margin, what beam search ranks by
            if ref_score - cand_score <= policy.tie_margin or not near_tie:
                margin, measure = ref_score - cand_score, "sequence"
                near_tie = margin <= policy.tie_margin
        near_tie = near_tie and math.isfinite(margin)
        divs.append(Divergence(sentence, step, rt, ct, margin, near_tie, k, measure))
    return SequenceCheck(mode, len(ref_results), identical, max_diff, tuple(divs), policy.min_agreement,
                         policy.score_atol, max_token_diff)


def run_parity(reference: Backend, candidate: Backend, tokenizer, sources: list[str], targets: list[str] | None = None,
               precision: str = "fp32", beam_size: int = 4, nbest: int = 1, batch_size: int = 16,
               candidate_name: str | None = None, reference_name: str | None = None,
               source_lang: str = "", target_lang: str = "") -> ParityReport:
    """Compare `candidate` with `reference` (both backends) on the given sentences.

    targets: the reference translations used for teacher forcing; None uses the reference
    backend's own greedy output. source_lang / target_lang: a multilingual model's languages (its defaults where
    not given; runtime.languages), whose codes begin every source and every output (forced, counted at log-prob 0
    in both searches), as decoding places them.
    """
    langs = languages.resolve(tokenizer, DecodingOptions(source_lang=source_lang, target_lang=target_lang))
    source_lead = languages.source_lead(tokenizer, langs)
    target_lead = languages.target_lead(tokenizer, langs)
    if precision not in POLICIES:
        raise InputError(f"no parity policy for precision {precision!r}", hint=f"one of {sorted(POLICIES)}")
    policy = POLICIES[precision]
    cfg = reference.config
    eos, pad, bos = cfg.eos_id, cfg.pad_id, cfg.bos_id
    limit = cfg.max_positions - 1 - len(source_lead)
    src_tok = tokenizer.encode_batch(sources)
    cut = sum(len(ids) > limit for ids in src_tok)
    if cut:  # both backends see the same cut sources; decode would refuse them (or --truncate them)
        warnings.warn(f"parity: {cut} source(s) longer than {limit} tokens (max_positions {cfg.max_positions} "
                      f"with EOS) were cut to their first {limit} for the check", stacklevel=2)
    src_tok = [ids[:limit] for ids in src_tok]
    keep = [i for i, ids in enumerate(src_tok) if ids]
    src_tok = [source_lead + src_tok[i] + [eos] for i in keep]
    limit = cfg.max_positions - 1  # the targets', the code included
    report = ParityReport(candidate_name or candidate.name, reference_name or reference.name, precision, len(src_tok))
    tf_ref: dict[str, list[np.ndarray]] = {}
    tf_cand: dict[str, list[np.ndarray]] = {}
    greedy_opts = DecodingOptions(beam_size=1, target_lang=langs.target_lang)
    beam_opts = DecodingOptions(beam_size=beam_size, nbest=nbest, target_lang=langs.target_lang)
    results: dict[str, tuple[list, list]] = {"greedy": ([], []), f"beam{beam_size}": ([], [])}
    src_rows: list[tuple[np.ndarray, int]] = []
    # a backend with more than one step graph (ONNX Runtime on an artifact with the fused graph, which it
    # decodes with, and the standard one, which parity pins it to and TensorRT builds from) gets its
    # teacher-forced log-probs checked once per graph
    for who, backend in (("reference", reference), ("candidate", candidate)):
        if not isinstance(backend, FullOutputs):
            raise InputError(f"the {who} backend ({backend.name}) gives no full log-probs and encoder outputs "
                             "(FullOutputs): parity compares them")
    graphs = step_graphs(candidate)
    lp_labels = [(f"log_probs [{g}]", g) for g in graphs] if len(graphs) > 1 else [("log_probs", None)]
    for start in range(0, len(src_tok), batch_size):
        chunk = src_tok[start : start + batch_size]
        src, _ = pad_ids(chunk, pad)
        lens = np.array([len(c) for c in chunk], dtype=np.int64)
        src_rows += [(src[j], int(lens[j])) for j in range(len(chunk))]
        # 1. teacher forcing: encoder outputs and every step's log-probs
        enc_r = reference.encoder_outputs(reference.encode(src, lens))
        enc_c = candidate.encoder_outputs(candidate.encode(src, lens))
        mask = np.arange(src.shape[1])[None, :] < lens[:, None]  # real source positions
        for name in enc_r:
            key = "memory" if name == "memory" else "cross_kv"
            r, c = enc_r[name], enc_c[name]
            sel = mask if name == "memory" else mask[:, None, :]  # (B,S) or (B,1,S) over (B,H,S,Dh)
            tf_ref.setdefault(key, []).append(r[sel] if name == "memory" else r.transpose(0, 2, 1, 3)[mask])
            tf_cand.setdefault(key, []).append(c[sel] if name == "memory" else c.transpose(0, 2, 1, 3)[mask])
        forced = [target_lead] * len(chunk) if target_lead else None
        if targets is not None:
            tgt_tok = [(target_lead + tokenizer.encode(targets[keep[start + j]]))[:limit]
                       for j in range(len(chunk))]
        else:
            tgt_tok = [list(r.best.tokens)[:limit] for r in decode(reference, src, lens, greedy_opts,
                                                                   prefixes=forced)]
        tgt_in, _ = pad_ids(tgt_tok, pad, lead=bos)
        lp_r = teacher_forced_log_probs(reference, src, lens, tgt_in)
        steps = np.arange(tgt_in.shape[1])[None, :] <= np.array([len(t) for t in tgt_tok])[:, None]  # incl. EOS step
        for label, graph in lp_labels:
            with only_step_graph(candidate, graph):
                lp_c = teacher_forced_log_probs(candidate, src, lens, tgt_in)
            tf_ref.setdefault(label, []).append(lp_r[steps])
            tf_cand.setdefault(label, []).append(lp_c[steps])
        # 2. and 3. decoded sequences
        for mode, opts in (("greedy", greedy_opts), (f"beam{beam_size}", beam_opts)):
            results[mode][0].extend(decode(reference, src, lens, opts, prefixes=forced))
            results[mode][1].extend(decode(candidate, src, lens, opts, prefixes=forced))
    for key in ["memory", "cross_kv"] + [label for label, _ in lp_labels]:
        if key in tf_ref:
            report.teacher_forced.append(error_stats(key, np.concatenate([a.ravel() for a in tf_ref[key]]),
                                                     np.concatenate([a.ravel() for a in tf_cand[key]]),
                                                     policy.outputs[key.split(" ")[0]]))
    for mode, (ref_res, cand_res) in results.items():
        report.sequences.append(_compare_sequences(mode, reference, src_rows, ref_res, cand_res, policy, cfg,
                                                   None if mode == "greedy" else beam_opts, keep))
    return report


def _check_quantized_graphs(artifact: Artifact, method: str) -> None:
    """The looser policy of a quantized artifact only for graphs that are quantized: the manifest is the one
    file no hash covers, and a hand-edited claim would hold fp32 graphs to int8's tolerances."""
    import onnx

    from transduce.formats.artifact import QUANTIZED_FILES, QUANTIZED_OP_TYPES

    for name in QUANTIZED_FILES:
        ops = {n.op_type for n in onnx.load(artifact.file(name), load_external_data=False).graph.node}
        if not ops & set(QUANTIZED_OP_TYPES):
            raise ArtifactError(f"{artifact.path}: its manifest says {method} quantization, but {name} has no "
                                f"quantized operator ({', '.join(QUANTIZED_OP_TYPES)})",
                                hint="its manifest.json was edited by hand: restore it, or export the artifact again")


def parity_for_artifact(path: str, spec: BackendSpec | None = None, *, data: str | None = None,
                        input_path: str | None = None, sentences: int = 200, beam_size: int = 4, nbest: int = 1,
                        reference_device: str = "cpu", source_lang: str = "", target_lang: str = "") -> ParityReport:
    """`transduce parity`: the backend `spec` names over `path` (an artifact, or an engine directory), checked
    against the eager model the artifact was exported from (spec.model_dir: another copy of it) on
    `reference_device` (the CPU unless asked: the fp32 CPU model is the reference of record), on the sample.
    The candidate is held to the policy of the precision (or quantization) it runs at. source_lang / target_lang:
    a multilingual model's languages, whose codes begin the sources and the outputs as decoding places them (its
    defaults where not given; a model without languages refuses them)."""
    from transduce.models.tokenizer import Tokenizer
    from transduce.runtime.api import open_backend
    from transduce.runtime.backends.torch_backend import TorchBackend, source_model
    from transduce.runtime.devices import torch_device

    spec = spec or BackendSpec()
    if sentences < 1:
        raise InputError(f"sentences must be >= 1, got {sentences}", params=("sentences",))
    if data and input_path:
        raise InputError("give either data (sources with references) or input_path (sources only), not both",
                         params=("data", "input_path"))
    reference_device = torch_device(reference_device, "reference_device")
    device = torch_device(spec.device, "device") if spec.backend == "torch" else spec.device
    if spec.backend == "torch" and reference_device == device and (spec.precision or "fp32") == "fp32" \
            and not spec.cuda_graph:
        raise InputError(f"parity of backend torch on {device} would compare eager PyTorch with itself (the "
                         f"reference runs on reference_device {reference_device})",
                         hint="check an exported backend (backend onnxruntime or tensorrt), eager PyTorch on "
                              "another device (device cuda, reference_device cpu) or at another precision",
                         params=("backend", "reference_device", "device", "precision"))
    sources, targets = _sample(data, input_path, sentences)
    candidate = open_backend(path, spec)
    artifact = candidate.artifact  # the one the candidate loaded (an engine directory's copy)
    reference = TorchBackend.from_model_dir(source_model(artifact, spec.model_dir), device=reference_device)
    tokenizer = Tokenizer.from_file(artifact.file(TOKENIZER_FILE))
    # an int8 artifact (transduce export --quantize) is held to the int8 policy, TensorRT engines (built from
    # unquantized exports only) to their precision's, and eager PyTorch, which runs the source model at its own
    # precision whatever the artifact's, to that one's
    policy = candidate.quantization or candidate.precision
    if policy not in POLICIES:
        what = "quantization" if candidate.quantization else "precision"
        raise ArtifactError(f"{artifact.path}: its manifest says {what} {policy!r}, which parity has no tolerances "
                            f"for (it knows {', '.join(POLICIES)})",
                            hint=artifact.rebuild_hint())
    if candidate.quantization:
        _check_quantized_graphs(artifact, candidate.quantization)
    shown = device if spec.backend == "torch" else str(candidate.device)  # TensorRT runs on a GPU whatever
    name = f"{spec.backend}:{shown} ({policy}{', CUDA graphs' if candidate.cuda_graph else ''})"
    return run_parity(reference, candidate, tokenizer, sources, targets, precision=policy, beam_size=beam_size,
                      nbest=nbest, candidate_name=name, reference_name=f"torch:{reference_device}",
                      source_lang=source_lang, target_lang=target_lang)


def _sample(data: str | None, input_path: str | None, sentences: int) -> tuple[list[str], list[str] | None]:
    """The sources (and references) parity checks: a TSV's first `sentences` pairs, a file's first sources, or
    the embedded demo's held-out set."""
    if data:
        from transduce.io.parallel import read_parallel

        pairs = read_parallel(data)[:sentences]
        return [s for s, _ in pairs], [t for _, t in pairs]
    if input_path:
        from transduce.io.text import read_lines

        sources = [line.strip() for line in read_lines(input_path, InputError) if line.strip()][:sentences]
        if not sources:
            raise InputError(f"input_path {input_path!r} has no sentences", hint="one source sentence per line",
                             params=("input_path",))
        return sources, None
    from transduce.models.corpus import demo_corpus

    _, valid = demo_corpus(n_train=0, n_valid=sentences)
    return [s for s, _ in valid], [t for _, t in valid]
