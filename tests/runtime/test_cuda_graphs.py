"""CUDA graphs: the shared bookkeeping (cuda_graphs.py) and the eager backend under graphs (torch_graph_backend.py).

On the CPU the capture is the double of tests/cuda_graph_fake.py, which records what a capture would and
replays it on the same buffers: buckets, static slabs, when a graph is captured, replayed or dropped, and
what is decoded run for real (the running batch's admissions: tests/runtime/test_running.py, the
conformance suite: tests/runtime/test_backends.py, both over this backend too). On a GPU (`pytest -m gpu`)
the same backend captures real CUDA graphs and is held to the CPU's eager model (fp32 identical; fp16 and
bf16 by the parity policy).
"""

from __future__ import annotations

import contextlib
import gc
import types

import numpy as np
import pytest
import torch
from cuda_graph_fake import HostCapturer

from transduce.errors import BackendUnavailable, InputError
from transduce.runtime.api import make_backend
from transduce.runtime.backends.cuda_graphs import CudaCapturer, GraphSet, GraphStats, length_bucket, row_bucket
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.backends.torch_graph_backend import MAX_FREE_SLABS, TorchGraphBackend
from transduce.runtime.decoding import DecodingOptions, decode, teacher_forced_log_probs
from transduce.runtime.spec import BackendSpec


def _batch(cfg, n=5, seed=0, longest=9):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, longest + 1, n)
    lens[0] = longest
    src = np.zeros((n, longest), dtype=np.int64)
    for i, m in enumerate(lens):
        src[i, : m - 1] = rng.integers(4, cfg.vocab_size, m - 1)
        src[i, m - 1] = cfg.eos_id
    return src, lens


def _same(got, want, atol=1e-4):
    for g, w in zip(got, want, strict=True):
        assert [h.tokens for h in g.hypotheses] == [h.tokens for h in w.hypotheses]
        np.testing.assert_allclose([h.score for h in g.hypotheses], [h.score for h in w.hypotheses], atol=atol)


# -- buckets and GraphSet ------------------------------------------------------------------------
def test_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 64, 65, 129)] == [1, 2, 4, 8, 8, 16, 64, 64, 128, 192]
    assert [length_bucket(n, 16, 64) for n in (1, 16, 17, 63, 64, 70)] == [16, 16, 32, 64, 64, 70]
    with pytest.raises(ValueError):
        row_bucket(0)


def test_a_key_runs_normally_once_then_is_captured_and_replayed():
    capturer, stats, ran = HostCapturer(), GraphStats(), []
    graphs = GraphSet(capturer, stats, "step")
    for key in ["a", "a", "a", "b", "b", "a"]:
        graphs.run(key, lambda key=key: ran.append(key))
    # a: normal, captured (the double's dry run) + replayed, replayed; b: normal, captured + replayed; a: replayed
    assert ran == ["a", "a", "a", "a", "b", "b", "b", "a"]
    assert capturer.log == ["capture", "replay", "replay", "capture", "replay", "replay"]
    assert (stats.captures, stats.replays) == (2, 4)


def test_warm_keys_one_means_another_run_undoes_the_warm_up():
    """A TensorRT context's shapes: after a run with other shapes, a key needs a normal run again."""
    capturer, stats = HostCapturer(), GraphStats()
    graphs = GraphSet(capturer, stats, "step", warm_keys=1)
    for key in ["a", "b", "a", "b"]:
        graphs.run(key, lambda: None)
    assert stats.captures == 0
    many = GraphSet(capturer, stats, "step", warm_keys=4)
    for key in ["a", "b", "a", "b"]:
        many.run(key, lambda: None)
    assert stats.captures == 2


def test_an_uncapturable_run_runs_normally_and_graphs_are_bounded():
    capturer, stats, ran = HostCapturer(), GraphStats(), []
    graphs = GraphSet(capturer, stats, "step", max_graphs=2)
    graphs.run("a", lambda: ran.append("a"))
    graphs.run("x", lambda: ran.append("x"), capturable=False)  # staged through scratch memory, say
    graphs.run("a", lambda: ran.append("a"))  # no longer warm: normal again
    assert stats.captures == 0 and ran == ["a", "x", "a"]
    for key in ["a", "b", "b", "c", "c"]:
        graphs.run(key, lambda: None)
    assert stats.captures == 3 and len(graphs) == 2  # a was captured first and dropped for c


def test_a_failed_capture_turns_graphs_off_and_the_run_goes_on():
    capturer, stats, ran = HostCapturer(fail=RuntimeError("operation not permitted when stream is capturing")), \
        GraphStats(), []
    graphs = GraphSet(capturer, stats, "decoder step")
    graphs.run("a", lambda: ran.append(1))
    with pytest.warns(UserWarning, match="decoder step could not be captured.*operation not permitted"):
        graphs.run("a", lambda: ran.append(2))
    graphs.run("a", lambda: ran.append(3))
    assert ran == [1, 2, 3] and not stats.enabled and "RuntimeError" in stats.error
    assert stats.to_dict()["cuda_graph"] is False


def test_cuda_capture_keeps_the_allocator_cache_and_ends_a_failed_capture():
    """The capture is made on the backend's stream in thread_local mode, into its pool, without
    torch.cuda.graph's device-wide synchronize and empty_cache; it is ended even when the work raises (a
    capture left open would poison the stream), and the work's error is the one raised. A capture_end that
    raises (an invalidated capture) also tells the allocator the capture is over."""
    calls = []
    stream = types.SimpleNamespace(synchronize=lambda: calls.append("stream.synchronize"),
                                   device=types.SimpleNamespace(index=3))

    def on_stream(s):
        assert s is stream
        return contextlib.nullcontext()

    class Graph:
        end_fails = False

        def capture_begin(self, pool=None, capture_error_mode="global"):
            calls.append(f"begin {pool} {capture_error_mode}")

        def capture_end(self):
            calls.append("end")
            if Graph.end_fails:
                raise RuntimeError("operation failed due to a previous error during capture")

    cuda = types.SimpleNamespace(stream=on_stream, CUDAGraph=Graph, empty_cache=lambda: calls.append("empty_cache"),
                                 synchronize=lambda: calls.append("device synchronize"))
    c = types.SimpleNamespace(_cuda_endAllocateToPool=lambda device, pool: calls.append(f"end allocating {device} "
                                                                                        f"{pool}"))
    class Tick:
        def add_(self, n):
            calls.append("keeper")

    def zeros(n, device):
        assert device is stream.device
        return Tick()

    capturer = CudaCapturer(types.SimpleNamespace(cuda=cuda, _C=c, zeros=zeros), stream, pool="pool")
    assert isinstance(capturer.capture(lambda: calls.append("work")), Graph)
    # first a one-op graph into the pool, held for the capturer's life: torch asserts in the next capture into a
    # pool all of whose graphs were dropped
    keeper = ["stream.synchronize", "begin pool thread_local", "keeper", "end"]
    assert calls == keeper + ["stream.synchronize", "begin pool thread_local", "work", "end"]
    assert isinstance(capturer._keeper[0], Graph)
    calls.clear()
    capturer.capture(lambda: calls.append("work"))
    assert calls == ["stream.synchronize", "begin pool thread_local", "work", "end"]  # one keeper per capturer
    calls.clear()

    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        capturer.capture(boom)
    assert calls[-1] == "end" and "empty_cache" not in calls and "device synchronize" not in calls
    Graph.end_fails = True
    with pytest.raises(RuntimeError, match="boom"):  # the first cause, not capture_end's
        capturer.capture(boom)
    assert calls[-2:] == ["end", "end allocating 3 pool"]
    with pytest.raises(RuntimeError, match="previous error during capture"):
        capturer.capture(lambda: None)


# -- the eager backend under graphs, on the CPU --------------------------------------------------
@pytest.fixture()
def graphed(tiny_model):
    return TorchGraphBackend(tiny_model, "cpu", _capturer=HostCapturer())


def test_decoding_replays_the_same_graphs_across_batches(graphed, tiny_model):
    """Greedy and beam 4 decode as eager does; batches of other sizes in the same buckets capture nothing new."""
    reference = TorchBackend(tiny_model)
    for beam in (1, 4):
        opts = DecodingOptions(beam_size=beam, nbest=min(beam, 2), max_len_b=12)
        for seed, n in ((0, 5), (1, 7), (2, 6)):  # 5, 7 and 6 sentences: the same row buckets
            src, lens = _batch(graphed.config, n, seed)
            _same(decode(graphed, src, lens, opts), decode(reference, src, lens, opts))
            if seed == 1:
                settled = graphed.stats.captures
        assert graphed.stats.captures == settled, "a batch in known buckets captured again"
    t = graphed.tuning()
    assert t["cuda_graph"] and t["graph_replays"] > 5 * t["graph_captures"] > 0
    assert t["idle_step_slabs"] == t["step_slabs"] <= MAX_FREE_SLABS  # every run handed its slab back


@pytest.mark.parametrize("given", [dict(beam_size=1, sampling_topk=0, sampling_temperature=1.3, seed=2),
                                   dict(beam_size=3, nbest=2, sampling_topk=10, seed=1),
                                   dict(beam_size=2, no_repeat_ngram_size=2, repetition_penalty=1.4,
                                        suppress=((5,), (6, 7)))], ids=["sampling", "beam-sampling", "repetition"])
def test_decoding_features_under_graphs_decode_as_eager(graphed, tiny_model, given):
    """Sampling, target prefixes and repetition control (full log-probs on the steps that force or adjust, the
    graphs' top-k on the others) decode as the eager backend does."""
    src, lens = _batch(graphed.config, 5, 4)
    opts = DecodingOptions(max_len_b=12, **given)
    prefixes = [[], [9, 10], [], [11], []]
    _same(decode(graphed, src, lens, opts, prefixes=prefixes),
          decode(TorchBackend(tiny_model), src, lens, opts, prefixes=prefixes))


def test_a_step_writes_in_place_and_rows_shrinking_within_a_bucket_stay(graphed):
    src, lens = _batch(graphed.config, 16, 3)
    state = graphed.begin(graphed.encode(src, lens), np.arange(16), 10)
    slab, cache = state.slab, state.slab.cache.data_ptr()
    for t in range(3):
        graphed.step(state, np.full(16, graphed.config.bos_id if t == 0 else 5), 2)
    rows = np.array([15, 0, 3, 3, 1, 7])  # 6 rows: more than a quarter of bucket 16
    graphed.reorder(state, rows, rows)
    graphed.step(state, np.full(6, 6), 2)
    assert state.slab is slab and slab.cache.data_ptr() == cache
    graphed.reorder(state, np.array([1, 2]), np.array([0, 3]))  # a quarter or less: a slab of bucket 2
    assert state.slab is not slab and state.slab.key[0] == 2 and slab.owner is None
    graphed.end(state)
    assert state.slab is None


def test_reorder_and_admit_keep_each_rows_history(graphed, tiny_model):
    """Rows moved within a slab, moved to a bigger one, and admitted beside rows further on, each continue
    their own history: their log-probs are the eager model's over the same prefix."""
    cfg = graphed.config
    src, lens = _batch(cfg, 3, 4)
    prefix = np.random.default_rng(5).integers(4, cfg.vocab_size, (3, 6))
    prefix[:, 0] = cfg.bos_id
    state = graphed.begin(graphed.encode(src, lens), np.arange(3), 12)
    for t in range(3):
        graphed.step_log_probs(state, prefix[:, t])
    rows = np.array([2, 2, 0, 1, 1, 0, 2])  # 3 rows -> 7: a bigger slab, its filled slots copied
    graphed.reorder(state, rows, rows)
    got = graphed.step_log_probs(state, prefix[rows, 3])
    want = teacher_forced_log_probs(TorchBackend(tiny_model), src[rows], lens[rows], prefix[rows, :4])[:, 3]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    new_src, new_lens = _batch(cfg, 2, 6, longest=20)  # a wider source: another source bucket
    graphed.admit(state, graphed.encode(new_src, new_lens))
    assert state.rows == 9 and state.slab.key[2] == 32
    tokens = np.concatenate([prefix[rows, 4], [cfg.bos_id] * 2])
    got = graphed.step_log_probs(state, tokens)
    eager = TorchBackend(tiny_model)
    want_old = teacher_forced_log_probs(eager, src[rows], lens[rows], prefix[rows, :5])[:, 4]
    want_new = teacher_forced_log_probs(eager, new_src, new_lens, np.full((2, 1), cfg.bos_id))[:, 0]
    np.testing.assert_allclose(got, np.concatenate([want_old, want_new]), atol=1e-4, rtol=0)
    graphed.end(state)


def test_a_state_dropped_without_end_frees_its_slab(graphed):
    src, lens = _batch(graphed.config, 2, 7)
    state = graphed.begin(graphed.encode(src, lens), np.arange(2), 10)
    slab = state.slab
    del state
    gc.collect()
    again = graphed.begin(graphed.encode(src, lens), np.arange(2), 10)
    assert again.slab is slab


def test_a_failed_capture_decodes_on_without_graphs(tiny_model):
    graphed = TorchGraphBackend(tiny_model, "cpu", _capturer=HostCapturer(fail=RuntimeError("no capture")))
    src, lens = _batch(graphed.config, 3, 8)
    opts = DecodingOptions(beam_size=2, max_len_b=8)
    with pytest.warns(UserWarning, match="could not be captured"):
        got = decode(graphed, src, lens, opts)
    _same(got, decode(TorchBackend(tiny_model), src, lens, opts))
    assert graphed.tuning()["cuda_graph"] is False and graphed.stats.captures == 0


def test_the_cache_capacity_is_enforced(graphed):
    src, lens = _batch(graphed.config, 1, 9)
    state = graphed.begin(graphed.encode(src, lens), np.arange(1), 2)
    graphed.step(state, np.array([1]), 1)
    graphed.step(state, np.array([5]), 1)
    with pytest.raises(IndexError, match="cache capacity 2 exhausted at position 2"):
        graphed.step(state, np.array([5]), 1)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reduced_precision_is_held_to_its_parity_policy(tiny_model, precision):
    """fp16 and bf16 weights (softmax, LayerNorm and log-softmax in fp32) against the fp32 model: teacher-forced
    log-probs within the policy's tolerance; the caller's model keeps its fp32 weights."""
    from transduce.verify.tolerances import POLICIES, within

    graphed = TorchGraphBackend(tiny_model, "cpu", precision, _capturer=HostCapturer())
    assert next(tiny_model.parameters()).dtype == torch.float32 and graphed.tuning()["precision"] == precision
    cfg = graphed.config
    src, lens = _batch(cfg, 4, 9)
    tgt = np.random.default_rng(10).integers(4, cfg.vocab_size, (4, 6))
    tgt[:, 0] = cfg.bos_id
    got = teacher_forced_log_probs(graphed, src, lens, tgt)
    want = teacher_forced_log_probs(TorchBackend(tiny_model), src, lens, tgt)
    assert got.dtype == np.float32
    assert within(np.abs(got - want), want, POLICIES[precision].outputs["log_probs"]).all()


def test_graphs_need_cuda_and_options_go_where_they_mean_something(tiny_model, tiny_artifact_dir):
    with pytest.raises(BackendUnavailable, match="CUDA graphs need a CUDA device") as e:
        TorchGraphBackend(tiny_model, "cpu")
    assert "device cuda" in e.value.hint and e.value.spelled({"cuda_graph": "--cuda-graph"}).endswith(
        "run it on device cuda, or without --cuda-graph")
    with pytest.raises(BackendUnavailable, match="CUDA graphs need a CUDA device"):
        make_backend(tiny_artifact_dir, "torch", "cpu", cuda_graph=True)
    with pytest.raises(BackendUnavailable, match="no precision 'fp8'"):
        TorchBackend(tiny_model, precision="fp8")
    assert BackendSpec("torch", cuda_graph=True, precision="fp16").name == "torch-graph-fp16"
    assert BackendSpec("tensorrt", cuda_graph=True).cuda_graph
    with pytest.raises(InputError, match="cuda_graph: the onnxruntime backend does not capture") as e:
        BackendSpec("onnxruntime", cuda_graph=True)
    assert e.value.spelled({"cuda_graph": "--cuda-graph"}).startswith("--cuda-graph: the onnxruntime backend")
    with pytest.raises(InputError, match="precision fp16: the onnxruntime backend runs the precision"):
        BackendSpec("onnxruntime", precision="fp16")
    eager = make_backend(tiny_artifact_dir, "torch", precision="bf16")
    assert type(eager) is TorchBackend and eager.tuning() == {"precision": "bf16", "cuda_graph": False}


# -- on a GPU ------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU available to PyTorch")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("beam", [1, 4])
def test_gpu_graphs_decode_as_the_cpu_model(tiny_model, beam):
    """Real CUDA graphs (fp32): the CPU's tokens, scores within 1e-4; the graphs are captured and replayed,
    and batches in known buckets capture nothing new."""
    import copy

    graphed = TorchGraphBackend(copy.deepcopy(tiny_model), "cuda")
    reference = TorchBackend(tiny_model)
    opts = DecodingOptions(beam_size=beam, nbest=min(beam, 2), max_len_b=12)
    for seed, n in ((0, 5), (1, 7), (2, 6)):
        src, lens = _batch(graphed.config, n, seed)
        _same(decode(graphed, src, lens, opts), decode(reference, src, lens, opts))
        if seed == 1:
            settled = graphed.stats.captures
    t = graphed.tuning()
    assert t["graph_error"] is None and t["graph_replays"] > t["graph_captures"] > 0 and t["graph_captures"] == settled


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gpu_reduced_precision_passes_parity_on_the_demo_model(demo_artifact_dir, precision):
    from transduce.verify.parity import parity_for_artifact

    spec = BackendSpec("torch", device="cuda", precision=precision, cuda_graph=True)
    report = parity_for_artifact(demo_artifact_dir, spec, sentences=40, beam_size=4)
    assert report.passed, report.to_dict()


def test_the_capture_double_refuses_what_a_graph_cannot_hold():
    """An op that needs its data on the host fails the (double's) capture, so it fails in CI, not on a GPU."""
    capturer = HostCapturer()
    flags = torch.tensor([1, 0, 1])
    with pytest.raises(Exception, match="nonzero|dynamic"):
        capturer.capture(lambda: flags.nonzero())
    with pytest.raises(Exception, match="item|local_scalar|[Dd]ata.dependent"):
        capturer.capture(lambda: flags.sum().item())
    out = torch.zeros(3)
    capturer.capture(lambda: out.copy_(flags * 2.0))  # recorded, not run
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_idle_slabs_are_bounded_in_memory(graphed, monkeypatch):
    from transduce.runtime.backends import torch_graph_backend

    opts = DecodingOptions(beam_size=2, max_len_b=6)
    for n in (1, 3, 9):  # three row buckets
        decode(graphed, *_batch(graphed.config, n, n), opts)
    before = graphed.tuning()["idle_step_slabs"]
    assert before >= 3
    monkeypatch.setattr(torch_graph_backend, "MAX_FREE_BYTES", 1)
    decode(graphed, *_batch(graphed.config, 17, 4), opts)  # each slab taken drops every idle one
    assert graphed.tuning()["idle_step_slabs"] == 0 < before  # each handed back is dropped at once


def test_a_shorter_batch_reuses_a_wider_idle_slab_and_its_graphs(graphed, tiny_model):
    """Capacity and source width up to twice a run's are taken as they are (the extra slots are masked)."""
    opts = DecodingOptions(beam_size=1, max_len_b=10)
    reference = TorchBackend(tiny_model)
    wide = _batch(graphed.config, 3, 11, longest=20)  # source bucket 32, capacity bucket 32
    for _ in range(2):
        decode(graphed, *wide, opts)
    slabs, captures = graphed.tuning()["step_slabs"], graphed.stats.captures
    short = _batch(graphed.config, 3, 12, longest=12)  # source bucket 16: the idle 32-wide slab serves it
    _same(decode(graphed, *short, opts), decode(reference, *short, opts))
    assert graphed.tuning()["step_slabs"] == slabs
    assert graphed.stats.captures == captures  # the step replayed; the encoder's new bucket ran its first, normal run


@pytest.mark.gpu
@needs_cuda
def test_gpu_graphs_capture_again_after_every_graph_was_dropped(tiny_model, monkeypatch):
    """The backend's memory pool outlives its graphs: with every idle slab dropped at once, later batches
    still capture (a pool without an owner would be released, and the next capture into it fail)."""
    import copy

    from transduce.runtime.backends import torch_graph_backend

    monkeypatch.setattr(torch_graph_backend, "MAX_FREE_BYTES", 1)
    graphed = TorchGraphBackend(copy.deepcopy(tiny_model), "cuda")
    opts = DecodingOptions(beam_size=1, max_len_b=8)
    for seed in range(3):
        decode(graphed, *_batch(graphed.config, 3, seed), opts)
    t = graphed.tuning()
    assert t["graph_error"] is None and t["cuda_graph"] and t["graph_captures"] > 0
