"""What training measures: the paper's learning-rate schedule, the label-smoothed loss, and the held-out
figures (validation loss, greedy exact match, BLEU)."""

from __future__ import annotations

import math

from transduce.training.data import Example


def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The paper's schedule: scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def label_smoothed_loss(logits, target, epsilon: float, pad_id: int):
    """Mean over non-pad targets of (1-eps) * NLL + eps * mean over non-pad classes of -log p.

    logits (B, T, V), target (B, T). Returns (loss, nll) as tensors; nll is the unsmoothed mean.
    """
    import torch

    lprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    mask = target != pad_id
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T)
    smooth = -(lprobs.sum(-1) - lprobs[..., pad_id]) / (lprobs.shape[-1] - 1)  # uniform over non-pad
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    n = mask.sum().clamp(min=1)
    return (loss * mask).sum() / n, (nll * mask).sum() / n


def evaluate(model, tokenizer, examples: list[Example], pairs: list[tuple[str, str]], n_sentences: int,
             max_tokens: int) -> dict[str, float]:
    """Validation loss (smoothed and NLL, per token), greedy exact match and BLEU on held-out pairs."""
    import numpy as np
    import sacrebleu
    import torch

    from transduce.runtime.backends.torch_backend import TorchBackend
    from transduce.runtime.decoding import DecodingOptions, decode
    from transduce.training.data import collate, make_batches

    cfg = model.cfg
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tot_nll, tot_tok = 0.0, 0
    with torch.inference_mode():
        for idx in make_batches(examples, max_tokens):
            src, lens, tin, tout = (t.to(device) for t in collate([examples[i] for i in idx], cfg.pad_id, cfg.bos_id,
                                                                  cfg.eos_id))
            _, nll = label_smoothed_loss(model(src, lens, tin), tout, 0.0, cfg.pad_id)
            n = int((tout != cfg.pad_id).sum())
            tot_nll += float(nll) * n
            tot_tok += n
    sub = examples[:n_sentences]
    refs = [tokenizer.normalize(t) for _, t in pairs[: len(sub)]]  # what a decode can give back at best
    backend = TorchBackend(model, str(device))
    hyps: list[str] = []
    opts = DecodingOptions(beam_size=1)
    for idx in make_batches(sub, max_tokens):
        batch = [sub[i] for i in idx]
        src, lens, _, _ = collate(batch, cfg.pad_id, cfg.bos_id, cfg.eos_id)
        res = decode(backend, src.numpy(), lens.numpy(), opts)
        for i, r in zip(idx, res):
            hyps.append((i, tokenizer.decode(r.best.tokens)))
    hyps_text = [h for _, h in sorted(hyps)]
    if was_training:
        model.train()
    exact = float(np.mean([h == r for h, r in zip(hyps_text, refs)])) if refs else 0.0
    bleu = sacrebleu.corpus_bleu(hyps_text, [refs]).score if refs else 0.0
    nll = tot_nll / max(tot_tok, 1)
    return {"valid_nll": nll, "valid_ppl": math.exp(min(nll, 50.0)), "exact_match": exact, "bleu": bleu}
