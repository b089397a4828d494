"""Comparisons of an imported model with the Hugging Face model it came from."""

from __future__ import annotations

import numpy as np
import torch


def teacher_forced_error(model, hf, src: list[list[int]], tgt: list[list[int]], start: int) -> float:
    """Max |log-prob difference| over every position and vocabulary entry, one sentence at a time (fp32)."""
    worst = 0.0
    for s, t in zip(src, tgt):
        s_ids, t_in = torch.tensor([s]), torch.tensor([[start] + t[:-1]])
        with torch.no_grad():
            ours = torch.log_softmax(model(s_ids, torch.tensor([len(s)]), t_in), dim=-1)
            # use_cache=False: FSMT applies no causal mask when it caches (it expects one token at a time)
            theirs = torch.log_softmax(hf(input_ids=s_ids, decoder_input_ids=t_in, use_cache=False).logits.float(),
                                       dim=-1)
        worst = max(worst, (ours - theirs).abs().max().item())
    return worst


def hf_generate(hf, src: list[list[int]], eos: int, **kwargs) -> list[list[int]]:
    """HF's output per source (one at a time: no padding), without the start token and cut after EOS's place."""
    out = []
    for s in src:
        with torch.no_grad():
            ids = hf.generate(input_ids=torch.tensor([s]), do_sample=False, **kwargs)[0].tolist()[1:]
        out.append(ids[: ids.index(eos)] if eos in ids else ids)
    return out


def ours_decode(model, src: list[list[int]], **options) -> list[list[int]]:
    from transduce.runtime.backends.torch_backend import TorchBackend
    from transduce.runtime.decoding import DecodingOptions, decode

    backend = TorchBackend(model)
    out = []
    for s in src:
        res = decode(backend, np.array([s]), np.array([len(s)]), DecodingOptions(**options))[0]
        out.append(list(res.hypotheses[0].tokens))
    return out
