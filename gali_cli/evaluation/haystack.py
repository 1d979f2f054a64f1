"""The text RULER's needles hide in, and fitting a sample to its target length in tokens.

A haystack is a list of units (sentences of an essay, lines of noise, distractor needles) that a task joins with its
needles at given depths. Fitting finds the most units whose prompt stays within the budget by measuring whole prompts
a few times (tokens grow almost linearly with units, so each measurement predicts the next), instead of RULER's
binary search over repeated tokenizations: each measurement is one tokenization, linear in the length.
"""

import functools
import gzip
import math
import re
from collections.abc import Callable
from importlib import resources

from ..errors import ConfigError
from .sample import Sample

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


@functools.cache
def default_text() -> str:
    """The shipped public-domain haystack (data/README.md: the King James Version, from Debian's bible-kjv-text)."""
    return gzip.decompress((resources.files(__package__) / "data" / "kjv.txt.gz").read_bytes()).decode()


@functools.lru_cache(maxsize=4)
def sentences(text: str) -> tuple[str, ...]:
    """`text` as sentences, whitespace runs made single spaces (RULER joins an essay's words with spaces, then
    splits sentences with NLTK; a split after . ! or ? does for prose)."""
    found = tuple(piece.strip() for piece in _SENTENCE_END.split(re.sub(r"\s+", " ", text)) if piece.strip())
    if not found:
        raise ConfigError("--haystack: the document has no text to hide needles in")
    return found


def cycled(units: tuple[str, ...], count: int) -> list[str]:
    """The first `count` units, starting again from the first when there are fewer (as RULER repeats its essay)."""
    return [units[index % len(units)] for index in range(count)]


def insert_at_depths(units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """`units` with each needle put before unit round(depth * len(units)): depth 0 is the start, 1 the end. Needles
    keep their order among equal positions."""
    placed = sorted(zip((round(depth * len(units)) for depth in depths), range(len(needles)), needles))
    out, start = [], 0
    for position, _, needle in placed:
        out += [*units[start:position], needle]
        start = position
    return out + units[start:]


def spread_depths(index: int, samples: int, count: int) -> list[float]:
    """Depths in [0, 1] for `count` needles of sample `index` of `samples`: evenly spaced within a sample, and the
    samples' offsets evenly spread so that together they sweep the whole document (one needle: 0, ..., 1)."""
    offset = index / (samples - 1) if samples > 1 else 0.5
    return [(needle + offset) / count for needle in range(count)]


def fit(make: Callable[[int], Sample], prompt_tokens: Callable[[Sample], int], budget: int, task: str,
        length: int) -> Sample:
    """The sample with the most units (`make(units)`) whose prompt takes at most `budget` tokens."""
    best, used = make(0), None
    used = prompt_tokens(best)
    if used > budget:
        raise ConfigError(f"--lengths {length}: too short for {task}, whose prompt alone takes {used} tokens "
                          f"and its answer {length - budget}")
    fixed, units, over = used, 0, None  # `over`: the fewest units known not to fit
    guess = max(1, (budget - used) // 16)
    for _ in range(12):
        candidate = make(guess)
        tokens = prompt_tokens(candidate)
        if tokens <= budget:
            best, used, units = candidate, tokens, guess
        else:
            over = guess
        per_unit = max((tokens - fixed) / guess, 1e-3)
        guess = units + max(1, math.floor((budget - used) / per_unit))
        if over is not None:
            guess = min(guess, over - 1) if guess < over else (units + over) // 2
        if guess <= units or (over is not None and guess >= over):
            break
    return best
