"""A corpus streamed from disk (--stream): indexed once, read a window at a time with the checks and errors of a
corpus read whole, batched deterministically per (seed, epoch, window), and trained on with an exact resume."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from transduce.errors import DataError
from transduce.io.parallel import index_parallel, read_pairs, read_parallel, write_tsv
from transduce.training.config import TrainConfig
from transduce.training.stream import StreamBatches, StreamedCorpus

QUIET = dict(progress=False, log=lambda *a: None)


def test_an_indexed_corpus_reads_back_every_window(tmp_path):
    pairs = [(f"s{i} é", f"t{i}") for i in range(23)]
    tsv = tmp_path / "c.tsv"
    tsv.write_bytes(b"\xef\xbb\xbf" + "".join(f"{s}\t{t}\r\n" + ("\n" if i == 5 else "")
                                             for i, (s, t) in enumerate(pairs)).encode())
    index = index_parallel(tsv, window=5)
    assert index.pairs == 23 and len(index.starts) == 5
    assert read_parallel(tsv) == pairs
    assert [p for first in range(0, 23, 5) for p in read_pairs(index, first, 5)] == pairs
    assert read_pairs(index, 7, 4) == pairs[7:11] and read_pairs(index, 21, 10) == pairs[21:]
    src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
    src.write_text("".join(f"{s}\n" for s, _ in pairs))
    tgt.write_text("".join(f"{t}\n" for _, t in pairs))
    aligned = index_parallel(src, tgt, window=4)
    assert [p for first in range(0, 23, 4) for p in read_pairs(aligned, first, 4)] == pairs


def test_a_streamed_corpus_is_checked_as_one_read_whole(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tb\nc\n")
    with pytest.raises(DataError, match=r"bad.tsv:2: expected 'source<TAB>target'"):
        index_parallel(bad)
    src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
    src.write_text("a\nb\nc\n")
    tgt.write_text("x\ny\n")
    with pytest.raises(DataError, match="has 3 lines but .* has 2"):
        index_parallel(src, tgt)
    with pytest.raises(DataError, match="not from standard input"):
        index_parallel("-")


def test_streamed_batches_are_deterministic_and_resume_mid_epoch(tmp_path, small_corpus, tiny_tokenizer):
    train_pairs, _ = small_corpus
    write_tsv(tmp_path / "c.tsv", train_pairs[:120])
    corpus = StreamedCorpus(index_parallel(tmp_path / "c.tsv", window=50), 120)
    assert corpus.windows == 3
    a = StreamBatches(corpus, tiny_tokenizer, 64, 300, seed=1)
    b = StreamBatches(corpus, tiny_tokenizer, 64, 300, seed=1)
    first = list(a.epoch(0))
    assert first == list(b.epoch(0)) and first != list(a.epoch(1))
    seen = sorted(tuple(e.src) for _, _, batch in first for e in batch)
    assert len(seen) == 120  # every pair once an epoch
    w, k = first[len(first) // 2][:2]
    assert list(a.epoch(0, w, k)) == first[len(first) // 2:]
    for _, _, batch in first:
        assert max(max(len(e.src), len(e.tgt) + 1) for e in batch) * len(batch) <= 300 or len(batch) == 1


def test_training_on_a_streamed_corpus_resumes_as_if_uninterrupted(tmp_path, small_corpus):
    from safetensors.torch import load_file

    from transduce.training.train import train_from_files

    train_pairs, valid_pairs = small_corpus
    write_tsv(tmp_path / "c.tsv", train_pairs[:150] + valid_pairs[:10])
    cfg = TrainConfig(vocab_size=200, max_steps=8, warmup=4, max_tokens=800, eval_every=8, save_every=8,
                      eval_sentences=5, stream=True, stream_window=40, threads=1)
    args = dict(data=str(tmp_path / "c.tsv"), valid_size=10, **QUIET)
    summary = train_from_files(str(tmp_path / "straight"), cfg, **args)
    assert summary["step"] == 8
    train_from_files(str(tmp_path / "resumed"), replace(cfg, max_steps=5), **args)
    train_from_files(str(tmp_path / "resumed"), cfg, resume=True, **args)
    sa, sb = (json.loads((tmp_path / d / "training" / "state.json").read_text()) for d in ("straight", "resumed"))
    assert (sa["step"], sa["epoch"], sa["window"], sa["batch"]) == (sb["step"], sb["epoch"], sb["window"], sb["batch"])
    assert sa["epoch"] >= 1  # it crossed into a second epoch
    wa, wb = (load_file(tmp_path / d / "model.safetensors") for d in ("straight", "resumed"))
    assert all((wa[k] - wb[k]).abs().max() <= 1e-6 for k in wa)
    # the held-out pairs are the file's last 10, never trained on
    assert sa["history"][-1]["step"] == 8
    with pytest.raises(Exception, match="stream"):
        train_from_files(str(tmp_path / "x"), cfg, **QUIET)  # the embedded corpus is made in memory


def test_held_out_pairs_that_a_streamed_corpus_trains_on_are_reported(tmp_path, small_corpus):
    from transduce.training.train import train_from_files

    train_pairs, valid_pairs = small_corpus
    write_tsv(tmp_path / "c.tsv", train_pairs[:60])
    write_tsv(tmp_path / "v.tsv", train_pairs[:2] + valid_pairs[:3])
    cfg = TrainConfig(vocab_size=200, max_steps=1, warmup=4, max_tokens=800, eval_every=1, save_every=1,
                      eval_sentences=2, stream=True, stream_window=25, threads=1)
    args = dict(data=str(tmp_path / "c.tsv"), valid=str(tmp_path / "v.tsv"), **QUIET)
    for resume in (False, True):
        with pytest.warns(UserWarning, match="2 of the 5 held-out pairs are also training pairs"):
            train_from_files(str(tmp_path / "m"), replace(cfg, max_steps=1 + resume), resume=resume, **args)
