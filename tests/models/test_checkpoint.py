"""Model directories: bit-exact round trip, strict loading, clear errors on damage."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from transduce.errors import CheckpointError, TransduceError
from transduce.models.checkpoint import load_model_dir, save_model_dir


def test_round_trip_is_bit_exact(tiny_model, tiny_model_dir):
    model, tok, cfg = load_model_dir(tiny_model_dir)
    assert model.cfg == tiny_model.cfg
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    assert tok.vocab_size == tiny_model.cfg.vocab_size
    assert set(os.listdir(tiny_model_dir)) == {"config.json", "model.safetensors", "tokenizer.json"}


@pytest.fixture
def damaged(tmp_path, tiny_model_dir):
    path = tmp_path / "m"
    shutil.copytree(tiny_model_dir, path)
    return path


def test_truncated_weights(damaged):
    w = damaged / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        load_model_dir(damaged)


def test_corrupted_weights(damaged):
    w = damaged / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors.*sha256"):
        load_model_dir(damaged)


def test_missing_files(damaged):
    os.unlink(damaged / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_model_dir(damaged)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_dir(damaged / "nope")


def test_truncated_config(damaged):
    c = damaged / "config.json"
    c.write_text(c.read_text()[:50])
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_model_dir(damaged)


def test_config_whose_model_is_not_an_object(damaged):
    cfg = json.loads((damaged / "config.json").read_text())
    cfg["model"] = None
    (damaged / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TransduceError,
                       match="config.json: the model config must be a JSON object of fields, got NoneType"):
        load_model_dir(damaged)


def test_config_that_does_not_match_weights(damaged, tiny_model, tiny_tokenizer):
    cfg = json.loads((damaged / "config.json").read_text())
    cfg["model"]["d_ff"] = 128
    (damaged / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="other shapes than the config"):
        load_model_dir(damaged)


@pytest.mark.parametrize("field,value", [("n_heads", 2), ("layer_norm_eps", 1e-6), ("max_positions", 40)])
def test_config_fields_that_keep_the_shapes_must_be_the_ones_saved_with_the_weights(damaged, field, value):
    """config.json is the one file no hash covers; a hand edit of a field that leaves every weight's shape
    alone would load and compute something else."""
    cfg = json.loads((damaged / "config.json").read_text())
    before = cfg["model"][field]
    cfg["model"][field] = value
    (damaged / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"not the one the weights were saved with: {field} {value!r} "
                                              rf"\(saved with the weights: {before!r}\)"):
        load_model_dir(damaged)


def test_dropout_may_differ_from_the_one_saved_with_the_weights(damaged):
    """Dropout is training-only: the weights compute the same with another (a resumed run may change it)."""
    cfg = json.loads((damaged / "config.json").read_text())
    cfg["model"]["dropout"] = 0.3
    (damaged / "config.json").write_text(json.dumps(cfg))
    assert load_model_dir(damaged)[0].cfg.dropout == 0.3


def test_weights_saved_without_their_config_still_load(damaged, tiny_model):
    """Weights written before the config went into their metadata carry none: loaded as they are."""
    from safetensors.torch import load_file, save_file

    from transduce.io.files import file_entry

    w = damaged / "model.safetensors"
    save_file(load_file(w), w, metadata={"format": "transduce-model"})
    cfg = json.loads((damaged / "config.json").read_text())
    cfg["files"]["model.safetensors"] = file_entry(str(w))
    (damaged / "config.json").write_text(json.dumps(cfg))
    assert load_model_dir(damaged)[0].cfg == tiny_model.cfg


def test_special_ids_must_be_the_tokenizers(tmp_path, tiny_model, tiny_tokenizer):
    """A model whose EOS id is one of its tokenizer's text pieces would never end where it should: saving
    one is refused, and a hand-edited config.json (not hash-checked) is a CheckpointError at load."""
    from transduce.errors import ConfigError
    from transduce.models.transformer import Transformer

    with pytest.raises(ConfigError, match=r"eos_id 6 \(the tokenizer's is 2\)"):
        save_model_dir(tmp_path / "x", Transformer(tiny_model.cfg.replace(bos_id=5, eos_id=6)), tiny_tokenizer)
    assert not (tmp_path / "x").exists()
    save_model_dir(tmp_path / "m", tiny_model, tiny_tokenizer)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model"].update(bos_id=5, eos_id=6)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError,
                       match=r"special ids are not its tokenizer's: bos_id 5 \(the tokenizer's is 1\)"):
        load_model_dir(tmp_path / "m")
    with pytest.raises(ConfigError, match="the tokenizer is a tokenizers.Tokenizer, not transduce's"):
        save_model_dir(tmp_path / "raw", tiny_model, tiny_tokenizer._tok)  # the Hugging Face object itself


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, tiny_model, tiny_tokenizer):
    path = tmp_path / "m"
    save_model_dir(path, tiny_model, tiny_tokenizer)
    before = {p: (path / p).read_bytes() for p in os.listdir(path)}

    class Boom(Exception):
        pass

    class BadTokenizer:
        pad_id, bos_id, eos_id, unk_id = (tiny_tokenizer.pad_id, tiny_tokenizer.bos_id, tiny_tokenizer.eos_id,
                                          tiny_tokenizer.unk_id)

        def save(self, _):
            raise Boom()

    with pytest.raises(Boom):
        save_model_dir(path, tiny_model, BadTokenizer())
    assert {p: (path / p).read_bytes() for p in os.listdir(path)} == before
    assert [p for p in os.listdir(tmp_path) if p != "m"] == []  # no temporary left behind


def test_directories_get_the_umask_modes(tmp_path, tiny_model, tiny_tokenizer):
    """mkdtemp's 0700 (and safetensors' 0600) would hide a model from a serving account."""
    import stat

    old = os.umask(0o022)
    try:
        path = tmp_path / "m"
        save_model_dir(path, tiny_model, tiny_tokenizer, optimizer_state={}, train_state={"step": 0})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    for root, dirs, files in os.walk(path):
        assert all(stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o755 for d in dirs)
        assert all(stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o644 for f in files), files


def test_hand_edited_file_entries_are_checkpoint_errors(tmp_path, tiny_model, tiny_tokenizer):
    for edit in (lambda c: c.update(files=[]), lambda c: c["files"]["model.safetensors"].pop("bytes"),
                 lambda c: c["files"].update({"tokenizer.json": None})):
        path = tmp_path / f"m{len(os.listdir(tmp_path))}"
        save_model_dir(path, tiny_model, tiny_tokenizer)
        cfg = json.loads((path / "config.json").read_text())
        edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match="does not give"):
            load_model_dir(path)


def test_modes_of_hard_linked_files_are_left_alone(tmp_path):
    """An engine directory hard-links its artifact's files: setting modes there must not touch the artifact."""
    import stat

    from transduce.io.atomic import atomic_directory

    src = tmp_path / "artifact.onnx"
    src.write_text("x")
    os.chmod(src, 0o444)
    with atomic_directory(tmp_path / "engine") as tmp:
        os.link(src, os.path.join(tmp, "artifact.onnx"))
        with open(os.path.join(tmp, "engine.plan"), "w") as f:
            f.write("plan")
        os.chmod(os.path.join(tmp, "engine.plan"), 0o600)
    assert stat.S_IMODE(os.stat(src).st_mode) == 0o444
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(tmp_path / "engine" / "engine.plan").st_mode) == 0o666 & ~mask


def test_a_replacement_killed_between_its_renames_says_how_to_restore(tmp_path, tiny_model, tiny_tokenizer,
                                                                      monkeypatch):
    """atomic_directory moves the old copy aside, then the new one into place: a kill in between leaves
    neither at the path; the error names the complete old copy and the command that restores it."""
    import transduce.io.atomic as io

    path = tmp_path / "m"
    save_model_dir(path, tiny_model, tiny_tokenizer)
    replace = os.replace

    def killed(src, dst):
        if str(dst) == str(path):
            raise KeyboardInterrupt  # as if the process died right here
        replace(src, dst)

    monkeypatch.setattr(io.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save_model_dir(path, tiny_model, tiny_tokenizer)
    monkeypatch.setattr(io.os, "replace", replace)
    with pytest.raises(CheckpointError, match="does not exist") as e:
        load_model_dir(path)
    (old,) = [n for n in os.listdir(tmp_path) if n.startswith(".m.old-")]
    assert e.value.hint == (f"a replacement of it was interrupted; the previous copy is {str(tmp_path / old)!r}: "
                            f"restore it with: mv {tmp_path / old} {path}")
    os.rename(tmp_path / old, path)
    load_model_dir(path)


def test_temporary_copies_of_killed_writers_are_removed(tmp_path, tiny_model, tiny_tokenizer):
    """A killed save leaves .m.tmp-HOST-PID-*: the next write of m removes those whose process is gone and
    that nothing changed for an hour, and keeps a running process's, another host's and a recent one."""
    import subprocess
    import sys

    from transduce.io.reaping import tmp_prefix as _tmp_prefix

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    prefix = _tmp_prefix("m")
    abandoned = tmp_path / f"{prefix}{dead_pid}-abc"
    running = tmp_path / f"{prefix}{os.getppid()}-def"
    other_host = tmp_path / f".m.tmp-otherhost-{dead_pid}-ghi"
    recent = tmp_path / f"{prefix}{dead_pid}-jkl"  # its process is gone here, but it changed a minute ago
    for d in (abandoned, running, other_host, recent):
        (d / "training").mkdir(parents=True)
        (d / "training" / "state.json").write_text("{}")
    hours_ago = os.stat(tmp_path).st_mtime - 2 * 3600
    for d in (abandoned, running, other_host):
        for p in (d, d / "training", d / "training" / "state.json"):
            os.utime(p, (hours_ago, hours_ago))
    save_model_dir(tmp_path / "m", tiny_model, tiny_tokenizer)
    assert sorted(os.listdir(tmp_path)) == sorted(["m", running.name, other_host.name, recent.name])


def test_an_export_or_a_file_given_as_a_model_dir_says_so(tmp_path, tiny_model_dir, tiny_artifact_dir):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a model directory"):
        load_model_dir(tmp_path / "afile")
    with pytest.raises(CheckpointError, match="is an ONNX export .transduce export., not a model directory"):
        load_model_dir(tiny_artifact_dir)


def test_a_model_without_training_state_cannot_be_resumed(tmp_path, tiny_model, tiny_tokenizer):
    from transduce.models.checkpoint import load_training_state

    save_model_dir(tmp_path / "m", tiny_model, tiny_tokenizer)  # no optimizer or train state: not resumable
    with pytest.raises(CheckpointError, match="holds a model but no training state") as e:
        load_training_state(tmp_path / "m")
    assert "--force" in e.value.hint
