"""LongBench v1's metrics, as its official eval.py scores an answer (THUDM/LongBench, LongBench/metrics.py and
eval.py): the code is gali's own, the definitions theirs, quirks included, so that a table of ours is comparable with
the published ones (tests/evaluation/test_longbench.py checks each against values worked out from those
definitions).

- qa F1: lower-cased, punctuation and English articles removed, whitespace tokens, F1 of the token multisets.
- ROUGE-L: the `rouge` package (pltrdy/rouge 1.0.1, what the official code calls): summary-level union LCS over
  sentences split at ".", case-sensitive whitespace tokens, each distinct word counted once in the lengths; any error
  it raises scores 0, as the official `except` does. Google's rouge-score computes other numbers (lower-cased, every
  word counted, one sequence), so it is not used.
- code similarity: the first line of the answer without "`", "#" or "//", compared by fuzzywuzzy's `fuzz.ratio`,
  which the official requirements install without python-Levenshtein: difflib's SequenceMatcher ratio rounded to a
  whole percent (rapidfuzz's ratio is the optimal Indel similarity and differs from it on some strings).
- classification, passage count, passage retrieval: as the official code, including the classification loop that
  skips the class after each one it drops.
Each returns a score in [0, 1]; the official tables show the mean times 100.
"""

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from difflib import SequenceMatcher

from ..errors import ConfigError
from ..extras import install_hint

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """The official normalization before qa F1 (SQuAD's): lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: Sequence[str], reference: Sequence[str]) -> float:
    """F1 of two token multisets; 0 when they share none."""
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, all_classes: Sequence[str] = ()) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def rouge_l(prediction: str, reference: str, all_classes: Sequence[str] = ()) -> float:
    """ROUGE-L F of the `rouge` package, called as the official code calls it (0 where it raises, e.g. an empty
    answer)."""
    from rouge import Rouge  # checked by require_libraries before a run starts

    try:
        return Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
    except Exception:  # the official rouge_score scores any failure 0
        return 0.0


def _share_of_numbers(prediction: str, wanted: str) -> float:
    """The share of the numbers in the answer that equal `wanted` (0 when it has none)."""
    numbers = re.findall(r"\d+", prediction)
    return sum(number == wanted for number in numbers) / len(numbers) if numbers else 0.0


def count(prediction: str, reference: str, all_classes: Sequence[str] = ()) -> float:
    return _share_of_numbers(prediction, str(reference))


def _retrieval(pattern: str) -> Callable[..., float]:
    def score(prediction: str, reference: str, all_classes: Sequence[str] = ()) -> float:
        return _share_of_numbers(prediction, paragraph_number(reference, pattern))

    return score


def paragraph_number(reference: str, pattern: str) -> str:
    """The paragraph a retrieval reference names ("Paragraph 12" -> "12"); ConfigError for one that names none."""
    found = re.findall(pattern, reference)
    if not found:
        raise ConfigError(f"LongBench retrieval answer {reference!r} names no paragraph: it cannot be scored")
    return found[0]


RETRIEVAL_EN, RETRIEVAL_ZH = r"Paragraph (\d+)", r"段落(\d+)"
retrieval = _retrieval(RETRIEVAL_EN)
retrieval_zh = _retrieval(RETRIEVAL_ZH)


def fuzz_ratio(first: str, second: str) -> int:
    """fuzzywuzzy's `fuzz.ratio` on its pure-Python path: 100 for equal strings, 0 when one is empty, else difflib's
    ratio as a rounded percent."""
    if first == second:
        return 100
    if not first or not second:
        return 0
    return round(100 * SequenceMatcher(None, first, second).ratio())


def code_similarity(prediction: str, reference: str, all_classes: Sequence[str] = ()) -> float:
    """The first answer line that is not a comment or a fence, against the reference line."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
    return fuzz_ratio(line, reference) / 100


def classification(prediction: str, reference: str, all_classes: Sequence[str] = ()) -> float:
    """1 / (classes named in the answer) when the reference is among them, after dropping the classes that are part
    of the reference's name. The official loop removes from the list it walks, so the class right after each one
    it drops is never checked; kept, as it decides the published scores."""
    named = [name for name in all_classes if name in prediction]
    index = 0
    while index < len(named):
        if named[index] in reference and named[index] != reference:
            named.pop(index)
        index += 1  # after a pop this skips the next class, as iterating a list while removing from it does
    return 1 / len(named) if reference in named else 0.0


Metric = Callable[..., float]
METRICS: dict[str, Metric] = {
    "qa_f1": qa_f1,
    "rouge": rouge_l,
    "classification": classification,
    "count": count,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "code_sim": code_similarity,
}


def require_libraries(metric: str) -> None:
    """ConfigError, before anything loads, when the metric needs a library that is not installed."""
    if metric != "rouge":
        return
    try:
        import rouge  # noqa: F401
    except ImportError:
        raise ConfigError(f"LongBench's summaries are scored with the `rouge` package: "
                          f"{install_hint('eval')}") from None


def check_references(metric: str, references: Sequence[str], all_classes: Sequence[str] = ()) -> None:
    """ConfigError, before a run, for references the metric cannot score: a retrieval answer naming no paragraph, a
    classification record without its classes."""
    if metric == "classification" and not all_classes:
        raise ConfigError("a LongBench classification record without all_classes cannot be scored")
    pattern = {"retrieval": RETRIEVAL_EN, "retrieval_zh": RETRIEVAL_ZH}.get(metric)
    for reference in references if pattern else ():
        paragraph_number(reference, pattern)


def best_score(metric: str, prediction: str, references: Sequence[str], all_classes: Sequence[str] = (),
               first_line: bool = False) -> float:
    """The official score of one answer: the best over the references; with `first_line` (trec, triviaqa, samsum,
    lsht) only the answer's first non-empty line counts."""
    if first_line:
        prediction = prediction.lstrip("\n").split("\n")[0]
    score = METRICS[metric]
    return max([0.0, *(score(prediction, reference, all_classes=all_classes) for reference in references)])
