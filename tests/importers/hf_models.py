"""Tiny Hugging Face translation models built locally (no model hub): a SentencePiece model trained on the demo
corpus with a Marian vocab.json, random MarianMTModel and FSMTForConditionalGeneration weights, saved with
save_pretrained as the hub's directories are."""

from __future__ import annotations

import json
import os

import torch

MARIAN_SHAPE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


def demo_sentences(n: int = 300, seed: int = 11) -> list[tuple[str, str]]:
    from transduce.models.corpus import demo_corpus

    train, _ = demo_corpus(n_train=n, n_valid=10, seed=seed)
    return train


def train_spm(directory: str, sentences: list[str], vocab_size: int = 100) -> str:
    """A unigram SentencePiece model trained on `sentences` (Marian's kind), as directory/spm.model."""
    import sentencepiece as spm

    text = os.path.join(directory, "spm.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write("\n".join(sentences) + "\n")
    prefix = os.path.join(directory, "spm")
    spm.SentencePieceTrainer.train(input=text, model_prefix=prefix, vocab_size=vocab_size, model_type="unigram",
                                   character_coverage=1.0, pad_id=-1, bos_id=-1, eos_id=1, unk_id=0,
                                   unk_piece="<unk>", eos_piece="</s>", minloglevel=2)
    return prefix + ".model"


def marian_dir(directory: str, activation: str = "swish", seed: int = 0, scale_embedding: bool = True,
               **config) -> str:
    """A MarianMTModel directory as OPUS-MT's look: one SentencePiece model as source.spm and target.spm, vocab.json
    (</s>=0, <unk>=1, the pieces, <pad> last), random weights with a random final_logits_bias; `config`: more
    MarianConfig fields (tie_word_embeddings=False: a random projection of its own)."""
    import shutil

    from transformers import MarianConfig, MarianMTModel

    os.makedirs(directory, exist_ok=True)
    pairs = demo_sentences()
    model_file = train_spm(directory, [s for p in pairs for s in p])
    for name in ("source.spm", "target.spm"):
        shutil.copy(model_file, os.path.join(directory, name))
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_file)
    pieces = ["</s>", "<unk>"] + [sp.id_to_piece(i) for i in range(sp.get_piece_size())
                                  if sp.id_to_piece(i) not in ("</s>", "<unk>")] + [">>fr<<"]
    vocab = {p: i for i, p in enumerate(pieces + ["<pad>"])}
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    pad = len(vocab) - 1
    cfg = MarianConfig(vocab_size=len(vocab), activation_function=activation, scale_embedding=scale_embedding,
                       pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=None,
                       bad_words_ids=[[pad]], **MARIAN_SHAPE, **config)
    torch.manual_seed(seed)
    model = MarianMTModel(cfg).eval()
    with torch.no_grad():  # HF initializes weights at N(0, 0.02): too flat for a test; and a non-zero bias
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
        model.final_logits_bias.normal_(0.0, 0.5)
        model.model.shared.weight[pad] = 0.0  # Marian's pad row is zeros (nn.Embedding's padding_idx), its start
        if config.get("tie_word_embeddings") is False:  # transformers 5 then unties the stacks' embeddings too;
            for stack in (model.model.encoder, model.model.decoder):  # Marian's (and transformers 4's) share one
                stack.embed_tokens.weight.copy_(model.model.shared.weight)
    model.save_pretrained(directory)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"separate_vocabs": False, "source_lang": "en", "target_lang": "fr"}, f)
    return directory


FSMT_SHAPE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


def learn_bpe(words: dict[str, int], n_merges: int) -> list[tuple[str, str]]:
    """subword-nmt's algorithm on word counts: repeatedly merge the most frequent adjacent pair ("</w>" ends words)."""
    from collections import Counter

    from transduce.models.pair_tokenizer import merge_pair

    segs = {w: list(w[:-1]) + [w[-1] + "</w>"] for w in words}
    merges = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, s in segs.items():
            for a, b in zip(s, s[1:]):
                pairs[a, b] += words[w]
        if not pairs:
            break
        best = max(sorted(pairs), key=pairs.__getitem__)
        merges.append(best)
        for w, s in segs.items():
            segs[w] = merge_pair(s, best)
    return merges


def fsmt_dir(directory: str, seed: int = 2) -> str:
    """An FSMTForConditionalGeneration directory (en -> fr): Moses + BPE merges learned on the demo corpus, separate
    source and target vocabularies (fairseq's specials first), random untied weights."""
    from collections import Counter

    import sacremoses
    from transformers import FSMTConfig, FSMTForConditionalGeneration, FSMTTokenizer

    os.makedirs(directory, exist_ok=True)
    pairs = demo_sentences()
    counts = {}
    for side, lang in ((0, "en"), (1, "fr")):
        mt = sacremoses.MosesTokenizer(lang=lang)
        counts[lang] = Counter(t for p in pairs for t in mt.tokenize(p[side], aggressive_dash_splits=True,
                                                                      escape=True))
    merges = learn_bpe(counts["en"] + counts["fr"], 80)
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("".join(f"{a} {b} 1\n" for a, b in merges))
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    sizes = {}
    for lang, name in (("en", "vocab-src.json"), ("fr", "vocab-tgt.json")):
        chars = {c for w in counts[lang] for c in list(w[:-1]) + [w[-1] + "</w>"]}
        symbols = sorted(chars | {a + b for a, b in merges})
        vocab = {s: i for i, s in enumerate(specials + symbols)}
        sizes[lang] = len(vocab)
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"langs": ["en", "fr"], "do_lower_case": False, "tokenizer_class": "FSMTTokenizer"}, f)
    cfg = FSMTConfig(langs=["en", "fr"], src_vocab_size=sizes["en"], tgt_vocab_size=sizes["fr"],
                     forced_eos_token_id=None, **FSMT_SHAPE)
    torch.manual_seed(seed)
    model = FSMTForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed_positions" not in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(directory)
    FSMTTokenizer(langs=["en", "fr"], src_vocab_file=os.path.join(directory, "vocab-src.json"),
                  tgt_vocab_file=os.path.join(directory, "vocab-tgt.json"),
                  merges_file=os.path.join(directory, "merges.txt"))  # it loads them
    return directory


def fairseq_dir_from_fsmt(fsmt: str, directory: str, **arg_changes) -> str:
    """A fairseq transformer's directory holding the FSMT model's weights in fairseq's layout (FSMT is fairseq's
    model renamed): checkpoint_best.pt ({"args": Namespace, "model": state dict}), dict.en.txt / dict.fr.txt with
    the FSMT vocabularies' ids, and subword-nmt codes from its merges (pieces spelt "hel@@", not "lo</w>")."""
    import argparse

    from safetensors.torch import load_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(fsmt, "config.json")) as f:
        hf = json.load(f)
    sd = {}
    for k, v in load_file(os.path.join(fsmt, "model.safetensors")).items():
        if "embed_positions" not in k:
            sd[k.removeprefix("model.")] = v
    for stack in ("encoder", "decoder"):
        sd[f"{stack}.embed_positions._float_tensor"] = torch.zeros(1)
        sd[f"{stack}.version"] = torch.tensor([3.0])
    args = argparse.Namespace(
        arch="transformer", source_lang="en", target_lang="fr", tokenizer="moses", bpe="subword_nmt",
        encoder_embed_dim=hf["d_model"], decoder_embed_dim=hf["d_model"], encoder_layers=hf["encoder_layers"],
        decoder_layers=hf["decoder_layers"], encoder_attention_heads=hf["encoder_attention_heads"],
        decoder_attention_heads=hf["decoder_attention_heads"], encoder_ffn_embed_dim=hf["encoder_ffn_dim"],
        decoder_ffn_embed_dim=hf["decoder_ffn_dim"], activation_fn=hf["activation_function"], dropout=0.1,
        max_source_positions=hf["max_position_embeddings"], max_target_positions=hf["max_position_embeddings"],
        share_all_embeddings=False, share_decoder_input_output_embed=False, encoder_normalize_before=False,
        decoder_normalize_before=False, encoder_learned_pos=False, decoder_learned_pos=False,
        no_scale_embedding=False, layernorm_embedding=False, adaptive_softmax_cutoff=None)
    for k, v in arg_changes.items():
        setattr(args, k, v)
    torch.save({"args": args, "model": sd, "optimizer_history": [], "extra_state": {"epoch": 1}},
               os.path.join(directory, "checkpoint_best.pt"))
    for fsmt_name, lang in (("vocab-src.json", "en"), ("vocab-tgt.json", "fr")):
        with open(os.path.join(fsmt, fsmt_name), encoding="utf-8") as f:
            vocab = json.load(f)
        tokens = sorted(vocab, key=vocab.get)[4:]  # after <s> <pad> </s> <unk>
        with open(os.path.join(directory, f"dict.{lang}.txt"), "w", encoding="utf-8") as f:
            f.write("".join(f"{t[:-4] if t.endswith('</w>') else t + '@@'} {100 - i % 90}\n"
                            for i, t in enumerate(tokens)))
    with open(os.path.join(fsmt, "merges.txt"), encoding="utf-8") as f:
        merges = f.read()
    with open(os.path.join(directory, "bpecodes"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + merges)
    return directory
