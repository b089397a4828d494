"""The TensorRT backend.

On CPU: the import fails cleanly without TensorRT, and the backend's own logic (profiles, row chunks,
preallocated cache and slot writes, in-place reorders, cross K/V gathers, top-k with
banned ids) runs against the TensorRT test double (tests/tensorrt_fake.py, which executes the eager
model on the bound host memory) and must decode exactly like the torch backend.

On a CUDA GPU without TensorRT (`pytest -m gpu`): the same tests with the backend on device="cuda",
the double running the model on the bound device memory on the backend's stream, against the torch
backend on the GPU; and with CUDA graphs, which then capture and replay the double's kernels. That
runs the backend's CUDA code (streams, pinned staging, device buffers, graph capture, replay and
invalidation) for real.

On a GPU (`pytest -m gpu`, skipped with the reason where CUDA or TensorRT is missing): real engines
built from freshly exported fp32 and fp16 artifacts give the torch backend's greedy tokens (fp32:
identical; fp16: the parity policy), beam 4 identical for fp32, with and without CUDA graphs.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import tensorrt_fake as fake

from transduce.build.builder import build_engines
from transduce.errors import ArtifactError, BackendUnavailable, EngineError
from transduce.formats.engine import RuntimeInfo
from transduce.formats.kinds import ENCODER_PLAN
from transduce.runtime.backends.tensorrt_support import import_tensorrt
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode


def test_backend_module_imports_no_framework():
    import subprocess

    code = ("import sys, transduce.runtime.backends.tensorrt_backend, transduce.build.builder, "
            "transduce.cli.build;"
            "bad=[m for m in ('torch','onnxruntime','tensorrt','onnx') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# -- against the test double (CPU) -------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are microseconds; torch's intra-op threads only contend on a shared CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_model_dir):
    return fake.make_artifact(str(tmp_path_factory.mktemp("trt") / "artifact"), tiny_model_dir)


def _engines(tmp_path_factory, artifact, **limits):
    out = str(tmp_path_factory.mktemp("engines") / "e")
    build_engines(artifact, out, _trt=fake, _gpu=dict(fake.FAKE_GPU), **limits)
    return out


def _backend(engine_dir, device="cpu", **kw):
    from transduce.runtime.backends.tensorrt_backend import TensorRTBackend

    return TensorRTBackend(engine_dir, device=device, _trt=fake, _runtime=fake.runtime_info(), **kw)


def _cuda_reason() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "no CUDA GPU available to PyTorch"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Where the backend runs under the double: host memory, or a CUDA GPU's (skipped without one)."""
    if request.param == "cuda" and _cuda_reason():
        pytest.skip(_cuda_reason())
    return request.param


@pytest.fixture(scope="module")
def wide(tmp_path_factory, artifact):
    """Room for the whole test batch: 8 sentences x beam 4, two profiles (latency, throughput)."""
    return _engines(tmp_path_factory, artifact, max_batch=8, beam=4, max_src_len=24, max_tgt_len=40)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory, artifact):
    """2 sentences x beam 2: every batch below runs in row chunks."""
    return _engines(tmp_path_factory, artifact, max_batch=2, beam=2, max_src_len=24, max_tgt_len=40)


def test_missing_tensorrt_fails_cleanly(monkeypatch, narrow):
    from transduce.runtime.api import make_backend
    from transduce.runtime.backends.tensorrt_backend import TensorRTBackend

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    for make in (lambda: TensorRTBackend(narrow), lambda: make_backend(narrow, backend="tensorrt")):
        with pytest.raises(BackendUnavailable) as e:
            make()
        assert "TensorRT is not installed" in str(e.value) and "pip install 'transduce[gpu]'" in str(e.value)


def test_a_wrong_directory_is_said_before_missing_tensorrt(monkeypatch, tmp_path, artifact, tiny_model_dir):
    """What to fix in the command line comes before what this machine lacks."""
    from transduce.runtime.api import make_backend

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    for path, says in [(str(tmp_path / "missing"), "engine directory .* does not exist"),
                       (artifact, "is an exported artifact, not a TensorRT engine directory"),
                       (tiny_model_dir, "is a model directory, not a TensorRT engine directory")]:
        with pytest.raises(ArtifactError, match=says):
            make_backend(path, backend="tensorrt")


@pytest.fixture(scope="module")
def batch(tiny_tokenizer, small_corpus):
    _, valid = small_corpus
    ids = [tiny_tokenizer.encode(s)[:15] + [2] for s, _ in valid[:7]]
    src = np.zeros((len(ids), max(map(len, ids))), np.int64)
    for i, row in enumerate(ids):
        src[i, : len(row)] = row
    return src, np.array([len(r) for r in ids], np.int64)


@pytest.fixture(scope="module")
def references(tiny_model, tiny_model_dir):
    """device -> the torch backend there (on a GPU, a copy of the model of its own)."""
    made = {"cpu": TorchBackend(tiny_model)}

    def get(device: str) -> TorchBackend:
        if device not in made:
            made[device] = TorchBackend.from_model_dir(tiny_model_dir, device=device)
        return made[device]

    return get


@pytest.fixture
def reference(references, device):
    return references(device)


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        assert [h.tokens for h in g.hypotheses] == [h.tokens for h in w.hypotheses]
        np.testing.assert_allclose([h.score for h in g.hypotheses], [h.score for h in w.hypotheses], atol=1e-4)
        assert [h.finished for h in g.hypotheses] == [h.finished for h in w.hypotheses]


OPTS = [DecodingOptions(beam_size=1, max_len_a=0, max_len_b=30),
        DecodingOptions(beam_size=4, nbest=2, max_len_a=0, max_len_b=30),
        DecodingOptions(beam_size=2, min_length=5, max_len_a=0, max_len_b=12)]


@pytest.mark.parametrize("opts", OPTS, ids=["greedy", "beam4", "beam2-minlen"])
@pytest.mark.parametrize("engines", ["wide", "narrow"])
def test_decodes_like_the_torch_backend(request, engines, opts, batch, reference, device):
    backend = _backend(request.getfixturevalue(engines), device)
    src, lens = batch
    _same(decode(backend, src, lens, opts), decode(reference, src, lens, opts))


def test_profiles_and_chunks_follow_the_rows(wide, narrow, batch):
    src, lens = batch
    b = _backend(wide)
    decode(b, src[:1], lens[:1], OPTS[0])  # 1 row: latency profile
    assert {p for p, _ in b._step.engine.executions} == {0}
    decode(b, src, lens, OPTS[1])  # 7 sentences x 4 beams = 28 rows: throughput
    assert {p for p, shapes in b._step.engine.executions if shapes["tokens"][0] > 8} == {1}
    # one context per profile in use, each with memory for its own profile only
    contexts = [c.ctx for c in b._step._contexts]
    assert len(contexts) == 2 and {c.allocation_strategy.name for c in contexts} == {"ON_PROFILE_CHANGE"}
    n = _backend(narrow)
    decode(n, src, lens, OPTS[1])
    assert max(s["tokens"][0] for _, s in n._step.engine.executions) == 4  # 28 rows in chunks of <= 4
    assert [s["src_ids"][0] for _, s in n._enc.engine.executions] == [2, 2, 2, 1]


def test_row_chunks_bind_aligned_addresses(wide, narrow, batch, reference, device):
    """TensorRT wants 256-byte aligned tensor addresses (the test double refuses others): a chunk's rows
    a:b of a buffer start a x row bytes in, so a misaligned chunk is staged through aligned scratch
    tensors, inputs copied in and outputs copied back; a run in one chunk binds every buffer in place."""
    src, lens = batch
    for engines, chunked in ((wide, False), (narrow, True)):
        b = _backend(engines, device)
        staged = []
        real = b._chunk_addresses

        def spy(inputs, outputs, a, c, real=real, staged=staged):
            addresses, keep, copy_back = real(inputs, outputs, a, c)
            assert all(ptr % 256 == 0 for ptr in addresses.values())
            staged.append((a, len(keep), len(copy_back)))
            return addresses, keep, copy_back

        b._chunk_addresses = spy
        _same(decode(b, src, lens, OPTS[1]), decode(reference, src, lens, OPTS[1]))
        assert all(k == c == 0 for a, k, c in staged if a == 0)  # first chunks (and one-chunk runs) in place
        # int64 tokens at row 2 are 16 bytes in: staged in the narrow engines' chunks (max batch 2)
        assert any(k and c for a, k, c in staged if a) == chunked
        assert all(a == 0 for a, _, _ in staged) != chunked


def test_encoder_chunks_stage_misaligned_outputs(tmp_path_factory, artifact, batch, reference, device):
    """Engines of max batch 1 and an odd source width: the encoder's outputs for row 1 on start 128 x 17
    bytes in (the tiny model's 32 fp32 values per position), so they run through scratch tensors
    copied back; the outputs and a decode still equal the torch backend's."""
    src, lens = batch
    src = np.pad(src, ((0, 0), (0, 17 - src.shape[1])))  # PAD columns: the same sentences
    b = _backend(_engines(tmp_path_factory, artifact, max_batch=1, beam=1, max_src_len=24, max_tgt_len=40), device)
    copied = []
    real = b._chunk_addresses

    def spy(inputs, outputs, a, c):
        addresses, keep, copy_back = real(inputs, outputs, a, c)
        if "memory" in outputs:
            copied.append(len(copy_back))
        return addresses, keep, copy_back

    b._chunk_addresses = spy
    got, want = b.encoder_outputs(b.encode(src, lens)), reference.encoder_outputs(reference.encode(src, lens))
    assert copied[0] == 0 and all(copied[1::2]) and len(copied) == len(src)  # odd rows: memory and cross K/V
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5)
    _same(decode(b, src, lens, OPTS[0]), decode(reference, src, lens, OPTS[0]))


def test_encoder_outputs_and_log_probs_match(wide, batch, reference, device):
    src, lens = batch
    b = _backend(wide, device)
    got, want = b.encoder_outputs(b.encode(src, lens)), reference.encoder_outputs(reference.encode(src, lens))
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5)
    rows = np.array([0, 0, 3, 5, 6])  # duplicated and dropped rows: cross K/V gathered per row
    sb, sr = b.begin(b.encode(src, lens), rows, 6), reference.begin(reference.encode(src, lens), rows, 6)
    tokens = np.full(len(rows), 1, np.int64)
    for t in range(4):
        lp_b, lp_r = b.step_log_probs(sb, tokens), reference.step_log_probs(sr, tokens)
        np.testing.assert_allclose(lp_b, lp_r, atol=1e-5)
        tokens = lp_r[:, 4:].argmax(1) + 4
        if t == 1:
            keep = np.array([4, 1, 1])
            b.reorder(sb, keep, rows[keep])
            reference.reorder(sr, keep, rows[keep])
            tokens = tokens[keep]


def test_reorders_move_rows_within_one_cache(wide, batch, reference, device):
    """A beam reorder moves rows inside the run's one cache buffer (every layer's K and V): the engine's
    cache addresses stay (a captured CUDA graph stays valid), no second cache is held, and the moved,
    duplicated and dropped rows step on exactly like the torch backend's."""
    src, lens = batch
    b = _backend(wide, device)
    rows = np.arange(4)
    sb = b.begin(b.encode(src[:4], lens[:4]), rows, 8)
    sr = reference.begin(reference.encode(src[:4], lens[:4]), rows, 8)
    assert sb.cache.shape == (2 * b.n_layers, 4, b.heads, 8, b.head_dim)
    addresses = [t.data_ptr() for t in sb.caches]
    assert addresses == [sb.cache[i].data_ptr() for i in range(2 * b.n_layers)]
    # each layer's K or V is contiguous and starts at a multiple of 256 bytes (TensorRT's alignment; the
    # tiny model's 4 x 8 x 8 fp32 values per row are 1 KiB, so also with 3 rows below)
    assert all(t.is_contiguous() and a % 256 == 0 for t, a in zip(sb.caches, addresses, strict=True))
    odd = b._stacked_zeros(3, (3, b.heads, 5, b.head_dim))  # 3 x 5 slots x 32 floats x 4 bytes: 1,920 bytes each
    assert odd.data_ptr() % 256 == 0
    assert [t.data_ptr() - odd.data_ptr() for t in odd.unbind(0)] == [0, 2048, 4096]
    assert all(t.is_contiguous() for t in odd.unbind(0)) and not odd.any()
    tokens = np.full(4, b.config.bos_id, np.int64)
    for keep in (None, np.array([3, 0, 0, 2]), np.array([1, 1, 3]), None):
        if keep is not None:
            b.reorder(sb, keep, rows[keep])
            reference.reorder(sr, keep, rows[keep])
            rows, tokens = rows[keep], tokens[keep]
        lp_b, lp_r = b.step_log_probs(sb, tokens), reference.step_log_probs(sr, tokens)
        np.testing.assert_allclose(lp_b, lp_r, atol=1e-5)
        tokens = lp_r[:, 4:].argmax(1) + 4
        assert [t.data_ptr() for t in sb.caches] == addresses
    assert not hasattr(sb, "spare")


def test_step_bans_pad_bos_and_eos(wide, batch, device):
    src, lens = batch
    b = _backend(wide, device)
    cfg = b.config
    state = b.begin(b.encode(src[:2], lens[:2]), np.arange(2), 4)
    vals, ids = b.step(state, np.full(2, cfg.bos_id), k=cfg.vocab_size, ban_eos=True)
    assert ids.dtype == np.int64 and vals.dtype == np.float32 and ids.shape == (2, cfg.vocab_size)
    for row_ids, row_vals in zip(ids, vals, strict=True):
        banned = {cfg.pad_id, cfg.bos_id, cfg.eos_id}
        assert set(row_ids[-3:]) == banned and np.isneginf(row_vals[-3:]).all()
        assert np.all(np.diff(row_vals[:-3]) <= 0)
    _, ids = b.step(state, ids[:, 0], k=3)
    assert (cfg.eos_id not in {cfg.pad_id, cfg.bos_id}
            and not ({cfg.pad_id, cfg.bos_id} & set(ids.ravel())))
    with pytest.raises(IndexError, match="capacity 4 exhausted"):
        for _ in range(3):
            b.step(state, ids[:, 0], k=1)


def test_limits_outside_the_engines_are_clear_errors(narrow, tiny_model_dir):
    b = _backend(narrow)
    with pytest.raises(EngineError, match="--max-src-len 30"):
        b.encode(np.full((1, 30), 5, np.int64), np.array([30]))
    enc = b.encode(np.full((1, 5), 5, np.int64), np.array([5]))
    with pytest.raises(EngineError, match="--max-tgt-len 41"):
        b.begin(enc, np.arange(1), 41)


def test_an_output_shape_tensorrt_disagrees_with_is_refused_every_time(narrow, monkeypatch):
    """TensorRT's output shape is checked against the contract-sized buffer before each run at new
    shapes; a refused one stays refused (it would otherwise write past the buffer on the next call)."""
    b = _backend(narrow)
    real = fake.IExecutionContext.get_tensor_shape

    def wider(self, name):  # an engine whose memory output is wider than the contract says
        shape = tuple(real(self, name))
        return shape[:-1] + (shape[-1] * 2,) if name == "memory" else shape

    monkeypatch.setattr(fake.IExecutionContext, "get_tensor_shape", wider)
    src, lens = np.array([[5, 6, 2]], np.int64), np.array([3])
    for _ in range(2):
        with pytest.raises(EngineError, match="TensorRT computes memory as"):
            b.encode(src, lens)
    monkeypatch.setattr(fake.IExecutionContext, "get_tensor_shape", real)
    assert b.encoder_outputs(b.encode(src, lens))["memory"].shape[-1] == b.config.d_model


def test_engine_refusals_reach_the_backend(tmp_path_factory, artifact):
    d = _engines(tmp_path_factory, artifact, max_batch=2)
    from transduce.runtime.backends.tensorrt_backend import TensorRTBackend

    with pytest.raises(ArtifactError, match="TensorRT 10.0.0"):
        TensorRTBackend(d, device="cpu", _trt=fake, _runtime=RuntimeInfo("10.0.0", "NVIDIA Fake H100", "9.0"))
    with open(os.path.join(d, ENCODER_PLAN), "ab") as f:
        f.write(b" ")
    with pytest.raises(ArtifactError, match="encoder.plan has .* bytes"):
        _backend(d)


def test_translator_over_an_engine_dir(wide, tiny_tokenizer, small_corpus, tiny_model):
    from transduce.runtime.translator import Translator

    b = _backend(wide)
    assert b.artifact.path == wide and b.artifact.lists("tokenizer.json")  # the engine directory's copy
    _, valid = small_corpus
    sources = [s for s, _ in valid[:5]]
    got = Translator(b, tiny_tokenizer).translate(sources, beam_size=2, max_len_b=20)
    want = Translator(TorchBackend(tiny_model), tiny_tokenizer).translate(sources, beam_size=2, max_len_b=20)
    assert [t.tokens for t in got] == [t.tokens for t in want]


@pytest.mark.gpu
@pytest.mark.parametrize("engines", ["wide", "narrow"])
def test_cuda_graphs_replay_the_step(request, engines, batch, references):
    """On a GPU, with the double's kernels standing in for an engine's: steps are captured once per
    shape and address set and replayed after, through beam reorders (the cache keeps its addresses),
    finished rows dropped and a new batch; tokens and scores stay the torch backend's; the caller's
    current stream is left as it was (the backend's work runs on its own stream)."""
    if _cuda_reason():
        pytest.skip(_cuda_reason())
    import torch

    reference = references("cuda")
    b = _backend(request.getfixturevalue(engines), "cuda", cuda_graph=True)
    src, lens = batch
    before = torch.cuda.current_stream()
    for opts in OPTS:
        for start in (0, 3):
            _same(decode(b, src[start:], lens[start:], opts), decode(reference, src[start:], lens[start:], opts))
    assert torch.cuda.current_stream() == before and b.stream != before
    assert b.graph_error is None, b.graph_error
    if engines == "wide":  # (the narrow engines' steps mostly run in row chunks, which are never captured)
        assert b.graph_captures > 0 and b.graph_replays > b.graph_captures, (b.graph_captures, b.graph_replays)


# -- real TensorRT on a GPU --------------------------------------------------------------------


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU available to PyTorch"
    try:
        import_tensorrt()
    except BackendUnavailable as e:
        return str(e).splitlines()[0]
    return None


@pytest.fixture(scope="module")
def gpu(tmp_path_factory, request):
    """The briefly trained demo model (peaked distributions: few near-ties), exported fp32 and fp16, built."""
    reason = _gpu_reason()
    if reason:
        pytest.skip(reason)
    demo_model_dir = request.getfixturevalue("demo_model_dir")  # trains for a minute: only once we know we can run
    from transduce.exporter.onnx_export import export_artifact
    from transduce.models.checkpoint import load_model_dir
    from transduce.models.corpus import demo_corpus

    root = tmp_path_factory.mktemp("gpu")
    engines = {}
    for precision in ("fp32", "fp16"):
        art = str(root / f"artifact-{precision}")
        export_artifact(demo_model_dir, art, precision=precision)
        engines[precision] = str(root / f"engines-{precision}")
        build_engines(art, engines[precision], max_batch=16, beam=4, timing_cache=str(root / "timing.cache"),
                          progress=False)
    model, tokenizer, _ = load_model_dir(demo_model_dir)
    _, valid = demo_corpus(n_train=0, n_valid=48)
    sources = [s for s, _ in valid]
    ids = [tokenizer.encode(s)[:60] + [model.cfg.eos_id] for s in sources]
    src = np.zeros((len(ids), max(map(len, ids))), np.int64)
    for i, row in enumerate(ids):
        src[i, : len(row)] = row
    return {"engines": engines, "model": model, "tokenizer": tokenizer, "sources": sources,
            "src": src, "lens": np.array([len(r) for r in ids], np.int64)}


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["enqueue", "cuda-graph"])
def test_gpu_fp32_greedy_and_beam_equal_torch(gpu, cuda_graph):
    from transduce.runtime.backends.tensorrt_backend import TensorRTBackend

    b = TensorRTBackend(gpu["engines"]["fp32"], cuda_graph=cuda_graph)
    reference = TorchBackend(gpu["model"], device="cuda")
    for start in range(0, len(gpu["src"]), 16):  # batches of 16 sentences: both profiles, every row count
        src, lens = gpu["src"][start : start + 16], gpu["lens"][start : start + 16]
        for opts in (DecodingOptions(beam_size=1), DecodingOptions(beam_size=4)):
            _same(decode(b, src, lens, opts), decode(reference, src, lens, opts))
    if cuda_graph:
        assert b.graph_error is None and b.graph_captures > 0 and b.graph_replays > b.graph_captures


@pytest.mark.gpu
def test_gpu_fp16_matches_torch_within_the_parity_policy(gpu):
    from transduce.runtime.backends.tensorrt_backend import TensorRTBackend
    from transduce.verify.parity import run_parity

    report = run_parity(TorchBackend(gpu["model"], device="cuda"), TensorRTBackend(gpu["engines"]["fp16"]),
                        gpu["tokenizer"], gpu["sources"], precision="fp16", beam_size=4)
    assert report.passed, report.to_dict()
    greedy = next(s for s in report.sequences if s.mode == "greedy")
    assert greedy.agreement >= 0.99


@pytest.mark.gpu
def test_gpu_engine_refused_on_other_runtime(gpu):
    from transduce.runtime.backends.tensorrt_backend import TensorRTBackend

    with pytest.raises(ArtifactError, match="rebuild the engines with: transduce build"):
        TensorRTBackend(gpu["engines"]["fp32"], _runtime=RuntimeInfo("0.0.0", "NVIDIA Nothing", "1.0"))



FEATURES = [dict(beam_size=1, sampling_topk=0, sampling_temperature=1.3, seed=2),
            dict(beam_size=3, nbest=2, sampling_topk=10, seed=1),
            dict(beam_size=2, no_repeat_ngram_size=2, repetition_penalty=1.4, suppress=((5,), (6, 7)))]


@pytest.mark.parametrize("given", FEATURES, ids=["sampling", "beam-sampling", "repetition"])
def test_decoding_features_decode_like_the_torch_backend(wide, given, batch, reference, device):
    """Sampling, target prefixes and repetition control (which read full log-probs where rows are forced or
    adjusted) give on TensorRT what they give on torch."""
    backend = _backend(wide, device)
    src, lens = batch
    opts = DecodingOptions(max_len_a=0, max_len_b=20, **given)
    prefixes = [[], [9, 10], [], [11], [], [], [12, 13, 14]]
    _same(decode(backend, src, lens, opts, prefixes=prefixes), decode(reference, src, lens, opts, prefixes=prefixes))


@pytest.mark.parametrize("engines", ["wide", "narrow"])
def test_a_running_batch_admits_rows_as_the_torch_backend_does(request, engines, reference, device):
    """Sentences admitted at different steps beside others (their own positions, their sources in the pool,
    a wider source growing it, rows run in chunks on the narrow engines) decode as the torch backend decodes
    each alone; the pool reuses the slots of sentences that finished."""
    from transduce.runtime.decoding.running import RunningBatch

    backend = _backend(request.getfixturevalue(engines), device)
    cfg = backend.config
    rng = np.random.default_rng(7)
    arrivals = []  # (step, src, lens, options)
    for step, lengths, opts in [(0, [5, 7], OPTS[0]), (0, [4], OPTS[1]), (2, [6], OPTS[2]),
                                (3, [18, 3], OPTS[0]), (9, [9], OPTS[1]), (30, [20, 5], OPTS[2])]:
        src = np.full((len(lengths), max(lengths)), cfg.pad_id, np.int64)
        for i, n in enumerate(lengths):
            src[i, : n - 1] = rng.integers(4, cfg.vocab_size, n - 1)
            src[i, n - 1] = cfg.eos_id
        arrivals.append((step, src, np.array(lengths, np.int64), opts))
    batch = RunningBatch(backend, capacity=40)
    pending, cohorts, got, widths = list(arrivals), [], {}, set()
    while pending or batch.cohorts:
        while pending and pending[0][0] <= batch.steps:
            _, src, lens, opts = pending.pop(0)
            assert batch.can_admit(src)
            cohorts.append(batch.admit(src, lens, opts))
        if not batch.cohorts:
            batch.steps = pending[0][0]
            continue
        widths.add(batch.state.enc.src_len)
        for c, s, res in batch.step():
            got[(c, s)] = res
    assert min(widths) == 7 and max(widths) >= 20  # the pool widened for the 18- and 20-token sources
    for cohort, (_, src, lens, opts) in zip(cohorts, arrivals, strict=True):
        for s in range(len(lens)):
            _same([got[(cohort, s)]], decode(reference, src[s: s + 1, : lens[s]], lens[s: s + 1], opts))


def test_sources_no_profile_takes_beside_the_cache_wait_for_an_empty_batch(wide, reference, device):
    """Where no step profile takes the widened source length beside the run's cache, the running batch does not
    admit (can_admit says so, admit refuses before anything changed) until it is empty. (Profiles of that shape
    are hand-made: `transduce build` gives every profile the same source lengths.)"""
    import dataclasses

    from transduce.formats.profiles import AxisRange
    from transduce.runtime.decoding.running import CapacityError, RunningBatch

    backend = _backend(wide, device)
    plan = backend.plan
    short_cache, long_cache = plan.decoder_step[0], plan.decoder_step[-1]
    backend.plan = dataclasses.replace(plan, decoder_step=[  # long sources only beside short caches
        dataclasses.replace(short_cache, src_len=AxisRange(1, 8, 24), cache_len=AxisRange(1, 8, 16)),
        dataclasses.replace(long_cache, batch=AxisRange(1, 4, 32), src_len=AxisRange(1, 8, 8),
                            cache_len=AxisRange(1, 16, 40))])
    cfg = backend.config
    batch = RunningBatch(backend, capacity=40)
    first = batch.admit(np.array([[5, 6, 7, cfg.eos_id]]), np.array([4]), OPTS[0])
    wide_src = np.array([[5] * 11 + [cfg.eos_id]])
    assert batch.can_admit(np.array([[5, 6, cfg.eos_id]])) and not batch.can_admit(wide_src)
    with pytest.raises(CapacityError, match="sources of 12 tokens do not fit the tensorrt backend's running batch"):
        batch.admit(wide_src, np.array([12]), OPTS[0])
    assert batch.cohorts == [first]
    backend.plan = plan  # the engines' own profiles (the test double runs those) to decode
    out = batch.run_until_empty()
    _same([out[first][0][1]], decode(reference, np.array([[5, 6, 7, cfg.eos_id]]), np.array([4]), OPTS[0]))
    assert batch.can_admit(wide_src)
