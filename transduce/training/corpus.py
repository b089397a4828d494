"""The corpus of `transduce train`: read whole into memory (every rank reads its own copy), or indexed for streaming
(train_cfg.stream: rank 0 reads it once to index it, and every rank then reads one window at a time); the held-out
pairs split off its end unless given."""

from __future__ import annotations

import os
import warnings

from transduce.errors import ConfigError, DataError, TransduceWarning
from transduce.training.checks import held_out_overlap, warn_overlap
from transduce.training.config import TrainConfig
from transduce.training.distributed import World

# a corpus this big held in memory once per rank, its text and its token ids, is worth streaming instead
LARGE_CORPUS_BYTES = 1 << 30


def read_corpus(world: World, train_cfg: TrainConfig, data, source, target, valid, valid_size: int):
    """-> (the training pairs, or a stream.StreamedCorpus; the held-out pairs, rank 0's: [] on the others).
    Rank 0 reads first and the others only once it has (its error is theirs: one message)."""
    if train_cfg.stream:
        if not (data or source):
            raise ConfigError("stream=True reads a corpus from disk: give data, or source and target (the embedded "
                              "corpus is made in memory)", params=("stream=True", "data", "source", "target"))
        return world.from_rank0(lambda: _indexed(train_cfg, data, source, target, valid, valid_size),
                                share=lambda read: (read[0], []))
    read = world.from_rank0(lambda: _in_memory(data, source, target, valid, valid_size, warn=True),
                            share=lambda _: None)
    if world.rank:
        pairs, _ = _in_memory(data, source, target, valid, valid_size, warn=False)
        return pairs, []
    return read


def _held_out_split(pairs: int, valid_size: int) -> int:
    """How many of a corpus's `pairs` are trained on when its last `valid_size` are held out."""
    if valid_size < 1:
        raise ConfigError(f"--valid-size must be >= 1, got {valid_size}", hint="or pass --valid FILE")
    if pairs <= valid_size:
        raise DataError(f"the corpus has {pairs} pairs, too few to hold out {valid_size}",
                        hint="pass --valid FILE or a smaller --valid-size")
    return pairs - valid_size


def _in_memory(data, source, target, valid, valid_size: int, warn: bool) -> tuple[list, list]:
    """The training and held-out pairs; with `warn`, the held-out ones that are also training pairs are counted in a
    warning, and a corpus big enough to stream in another."""
    from transduce.io.parallel import read_parallel
    from transduce.models.corpus import demo_corpus

    if data or source:
        if warn:
            _warn_large(data or source, target if source else None)
        pairs = read_parallel(data) if data else read_parallel(source, target)
        if valid:
            valid_pairs = read_parallel(valid)
        else:
            n = _held_out_split(len(pairs), valid_size)
            pairs, valid_pairs = pairs[:n], pairs[n:]
    else:
        pairs, valid_pairs = demo_corpus()
        if valid:
            valid_pairs = read_parallel(valid)
    if warn:
        warn_overlap(held_out_overlap(pairs, valid_pairs), len(valid_pairs))
    return pairs, valid_pairs


def _warn_large(*paths: str | None) -> None:
    try:
        size = sum(os.path.getsize(p) for p in paths if p)
    except OSError:  # reading it says what is wrong
        return
    if size > LARGE_CORPUS_BYTES:
        warnings.warn(TransduceWarning(
            f"the corpus is {size / 1e9:.1f} GB, read whole into memory by every process: stream=True reads it "
            "from disk a window at a time", params=("stream=True",)), stacklevel=5)


def _indexed(train_cfg: TrainConfig, data, source, target, valid, valid_size: int):
    """The corpus indexed for streaming (io.parallel.index_parallel), and its held-out pairs."""
    from transduce.io.parallel import index_parallel, read_pairs, read_parallel
    from transduce.training.stream import StreamedCorpus

    index = index_parallel(data or source, None if data else target, train_cfg.stream_window)
    if valid:
        return StreamedCorpus(index, index.pairs), read_parallel(valid)
    n = _held_out_split(index.pairs, valid_size)
    return StreamedCorpus(index, n), read_pairs(index, n, index.pairs - n)
