"""A model with the imported models' deviations (gelu, fairseq's position table and offset, no embedding scale,
a projection bias, untied source embedding with the projection tied to the target's) exports: both step graphs
and the encoder validate against eager PyTorch, and TensorRT's operator check passes."""

from __future__ import annotations

import torch


def test_a_model_with_every_deviation_exports_and_validates(tiny_tokenizer, tmp_path):
    from transduce.exporter.onnx_export import export_artifact
    from transduce.models.checkpoint import save_model_dir
    from transduce.models.config import ModelConfig
    from transduce.models.transformer import Transformer
    from transduce.verify.opcheck import check_file

    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=tiny_tokenizer.vocab_size, encoder_layers=1, decoder_layers=1, d_model=32, n_heads=4,
                      d_ff=64, max_positions=32, activation="gelu", position_layout="halves",
                      position_frequencies="fairseq", position_offset=2, scale_embedding=False,
                      final_logits_bias=True, share_embeddings=False, tie_output=True)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 1.0)
    save_model_dir(tmp_path / "model", model, tiny_tokenizer)
    manifest = export_artifact(tmp_path / "model", tmp_path / "art")  # validates every graph against eager
    assert manifest["model"]["activation"] == "gelu" and "decoder_step.ort.onnx" in manifest["files"]
    for graph in ("encoder.onnx", "decoder_step.onnx"):
        assert check_file(tmp_path / "art" / graph) == []


def test_learned_positions_and_the_embedding_norm_export_and_validate(tiny_tokenizer, tmp_path):
    """mBART's deviations (a learned table per stack, a LayerNorm on embeddings + positions, pre-norm, gelu) in
    every graph, the attention step's included: validated against eager, TensorRT's operator check passes; the
    ONNX Runtime step graph, which has no such tables, is not built."""
    from transduce.exporter.onnx_export import export_artifact
    from transduce.models.checkpoint import save_model_dir
    from transduce.models.config import ModelConfig
    from transduce.models.transformer import Transformer
    from transduce.verify.opcheck import check_file

    torch.manual_seed(4)
    cfg = ModelConfig(vocab_size=tiny_tokenizer.vocab_size, encoder_layers=1, decoder_layers=1, d_model=32, n_heads=4,
                      d_ff=64, max_positions=32, activation="gelu", norm_first=True, positions="learned",
                      layernorm_embedding=True)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # norms that are not the identity, so a graph that skipped them fails validation
        for norm in (model.encoder_embed_norm, model.decoder_embed_norm):
            norm.weight.normal_(1.0, 0.5)
            norm.bias.normal_(0.0, 0.5)
    save_model_dir(tmp_path / "model", model, tiny_tokenizer)
    manifest = export_artifact(tmp_path / "model", tmp_path / "art")
    assert manifest["model"]["positions"] == "learned" and "decoder_step.ort.onnx" not in manifest["files"]
    for graph in ("encoder.onnx", "decoder_step.onnx", "decoder_step.attn.onnx"):
        assert check_file(tmp_path / "art" / graph) == []
