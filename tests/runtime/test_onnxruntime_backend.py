"""The ONNX Runtime backend's own machinery: in-place reorders, the TopK session, the two step sessions."""

from __future__ import annotations

import numpy as np
import pytest

from transduce.runtime.api import make_backend
from transduce.runtime.backends import onnxruntime_backend as orb
from transduce.runtime.backends.base import banned_ids, numpy_topk
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode, teacher_forced_log_probs


def _src(cfg, n, seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, 9, n)
    src = np.full((n, 8), cfg["pad_id"], dtype=np.int64)
    for i, m in enumerate(lens):
        src[i, : m - 1] = rng.integers(4, cfg["vocab_size"], m - 1)
        src[i, m - 1] = cfg["eos_id"]
    return src, lens


def test_in_place_reorders_with_cycles_duplicates_and_growth(tiny_artifact_dir, tiny_model):
    """Rows that stay, a swap (a cycle: each side is overwritten and read), duplicates, growth, then a
    second reorder that drops rows: every row continues the history of the row it was taken from."""
    be = make_backend(tiny_artifact_dir, "onnxruntime")
    ref = TorchBackend(tiny_model)
    cfg = be.config
    src, lens = _src(cfg, 5, seed=1)
    prefix = np.random.default_rng(2).integers(4, cfg["vocab_size"], (5, 6))
    prefix[:, 0] = cfg["bos_id"]
    state = be.begin(be.encode(src, lens), np.arange(5), 8)
    for t in range(3):
        be.step_log_probs(state, prefix[:, t])
    first = np.array([0, 2, 1, 3, 3, 4, 1])  # 0 and 3 stay, 1 <-> 2 swap, 3 duplicated, 7 rows > 5
    be.reorder(state, first, first)
    be.step_log_probs(state, prefix[first, 3])
    second = np.array([6, 0, 4])  # drop rows, move the last one first
    be.reorder(state, second, first[second])
    got = be.step_log_probs(state, prefix[first[second], 4])
    origin = first[second]
    want = teacher_forced_log_probs(ref, src[origin], lens[origin], prefix[origin, :5])[:, 4]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("ban_eos", [False, True])
def test_ort_topk_equals_numpy_topk(tiny_artifact_dir, ban_eos):
    be = make_backend(tiny_artifact_dir, "onnxruntime")
    cfg = be.config
    rng = np.random.default_rng(0)
    buf = np.log(rng.dirichlet(np.ones(cfg["vocab_size"]), 12)).astype(np.float32)
    topk = orb._OrtTopK(be.ort, cfg)
    for rows, k in [(12, 8), (3, 8), (12, 2)]:
        vals, ids = topk(buf, rows, k, ban_eos)
        want_vals, want_ids = numpy_topk(buf[:rows], k, banned_ids(cfg, ban_eos))
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(vals, want_vals)
        assert not set(ids.ravel().tolist()) & set(banned_ids(cfg, ban_eos))


def test_wide_step_session_for_large_row_counts(tiny_artifact_dir, tiny_model, monkeypatch):
    """A small model gets a one-thread step session and a second one with the whole budget for large
    row counts; decoding that crosses between them gives the eager model's results."""
    be = make_backend(tiny_artifact_dir, "onnxruntime", threads=2)
    assert be.threads == 1 and be.decoder_wide is not be.decoder
    monkeypatch.setattr(orb, "WIDE_STEP_MFLOP", 6 * be._mflop_per_row)  # wide from 6 rows
    assert be.wide_rows_threshold() == 6
    assert be._session_for(5) is be.decoder and be._session_for(6) is be.decoder_wide
    ref = TorchBackend(tiny_model)
    src, lens = _src(be.config, 4, seed=3)  # beam 4: 4 rows at step 0, then 16
    opts = DecodingOptions(beam_size=4, nbest=2, max_len_b=10)
    got, want = decode(be, src, lens, opts), decode(ref, src, lens, opts)
    for g, w in zip(got, want):
        assert [h.tokens for h in g.hypotheses] == [h.tokens for h in w.hypotheses]


def test_one_thread_budget_has_one_step_session(tiny_artifact_dir):
    be = make_backend(tiny_artifact_dir, "onnxruntime", threads=1)
    assert be.threads == 1 and be.decoder_wide is be.decoder
