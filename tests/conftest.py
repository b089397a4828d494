"""Shared fixtures: a tiny seeded model (random weights) and a briefly trained demo model, built once per session."""

from __future__ import annotations

import functools
import os
import warnings

import background  # tests/background.py: this directory is on sys.path, as for every conftest here
import numpy as np
import pytest
import torch

# The fixtures' models are tiny: one intra-op thread is fastest and immune to OpenMP stalls when the
# machine is shared.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts on one intra-op thread: code run in-process may change the process-wide count (a
    ctranslate2 Translator sets OpenMP's, which torch shares; load(backend="torch", threads=n) sets torch's), and
    the tests after it would spin 2 OpenMP threads against each other on a busy machine (tens of times slower)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)  # and so do the session's fixtures that the next test builds


TINY = dict(encoder_layers=2, decoder_layers=2, d_model=32, n_heads=4, d_ff=64, dropout=0.1, max_positions=64)


@functools.cache
def make_small_corpus():
    from transduce.models.corpus import demo_corpus

    return demo_corpus(n_train=600, n_valid=40, seed=7)


@functools.cache
def make_tiny_tokenizer():
    from transduce.models.tokenizer import Tokenizer

    train, _ = make_small_corpus()
    return Tokenizer.train((s for p in train for s in p), vocab_size=200)


@pytest.fixture(scope="session")
def small_corpus():
    return make_small_corpus()


@pytest.fixture(scope="session")
def tiny_tokenizer(small_corpus):
    return make_tiny_tokenizer()


def seeded_model(tokenizer, seed: int, **shape):
    """A Transformer of the given shape with seeded random weights (eval mode)."""
    from transduce.models.config import ModelConfig
    from transduce.models.transformer import Transformer

    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=tokenizer.vocab_size, **shape)).eval()


def saved_model_dir(tmp_path_factory, name: str, model, tokenizer) -> str:
    """Write `model` as a model directory (config.json, model.safetensors, tokenizer.json)."""
    from transduce.models.checkpoint import save_model_dir

    path = tmp_path_factory.mktemp(name) / "model"
    save_model_dir(path, model, tokenizer)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    """A tiny Transformer with seeded random weights (eval mode)."""
    return seeded_model(tiny_tokenizer, 0, **TINY)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, tiny_tokenizer):
    """A model directory of the tiny random model."""
    return saved_model_dir(tmp_path_factory, "tiny", tiny_model, tiny_tokenizer)


def train_demo_model(path: str, paths=None) -> None:
    """demo_model_dir's training run, into the new model directory `path`."""
    from transduce.models.corpus import demo_corpus
    from transduce.training.config import TrainConfig
    from transduce.training.train import train

    train_pairs, valid_pairs = demo_corpus(n_train=6000, n_valid=100, seed=3)
    # half the demo's learning rate and one thread: at the full rate a run this short ended anywhere from
    # exact match 0.23 to 0.80 depending on the thread count and CPU (0.51-0.90 at half; test_train.py)
    cfg = TrainConfig(preset="tiny", vocab_size=400, max_steps=200, warmup=200, lr_scale=0.5, max_tokens=2500,
                      eval_every=200, save_every=200, eval_sentences=100, seed=1, threads=1)
    with warnings.catch_warnings():  # a run that ends at its warmup's peak, on purpose: no warning about it
        warnings.filterwarnings("ignore", "warmup .* >= max_steps")
        train(train_pairs, valid_pairs, path, cfg, progress=False, log=lambda *a: None)


def export_demo_artifact(path: str, paths: dict[str, str]) -> None:
    from transduce.exporter.onnx_export import export_artifact

    export_artifact(paths["demo_model_dir"], path)


def pytest_collection_finish(session):
    background.start(session)


def pytest_sessionfinish(session):
    background.stop(session)


@pytest.fixture(scope="session")
def demo_model_dir(request, tmp_path_factory):
    """The demo task's tiny model trained briefly (about 45 s of one core): it translates, imperfectly.

    Set TRANSDUCE_TEST_DEMO_MODEL to reuse an existing model directory instead.
    """
    existing = os.environ.get("TRANSDUCE_TEST_DEMO_MODEL")
    if existing:
        return existing
    path = background.built(request, "demo_model_dir")
    if path is None:
        path = str(tmp_path_factory.mktemp("demo") / "model")
        train_demo_model(path)
    return path  # config.json's "training" block holds the held-out exact match and BLEU


@pytest.fixture(scope="session")
def tiny_artifact_dir(tmp_path_factory, tiny_model_dir):
    """The tiny random model exported to ONNX (fp32)."""
    from transduce.exporter.onnx_export import export_artifact

    path = tmp_path_factory.mktemp("tiny-artifact") / "artifact"
    export_artifact(tiny_model_dir, path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_int8_artifact(tmp_path_factory, tiny_model_dir) -> tuple[str, dict]:
    """The tiny random model exported with int8 weights (--quantize int8): its path and the export's manifest."""
    from transduce.exporter.onnx_export import export_artifact

    path = tmp_path_factory.mktemp("int8") / "artifact"
    manifest = export_artifact(tiny_model_dir, path, quantize="int8")
    return str(path), manifest


@pytest.fixture(scope="session")
def demo_artifact_dir(request, tmp_path_factory, demo_model_dir):
    """The briefly trained demo model exported to ONNX (fp32)."""
    path = background.built(request, "demo_artifact_dir")
    if path is None:
        path = str(tmp_path_factory.mktemp("demo-artifact") / "artifact")
        export_demo_artifact(path, {"demo_model_dir": demo_model_dir})
    return path


@pytest.fixture
def edited_copy(tmp_path):
    """copy(src, name, file, edit): a copy of directory `src` as tmp_path/name whose JSON file `file` went
    through edit(obj), which changes obj in place (a hand-edited manifest or config) -> the copy's path."""
    import json
    import shutil

    def copy(src, name: str, file: str, edit):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        obj = json.loads((dst / file).read_text())
        edit(obj)
        (dst / file).write_text(json.dumps(obj))
        return dst

    return copy


def random_sources(cfg, n: int, seed: int, high: int = 8):
    """n random sources of 2..high-1 tokens plus EOS, padded: -> (src (n, S) int64, lengths (n,), the generator,
    to draw more from)."""
    rng = np.random.default_rng(seed)
    src, lens = sources_of_lengths(cfg, rng.integers(3, high, n), rng)
    return src, lens, rng


def sources_of_lengths(cfg, lengths, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random sources of these lengths (EOS included), padded: -> (src (n, S) int64, lengths (n,))."""
    lengths = np.asarray(lengths, np.int64)
    src = np.full((len(lengths), int(lengths.max())), cfg.pad_id, np.int64)
    for i, m in enumerate(lengths):
        src[i, : m - 1] = rng.integers(4, cfg.vocab_size, m - 1)
        src[i, m - 1] = cfg.eos_id
    return src, lengths
