"""The embedded default corpus: English number words -> French number words, generated offline.

A real-language translation task that needs no download: `num2words` writes each number in English
("seventy-one thousand, two hundred and five") and in French ("soixante et onze mille deux cent
cinq"). It exercises what translation needs at a small scale: reordering and agglutination
("quatre-vingt-dix-sept" = 4*20+17), agreement ("deux cents" but "deux cent un"), and words that
appear or vanish ("and", "et"). Held-out numbers never occur in training, so quality measures
generalisation, not memory. Numbers are drawn log-uniformly over 0..999,999 from a seeded RNG.
"""

from __future__ import annotations

import math
import random

MAX_NUMBER = 999_999


def _sample_numbers(n: int, rng: random.Random, exclude: set[int]) -> list[int]:
    out: list[int] = []
    seen = set(exclude)
    while len(out) < n:
        x = int(math.exp(rng.uniform(0.0, math.log(MAX_NUMBER + 1)))) - 1
        x = min(max(x, 0), MAX_NUMBER)
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def pair(number: int) -> tuple[str, str]:
    from num2words import num2words

    return num2words(number, lang="en"), num2words(number, lang="fr")


def demo_corpus(n_train: int = 40_000, n_valid: int = 400, seed: int = 1234) -> tuple[list, list]:
    """(train, valid) lists of (english, french) pairs; valid numbers are disjoint from train."""
    rng = random.Random(seed)
    valid_numbers = _sample_numbers(n_valid, rng, set())
    train_numbers = _sample_numbers(n_train, rng, set(valid_numbers))
    return [pair(x) for x in train_numbers], [pair(x) for x in valid_numbers]
