"""`transduce decode` and `transduce parity` through the CLI: output format, exit codes, clear errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from transduce.cli import main
from transduce.errors import CheckpointError


def test_decode_stdin_to_stdout(tiny_artifact_dir):
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--beam-size", "2", "--max-len-b", "4"],
                           input="two hundred\n\nthree\n")
    assert r.exit_code == 0, r.output
    lines = r.stdout.split("\n")[:-1]
    assert len(lines) == 3 and lines[1] == ""


def test_decode_nbest_and_scores(tiny_artifact_dir, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("two hundred\nthree\n")
    out = tmp_path / "out.txt"
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--input", str(src), "--out", str(out),
                                  "--beam-size", "3", "--nbest", "3", "--max-len-b", "4"])
    assert r.exit_code == 0, r.output
    rows = [line.split(" ||| ") for line in out.read_text().splitlines()]
    assert [int(r[0]) for r in rows] == [0, 0, 0, 1, 1, 1]
    scores = [float(r[2]) for r in rows[:3]]
    assert scores == sorted(scores, reverse=True)


def test_decode_errors_are_one_line(tiny_artifact_dir, tmp_path):
    r = CliRunner().invoke(main, ["decode", str(tmp_path / "nope")], input="one\n")
    assert r.exit_code == 2 and "error:" in r.stderr and "does not exist" in r.stderr
    assert f"export one with: transduce export MODEL_DIR --out {tmp_path / 'nope'}" in r.stderr  # not "--force"
    assert "Traceback" not in r.output
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir], input=" ".join(["nine"] * 200) + "\n")
    assert r.exit_code == 2 and "input line 1 has" in r.stderr and "pass --truncate to keep" in r.stderr
    assert "truncate=True" not in r.stderr  # the library's spelling, for Python
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--beam-size", "1", "--max-len-b", "2"],
                           input="two 日本\n")
    assert r.exit_code == 0 and "unknown to the tokenizer" in r.stderr
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--input", str(bad)])
    assert r.exit_code == 2 and "not UTF-8" in r.stderr


def test_parity_cli_passes_and_writes_json(tiny_artifact_dir, tiny_model_dir, small_corpus, tmp_path):
    from transduce.io.parallel import write_tsv

    _, valid = small_corpus
    data = tmp_path / "valid.tsv"
    write_tsv(data, valid[:8])
    report = tmp_path / "report.json"
    r = CliRunner().invoke(main, ["parity", tiny_artifact_dir, "--model", tiny_model_dir, "--data", str(data),
                                  "--out", str(report)])
    assert r.exit_code == 0, r.output
    rep = json.loads(report.read_text())
    assert rep["passed"] and rep["sentences"] == 8
    # the artifact has two step graphs (decoder_step.ort.onnx at few rows): log-probs checked on each
    assert {s["name"] for s in rep["teacher_forced"]} == {"memory", "cross_kv", "log_probs [decoder_step.ort.onnx]",
                                                         "log_probs [decoder_step.onnx]"}
    assert "log_probs [decoder_step.ort.onnx]" in r.stdout  # printed whole (brackets are not markup)
    assert "PARITY PASSED" in r.stdout
    assert (rep["candidate"], rep["reference"]) == ("onnxruntime:cpu (fp32)", "torch:cpu")


def test_eager_pytorch_at_reduced_precision_decodes_and_is_held_to_its_policy(tiny_artifact_dir, tiny_model_dir,
                                                                              small_corpus, tmp_path):
    from transduce.io.parallel import write_tsv

    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--backend", "torch", "--precision", "bf16",
                                  "--beam-size", "2", "--max-len-b", "4"], input="two hundred\nforty one\n")
    assert r.exit_code == 0, r.output
    assert len(r.stdout.splitlines()) == 2
    _, valid = small_corpus
    data = tmp_path / "valid.tsv"
    write_tsv(data, valid[:8])
    report = tmp_path / "report.json"
    r = CliRunner().invoke(main, ["parity", tiny_artifact_dir, "--model", tiny_model_dir, "--data", str(data),
                                  "--backend", "torch", "--precision", "bf16", "--out", str(report)])
    rep = json.loads(report.read_text())
    assert (rep["candidate"], rep["precision"]) == ("torch:cpu (bf16)", "bf16"), r.output
    lp = [s for s in rep["teacher_forced"] if s["name"].startswith("log_probs")]
    assert lp and lp[0]["max_abs"] > 0  # bf16 weights really ran (fp32 would be exact on the same CPU)


@pytest.mark.gpu
def test_parity_of_eager_pytorch_on_the_gpu_against_the_cpu(tiny_artifact_dir, tiny_model_dir, small_corpus, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available to PyTorch")
    from transduce.io.parallel import write_tsv

    _, valid = small_corpus
    data = tmp_path / "valid.tsv"
    write_tsv(data, valid[:16])
    report = tmp_path / "report.json"
    moved = shutil.copytree(tiny_model_dir, tmp_path / "moved")  # not where the manifest says: --model serves both
    r = CliRunner().invoke(main, ["parity", tiny_artifact_dir, "--model", str(moved), "--data", str(data),
                                  "--backend", "torch", "--device", "cuda", "--out", str(report)])
    assert r.exit_code == 0, r.output
    rep = json.loads(report.read_text())
    assert rep["passed"] and (rep["candidate"], rep["reference"]) == ("torch:cuda:0 (fp32)", "torch:cpu")


def test_parity_refuses_other_weights(tiny_artifact_dir, demo_model_dir, tmp_path):
    r = CliRunner().invoke(main, ["parity", tiny_artifact_dir, "--model", demo_model_dir, "-n", "2"])
    assert r.exit_code == 2 and "other weights" in r.stderr


def test_parity_needs_the_model_when_the_manifest_path_is_gone(tiny_artifact_dir, tmp_path):
    art = tmp_path / "a"
    shutil.copytree(tiny_artifact_dir, art)
    m = json.loads((art / "manifest.json").read_text())
    m["source_model"]["path"] = str(tmp_path / "moved")
    (art / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["parity", str(art), "-n", "2"])
    assert r.exit_code == 2 and "--model" in r.stderr
    assert os.path.isdir(art)


def test_decode_keeps_one_output_line_per_input_line(tiny_artifact_dir, tmp_path):
    """Lines end at "\\n" only: Unicode's other line breaks stay in their line; a BOM is not text."""
    text = "\ufefftwo\nsix\u2028seven\neight\x0cnine\r\nten\x85eleven\n\ntwelve"
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--beam-size", "1", "--max-len-b", "2"],
                           input=text.encode())
    assert r.exit_code == 0, r.output
    assert len(r.stdout.split("\n")[:-1]) == 6
    alone = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--beam-size", "1", "--max-len-b", "2"],
                               input="two\n")
    assert r.stdout.split("\n")[0] == alone.stdout.split("\n")[0]  # the BOM changed nothing
    src = tmp_path / "in.txt"
    src.write_bytes(text.encode())
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--input", str(src), "--beam-size", "3", "--nbest", "2",
                                  "--max-len-b", "2"])
    assert r.exit_code == 0, r.output
    ids = [int(line.split(" ||| ")[0]) for line in r.stdout.splitlines()]
    assert ids == [i for i in range(6) for _ in range(2)]  # nbest lines for every input, the blank one too


def test_decode_input_and_output_errors_come_before_decoding(tiny_artifact_dir, tmp_path, monkeypatch):
    from transduce.runtime import api

    def must_not_load(*args, **kwargs):
        raise AssertionError("loaded the artifact")

    monkeypatch.setattr(api, "load", must_not_load)
    for args, stdin, message in (
        (["--out", str(tmp_path / "missing" / "x" / "out.txt"), "--input", str(tmp_path / "nope.txt")], None,
         "does not exist"),
        (["--out", str(tmp_path)], "one\n", "is a directory"),
        (["--input", str(tmp_path)], None, "is a directory"),
        ([], b"f\xffive\n", "standard input is not UTF-8 text: line 1"),
        (["--out", str(tmp_path / ("x" * 256))], "one\n", "longer than this file system allows"),
        (["--out", str(tmp_path / ("d" * 256) / "out.txt")], "one\n", "longer than this file system allows"),
        (["--out", str(tmp_path / "results") + os.sep], "one\n", "names a directory (it ends in '/')"),
        (["--out", ""], "one\n", "--out is empty"),
        (["--threads", "-1"], "one\n", "--threads must be between 0 and 1024"),
        (["--threads", "100000"], "one\n", "--threads must be between 0 and 1024, got 100000"),
    ):
        r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, *args], input=stdin)
        assert r.exit_code == 2 and "error:" in r.stderr and message in r.stderr, (args, r.output)
        assert isinstance(r.exception, SystemExit)  # handled, not raised
    (tmp_path / "file").write_text("x")
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--out", str(tmp_path / "file" / "out.txt")],
                           input="one\n")
    assert r.exit_code == 2 and "cannot be created: " in r.stderr and "is not a directory" in r.stderr
    assert not (tmp_path / "missing").exists()  # the checks create nothing
    os.symlink(tmp_path / "file" / "target.txt", tmp_path / "dangling")  # written in place: its target's place
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--out", str(tmp_path / "dangling")], input="one\n")
    assert r.exit_code == 2 and "a link to" in r.stderr and "is not a directory" in r.stderr


def test_decode_refuses_to_overwrite_its_input_while_reading_it(tiny_artifact_dir, tmp_path):
    """An --out that leads to the --input file (a link) is written in place: with --chunk-lines that
    would truncate the input after its first part (refused even with --force). Without --chunk-lines the
    input is read whole first: --force may replace it."""
    src = tmp_path / "in.txt"
    src.write_text("two hundred\nthree\none\n")
    os.symlink(src, tmp_path / "out.txt")
    args = ["decode", tiny_artifact_dir, "--input", str(src), "--out", str(tmp_path / "out.txt"), "--beam-size", "1",
            "--max-len-b", "3"]
    r = CliRunner().invoke(main, [*args, "--chunk-lines", "1", "--force"])
    assert r.exit_code == 2 and "leads to the file the input is read from" in r.stderr, r.output
    assert src.read_text() == "two hundred\nthree\none\n"
    # the same file as standard input (< in.txt): a subprocess, for a real file descriptor 0
    import subprocess
    import sys

    with open(src, "rb") as stdin:
        done = subprocess.run([sys.executable, "-m", "transduce.cli", *args[:2], "--out", str(tmp_path / "out.txt"),
                               "--chunk-lines", "1", "--beam-size", "1"], stdin=stdin, capture_output=True, text=True)
    assert done.returncode == 2 and "leads to the file the input is read from" in done.stderr, done.stderr
    assert src.read_text() == "two hundred\nthree\none\n"
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "already exists" in r.stderr and "pass --force" in r.stderr, r.output
    r = CliRunner().invoke(main, [*args, "--force"])
    assert r.exit_code == 0, r.output
    assert len(src.read_text().splitlines()) == 3 and os.path.islink(tmp_path / "out.txt")


def test_parity_input_errors_come_before_the_run(tiny_artifact_dir, tiny_model_dir, tmp_path):
    (tmp_path / "pairs.tsv").write_text("two hundred\tdeux cents\n")
    (tmp_path / "sources.txt").write_text("two hundred\n")
    for args, message in ((["-n", "0"], "--sentences must be >= 1"), (["--out", str(tmp_path)], "--out"),
                          (["--out", "-"], "--out -: the report goes to standard output already"),
                          (["--out", str(tmp_path / "reports") + os.sep], "names a directory"),
                          (["--data", str(tmp_path / "pairs.tsv"), "--input", str(tmp_path / "sources.txt")],
                           "give either --data"),
                          (["--backend", "torch"], "eager PyTorch with itself"),
                          (["--backend", "torch", "--device", "cpu:0"], "eager PyTorch with itself"),
                          (["--cuda-graph"], "--cuda-graph: the onnxruntime backend does not capture"),
                          (["--precision", "bf16"], "--precision bf16: the onnxruntime backend runs the precision"),
                          (["--backend", "torch", "--cuda-graph"], "CUDA graphs need a CUDA device"),
                          (["--reference-device", "gpu"],
                           "--reference-device 'gpu': eager PyTorch runs on cpu or cuda"),
                          (["--reference-device", "cuda:7"], "--reference-device cuda:7: "),  # no such GPU here
                          (["--input", str(tmp_path / "nope.txt")], "does not exist")):
        r = CliRunner().invoke(main, ["parity", tiny_artifact_dir, "--model", tiny_model_dir, *args])
        assert r.exit_code == 2 and "error:" in r.stderr and message in r.stderr, (args, r.output)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    r = CliRunner().invoke(main, ["parity", tiny_artifact_dir, "--model", tiny_model_dir, "--input", str(empty)])
    assert r.exit_code == 2 and "has no sentences" in r.stderr


def test_decode_output_to_a_device_or_an_existing_file(tiny_artifact_dir, tmp_path, monkeypatch):
    """/dev/null is written in place (not replaced by a file), without --force; an existing file is replaced
    only with --force (refused before the model loads), and keeps its mode; an empty one (mktemp's) needs
    no --force."""
    args = ["decode", tiny_artifact_dir, "--beam-size", "1", "--max-len-b", "2"]
    r = CliRunner().invoke(main, [*args, "--out", os.devnull], input="two\n")
    assert r.exit_code == 0, r.output
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)
    out = tmp_path / "out.txt"
    out.write_text("old\n")
    os.chmod(out, 0o640)
    os.symlink(out, tmp_path / "link.txt")  # a link to it: its target would be written
    from transduce.runtime import api

    with monkeypatch.context() as m:
        m.setattr(api, "load", lambda *a, **k: pytest.fail("loaded the artifact"))
        for path in (out, tmp_path / "link.txt"):
            r = CliRunner().invoke(main, [*args, "--out", str(path)], input="two\nthree\n")
            assert r.exit_code == 2 and f"--out {str(path)!r} already exists" in r.stderr, r.output
            assert "pass --force to replace it" in r.stderr and out.read_text() == "old\n"
    r = CliRunner().invoke(main, [*args, "--out", str(out), "--force"], input="two\nthree\n")
    assert r.exit_code == 0, r.output
    assert len(out.read_text().splitlines()) == 2 and (os.stat(out).st_mode & 0o777) == 0o640
    empty = tmp_path / "empty.txt"
    empty.touch()
    r = CliRunner().invoke(main, [*args, "--out", str(empty)], input="two\n")
    assert r.exit_code == 0 and len(empty.read_text().splitlines()) == 1, r.output


def test_parity_names_a_model_config_other_than_the_artifacts(tiny_artifact_dir, tiny_model_dir, tmp_path):
    """Same weights, edited config.json (n_heads): a config error naming the field, not a parity failure."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["model"]["n_heads"] //= 2
    (model / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["parity", tiny_artifact_dir, "--model", str(model), "-n", "2"])
    assert r.exit_code == 2 and "another model config" in r.stderr and "n_heads 4 vs 2" in r.stderr, r.output
    # a minimal config.json (defaults left out) is the same config as the manifest's full one
    cfg["model"]["n_heads"] *= 2
    del cfg["model"]["layer_norm_eps"], cfg["model"]["share_embeddings"]
    (model / "config.json").write_text(json.dumps(cfg))
    from transduce.formats.artifact import Artifact
    from transduce.runtime.backends.torch_backend import source_model

    assert source_model(Artifact.load(tiny_artifact_dir), str(model)).path == str(model)
    del cfg["files"]["model.safetensors"]  # the same weights, unrecorded: said so, not "other weights"
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not record model.safetensors"):
        source_model(Artifact.load(tiny_artifact_dir), str(model))


def test_decode_checks_its_options_before_reading_input_or_loading(tmp_path):
    """An option error comes first: before the input is read (a pipe may take long to end) and before the
    model loads (here there is none, and the input is not UTF-8: neither is reached). An error that involves an
    option not given (--nbest 5 alone) waits for the model's defaults (its beam may be 6)."""
    missing = str(tmp_path / "nope")
    for args, message in ((["--beam-size", "0"], "error: --beam-size must be >= 1, got 0"),
                          (["--nbest", "5", "--beam-size", "4"],
                           "error: --nbest must be between 1 and --beam-size (4), got 5"),
                          (["--length-penalty", "-1"], "error: --length-penalty must be >= 0, got -1.0"),
                          (["--length-penalty", "nan"], "error: --length-penalty must be a finite number, got nan"),
                          (["--min-length", "-1"], "error: --min-length must be >= 0, got -1"),
                          (["--max-len-b", "-1"], "error: --max-len-b must be >= 0, got -1"),
                          (["--max-batch-tokens", "0"], "error: --max-batch-tokens must be >= 1, got 0")):
        r = CliRunner().invoke(main, ["decode", missing, *args], input=b"\xff\xfe bad\n")
        assert r.exit_code == 2 and message in r.stderr and "does not exist" not in r.stderr, (args, r.output)
        # the command line speaks in its flags: none of the library's parameter names
        assert not any(name in r.stderr for name in ("beam_size", "length_penalty", "min_length", "max_len_",
                                                     "max_batch_tokens")), r.stderr


def test_decode_takes_a_huge_max_len_b_as_the_models_cap(tiny_artifact_dir):
    args = ["decode", tiny_artifact_dir, "--beam-size", "1", "--scores"]
    capped = CliRunner().invoke(main, [*args, "--max-len-b", "1000"], input="two hundred\n")
    huge = CliRunner().invoke(main, [*args, "--max-len-b", str(10**30)], input="two hundred\n")
    assert capped.exit_code == 0 and huge.exit_code == 0 and huge.stdout == capped.stdout, huge.output
    assert "warning" not in huge.stderr


def test_parity_warnings_are_one_line(tiny_artifact_dir, tmp_path):
    """The package's warnings print as 'warning: ...' lines under the CLI, not as Python's UserWarning
    with a source line."""
    src = tmp_path / "in.txt"
    src.write_text(" ".join(["nine"] * 300) + "\nseven\n")
    r = CliRunner().invoke(main, ["parity", tiny_artifact_dir, "--input", str(src), "-n", "2", "--beam-size", "2"])
    assert r.exit_code in (0, 1), r.output
    assert "warning: parity: 1 source(s) longer than" in r.stderr
    assert "UserWarning" not in r.stderr and "warnings.warn" not in r.stderr


def test_decode_in_chunks(tiny_artifact_dir, tmp_path):
    """--chunk-lines N: the same output as the whole input at once, each part written when it is done; an
    error in a later part leaves a file --out as it was (and no temporary), stdout with the parts before."""
    args = ["decode", tiny_artifact_dir, "--beam-size", "2", "--max-len-b", "3"]
    text = "one\ntwo hundred\n\nseven\nnine\n"
    whole = CliRunner().invoke(main, args, input=text)
    assert whole.exit_code == 0, whole.output
    for n in ("1", "2", "10"):
        r = CliRunner().invoke(main, [*args, "--chunk-lines", n], input=text)
        assert r.exit_code == 0 and r.stdout == whole.stdout, (n, r.output)
    r = CliRunner().invoke(main, [*args, "--chunk-lines", "-1"], input=text)
    assert r.exit_code == 2 and "--chunk-lines must be >= 0" in r.stderr
    bad = text + " ".join(["nine"] * 200) + "\n"
    out = tmp_path / "out.txt"
    out.write_text("old\n")
    r = CliRunner().invoke(main, [*args, "--chunk-lines", "2", "--out", str(out), "--force"], input=bad)
    assert r.exit_code == 2 and "input line 6 has" in r.stderr
    assert out.read_text() == "old\n" and os.listdir(tmp_path) == ["out.txt"]
    r = CliRunner().invoke(main, [*args, "--chunk-lines", "2"], input=bad)
    # written: the parts before the bad line's (lines 1-2 and 3-4), not the line beside it in its part (5)
    assert r.exit_code == 2 and r.stdout.splitlines() == whole.stdout.splitlines()[:4]
    # the first part is decoded before the output is opened: a link --out (written in place) keeps its
    # target when that part fails, and an empty input still has its options checked
    (tmp_path / "target.txt").write_text("precious\n")
    os.symlink(tmp_path / "target.txt", tmp_path / "link.txt")
    for extra, stdin in ((["--chunk-lines", "0"], bad), (["--chunk-lines", "3"], "one\n" + bad[len(text):] + text),
                         (["--beam-size", "0"], "one\n")):
        r = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "link.txt"), "--force", *extra], input=stdin)
        assert r.exit_code == 2 and (tmp_path / "target.txt").read_text() == "precious\n", (extra, r.output)
    r = CliRunner().invoke(main, [*args, "--nbest", "5"], input="")
    assert r.exit_code == 2 and "--nbest must be between 1 and --beam-size (2)" in r.stderr


def test_decode_warnings_come_in_line_order(tiny_artifact_dir):
    """Each line's warnings print in input order, whether they come from encoding the whole part
    (truncation) or from its result (unknown characters)."""
    long = " ".join(["seven hundred"] * 100)
    text = f"two 日本 three\n{long}\none\n{long}\n"
    for chunk in ("0", "2"):
        r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--beam-size", "1", "--max-len-b", "2", "--truncate",
                                      "--chunk-lines", chunk], input=text)
        assert r.exit_code == 0, r.output
        lines = [line.split(":")[1].strip() for line in r.stderr.splitlines() if line.startswith("warning:")]
        assert lines == ["input line 1", "input line 2", "input line 4"], r.stderr


def test_decode_an_error_from_decoding_is_not_called_a_write_error(tiny_artifact_dir, tmp_path, monkeypatch):
    from transduce.runtime.translator import Translator

    calls = []
    translate = Translator._translate

    def failing(self, texts, *args):
        calls.append(texts)
        if len(calls) == 2:
            raise OSError(5, "Input/output error while decoding")
        return translate(self, texts, *args)

    monkeypatch.setattr(Translator, "_translate", failing)
    out = tmp_path / "out.txt"
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--beam-size", "1", "--max-len-b", "2",
                                  "--chunk-lines", "1", "--out", str(out)], input="one\ntwo\n")
    assert isinstance(r.exception, OSError) and "cannot write" not in r.output
    assert not out.exists() and os.listdir(tmp_path) == []
    if os.path.exists("/dev/full"):  # a write that fails is one: at the close's flush, or at a write (> 8 KiB)
        for lines in (1, 3000):
            r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--beam-size", "1", "--max-len-b", "2",
                                          "--scores", "--out", "/dev/full"], input="one\n" * lines)  # >= 12 B a line
            assert r.exit_code == 2 and "cannot write --out '/dev/full': No space left on device" in r.stderr, r.output
            assert "hint: free disk space" in r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_decode_to_a_full_stdout_is_a_clear_error(tiny_artifact_dir):
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "transduce.cli", "decode", tiny_artifact_dir, "--beam-size", "1",
                            "--max-len-b", "2"], input="one\ntwo\n", stdout=full, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 2 and "cannot write the translations to standard output" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_decode_output_is_the_deprecated_spelling_of_out(tiny_artifact_dir, tmp_path):
    out = tmp_path / "out.txt"
    args = ["decode", tiny_artifact_dir, "--beam-size", "1", "--max-len-b", "2"]
    r = CliRunner().invoke(main, [*args, "--output", str(out)], input="two\n")
    assert r.exit_code == 0 and "warning: --output is deprecated: use --out" in r.stderr, r.output
    assert len(out.read_text().splitlines()) == 1 and r.stdout == ""
    r = CliRunner().invoke(main, [*args, "--output", str(out), "--out", str(tmp_path / "b.txt")], input="two\n")
    assert r.exit_code == 2 and "give --out alone" in r.stderr and not (tmp_path / "b.txt").exists()


def test_decode_progress_lines_when_stderr_is_not_a_terminal(tiny_artifact_dir, monkeypatch):
    """Not on a terminal: '[decode] ...' lines every LOG_EVERY_S (here every batch) and one at the end;
    stdout holds the translations alone; --quiet prints none."""
    from transduce.cli import decode as commands

    monkeypatch.setattr(commands, "LOG_EVERY_S", 0.0)
    text = "two hundred\n\nthree\n" * 10
    args = ["decode", tiny_artifact_dir, "--beam-size", "2", "--max-len-b", "3", "--max-batch-tokens", "16"]
    r = CliRunner().invoke(main, args, input=text)
    quiet = CliRunner().invoke(main, [*args, "--quiet"], input=text)
    assert r.exit_code == 0 and quiet.exit_code == 0, r.output + quiet.output
    assert r.stdout == quiet.stdout and len(r.stdout.splitlines()) == 30
    lines = r.stderr.splitlines()
    assert len(lines) > 2 and all(line.startswith("[decode] ") for line in lines), r.stderr
    assert lines[-1].startswith("[decode] 30 of 30 sentences in ") and lines[-1].endswith(" tokens/s"), lines[-1]
    assert " sentences/s, " in lines[-1] and len(set(lines)) == len(lines)  # the last is not said twice
    assert quiet.stderr == ""
    monkeypatch.setattr(commands, "LOG_EVERY_S", 3600.0)  # a short run: nothing
    r = CliRunner().invoke(main, args, input=text)
    assert r.exit_code == 0 and r.stderr == "", r.stderr


def test_decode_progress_bar_on_a_terminal():
    """On a terminal: a bar with sentences/s and tokens/s, cleared for a line written meanwhile."""
    import io

    from transduce.cli.decode import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    now = [0.0]
    stream = Terminal()
    progress = Progress(4, stream=stream, clock=lambda: now[0])
    now[0] = 2.0
    progress(3, 50)
    with progress.above():
        stream.write("warning: something\n")
    progress(1, 10)
    progress.close(True)
    shown = stream.getvalue()
    assert "decode" in shown and "4/4" in shown and " sentences/s" in shown and "30 tokens/s" in shown, shown
    assert "\nwarning: something\n" in shown.replace("\r", "\n")


def test_decode_warns_of_options_the_model_cannot_honour(tiny_artifact_dir):
    """A beam wider than the vocabulary, a --min-length past a sentence's maximum length: warnings in the
    command's flags, before the lines' own warnings."""
    args = ["decode", tiny_artifact_dir, "--max-len-b", "2"]
    r = CliRunner().invoke(main, [*args, "--beam-size", "300"], input="two 日本\n")
    assert r.exit_code == 0, r.output
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert warned[0] == ("warning: --beam-size 300 is wider than the vocabulary (200 tokens): each sentence carries up "
                         "to 300 hypotheses a step, 300x the work of greedy search"), r.stderr
    assert "input line 1:" in warned[1]
    r = CliRunner().invoke(main, [*args, "--beam-size", "1", "--min-length", "1000"], input="two\n")
    assert r.exit_code == 0, r.output
    assert ("warning: --min-length 1000 is more than any sentence's maximum length (1 x source tokens + 2, at most "
            "64): every translation is cut there, unfinished") in r.stderr, r.stderr
    r = CliRunner().invoke(main, [*args, "--beam-size", "4", "--min-length", "3"], input="two\n")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.stderr


def test_decode_names_a_directory_that_cannot_hold_files(tiny_artifact_dir, monkeypatch):
    """/proc refuses new files even to root, whom a permission check lets through: said before the model
    loads, as what it is (not 'free disk space')."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    from transduce.runtime import api

    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("loaded the artifact"))
    r = CliRunner().invoke(main, ["decode", tiny_artifact_dir, "--out", "/proc/out.txt"], input="one\n")
    assert r.exit_code == 2 and "'/proc'" in r.stderr, r.output
    assert "cannot hold new files" in r.stderr or "is not writable" in r.stderr, r.stderr  # root, or not
    assert "free disk space" not in r.stderr and ".tmp-" not in r.stderr


def test_an_output_write_error_is_named_by_its_cause(tmp_path):
    import errno

    from transduce.io.paths import write_error

    path = str(tmp_path / "out.txt")
    gone = write_error("--out", path, FileNotFoundError(errno.ENOENT, "No such file or directory", path + ".tmp"))
    assert f"its directory {str(tmp_path)!r} cannot hold new files (No such file or directory)" in str(gone)
    assert "free disk space" not in str(gone)
    full = write_error("--out", path, OSError(errno.ENOSPC, "No space left on device"))
    assert "No space left on device" in str(full) and full.hint == "free disk space, or choose another --out"


def test_parity_out_follows_the_output_rules(tmp_path):
    """--out FILE (the JSON report): an existing one refused without --force, before anything loads;
    --json is its deprecated spelling."""
    report = tmp_path / "report.json"
    report.write_text("{}\n")
    missing = str(tmp_path / "no-artifact")
    r = CliRunner().invoke(main, ["parity", missing, "--out", str(report)])
    assert r.exit_code == 2 and "already exists" in r.stderr and "pass --force" in r.stderr, r.output
    r = CliRunner().invoke(main, ["parity", missing, "--json", str(report), "--force"])
    assert r.exit_code == 2 and "warning: --json is deprecated: use --out" in r.stderr, r.output
    assert "already exists" not in r.stderr and "does not exist" in r.stderr and report.read_text() == "{}\n"
