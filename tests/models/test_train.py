"""Training: schedule, loss, batching, exact resume, and that the demo task is learned."""

from __future__ import annotations

import json
import os

import pytest
import torch

from transduce.errors import DataError
from transduce.models.data import Example, make_batches, read_parallel
from transduce.models.train import TrainConfig, label_smoothed_loss, learning_rate, train


def test_learning_rate_schedule():
    d, w = 512, 4000
    assert learning_rate(1, d, w) == pytest.approx(d**-0.5 * w**-1.5)
    assert learning_rate(w, d, w) == pytest.approx(d**-0.5 * w**-0.5)  # the peak
    assert learning_rate(4 * w, d, w) == pytest.approx(d**-0.5 * (4 * w) ** -0.5)
    assert learning_rate(w // 2, d, w, scale=2.0) == pytest.approx(2 * d**-0.5 * (w // 2) * w**-1.5)


def test_label_smoothing_ignores_padding():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 10)
    target = torch.tensor([[5, 6, 0], [7, 0, 0]])
    plain, nll = label_smoothed_loss(logits, target, 0.0, pad_id=0)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), target.reshape(-1), ignore_index=0)
    torch.testing.assert_close(plain, ref)
    torch.testing.assert_close(nll, ref)
    smoothed, _ = label_smoothed_loss(logits, target, 0.1, pad_id=0)
    lp = torch.log_softmax(logits, -1)
    mask = target != 0
    uniform = -(lp.sum(-1) - lp[..., 0]) / 9
    manual = (0.9 * -lp.gather(-1, target[..., None])[..., 0] + 0.1 * uniform)[mask].mean()
    torch.testing.assert_close(smoothed, manual)
    logits2 = logits.clone()
    logits2[0, 2] += 100  # a padded position
    torch.testing.assert_close(label_smoothed_loss(logits2, target, 0.1, 0)[0], smoothed)


def test_token_batches_respect_budget():
    ex = [Example(tuple(range(n % 17 + 1)), tuple(range(n % 13 + 1))) for n in range(200)]
    batches = make_batches(ex, 64)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        longest = max(max(len(ex[i].src), len(ex[i].tgt) + 1) for i in b)
        assert longest * len(b) <= 64 or len(b) == 1


def test_corpus_errors(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("one\tun\ntwo deux\n")
    with pytest.raises(DataError, match="bad.tsv:2"):
        read_parallel(bad)
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.txt").write_text("un\n")
    with pytest.raises(DataError, match="not aligned"):
        read_parallel(tmp_path / "a.txt", tmp_path / "b.txt")
    with pytest.raises(DataError, match="does not exist"):
        read_parallel(tmp_path / "missing.tsv")


def _cfg(steps, save_every):
    from tests.conftest import TINY

    return TrainConfig(preset="tiny", model_overrides=dict(TINY), vocab_size=120, max_steps=steps, warmup=4,
                       max_tokens=200, eval_every=1000, save_every=save_every, eval_sentences=5, seed=3, threads=1)


def test_resume_continues_as_if_uninterrupted(tmp_path, small_corpus):
    train_pairs, valid_pairs = small_corpus
    quiet = dict(progress=False, log=lambda *a: None)
    straight = tmp_path / "straight"
    train(train_pairs[:300], valid_pairs[:5], str(straight), _cfg(6, 6), **quiet)
    resumed = tmp_path / "resumed"
    train(train_pairs[:300], valid_pairs[:5], str(resumed), _cfg(3, 3), **quiet)
    state = json.loads((resumed / "training" / "state.json").read_text())
    assert state["step"] == 3
    train(train_pairs[:300], valid_pairs[:5], str(resumed), _cfg(6, 6), resume=True, **quiet)
    a = json.loads((straight / "training" / "state.json").read_text())
    b = json.loads((resumed / "training" / "state.json").read_text())
    assert (a["step"], a["epoch"], a["batch"], a["tokens"]) == (b["step"], b["epoch"], b["batch"], b["tokens"])
    assert a["history"][-1]["lr"] == b["history"][-1]["lr"]
    from safetensors.torch import load_file

    wa, wb = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0, msg=k)


def test_demo_task_is_learned(demo_model_dir):
    """The tiny model, 200 steps on the demo task, translates held-out numbers (measured: see README)."""
    cfg = json.loads(open(os.path.join(demo_model_dir, "config.json")).read())
    metrics = cfg["training"]
    assert metrics["step"] == 200
    assert metrics["exact_match"] >= 0.30, metrics  # measured: 0.71 on 100 held-out numbers
    assert metrics["bleu"] >= 40.0, metrics  # measured: 60.1
