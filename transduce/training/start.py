"""How a training run starts: the tokenizer trained (or a checkpoint's), the model config, the data encoded, or for
--resume the checkpoint loaded and checked against this run. On several processes rank 0 does all of it; the others
build the same run from what it sends them (Start.shared, started_elsewhere), encoding the data themselves."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from transduce.errors import ConfigError, DataError
from transduce.training.checks import check_resumable, pairs_sha256, warn_overlap
from transduce.training.config import TrainConfig
from transduce.training.data import Batches, encode_pairs


def model_config(sentences: Callable[[], Iterable[str]], train_cfg: TrainConfig, tokenizer=None):
    """The tokenizer (trained on `sentences()` unless given) and the model config for it."""
    from transduce.models.checkpoint import special_id_mismatches
    from transduce.models.config import preset
    from transduce.models.tokenizer import Tokenizer

    if tokenizer is None:
        tokenizer = Tokenizer.train(sentences(), train_cfg.vocab_size)
    mcfg = preset(train_cfg.preset, tokenizer.vocab_size, train_cfg.model_overrides)
    wrong = special_id_mismatches(mcfg, tokenizer)
    if wrong:
        raise ConfigError(f"the model's special ids must be the tokenizer's: {', '.join(wrong)}",
                          hint="drop these --set overrides")
    return tokenizer, mcfg


def held_out(tokenizer, mcfg, valid_pairs: list[tuple[str, str]]):
    """The held-out pairs that fit max_positions, encoded; -> (their examples, those pairs)."""
    valid_ex, vkept = encode_pairs(tokenizer, valid_pairs, mcfg.max_positions)
    if not valid_pairs:
        raise DataError("there are no held-out pairs to validate on", hint="pass --valid FILE or a --valid-size >= 1")
    if not valid_ex:  # its loss would read 0.000 and its BLEU 0, as if measured
        raise DataError(f"none of the {len(valid_pairs)} held-out pairs fits the model's max_positions "
                        f"({mcfg.max_positions} tokens a side, EOS included)",
                        hint="hold out shorter pairs (--valid FILE), or raise max_positions (--set max_positions=N)")
    return valid_ex, [valid_pairs[i] for i in vkept]


def prepare(train_pairs, valid_pairs, train_cfg: TrainConfig, tokenizer=None):
    """Train (or reuse) the tokenizer, build the model config, and encode both corpora."""
    tokenizer, mcfg = model_config(lambda: (s for p in train_pairs for s in p), train_cfg, tokenizer)
    train_ex, kept = encode_pairs(tokenizer, train_pairs, mcfg.max_positions)
    if not train_ex:
        raise DataError("no training pair fits the model's max_positions")
    valid_ex, valid_pairs = held_out(tokenizer, mcfg, valid_pairs)
    return tokenizer, mcfg, train_ex, valid_ex, valid_pairs, len(train_pairs) - len(kept)


def _prepared(data, valid_pairs, train_cfg: TrainConfig, tokenizer=None):
    """prepare() for the data of a run: pairs in memory, or a streamed corpus (whose batches are read later) ->
    (tokenizer, model config, batch source, held-out examples and pairs, training pairs dropped)."""
    if isinstance(data, list):
        tokenizer, mcfg, train_ex, valid_ex, valid_pairs, dropped = prepare(data, valid_pairs, train_cfg, tokenizer)
        return tokenizer, mcfg, Batches(train_ex, train_cfg.max_tokens, train_cfg.seed), valid_ex, valid_pairs, dropped
    from transduce.training.stream import StreamBatches

    tokenizer, mcfg = model_config(lambda: data.sentences(valid_pairs), train_cfg, tokenizer)
    valid_ex, valid_kept = held_out(tokenizer, mcfg, valid_pairs)
    source = StreamBatches(data, tokenizer, mcfg.max_positions, train_cfg.max_tokens, train_cfg.seed)
    return tokenizer, mcfg, source, valid_ex, valid_kept, 0


def _fingerprint(data, valid_pairs) -> str:
    """The training pairs' fingerprint; a streamed corpus's comes from a pass over it (the tokenizer's, if one was
    trained on it), which also counts the held-out pairs among them, warned about here (a corpus held in memory
    is checked as it is read: corpus.read_corpus)."""
    if isinstance(data, list):
        return pairs_sha256(data)
    sha256 = data.fingerprint(valid_pairs)
    warn_overlap(data.overlap, len(valid_pairs))
    return sha256


@dataclass
class Start:
    """What a run starts from: its model and tokenizer, the batches (data.Batches, stream.StreamBatches), the
    held-out data (rank 0's), where the run is (`state`), a resumed run's optimizer and RNG states."""

    model: Any
    tokenizer: Any
    source: Any
    valid_ex: list
    valid_pairs: list
    state: dict[str, Any]
    opt_state: dict[str, Any] | None
    rng: dict[str, Any] | None
    data_sha256: str
    dropped: int = 0  # training pairs longer than max_positions
    replaces: bool = False  # the first checkpoint replaces a model directory
    save_bytes: int = 0  # a checkpoint's size (estimated)

    def shared(self) -> dict[str, Any]:
        """What the other ranks build the same run from (started_elsewhere): the tokenizer, the model config, where
        the run is, a resumed run's optimizer and RNG states; not the data, which each encodes itself."""
        return {"tokenizer": self.tokenizer.to_json(), "model": self.model.cfg, "state": self.state,
                "opt_state": self.opt_state, "rng": self.rng, "data_sha256": self.data_sha256,
                "save_bytes": self.save_bytes}


def started_elsewhere(shared: dict[str, Any], data, train_cfg: TrainConfig, rank: int) -> Start:
    """Rank `rank`'s Start from rank 0's Start.shared(): the same tokenizer and batches, a model of the same config
    (its weights are rank 0's once DistributedDataParallel has sent them), its own RNG: its saved states on a
    resume, else seeded from (seed, rank) (distributed.rank_seed)."""
    import torch

    from transduce.models.tokenizer import Tokenizer
    from transduce.models.transformer import Transformer
    from transduce.training.distributed import rank_rng_state, rank_seed

    tokenizer, mcfg = Tokenizer.from_json(shared["tokenizer"]), shared["model"]
    torch.manual_seed(train_cfg.seed)
    model = Transformer(mcfg)
    if isinstance(data, list):
        train_ex, _ = encode_pairs(tokenizer, data, mcfg.max_positions)
        source = Batches(train_ex, train_cfg.max_tokens, train_cfg.seed)
    else:
        from transduce.training.stream import StreamBatches

        source = StreamBatches(data, tokenizer, mcfg.max_positions, train_cfg.max_tokens, train_cfg.seed)
    state = shared["state"]
    torch.manual_seed(rank_seed(train_cfg.seed + state["step"], rank))  # a resume's saved state replaces it
    return Start(model, tokenizer, source, [], [], state, shared["opt_state"], rank_rng_state(shared["rng"], rank),
                 shared["data_sha256"], save_bytes=shared["save_bytes"])


def load_or_start(data, valid_pairs, train_cfg: TrainConfig, out_dir: str, resume: bool,
                  log: Callable[[str], None], ranks: int = 1) -> Start:
    """The run to train: the checkpoint in `out_dir` (resume, checked against this run's options and data) or a
    new one seeded from the config."""
    import torch

    from transduce.models.checkpoint import load_model_dir, load_training_state
    from transduce.models.transformer import Transformer

    if not resume:
        held = valid_pairs
        tokenizer, mcfg, source, valid_ex, valid_pairs, dropped = _prepared(data, held, train_cfg)
        data_sha256 = _fingerprint(data, held)  # a stream's: the tokenizer's pass over it computed it
        torch.manual_seed(train_cfg.seed)
        model = Transformer(mcfg)
        state = {"step": 0, "epoch": 0, "window": 0, "batch": 0, "tokens": 0, "history": []}
        return Start(model, tokenizer, source, valid_ex, valid_pairs, state, None, None, data_sha256, dropped)
    data_sha256 = _fingerprint(data, valid_pairs)
    model, tokenizer, _ = load_model_dir(out_dir)
    state, opt_state, rng = load_training_state(out_dir)
    check_resumable(state, train_cfg, data_sha256, out_dir, ranks)
    if state["step"] >= train_cfg.max_steps:
        raise ConfigError(f"--resume: {out_dir} is at step {state['step']} already, and --max-steps is "
                          f"{train_cfg.max_steps}: there is nothing to train",
                          hint=f"pass a --max-steps above {state['step']} to train further")
    before = state.get("train_config", {}).get("max_steps")
    log(f"resuming {out_dir} at step {state['step']} of {train_cfg.max_steps}"
        + (f" (--max-steps was {before})" if before not in (None, train_cfg.max_steps) else ""))
    tokenizer, mcfg, source, valid_ex, valid_pairs, dropped = _prepared(data, valid_pairs, train_cfg, tokenizer)
    if mcfg != model.cfg:
        raise ConfigError(f"--resume: {out_dir} holds a model config that differs from this run's "
                          f"(preset/overrides changed?): {model.cfg} vs {mcfg}")
    return Start(model, tokenizer, source, valid_ex, valid_pairs, state, opt_state, rng, data_sha256, dropped)


def on_device(model, device, opt_state, rng):
    """The model moved to its device, its Adam optimizer (restored from `opt_state`), and the RNG restored
    (`rng`); -> the optimizer."""
    import torch

    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the RNG state a checkpoint saves is the current GPU's
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    if opt_state is not None:
        opt.load_state_dict(opt_state)  # onto the parameters' device
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        if device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], device)
    return opt
