"""End to end on the demo model: each beam-search stopping rule against CTranslate2, on the demo's 300 held-out
sentences: sentences/s all at once, ms per sentence one at a time, decoder steps per sentence, BLEU, outputs
identical to CTranslate2's. Usage: python scripts/e2e_rules.py ARTIFACT MODEL_DIR [CT2_DIR]."""

from __future__ import annotations

import statistics
import sys
import time

import sacrebleu

from transduce.demo.pipeline import DEMO_TRAIN_PAIRS, DEMO_VALID_PAIRS
from transduce.models.corpus import demo_corpus
from transduce.runtime.api import load

artifact, model_dir = sys.argv[1], sys.argv[2]
ct2_dir = sys.argv[3] if len(sys.argv) > 3 else "/tmp/ct2-demo"
_, valid = demo_corpus(DEMO_TRAIN_PAIRS, DEMO_VALID_PAIRS)
srcs, refs = [s for s, _ in valid], [r for _, r in valid]
tr = load(artifact, threads=2)
calls = [0]
step = tr.backend.step


def counted(*a, **k):
    calls[0] += 1
    return step(*a, **k)


tr.backend.step = counted


def timed(fn, reps=3):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def ours(beam, rule, patience):
    kw = dict(beam_size=beam, early_stopping=rule, patience=patience)
    whole, out = timed(lambda: tr.translate(srcs, **kw))
    calls[0] = 0
    one, _ = timed(lambda: [tr.translate([s], **kw) for s in srcs], reps=2)
    steps = calls[0] / 3 / len(srcs)  # 3 passes (a warm-up and 2)
    return whole, one, steps, [t.text for t in out]


from transduce.bench.ctranslate2.convert import convert_to_ctranslate2, ct2_vocab, load_translator  # noqa: E402

convert_to_ctranslate2(model_dir, ct2_dir)
vocab = ct2_vocab(ct2_dir)
tok = tr.tokenizer
eos = tr.config.eos_id


def ct2(beam, threads):
    t = load_translator(ct2_dir, threads=threads)

    def run(texts):
        ids = [e[:-1] if e and e[-1] == eos else e for e in (tok.encode(x) for x in texts)]
        res = t.translate_batch([[vocab[i] for i in s] for s in ids], beam_size=beam, max_batch_size=0,
                                max_decoding_length=max(len(s) for s in ids) + 50)
        index = {w: i for i, w in enumerate(vocab)}
        return [tok.decode([index[w] for w in r.hypotheses[0]]) for r in res]
    whole, out = timed(lambda: run(srcs))
    one, _ = timed(lambda: [run([s]) for s in srcs], reps=2)
    return whole, one, out


rows = []
for beam in (1, 4):
    c2 = ct2(beam, 2)
    c1 = ct2(beam, 1)
    print(f"CTranslate2 {'greedy' if beam == 1 else 'beam 4'}: BLEU {sacrebleu.corpus_bleu(c2[2], [refs]).score:.2f}")
    rules = [("k-finished", 1.0)] if beam == 1 else [("exact", 1.0), ("heuristic", 1.0), ("k-finished", 1.0),
                                                     ("k-finished", 2.0)]
    for rule, patience in rules:
        whole, one, steps, out = ours(beam, rule, patience)
        rule = rule if patience == 1 else f"{rule}, patience {patience:g}"
        same = sum(a == b for a, b in zip(out, c2[2], strict=True))
        bleu = sacrebleu.corpus_bleu(out, [refs]).score
        rows.append(f"| {'greedy' if beam == 1 else 'beam 4'} | {rule if beam > 1 else '-'} | "
                    f"{len(srcs) / whole:,.0f} | {len(srcs) / c2[0]:,.0f} | {c2[0] / whole:.2f} | "
                    f"{one / len(srcs) * 1e3:.2f} | {min(c1[1], c2[1]) / len(srcs) * 1e3:.2f} | "
                    f"{min(c1[1], c2[1]) / one:.2f} | {steps:.1f} | {bleu:.2f} | {same}/{len(srcs)} |")
        print(rows[-1], flush=True)
print("| search | rule | ours sent/s | CT2 sent/s | ratio | ours ms/sent (one) | CT2 ms/sent (best of 1, 2 threads) "
      "| ratio | steps/sent | BLEU | = CT2 |")
print("|---" * 11 + "|")
print("\n".join(rows))
