"""Tiny Hugging Face models (built locally by hf_models) and their imports, once per session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("transformers", reason="the importers' tests need the import extra (transformers)")
pytest.importorskip("sentencepiece", reason="the importers' tests need the import extra (sentencepiece)")


@pytest.fixture(scope="session")
def marian_swish(tmp_path_factory):
    from hf_models import marian_dir

    return marian_dir(str(tmp_path_factory.mktemp("marian-swish") / "hf"), activation="swish", seed=0)


@pytest.fixture(scope="session")
def marian_relu(tmp_path_factory):
    from hf_models import marian_dir

    return marian_dir(str(tmp_path_factory.mktemp("marian-relu") / "hf"), activation="relu", seed=1,
                      scale_embedding=False)


@pytest.fixture(scope="session")
def marian_swish_imported(tmp_path_factory, marian_swish):
    from transduce.importers import import_model

    return import_model("marian", marian_swish, tmp_path_factory.mktemp("marian-swish-import") / "model")


@pytest.fixture(scope="session")
def demo_pairs():
    from hf_models import demo_sentences

    return demo_sentences(12, seed=5)


@pytest.fixture(scope="session")
def fsmt(tmp_path_factory):
    pytest.importorskip("sacremoses", reason="FSMT's tokenizer needs sacremoses (the import extra)")
    from hf_models import fsmt_dir

    return fsmt_dir(str(tmp_path_factory.mktemp("fsmt") / "hf"))


@pytest.fixture(scope="session")
def fsmt_imported(tmp_path_factory, fsmt):
    from transduce.importers import import_model

    return import_model("fsmt", fsmt, tmp_path_factory.mktemp("fsmt-import") / "model")


@pytest.fixture(scope="session")
def fairseq_imported(tmp_path_factory, fsmt):
    from hf_models import fairseq_dir_from_fsmt

    from transduce.importers import import_model

    src = fairseq_dir_from_fsmt(fsmt, str(tmp_path_factory.mktemp("fairseq") / "ckpt"))
    return import_model("fairseq", src, tmp_path_factory.mktemp("fairseq-import") / "model")
