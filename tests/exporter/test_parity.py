"""Numbers: the exported fp32 graphs against eager PyTorch, step by step and over whole sequences,
and ONNX Runtime against onnx's ReferenceEvaluator (a third, independent implementation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

LOG_PROBS_ATOL = 1e-4


def _padded_batch(cfg, lengths, rng):
    s = max(lengths)
    src = rng.integers(4, cfg.vocab_size, (len(lengths), s))
    lengths = np.array(lengths, dtype=np.int64)
    src[np.arange(s)[None, :] >= lengths[:, None]] = cfg.pad_id
    return src, lengths


def _eager_step(model, tokens, positions, lengths, past, cross):
    t = torch.from_numpy
    with torch.inference_mode():
        lp, nk, nv = model.decode_step(t(tokens), t(positions), t(lengths), [t(a) for a in past[0::2]],
                                       [t(a) for a in past[1::2]], [t(a) for a in cross[0::2]],
                                       [t(a) for a in cross[1::2]])
    return lp.numpy(), [a.numpy() for kv in zip(nk, nv) for a in kv]


@pytest.mark.parametrize("lengths", [[9], [1, 64, 30]], ids=["batch1", "padded"])
def test_step_parity_at_every_past_length(artifact_fp32, tiny_model, lengths):
    """ONNX step == eager step at past lengths 0..12 given the same cache; slots >= position hold garbage."""
    from transduce.verify.graph_runners import ArtifactRunner

    cfg = tiny_model.cfg
    rng = np.random.default_rng(len(lengths))
    runner = ArtifactRunner(artifact_fp32.path)
    src, src_lengths = _padded_batch(cfg, lengths, rng)
    enc = runner.encode(src, src_lengths)
    cross = [enc[f"cross_{kv}_{i}"] for i in range(cfg.decoder_layers) for kv in ("key", "value")]
    b, steps = len(lengths), 13
    past = [rng.normal(0, 5, (b, cfg.n_heads, steps + 3, cfg.head_dim)).astype(np.float32) for _ in cross]
    tokens = rng.integers(4, cfg.vocab_size, (b, steps))
    tokens[:, 0] = cfg.bos_id
    for t in range(steps):
        positions = np.full(b, t)
        got = runner.step(tokens[:, t], positions, src_lengths, past, cross)
        ref_lp, ref_kv = _eager_step(tiny_model, tokens[:, t], positions, src_lengths, past, cross)
        np.testing.assert_allclose(got["log_probs"], ref_lp, atol=LOG_PROBS_ATOL, rtol=0, err_msg=f"past length {t}")
        new_names = [n for n in got if n != "log_probs"]  # new_key_0, new_value_0, ... (the contract's order)
        for i, name in enumerate(new_names):
            np.testing.assert_allclose(got[name], ref_kv[i], atol=1e-5, rtol=1e-4, err_msg=f"{name} at past length {t}")
            past[i][:, :, t] = ref_kv[i][:, :, 0]  # the runtime's write into slot t


def test_garbage_beyond_position_is_ignored(artifact_fp32, tiny_model):
    """Two caches that differ only in slots >= positions[b] give identical outputs."""
    from transduce.verify.graph_runners import ArtifactRunner

    cfg = tiny_model.cfg
    rng = np.random.default_rng(3)
    runner = ArtifactRunner(artifact_fp32.path)
    src, lengths = _padded_batch(cfg, [5, 2, 7], rng)
    enc = runner.encode(src, lengths)
    cross = [enc[f"cross_{kv}_{i}"] for i in range(cfg.decoder_layers) for kv in ("key", "value")]
    positions = np.array([0, 3, 9])
    a = [rng.standard_normal((3, cfg.n_heads, 10, cfg.head_dim)).astype(np.float32) for _ in cross]
    b = [x.copy() for x in a]
    for x in b:
        for r, p in enumerate(positions):
            x[r, :, p:] = 1e3 * rng.standard_normal(x[r, :, p:].shape)
    tokens = np.array([cfg.bos_id, 7, 9])
    out_a, out_b = runner.step(tokens, positions, lengths, a, cross), runner.step(tokens, positions, lengths, b, cross)
    for name in out_a:
        np.testing.assert_array_equal(out_a[name], out_b[name], err_msg=name)


def test_stepping_reproduces_teacher_forcing(artifact_fp32, tiny_model):
    """Step the ONNX decoder over whole target sequences, writing new K/V into a preallocated numpy
    buffer as the contract says; each step's log_probs equal log_softmax of Transformer.forward."""
    from transduce.verify.graph_runners import ArtifactRunner

    cfg = tiny_model.cfg
    rng = np.random.default_rng(11)
    runner = ArtifactRunner(artifact_fp32.path)
    src, src_lengths = _padded_batch(cfg, [1, 40], rng)
    b, t_len = 2, 24
    tgt_in = rng.integers(4, cfg.vocab_size, (b, t_len))
    tgt_in[:, 0] = cfg.bos_id
    with torch.inference_mode():
        logits = tiny_model(torch.from_numpy(src), torch.from_numpy(src_lengths), torch.from_numpy(tgt_in))
        want = torch.log_softmax(logits.float(), dim=-1).numpy()  # (B, T, V)
    enc = runner.encode(src, src_lengths)
    cross = [enc[f"cross_{kv}_{i}"] for i in range(cfg.decoder_layers) for kv in ("key", "value")]
    cache = [np.zeros((b, cfg.n_heads, t_len, cfg.head_dim), np.float32) for _ in cross]
    new_names = [f"new_{kv}_{i}" for i in range(cfg.decoder_layers) for kv in ("key", "value")]
    for t in range(t_len):
        out = runner.step(tgt_in[:, t], np.full(b, t), src_lengths, cache, cross)
        np.testing.assert_allclose(out["log_probs"], want[:, t], atol=LOG_PROBS_ATOL, rtol=0, err_msg=f"step {t}")
        for buf, name in zip(cache, new_names):
            buf[:, :, t] = out[name][:, :, 0]  # slot `position`


def test_reference_evaluator_agrees_with_onnxruntime(artifact_fp32, tiny_model):
    """A third implementation: onnx.reference runs the same graphs and agrees with ONNX Runtime."""
    from transduce.verify.graph_runners import ArtifactRunner

    cfg = tiny_model.cfg
    rng = np.random.default_rng(5)
    ort_runner = ArtifactRunner(artifact_fp32.path, evaluator="onnxruntime")
    ref_runner = ArtifactRunner(artifact_fp32.path, evaluator="reference")
    src, lengths = _padded_batch(cfg, [1, 23, 12], rng)
    a, r = ort_runner.encode(src, lengths), ref_runner.encode(src, lengths)
    for name in a:
        np.testing.assert_allclose(a[name], r[name], atol=1e-5, rtol=1e-4, err_msg=name)
    cross = [a[f"cross_{kv}_{i}"] for i in range(cfg.decoder_layers) for kv in ("key", "value")]
    past = [rng.standard_normal((3, cfg.n_heads, 6, cfg.head_dim)).astype(np.float32) for _ in cross]
    for positions in (np.array([0, 0, 0]), np.array([5, 2, 1])):
        tokens = rng.integers(4, cfg.vocab_size, 3)
        a, r = (ort_runner.step(tokens, positions, lengths, past, cross),
                ref_runner.step(tokens, positions, lengths, past, cross))
        for name in a:
            np.testing.assert_allclose(a[name], r[name], atol=1e-5, rtol=1e-4, err_msg=name)
