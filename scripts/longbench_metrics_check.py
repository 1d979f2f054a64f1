"""Score random answers with LongBench's official metrics.py and with gali's, and count where they disagree.

    python scripts/longbench_metrics_check.py OFFICIAL_DIR [--pairs 3000]

OFFICIAL_DIR holds the official LongBench/metrics.py (github.com/THUDM/LongBench) with its imports installed there or
on the path: `pip install --target OFFICIAL_DIR fuzzywuzzy==0.18.0 rouge==1.0.1` (the official requirements: no
python-Levenshtein). jieba is only needed by the Chinese metrics gali refuses; a stand-in is written when it is missing.
The answers are built from words where case, punctuation, articles, comment markers and numbers change the score.
It also counts how often rapidfuzz's ratio, rounded, differs from fuzzywuzzy's (why gali does not use it).
"""

import argparse
import random
import sys
import warnings
from pathlib import Path

from gali_cli.evaluation import longbench_metrics as ours

WORDS = ["the", "The", "a", "an", "cat", "Cat", "sat", "on", "mat.", "mat", "dog,", "x = 1", "#", "//", "`", "\n",
         "Paragraph 3", "12", "3", "city", "capital city", "capital", ".", "if", "(", ")", "return"]
CLASSES = ["city", "capital city", "capital", "cat", "Cat", "mat"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("official_dir", type=Path)
    parser.add_argument("--pairs", type=int, default=3000)
    args = parser.parse_args()
    if not (args.official_dir / "jieba.py").exists():
        (args.official_dir / "jieba.py").write_text("def cut(text, cut_all=False):\n    return list(text)\n")
    sys.path.insert(0, str(args.official_dir))
    warnings.filterwarnings("ignore")  # fuzzywuzzy warns that it uses the slow pure-Python SequenceMatcher
    import metrics as official

    pairs = {"qa_f1": official.qa_f1_score, "rouge": official.rouge_score, "count": official.count_score,
             "code_sim": official.code_sim_score}
    rng = random.Random(0)
    disagreements = dict.fromkeys([*pairs, "classification", "retrieval"], 0)
    rapidfuzz_differs = 0
    for _ in range(args.pairs):
        prediction, reference = text(rng, 12), text(rng, 8)
        for name, metric in pairs.items():
            gap = abs(metric(prediction, reference) - ours.METRICS[name](prediction, reference))
            disagreements[name] += gap > 1e-12
        classes = rng.sample(CLASSES, 4)
        label = rng.choice(classes)
        disagreements["classification"] += (official.classification_score(prediction, label, all_classes=list(classes))
                                            != ours.classification(prediction, label, classes))
        paragraph = f"Paragraph {rng.randint(1, 30)}"
        disagreements["retrieval"] += official.retrieval_score(prediction, paragraph) != ours.retrieval(prediction,
                                                                                                        paragraph)
        rapidfuzz_differs += rapidfuzz_disagrees(official, prediction, reference)
    print(f"{args.pairs} random pairs; disagreements with the official metrics: {disagreements}")
    print(f"rapidfuzz's rounded ratio differs from fuzzywuzzy's on {rapidfuzz_differs} pairs")


def text(rng: random.Random, most: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, most)))


def rapidfuzz_disagrees(official, first: str, second: str) -> bool:
    try:
        from rapidfuzz import fuzz
    except ImportError:
        return False
    return bool(first and second) and official.fuzz.ratio(first, second) != round(fuzz.ratio(first, second))


if __name__ == "__main__":
    main()
