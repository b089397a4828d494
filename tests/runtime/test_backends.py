"""One conformance suite, run over every backend available here, against the eager model itself."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
import torch
from artifact_edits import REFUSALS, perturb_one_weight, refused_copy

from transduce.errors import ArtifactError
from transduce.formats.artifact import Artifact, read_manifest
from transduce.formats.kinds import ENGINE_MANIFEST_FILE
from transduce.io.files import file_entry, listed_file_problem
from transduce.runtime.api import load, make_backend
from transduce.runtime.backends.torch_backend import TorchBackend
from transduce.runtime.decoding import DecodingOptions, decode, teacher_forced_log_probs
from transduce.runtime.spec import BackendSpec


def _available():
    # torch-graph: the CUDA-graph backend, on the CPU with the capture double; torch-cuda-graph: on a GPU
    out = ["torch", "torch-graph", "onnxruntime", pytest.param("torch-cuda-graph", marks=pytest.mark.gpu)]
    if importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available():
        out.append("tensorrt")
    return out


BACKENDS = _available()


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    lens = np.array([9, 1, 5, 9, 3])
    src = np.zeros((5, 9), dtype=np.int64)
    for i, n in enumerate(lens):
        src[i, : n - 1] = rng.integers(4, cfg.vocab_size, n - 1)
        src[i, n - 1] = cfg.eos_id
    return src, lens


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tiny_artifact_dir, tiny_model_dir):
    if request.param == "tensorrt":
        pytest.skip("the tensorrt backend runs from an engine directory: see tests/runtime/test_tensorrt_backend.py")
    if request.param == "torch-graph":
        from cuda_graph_fake import HostCapturer

        from transduce.runtime.backends.torch_graph_backend import TorchGraphBackend

        return TorchGraphBackend.from_model_dir(tiny_model_dir, "cpu", _capturer=HostCapturer())
    if request.param == "torch-cuda-graph":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA GPU available to PyTorch")
        return make_backend(tiny_artifact_dir, "torch", "cuda", cuda_graph=True)
    return make_backend(tiny_artifact_dir, request.param)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return TorchBackend(tiny_model)


def test_encoder_outputs_match_eager(backend, reference):
    src, lens = _batch(reference.config)
    got = backend.encoder_outputs(backend.encode(src, lens))
    want = reference.encoder_outputs(reference.encode(src, lens))
    assert set(got) == set(want)
    for name in want:
        for b, n in enumerate(lens):  # real source positions only
            a = want[name][b, :n] if name == "memory" else want[name][b, :, :n]
            g = got[name][b, :n] if name == "memory" else got[name][b, :, :n]
            np.testing.assert_allclose(g, a, atol=1e-4, rtol=0, err_msg=name)


def test_stepped_log_probs_match_full_forward(backend, tiny_model):
    cfg = tiny_model.cfg
    src, lens = _batch(cfg, seed=1)
    tgt = np.random.default_rng(2).integers(4, cfg.vocab_size, (5, 7))
    tgt[:, 0] = cfg.bos_id
    got = teacher_forced_log_probs(backend, src, lens, tgt)
    with torch.no_grad():
        want = torch.log_softmax(tiny_model(torch.from_numpy(src), torch.from_numpy(lens), torch.from_numpy(tgt)), -1)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=0)


def test_reorder_keeps_the_selected_rows(backend, reference):
    """After reorder(rows), stepping row i continues the history of old row rows[i]."""
    cfg = reference.config
    src, lens = _batch(cfg, seed=3)
    rng = np.random.default_rng(4)
    prefix = rng.integers(4, cfg.vocab_size, (5, 4))
    prefix[:, 0] = cfg.bos_id
    enc = backend.encode(src, lens)
    state = backend.begin(enc, np.arange(5), 8)
    for t in range(3):
        backend.step_log_probs(state, prefix[:, t])
    rows = np.array([4, 4, 0, 2])  # drop rows 1 and 3, duplicate 4
    backend.reorder(state, rows, rows)
    got = backend.step_log_probs(state, prefix[rows, 3])
    want = teacher_forced_log_probs(reference, src[rows], lens[rows], prefix[rows])[:, 3]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("beam", [1, 4])
def test_decoding_matches_eager(backend, reference, beam):
    src, lens = _batch(reference.config, seed=5)
    opts = DecodingOptions(beam_size=beam, nbest=min(beam, 2), max_len_b=12)
    got = decode(backend, src, lens, opts)
    want = decode(reference, src, lens, opts)
    for g, w in zip(got, want, strict=True):
        assert [h.tokens for h in g.hypotheses] == [h.tokens for h in w.hypotheses]
        np.testing.assert_allclose([h.score for h in g.hypotheses], [h.score for h in w.hypotheses], atol=1e-4)


def test_backends_agree_on_the_trained_demo_model(demo_artifact_dir, small_corpus):
    from transduce.models.corpus import demo_corpus

    _, valid = demo_corpus(n_train=0, n_valid=60, seed=3)
    texts = [s for s, _ in valid]
    outs = {name: load(demo_artifact_dir, backend=name) for name in ("torch", "onnxruntime")}
    for beam in (1, 4):
        a = outs["torch"].translate(texts, beam_size=beam)
        b = outs["onnxruntime"].translate(texts, beam_size=beam)
        assert [r.tokens for r in a] == [r.tokens for r in b]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_the_torch_backend_refuses_options_it_would_ignore(tiny_artifact_dir):
    from transduce.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="torch backend takes no option fused, provider"):
        make_backend(tiny_artifact_dir, "torch", fused=False, provider="cpu")


def test_tampered_or_missing_artifact_files_are_refused(tiny_artifact_dir, tmp_path):
    art = _copy(tiny_artifact_dir, tmp_path / "a")
    with open(os.path.join(art, "decoder_step.onnx"), "r+b") as f:
        f.seek(-20, os.SEEK_END)
        f.write(b"\x00" * 4)
    with pytest.raises(ArtifactError, match=r"decoder_step.onnx does not match its sha256.*\n.*transduce export"):
        load(art)
    missing = _copy(tiny_artifact_dir, tmp_path / "m")
    os.unlink(os.path.join(missing, "encoder.onnx"))
    with pytest.raises(ArtifactError, match="encoder.onnx is missing"):
        load(missing)
    art2 = _copy(tiny_artifact_dir, tmp_path / "b")
    m = json.loads(open(os.path.join(art2, "manifest.json")).read())
    m["contract_version"] = 999
    open(os.path.join(art2, "manifest.json"), "w").write(json.dumps(m))
    with pytest.raises(ArtifactError, match="contract version 999.*\n.*transduce export"):
        load(art2)
    m["contract_version"], m["files"]["tokenizer.json"] = 2, None  # a hand-edited entry
    open(os.path.join(art2, "manifest.json"), "w").write(json.dumps(m))
    with pytest.raises(ArtifactError, match="does not give tokenizer.json as"):
        load(art2)


def test_parity_passes_on_good_and_fails_on_perturbed(demo_artifact_dir, demo_model_dir, tmp_path):
    from transduce.models.corpus import demo_corpus
    from transduce.models.tokenizer import Tokenizer
    from transduce.verify.parity import run_parity

    _, valid = demo_corpus(n_train=0, n_valid=24, seed=3)
    sources, targets = [s for s, _ in valid], [t for _, t in valid]
    tok = Tokenizer.from_file(os.path.join(demo_artifact_dir, "tokenizer.json"))
    ref = TorchBackend.from_model_dir(demo_model_dir)
    good = run_parity(ref, make_backend(demo_artifact_dir, "onnxruntime"), tok, sources, targets)
    assert good.passed, good.to_dict()
    lps = {s.name: s for s in good.teacher_forced if s.name.startswith("log_probs")}
    assert set(lps) == {"log_probs [decoder_step.ort.onnx]", "log_probs [decoder_step.onnx]"}  # each step graph
    assert all(s.max_abs < 1e-4 for s in lps.values())
    bad_art = perturb_one_weight(demo_artifact_dir, tmp_path / "bad")  # the standard step graph only
    bad = run_parity(ref, make_backend(bad_art, "onnxruntime"), tok, sources, targets)
    assert not bad.passed
    lp_bad = {s.name: s for s in bad.teacher_forced}
    assert (lp_bad["log_probs [decoder_step.onnx]"].failing > 0
            and lp_bad["log_probs [decoder_step.onnx]"].max_abs > 1e-3)
    assert lp_bad["log_probs [decoder_step.ort.onnx]"].passed  # the untouched fused graph still matches
    assert json.loads(json.dumps(bad.to_dict()))["passed"] is False


def test_parity_says_when_it_cuts_long_sources(tiny_artifact_dir, tiny_model_dir, tiny_tokenizer):
    from transduce.verify.parity import run_parity

    ref = TorchBackend.from_model_dir(tiny_model_dir)
    long = " ".join(["nine hundred and ninety"] * 40)  # past the tiny model's 63 source tokens
    with pytest.warns(UserWarning, match=r"parity: 1 source\(s\) longer than 63 tokens"):
        report = run_parity(ref, make_backend(tiny_artifact_dir, "onnxruntime"), tiny_tokenizer, [long, "one"], None,
                            beam_size=2)
    assert report.sentences == 2


def test_a_nan_score_fails_the_sequence_check():
    """Identical tokens with a NaN score (a broken candidate) must not pass as a score difference of 0."""
    from transduce.runtime.decoding import DecodeResult, Hypothesis
    from transduce.verify.parity import _compare_sequences
    from transduce.verify.tolerances import POLICIES

    def result(score):
        return DecodeResult((Hypothesis((5, 6), score, score, (score / 2, score / 2), True),))

    for ref, cand, passed in ((-1.0, -1.0, True), (-1.0, float("nan"), False), (-1.0, float("-inf"), False),
                              (float("-inf"), float("-inf"), True)):  # the same -inf on both sides is no difference
        check = _compare_sequences("greedy", None, [], [result(ref)], [result(cand)], POLICIES["fp32"], {})
        assert check.identical == 1 and check.passed is passed, (ref, cand)


def test_eager_parity_is_held_to_fp32_whatever_the_artifact(tiny_artifact_dir, tiny_model_dir, tmp_path, monkeypatch):
    """--backend torch checks the fp32 source model (on another device): an fp16 artifact's looser
    tolerances must not apply to it."""
    import transduce.runtime.devices as devices
    import transduce.verify.parity as parity

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact_dir, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["precision"] = "fp16"  # read without its hashes here
    (art / "manifest.json").write_text(json.dumps(manifest))
    seen = {}
    monkeypatch.setattr(parity, "run_parity", lambda *a, **k: seen.update(k))
    monkeypatch.setattr(devices, "torch_device", lambda name, *a, **k: "cuda:0" if name == "cuda" else "cpu")
    def candidate(path, spec):  # the eager model on the CPU, standing in for one on the GPU
        backend = TorchBackend.from_model_dir(tiny_model_dir)
        backend.artifact = Artifact.load(path, verify_hashes=False)
        return backend

    monkeypatch.setattr("transduce.runtime.api.open_backend", candidate)
    parity.parity_for_artifact(str(art), BackendSpec("torch", device="cuda", model_dir=tiny_model_dir), sentences=2)
    assert seen["precision"] == "fp32" and seen["candidate_name"] == "torch:cuda:0 (fp32)"


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.name)
def test_hand_edits_and_changed_files_are_refused(tiny_artifact_dir, tmp_path, refusal):
    """Every refusal of tests/artifact_edits.py (`transduce inspect` is held to the same table): a hand-edited
    manifest, a graph from another export or for one batch size, a changed or missing file. The IO contract
    and the manifest's model config against its copy of config.json are checked on load, before any session."""
    art = refused_copy(tiny_artifact_dir, tmp_path / "a", refusal)
    with pytest.raises(ArtifactError, match=refusal.says) as e:
        load(art)
    assert "transduce export" in e.value.hint


def test_graph_headers_are_read_as_onnx_reads_them(tiny_artifact_dir, tmp_path):
    """The runtime reads each graph's inputs, outputs and op types from the protobuf wire format, skipping the
    weights (transduce/runtime/checks.py): the same as onnx's own reader finds, initializers left out of the
    inputs as ONNX Runtime leaves them out."""
    import onnx

    from transduce.formats import contract
    from transduce.formats.dtypes import onnx_type
    from transduce.runtime.checks import read_graph_header

    def dims(v):
        shape = v.type.tensor_type.shape
        return tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in shape.dim)

    for name in (contract.ENCODER_FILE, contract.STEP_FILE, contract.ORT_STEP_FILE):
        path = os.path.join(tiny_artifact_dir, name)
        graph = onnx.load(path).graph
        header = read_graph_header(path)
        for got, values in ((header.inputs, graph.input), (header.outputs, graph.output)):
            assert got == [(v.name, onnx_type(v.type.tensor_type.elem_type), dims(v)) for v in values], name
        assert header.op_types == {n.op_type for n in graph.node}
    model = onnx.load(os.path.join(tiny_artifact_dir, contract.ENCODER_FILE))
    model.graph.input.append(onnx.helper.make_tensor_value_info(model.graph.initializer[0].name, 1, None))
    onnx.save(model, tmp_path / "init.onnx")  # an initializer listed as an input too (older IR versions)
    assert [i[0] for i in read_graph_header(str(tmp_path / "init.onnx")).inputs] == ["src_ids", "src_lengths"]
    for junk in (b"", b"not a protobuf at all \xff\xff\xff", b"\x3a\x05ab"):  # the last: a field cut short
        (tmp_path / "junk.onnx").write_bytes(junk)
        with pytest.raises(ValueError):
            read_graph_header(str(tmp_path / "junk.onnx"))


def test_listed_files_stay_inside_and_unreadable_ones_are_named(tmp_path, monkeypatch):
    from transduce.io import files

    (tmp_path / "a.bin").write_bytes(b"abc")
    good = file_entry(tmp_path / "a.bin")
    problem = listed_file_problem
    assert problem(str(tmp_path), "a.bin", good) is None
    for name in ("/etc/hostname", "../a.bin", "x/../../a.bin", "", 5):
        assert "not a file name inside" in problem(str(tmp_path), name, good)
    assert "does not give a.bin as" in problem(str(tmp_path), "a.bin", {"bytes": "3"})
    assert "has 3 bytes, the manifest says 4" in problem(str(tmp_path), "a.bin", {**good, "bytes": 4})

    def denied(path, chunk=0):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(files, "sha256_file", denied)
    assert "a.bin cannot be read (Permission denied)" in problem(str(tmp_path), "a.bin", good)
    assert problem(str(tmp_path), "a.bin", good, verify_hash=False) is None


def test_a_hand_edited_model_config_or_version_is_refused(tiny_artifact_dir, edited_copy):
    """The manifest's model config is checked whole when it is read: n_heads 0, a missing eos_id or one
    past the vocabulary failed later as a ZeroDivisionError, KeyError or IndexError."""

    for n, (edit, says) in enumerate(((lambda m: m["model"].update(n_heads=0), "n_heads must be >= 1"),
                                      (lambda m: m["model"].pop("eos_id"), "its model config lacks eos_id"),
                                      (lambda m: m["model"].update(eos_id=5000), "must be distinct and < vocab_size"),
                                      (lambda m: m.update(contract_version=2.0), "contract version 2.0"))):
        art = edited_copy(tiny_artifact_dir, f"a{n}", "manifest.json", edit)
        with pytest.raises(ArtifactError, match=says):
            read_manifest(art, verify_hashes=False)


def test_the_rebuild_hint_keeps_the_artifacts_options(tiny_artifact_dir, tiny_model_dir, edited_copy):
    """The hint of a refused artifact is the export that makes it again as it was made (its model, precision,
    quantization, no fused step graph); an engine directory, which export refuses, gets the export and the build."""
    from transduce.formats import contract

    def old(**changes):
        return lambda m: m.update(contract_version=1, **changes)

    cases = ((old(), ""), (old(quantization={"method": "int8"}), " --quantize int8"),
             (old(precision="fp16"), " --precision fp16"),
             # a hand edit gets no option export would refuse: an unknown method, or int8 of an fp16 export
             (old(quantization={"method": "int4"}), ""), (old(precision="fp16", quantization={"method": "int8"}),
                                                         " --precision fp16"))
    for n, (edit, options) in enumerate(cases):
        art = edited_copy(tiny_artifact_dir, f"v{n}", "manifest.json", edit)
        with pytest.raises(ArtifactError, match="contract version 1") as e:
            read_manifest(art, verify_hashes=False)
        assert e.value.hint == (f"rebuild the artifact with: transduce export {tiny_model_dir} --out {art} "
                                f"--force{options}")

    def no_ort_step(m):  # as `--no-ort-step` records it; a manifest without the record gets no option (above)
        m.update(contract_version=1, source_model={"path": "/gone"}, ort_step_graph=False)
        m["files"].pop(contract.ORT_STEP_FILE)

    art = edited_copy(tiny_artifact_dir, "noort", "manifest.json", no_ort_step)
    with pytest.raises(ArtifactError) as e:
        read_manifest(art, verify_hashes=False)
    assert e.value.hint == f"rebuild the artifact with: transduce export MODEL_DIR --out {art} --force --no-ort-step"
    (art / ENGINE_MANIFEST_FILE).write_text("{}")  # an engine directory holds its artifact's manifest
    with pytest.raises(ArtifactError) as e:
        read_manifest(art, verify_hashes=False)
    assert e.value.hint == (f"{art} is an engine directory: export the model again, then build its engines again: "
                            f"transduce export MODEL_DIR --out ARTIFACT_DIR --force --no-ort-step && "
                            f"transduce build ARTIFACT_DIR --out {art} --force")


def test_an_artifact_must_list_its_tokenizer(tiny_artifact_dir, edited_copy):
    """decode reads tokenizer.json: an unlisted one would be used unchecked (another model's, say)."""

    art = edited_copy(tiny_artifact_dir, "a", "manifest.json", lambda m: m["files"].pop("tokenizer.json"))
    with pytest.raises(ArtifactError, match="does not list encoder.onnx, decoder_step.onnx, tokenizer.json and config"):
        read_manifest(art)


def test_the_core_protocol_and_the_capabilities_are_declared_apart(tiny_model, tiny_artifact_dir):
    """Every backend has the core (what the search calls); the optional capabilities are protocols of their own,
    asked with isinstance: the eager model admits rows and gives full outputs, but has no parts nor step graphs;
    the ONNX Runtime backend has them all (its step graphs, parts and load-time choices)."""
    from transduce.formats import contract
    from transduce.runtime.backends import base
    from transduce.runtime.backends.base import (
        AdmitsRows,
        Backend,
        EncodesAside,
        FullOutputs,
        Shards,
        StepGraphs,
        Tuned,
    )

    eager = TorchBackend(tiny_model)
    assert Backend in TorchBackend.__mro__ and eager.artifact is None and not base.missing_members(eager)
    assert base.capabilities(eager) == ["AdmitsRows", "FullOutputs", "KeepsLogProbs", "Tuned", "ReturnsAttention"]
    assert not isinstance(eager, Shards) and base.step_graphs(eager) == []
    assert eager.tuning() == {"precision": "fp32", "cuda_graph": False}
    state = eager.begin(eager.encode(np.array([[5, 2]]), np.array([2])), np.arange(1), 2)
    eager.end(state)  # nothing to hand back
    with base.only_step_graph(eager, None):
        pass
    with pytest.raises(ValueError, match="not one of this backend's step graphs"), base.only_step_graph(eager, "x"):
        pass
    ort = make_backend(tiny_artifact_dir, "onnxruntime", threads=2, wide_steps="rows")
    assert ort.artifact.path == tiny_artifact_dir and ort.artifact.config == ort.config and ort.device == "cpu"
    assert all(isinstance(ort, c) for c in (AdmitsRows, EncodesAside, FullOutputs, Shards, StepGraphs, Tuned))
    assert ort.encodes_aside and not isinstance(eager, EncodesAside)
    tuning = ort.tuning()
    assert json.loads(json.dumps(tuning)) == tuning  # JSON-ready, for reports
    assert tuning["step_threads"] == 1 and tuning["wide_session"] and tuning["shard_count"] == 2
    assert tuning["wide_steps"] == {"option": "rows", "rule": "rows"} and tuning["step_graph"] == contract.ORT_STEP_FILE
    with ort.only_step_graph(contract.STEP_FILE):
        with ort.only_step_graph(None):  # None keeps the graph pinned around it
            assert ort.shards(16, 4) is None
        assert ort.shards(16, 4) is None
    assert len(ort.shards(16, 4)) == 2
    with pytest.raises(ValueError, match="not one of this backend's step graphs"), ort.only_step_graph("x.onnx"):
        pass


def test_an_artifact_exported_before_the_newer_deviation_fields_loads_and_decodes_as_before(tiny_artifact_dir,
                                                                                               edited_copy):
    """An artifact whose manifest and config.json predate a deviation field (positions, layernorm_embedding,
    untied_output: each defaults to the paper's) is read with that default, not refused with a rebuild hint: an
    export from before the field existed holds the paper's model."""
    import hashlib
    import json

    from transduce.formats.model_config import DEVIATION_FIELDS
    from transduce.runtime.api import load

    later = ("positions", "layernorm_embedding", "untied_output")
    assert set(later) <= set(DEVIATION_FIELDS)

    def old_manifest(m):
        for name in later:
            m["model"].pop(name)
        config = json.loads((art / "config.json").read_text())
        for name in later:
            config["model"].pop(name)
        data = json.dumps(config).encode()
        (art / "config.json").write_bytes(data)
        m["files"]["config.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}

    art = edited_copy(tiny_artifact_dir, "old", "manifest.json", lambda m: None)
    manifest = json.loads((art / "manifest.json").read_text())
    old_manifest(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    texts = ["a b c", "b c d e"]
    want = [t.tokens for t in load(tiny_artifact_dir, threads=1).translate(texts, beam_size=2, max_len_b=6)]
    got = [t.tokens for t in load(str(art), threads=1).translate(texts, beam_size=2, max_len_b=6)]
    assert got == want
