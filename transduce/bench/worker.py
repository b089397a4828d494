"""One benchmarked system in its own process: `python -m transduce.bench.worker`.

Every system (torch, the torch-cuda family, onnxruntime, tensorrt, and CTranslate2 under each setting) runs in a
process of its own, so that
- environment settings that must precede a library's loading (ONEDNN_MAX_CPU_ISA for CTranslate2's
  oneDNN) differ between systems of one run;
- thread pools do not meet: each process has only its system's threads, idle (blocked on a pipe, once
  their post-call spinning is over: the harness waits for that, cpu.settle) while another system
  is being timed;
- the parent can interleave systems (A B A B ...) at the granularity of one measurement.

Protocol: one JSON object per line on stdin, one JSON reply per line on the original stdout (fd 1 is
pointed at stderr, so anything a library prints cannot corrupt the protocol):
  {"op": "load", "system": "torch"|"torch-cuda[-graph][-fp16|-bf16]"|"onnxruntime"|"tensorrt"|"ctranslate2",
   "path": DIR, "model_dir": DIR, "threads": N, "inter_threads": M}   -> {"ok": true, "info": {...}}
      (inter_threads: CTranslate2 only, 1 if absent; a batch is then decoded in M sub-batches at once)
  {"op": "decode", "src": [[id, ...], ...], "beam": K, "steps": N, "min_seconds": T}
      a forced-length decode: exactly N tokens per sentence (EOS banned), source ids given without EOS
      (it is appended), called back to back until the calls fill T seconds (at least once, at most
      MAX_CALLS times) -> {"seconds": the calls' median, "calls": c, "tokens": n}
  {"op": "direct", "src": ..., "beam": K, "steps": N}      (our backends only) encoder alone, then N calls
      of backend.step at batch x beam rows -> {"encode_seconds": s, "step_seconds": [s, ...]}
  {"op": "translate", "texts": [str, ...], "beam": K, "early_stopping": RULE|null, "one_at_a_time": B,
   "min_seconds": T, "languages": {"source", "target", "source_lead", "target_prefix"}|null}
      end to end: the texts translated with the system's defaults (natural stopping, maximum length source
      tokens + 50), tokenisation and detokenisation inside the timed call; all at once (one call for the whole
      list) or one at a time (a loop of one-sentence calls); timed as decode is -> {"seconds": the median of one
      pass over the texts, "calls": c, "outputs": [text, ...], "steps": n}. Ours: Translator.translate with
      beam_size K and early_stopping RULE (null: our default), steps = backend.step calls in one pass (one at a
      time, each is one sentence's). CTranslate2: RULE must be null (its own rule), no "steps"; the load
      request must have given "model_dir" (the tokenizer). languages: a multilingual model's codes (bench.gates'
      Languages), ours as source_lang and target_lang, CTranslate2's as the source's first token and the
      target_prefix, as its users give them.
  {"op": "quit"}
Times are taken inside the worker around the call (perf_counter), not including the pipe.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

from transduce.runtime.backends.base import Tuned

MAX_CALLS = 25  # decode calls per measurement, at most (see the protocol above)


def repeated(call, min_seconds: float) -> dict[str, Any]:
    """Run `call` (-> {"seconds": s, ...}) back to back until the calls fill min_seconds (at least
    once, at most MAX_CALLS times); -> the last reply with the median seconds and the call count."""
    times, spent = [], 0.0
    while True:
        reply = call()
        times.append(reply["seconds"])
        spent += reply["seconds"]
        if spent >= min_seconds or len(times) >= MAX_CALLS:
            return {**reply, "seconds": float(np.median(times)), "calls": len(times)}


def encoder_threads_rule(threads: int, narrow: int) -> str:
    """How ONNX Runtime's encoder uses `threads`: one thread below `narrow` source tokens per run."""
    if threads == 1:
        return "1"
    if narrow <= 1:  # a model whose one source token is already past the one-thread limit
        return f"{threads} always"
    if narrow == 2:  # the base model's: "below 2 tokens" would be an odd way to say it
        return f"1 for a run of one source token, {threads} from two"
    return f"1 below {narrow} source tokens per run, {threads} from there"


def ort_info(tuning: dict[str, Any], threads: int) -> dict[str, Any]:
    """The ONNX Runtime backend's choices (its tuning()) as the bench reports them, for a budget of `threads`."""
    step, wide_from = tuning["step_threads"], tuning["wide_from_rows"]
    if not tuning["wide_session"]:
        step_rule = f"{step} always"
    elif wide_from > 1:
        step_rule = f"{step} below {wide_from} rows, {threads} from there"
    else:
        step_rule = f"{threads} always"
    parts_rule = "every batch whole"
    if tuning["shard_count"] > 1:
        parts_rule = (f"a batch of 2 sentences or more and {tuning['shard_min_rows']} rows or more in up to "
                      f"{tuning['shard_count']} parts of {tuning['shard_min_part_rows']} rows or more at the same "
                      "time, one thread each")
    return {"encoder_threads_rule": encoder_threads_rule(threads, tuning["narrow_encoder_tokens"]),
            "step_intra_op_threads": step, "inter_op_threads": tuning["inter_op_threads"],
            "step_threads_rule": step_rule, "wide_steps": tuning["wide_steps"], "parts_rule": parts_rule,
            "step_graph": tuning["step_graph"], "pool_spin_us": tuning["pool_spin_us"]}


def tokenizer_of(model_dir: str | None, backend=None):
    """The model's tokenizer, for the translate op: the model directory's, else the one in the artifact the backend
    decodes (as transduce.runtime.api.load takes it)."""
    if model_dir:
        from transduce.models.checkpoint import load_tokenizer

        return load_tokenizer(model_dir)
    artifact = getattr(backend, "artifact", None)
    if artifact is None:
        raise RuntimeError("the translate op needs the model's tokenizer: load the system with its model_dir")
    from transduce.formats.model_dir import TOKENIZER_FILE
    from transduce.models.tokenizer import Tokenizer

    return Tokenizer.from_file(artifact.file(TOKENIZER_FILE))


@contextlib.contextmanager
def counted_steps(backend):
    """The step calls of the backend's class counted while inside: the backend's, and those of the one-thread views
    a batch may be dealt out to (backend.shards: copies of it, each stepped on a thread of its own). Patched on the
    class, not the instance: a view copied from a patched instance would keep the patch. A call and a lock more per
    step, well under a microsecond. -> a function giving the calls so far."""
    cls = type(backend)
    own = cls.__dict__.get("step")  # None: inherited
    step = cls.step
    count, lock = [0], threading.Lock()

    def counted(self, *args, **kwargs):
        with lock:
            count[0] += 1
        return step(self, *args, **kwargs)

    cls.step = counted
    try:
        yield lambda: count[0]
    finally:
        if own is not None:
            cls.step = own
        else:
            del cls.step


def max_decoding_length(source_tokens: int) -> int:
    """Our default maximum output length for a source of that many tokens (DecodingOptions' max_len_a and
    max_len_b: source tokens + 50), which CTranslate2 is given for the longest source of a call."""
    from transduce.runtime.decoding import DecodingOptions

    d = DecodingOptions()
    return math.ceil(d.max_len_a * source_tokens) + d.max_len_b


def compile_step(backend) -> None:
    """The eager torch backend's decoder step through torch.compile(mode="reduce-overhead"): Inductor's kernels,
    replayed from torch's own CUDA graphs, each shape compiled on its first call (the bench's warm-up). Shapes are
    marked dynamic so that the rows and cache capacities of a run share one compilation."""
    import torch

    for name in ("recompile_limit", "cache_size_limit"):  # the setting's name differs across torch versions
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    model = backend.model
    compiled = torch.compile(model.decode_step, mode="reduce-overhead", dynamic=True)

    def step(*args):
        torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were read: their memory may be reused
        return compiled(*args)

    model.decode_step = step


class _Ours:
    """A transduce backend (the BackendSpec its system name stands for), driven by transduce.runtime.decoding."""

    def __init__(self, system: str, path: str, model_dir: str | None, threads: int):
        from transduce.bench.config import compiled_system, system_spec
        from transduce.runtime.api import open_backend

        spec = system_spec(system, threads=threads, model_dir=model_dir)
        on_gpu = spec.device.startswith("cuda") or spec.backend == "tensorrt"
        self.cuda = on_gpu  # device work to wait for before reading a clock
        if spec.backend == "torch":
            import torch

            torch.set_num_threads(threads)
            if spec.device.startswith("cuda"):  # the torch backend's own check and words, before anything loads
                from transduce.errors import BackendUnavailable
                from transduce.runtime.devices import torch_device

                torch_device(spec.device, unavailable=BackendUnavailable)
        self.backend = open_backend(path, spec)
        self.model_dir = model_dir
        self._translator = None  # made by the first translate op
        if compiled_system(system):
            compile_step(self.backend)
        self.cfg = self.backend.config
        self.info: dict[str, Any] = {"threads": threads}
        if spec.backend == "torch":
            import torch

            self.info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
            if spec.device.startswith("cuda"):
                self.info.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(self.backend.device),
                                 cuda_graph=spec.cuda_graph, precision=self.backend.precision)
                if isinstance(self.backend, Tuned):  # JSON-safe: a value json cannot write would fail the reply
                    self.info["tuning"] = json.loads(json.dumps(self.backend.tuning(), default=str))
        elif spec.backend == "onnxruntime":
            import onnxruntime

            self.info.update(onnxruntime=onnxruntime.__version__, **ort_info(self.backend.tuning(), threads))

    def _batch(self, src: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        from transduce.runtime.decoding.batch import pad_ids

        return pad_ids(src, self.cfg.pad_id, end=self.cfg.eos_id)

    def decode(self, src, beam: int, steps: int) -> dict[str, Any]:
        from transduce.runtime.decoding import DecodingOptions, decode

        ids, lens = self._batch(src)
        opts = DecodingOptions.forced(steps, beam_size=beam)
        t = time.perf_counter()
        results = decode(self.backend, ids, lens, opts)
        seconds = time.perf_counter() - t
        lengths = [len(r.best.tokens) for r in results]
        if any(n != steps for n in lengths):
            raise RuntimeError(f"forced decoding produced lengths {sorted(set(lengths))}, not {steps}")
        return {"seconds": seconds, "tokens": int(sum(lengths))}

    def direct(self, src, beam: int, steps: int) -> dict[str, Any]:
        ids, lens = self._batch(src)
        be = self.backend
        t = time.perf_counter()
        enc = be.encode(ids, lens)
        if self.cuda:  # encode only queues the GPU's work (steps return host arrays: they wait for theirs)
            import torch

            torch.cuda.synchronize()
        encode_seconds = time.perf_counter() - t
        b = len(src)
        state = be.begin(enc, np.repeat(np.arange(b), beam), steps)
        rng = np.random.default_rng(0)
        k = 1 if beam == 1 else 2 * beam
        times = []
        for _ in range(steps):
            tokens = rng.integers(4, self.cfg.vocab_size, size=b * beam, dtype=np.int64)
            t = time.perf_counter()
            be.step(state, tokens, k)
            times.append(time.perf_counter() - t)
        # the run's buffers back to the backend's pool, as decode does: the next timed decode would
        # otherwise allocate (and page-fault) them afresh
        be.end(state)
        return {"encode_seconds": encode_seconds, "step_seconds": times}

    def translate(self, texts: list[str], beam: int, early_stopping: str | None, one_at_a_time: bool,
                  languages: dict[str, Any] | None = None) -> dict[str, Any]:
        """One pass over `texts` with Translator.translate (our defaults but the beam size, the stopping rule and a
        multilingual model's languages), and the backend.step calls it took."""
        if self._translator is None:
            from transduce.runtime.translator import Translator

            self._translator = Translator(self.backend, tokenizer_of(self.model_dir, self.backend))
        tr = self._translator
        fields: dict[str, Any] = {"beam_size": beam}
        if early_stopping is not None:
            fields["early_stopping"] = early_stopping
        if languages:
            fields.update(source_lang=languages["source"], target_lang=languages["target"])
        with counted_steps(self.backend) as steps:
            t = time.perf_counter()
            out = [tr.translate([x], **fields)[0] for x in texts] if one_at_a_time else tr.translate(texts, **fields)
            seconds = time.perf_counter() - t
            return {"seconds": seconds, "steps": steps(), "outputs": [x.text for x in out]}


class _CTranslate2:
    def __init__(self, path: str, threads: int, inter_threads: int = 1, compute_type: str = "float32",
                 model_dir: str | None = None):
        import ctranslate2

        from transduce.bench.ctranslate2.convert import ct2_vocab, suppressed

        self.suppress = suppressed(path)
        self.inter = inter_threads
        self.translator = ctranslate2.Translator(path, device="cpu", compute_type=compute_type,
                                                 inter_threads=inter_threads, intra_threads=threads)
        self.vocab = ct2_vocab(path)
        self.index = {t: i for i, t in enumerate(self.vocab)}  # CTranslate2's token -> our id
        self.model_dir = model_dir
        self.tokenizer = None  # loaded by the first translate op
        self.info = {"ctranslate2": ctranslate2.__version__, "intra_threads": threads, "inter_threads": inter_threads,
                     "compute_type": self.translator.compute_type,
                     "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
                     "CT2_USE_MKL": os.environ.get("CT2_USE_MKL", "")}

    def decode(self, src, beam: int, steps: int) -> dict[str, Any]:
        tokens = [[self.vocab[i] for i in x] for x in src]
        t = time.perf_counter()
        # with inter_threads, the batch in that many sub-batches decoded at the same time (0: one batch)
        parts = math.ceil(len(tokens) / self.inter) if self.inter > 1 else 0
        results = self.translator.translate_batch(
            tokens, beam_size=beam, max_decoding_length=steps, min_decoding_length=steps,
            suppress_sequences=self.suppress or None, max_batch_size=parts)
        seconds = time.perf_counter() - t
        lengths = [len(r.hypotheses[0]) for r in results]
        if any(n != steps for n in lengths):
            raise RuntimeError(f"forced decoding produced lengths {sorted(set(lengths))}, not {steps}")
        return {"seconds": seconds, "tokens": int(sum(lengths))}

    def translate(self, texts: list[str], beam: int, early_stopping: str | None, one_at_a_time: bool,
                  languages: dict[str, Any] | None = None) -> dict[str, Any]:
        """One pass over `texts`: our tokenizer, translate_batch with CTranslate2's defaults (its own stopping
        rule; a multilingual model's codes as it takes them), our tokenizer back to text, all inside the timed
        call."""
        if early_stopping is not None:
            raise RuntimeError("CTranslate2 stops beam search by its own rule only (beam_size x patience hypotheses "
                               f"finished): early_stopping must be null, got {early_stopping!r}")
        if self.tokenizer is None:
            if not self.model_dir:
                raise RuntimeError("the translate op needs the model's tokenizer: load the system with its model_dir")
            self.tokenizer = tokenizer_of(self.model_dir)
        t = time.perf_counter()
        out = ([self._texts([x], beam, languages)[0] for x in texts] if one_at_a_time
               else self._texts(texts, beam, languages))
        return {"seconds": time.perf_counter() - t, "outputs": out}

    def _texts(self, texts: list[str], beam: int, languages: dict[str, Any] | None) -> list[str]:
        """texts -> their translations, as a user of CTranslate2 with our tokenizer would get them (a multilingual
        model's: the source's code first in each source, the target's as target_prefix; our detokenizer drops
        codes)."""
        tok = self.tokenizer
        lead = list(languages["source_lead"]) if languages else []
        ids = [lead + x for x in tok.encode_batch(texts)]  # without EOS (ours never adds one): CTranslate2 appends it
        parts = math.ceil(len(ids) / self.inter) if self.inter > 1 else 0  # as in decode
        prefix = [[self.vocab[i] for i in languages["target_prefix"]]] * len(ids) if languages else None
        # the tokens our search never proposes are banned here too (suppress, as in decode): the same model
        results = self.translator.translate_batch(
            [[self.vocab[i] for i in x] for x in ids], beam_size=beam, max_batch_size=parts, target_prefix=prefix,
            max_decoding_length=max_decoding_length(max((len(x) for x in ids), default=0)),
            suppress_sequences=self.suppress or None)
        return [tok.decode([self.index[w] for w in r.hypotheses[0]]) for r in results]


def _load(req: dict[str, Any]):
    system = req["system"]
    if system == "ctranslate2":
        return _CTranslate2(req["path"], int(req["threads"]), int(req.get("inter_threads", 1)),
                            req.get("compute_type", "float32"), req.get("model_dir"))
    return _Ours(system, req["path"], req.get("model_dir"), int(req["threads"]))


def _measure(system, op: str, req: dict[str, Any]) -> dict[str, Any]:
    """A decode, direct or translate request on the loaded system -> its reply."""
    if system is None:
        raise RuntimeError("no system loaded")
    if not hasattr(system, op):
        raise RuntimeError(f"{op!r} is not available for this system")
    min_seconds = float(req.get("min_seconds", 0.0))
    if op == "translate":
        return repeated(functools.partial(system.translate, list(req["texts"]), int(req["beam"]),
                                          req.get("early_stopping"), bool(req.get("one_at_a_time")),
                                          req.get("languages")), min_seconds)
    args = (req["src"], int(req["beam"]), int(req["steps"]))
    if op == "decode":
        return repeated(functools.partial(system.decode, *args), min_seconds)
    return system.direct(*args)


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # library output goes to stderr
    sys.stdout = sys.stderr
    system = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req["op"]
            if op == "quit":
                reply: dict[str, Any] = {"ok": True}
                proto.write(json.dumps(reply) + "\n")
                break
            if op == "load":
                system = None
                system = _load(req)
                reply = {"ok": True, "info": system.info, "pid": os.getpid()}
            elif op in ("decode", "direct", "translate"):
                reply = _measure(system, op, req)
            else:
                raise RuntimeError(f"unknown op {op!r}")
        except Exception as e:  # reported to the parent, which decides
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=5)}
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
