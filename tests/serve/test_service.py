"""The decode service in-process: each of its schedulers gives offline decoding's translations."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

TEXTS = ["one two three", "four hundred and five", "twelve", "", "seven thousand and one", "nine"]


@pytest.mark.parametrize("scheduler", ["continuous", "static", "single"])
def test_each_scheduler_translates_as_offline_decoding(tiny_artifact_dir, scheduler):
    from transduce.runtime.api import load
    from transduce.serve.service import DecodeService, ServiceOptions

    service = DecodeService(load(tiny_artifact_dir, threads=1), ServiceOptions(scheduler=scheduler, max_rows=16))
    service.start()
    try:
        cases = [(TEXTS[j:] + TEXTS[:j], {"beam_size": 1 + j % 3}) for j in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda c: service.translate(c[0], c[1]), cases))
        offline = load(tiny_artifact_dir, threads=1)
        for (texts, opts), got in zip(cases, answers, strict=True):
            want = offline.translate(texts, **opts)
            assert [g.tokens for g in got] == [w.tokens for w in want]
            np.testing.assert_allclose([g.score for g in got], [w.score for w in want], atol=1e-5)
        assert service.batch.rows == 0 and service.queue_depth() == 0
    finally:
        service.stop()
    assert not service.alive()
