"""What the bench's tests share: CTranslate2 (skipped where it is not installed) and the tiny model converted to it."""

from __future__ import annotations

import pytest


def require_ct2():
    return pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (pip install 'transduce[bench]')")


@pytest.fixture(scope="session")
def tiny_ct2_dir(tmp_path_factory, tiny_model_dir):
    require_ct2()
    from transduce.bench.ctranslate2.convert import convert_to_ctranslate2

    return convert_to_ctranslate2(tiny_model_dir, str(tmp_path_factory.mktemp("ct2") / "tiny"))
