"""Teacher-forced scoring (Translator.score, `transduce score`): equal to what decoding reports for its own
outputs, on every backend and step graph; the token log-probs are those of the model's full forward pass."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from transduce.cli import main
from transduce.errors import InputError, TransduceWarning, TruncatedInput
from transduce.formats import contract
from transduce.runtime.api import load
from transduce.runtime.backends.base import only_step_graph
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import teacher_forced_log_probs
from transduce.runtime.decoding.batch import pad_ids
from transduce.runtime.decoding.scoring import score_ids

TEXTS = ["one two three", "four hundred and five", "twelve", "seven thousand and one", "nine", ""]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "onnxruntime-standard"])
def test_a_decoded_outputs_score_is_its_decode_score(demo_artifact_dir, backend):
    """Each finished n-best hypothesis of a beam decode (the trained demo model's: they finish), scored as a
    target, gets its log_prob and score (the length penalty too); token log-probs one per token, EOS's last."""
    tr = load(demo_artifact_dir, backend=backend.split("-")[0], threads=1)
    with only_step_graph(tr.backend, contract.STEP_FILE if backend.endswith("standard") else None):
        out = tr.translate(TEXTS, beam_size=3, nbest=3, max_len_b=12, length_penalty=1.0)
        pairs = [(s, c) for s, t in zip(TEXTS, out, strict=True) for c in t.nbest if c.finished and not t.empty]
        scores = tr.score([s for s, _ in pairs], [c.text for _, c in pairs], length_penalty=1.0)
    assert len(pairs) > 5
    for (_, c), s in zip(pairs, scores, strict=True):
        assert s.tokens == c.tokens and len(s.token_log_probs) == len(c.tokens) + 1
        assert s.log_prob == pytest.approx(c.log_prob, abs=1e-4) and s.score == pytest.approx(c.score, abs=1e-4)


def test_token_log_probs_are_the_full_passes_as_rows_leave(tiny_model):
    """score_ids on targets of different lengths (rows leave the state as theirs end) gives, for each token,
    the log-prob the model's full log-probs over the same prefix give it."""
    backend = TorchBackend(tiny_model)
    cfg = backend.config
    rng = np.random.default_rng(0)
    targets = [rng.integers(4, cfg.vocab_size, n).tolist() for n in (5, 0, 9, 2)]
    src, lens = pad_ids([rng.integers(4, cfg.vocab_size, n).tolist() for n in (3, 6, 2, 4)], cfg.pad_id,
                        end=cfg.eos_id)
    got = score_ids(backend, src, lens, targets)
    fed, _ = pad_ids(targets, cfg.pad_id, lead=cfg.bos_id)
    full = teacher_forced_log_probs(TorchBackend(tiny_model), src, lens, fed)
    for i, t in enumerate(targets):
        want = full[i, np.arange(len(t) + 1), t + [cfg.eos_id]]
        np.testing.assert_allclose(got[i], want, atol=1e-5)


def test_bad_pairs_are_refused_naming_the_side(tiny_artifact_dir):
    tr = load(tiny_artifact_dir, threads=1)
    with pytest.raises(InputError, match="2 sources and 1 targets"):
        tr.score(["a", "b"], ["x"])
    with pytest.raises(InputError, match="sentence 2 is None") as e:
        tr.score(["a", "b"], ["x", None])
    assert e.value.field == "target" and e.value.sentence == 2
    with pytest.raises(InputError, match="target line 1 has .* tokens; this model takes at most") as e:
        tr.score(["a"], ["two " * 600])
    assert e.value.field == "target"
    with pytest.warns(TruncatedInput, match="target line 1: 600 tokens truncated to"):
        assert tr.score(["a"], ["two " * 600], truncate=True)[0].truncated
    with pytest.raises(InputError, match="takes a list of sentences"):
        tr.score("a", ["x"])


def test_unknown_tokens_on_either_side_are_warned_of(tiny_artifact_dir):
    import warnings

    tr = load(tiny_artifact_dir, threads=1)
    with pytest.warns(TransduceWarning) as got:
        tr.score(["one", "\u4e2d one"], ["two \u4e2d \u4e2d", "two"])
    assert [str(w.message) for w in got] == ["target line 1: 2 token(s) unknown to the tokenizer became <unk>",
                                             "source line 2: 1 token(s) unknown to the tokenizer became <unk>"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr.prepare_pairs(["\u4e2d"], ["two " * 600], truncate=True, warn=False)  # a server's: said in its answer


def test_score_command_reads_tsv_or_two_files_and_writes_one_line_each(tiny_artifact_dir, tmp_path):
    tr = load(tiny_artifact_dir, threads=1)
    targets = [t.text for t in tr.translate(TEXTS[:4], beam_size=1)]
    want = tr.score(TEXTS[:4], targets)
    tsv = "".join(f"{s}\t{t}\n" for s, t in zip(TEXTS[:4], targets, strict=True))
    r = CliRunner().invoke(main, ["score", tiny_artifact_dir], input=tsv)
    assert r.exit_code == 0, r.output
    assert [float(x) for x in r.stdout.split()] == pytest.approx([s.log_prob for s in want], abs=1e-5)
    (tmp_path / "src").write_text("".join(s + "\n" for s in TEXTS[:4]))
    (tmp_path / "tgt").write_text("".join(t + "\n" for t in targets))
    out = tmp_path / "scores.txt"
    r = CliRunner().invoke(main, ["score", tiny_artifact_dir, "--source", str(tmp_path / "src"), "--target",
                                  str(tmp_path / "tgt"), "--out", str(out), "--tokens", "--normalized"])
    assert r.exit_code == 0, r.output
    lines = [line.split("\t") for line in out.read_text().splitlines()]
    assert [float(a) for a, _ in lines] == pytest.approx([s.score for s in want], abs=1e-5)
    assert [[float(x) for x in b.split()] for _, b in lines] == [pytest.approx(s.token_log_probs, abs=1e-5)
                                                                 for s in want]


@pytest.mark.parametrize("args, stdin, says", [
    ([], "no tab here\n", "input line 1 has 0 tabs"),
    ([], "a\tb\tc\n", "input line 1 has 2 tabs"),
    (["--source", "SRC"], "", "--source and --target go together"),
    (["--length-penalty", "-1"], "a\tb\n", "length_penalty must be >= 0"),
])
def test_score_command_errors_are_one_line(tiny_artifact_dir, tmp_path, args, stdin, says):
    (tmp_path / "SRC").write_text("a\n")
    args = [str(tmp_path / a) if a == "SRC" else a for a in args]
    r = CliRunner().invoke(main, ["score", tiny_artifact_dir, *args], input=stdin)
    assert r.exit_code == 2 and "error:" in r.stderr and says.replace("length_penalty", "--length-penalty") in \
        r.stderr.replace("length_penalty", "--length-penalty"), r.output
