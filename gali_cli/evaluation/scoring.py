"""RULER's metrics for one answer (NVIDIA/RULER scripts/eval/synthetic/constants.py and evaluate.py): the answer is
cleaned as RULER's `postprocess_pred` does, then each reference is looked for in it, case-insensitively.

RULER reports the mean over samples times 100; here each sample's score is in [0, 1] and the table shows the mean
times 100, which is the same number.
"""

import re

_CONTROLS = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's cleaning: stripped, control characters (newlines and tabs among them) turned into newlines, stripped."""
    return _CONTROLS.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: tuple[str, ...]) -> float:
    """The share of the references found in the answer (RULER's niah, vt, cwe and fwe)."""
    text = postprocess(prediction).lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def string_match_part(prediction: str, references: tuple[str, ...]) -> float:
    """1 if any reference is found in the answer, else 0 (RULER's qa)."""
    text = postprocess(prediction).lower()
    return float(any(reference.lower() in text for reference in references))
