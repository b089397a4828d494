"""A batch of sources of different lengths encoded in runs of similar lengths (ort_cpu_policy.encoder_runs):
which runs, and that the backend's outputs and decoding are exactly those of one run."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import sources_of_lengths
from transduce.runtime.api import make_backend
from transduce.runtime.backends import ort_cpu_policy as policy
from transduce.runtime.decoding import DecodingOptions, decode


def test_no_runs_where_the_padding_saved_is_less_than_a_run():
    least = policy.ENCODER_RUN_TOKENS
    assert policy.encoder_runs(np.array([7])) is None
    assert policy.encoder_runs(np.array([9, 9, 9, 9])) is None
    assert policy.encoder_runs(np.array([10, 12, 11, 10])) is None  # a cut saves at most 3 x 2 tokens
    assert policy.encoder_runs(np.array([3, 3 + least])) is None  # saves exactly a run's worth: not cut
    assert policy.encoder_runs(np.array([3, 4 + least])) is not None


def test_runs_hold_every_row_once_shortest_first_and_each_cut_pays():
    lengths = np.array([40, 3, 41, 4, 3, 40, 20, 3])
    runs = policy.encoder_runs(lengths)
    assert [sorted(r.tolist()) for r in runs] == [[1, 3, 4, 7], [6], [0, 2, 5]]
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(2, 120, rng.integers(2, 65))
        runs = policy.encoder_runs(lengths)
        if runs is None:
            continue
        rows = np.concatenate(runs)
        assert sorted(rows.tolist()) == list(range(len(lengths)))
        tops = [lengths[r].max() for r in runs]
        assert tops == sorted(tops) and all(lengths[a].max() <= lengths[b].min() for a, b in zip(runs, runs[1:]))
        padded = sum(len(r) * lengths[r].max() for r in runs)
        assert len(lengths) * lengths.max() - padded > policy.ENCODER_RUN_TOKENS * (len(runs) - 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_encoded_in_runs_is_exactly_one_runs_and_decodes_alike(tiny_artifact_dir, monkeypatch, threads):
    be = make_backend(tiny_artifact_dir, "onnxruntime", threads=threads)
    src, lens = sources_of_lengths(be.config, [3, 40, 4, 38, 3, 21, 40, 5], np.random.default_rng(0))
    calls = []
    real = be._encode_cpu
    monkeypatch.setattr(be, "_encode_cpu", lambda feeds: (calls.append(feeds["src_ids"].shape), real(feeds))[1])
    split = be.encode(src, lens)  # zeros past each run's width
    runs = policy.encoder_runs(lens)
    assert len(calls) == 3 and sorted(w for _, w in calls) == [5, 21, 40]
    monkeypatch.setattr(policy, "ENCODER_RUN_TOKENS", float("inf"))
    calls.clear()
    whole = be.encode(src, lens)
    assert calls == [src.shape]
    assert split.keys() == whole.keys()
    for name in whole:
        if name == "src_lengths":
            np.testing.assert_array_equal(split[name], whole[name])
            continue
        axis = be._src_axis[name]
        assert split[name].shape == whole[name].shape
        for i, m in enumerate(lens):
            real_part = np.take(whole[name][i], np.arange(m), axis=axis - 1)
            np.testing.assert_array_equal(np.take(split[name][i], np.arange(m), axis=axis - 1), real_part)
            run_width = lens[next(r for r in runs if i in r)].max()
            assert not np.take(split[name][i], np.arange(run_width, src.shape[1]), axis=axis - 1).any()
    for options in (DecodingOptions(beam_size=1, max_len_b=10), DecodingOptions(beam_size=3, max_len_b=10)):
        one = decode(be, src, lens, options)
        monkeypatch.setattr(policy, "ENCODER_RUN_TOKENS", 16)
        runs = decode(be, src, lens, options)
        monkeypatch.setattr(policy, "ENCODER_RUN_TOKENS", float("inf"))
        for a, b in zip(one, runs, strict=True):
            assert [h.tokens for h in a.hypotheses] == [h.tokens for h in b.hypotheses]
            assert [h.score for h in a.hypotheses] == [h.score for h in b.hypotheses]


def test_a_quantized_artifact_encodes_in_one_run(tiny_int8_artifact, monkeypatch):
    """int8 graphs scale their activations per run: a sentence would encode otherwise in another run."""
    be = make_backend(tiny_int8_artifact[0], "onnxruntime", threads=1)
    src, lens = sources_of_lengths(be.config, [3, 40, 4, 38], np.random.default_rng(1))
    calls = []
    real = be._encode_cpu
    monkeypatch.setattr(be, "_encode_cpu", lambda feeds: (calls.append(feeds["src_ids"].shape), real(feeds))[1])
    be.encode(src, lens)
    assert policy.encoder_runs(lens) is not None and calls == [src.shape]
