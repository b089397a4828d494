"""The embedded default corpus: English number words -> French number words, generated offline.

A real-language translation task that needs no download: `num2words` writes each number in English
("seventy-one thousand, two hundred and five") and in French ("soixante et onze mille deux cent
cinq"). It exercises what translation needs at a small scale: reordering and agglutination
("quatre-vingt-dix-sept" = 4*20+17), agreement ("deux cents" but "deux cent un"), and words that
appear or vanish ("and", "et"). Held-out numbers never occur in training, so quality measures
generalisation, not memory. The training set holds every number below 1,000 once (the lexicon of
the task: the words and their small combinations), plus numbers drawn log-uniformly over
1,000..999,999 from a seeded RNG; held-out numbers are drawn the same way and never occur in training.
"""

from __future__ import annotations

import math
import random

MAX_NUMBER = 999_999
LEXICON = 1_000  # numbers below this are all in the training set
# distinct numbers of LEXICON..MAX_NUMBER drawn at most: log-uniform draws of nearly all 999,000 take ever
# longer (the largest numbers are the rarest; all of them would take ~1e8 draws), so a request past this
# is refused rather than left running (600,000 take ~4 s)
MAX_DRAWN = 900_000


def _sample_numbers(n: int, rng: random.Random, exclude: set[int]) -> list[int]:
    out: list[int] = []
    seen = set(exclude)
    while len(out) < n:
        x = int(math.exp(rng.uniform(math.log(LEXICON), math.log(MAX_NUMBER + 1))))
        x = min(max(x, LEXICON), MAX_NUMBER)
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def pair(number: int) -> tuple[str, str]:
    from num2words import num2words

    return num2words(number, lang="en"), num2words(number, lang="fr")


def demo_corpus(n_train: int = 40_000, n_valid: int = 400, seed: int = 1234) -> tuple[list, list]:
    """(train, valid) lists of (english, french) pairs; valid numbers are disjoint from train.

    n_train counts the drawn numbers; the lexicon (0..999, min(n_train, 1000) of them) comes on top
    of it, shuffled in.
    """
    if n_train + n_valid > MAX_DRAWN:
        from transduce.errors import DataError

        raise DataError(f"the demo corpus has {MAX_NUMBER - LEXICON + 1:,} numbers to draw from and draws at most "
                        f"{MAX_DRAWN:,} distinct ones; {n_train:,} training and {n_valid:,} held-out ones "
                        "were asked for",
                        hint="ask for fewer sentences (parity -n, bench --check-sentences), or give your own data")
    rng = random.Random(seed)
    valid_numbers = _sample_numbers(n_valid, rng, set())
    train_numbers = _sample_numbers(n_train, rng, set(valid_numbers)) + list(range(min(n_train, LEXICON)))
    rng.shuffle(train_numbers)
    return [pair(x) for x in train_numbers], [pair(x) for x in valid_numbers]
