"""Questions about the bundled Declaration of Independence, written as a LongBench dataset, so that `gali eval
--prompt-style` can compare gali ask's wrappers on a real document (docs/notes/2026-11-28-ask-wrappers.md):

    python benchmarks/ask_styles.py /tmp/declaration-qa
    for style in task plain wrapped brief; do
        gali eval longbench/multifieldqa_en --longbench-data /tmp/declaration-qa --lengths 4k --samples 8 \\
            -m smollm2 --train-len 1024 --method gali --prompt-style $style --out /tmp/declaration-qa/$style.jsonl
    done

multifieldqa_en is the LongBench dataset whose prompt and metric (token F1 against the best reference) fit short
questions about one document. The questions and answers are this file's own; the text is public domain.
"""

import json
import sys
from pathlib import Path

DOCUMENT = Path(__file__).parents[1] / "examples" / "declaration-of-independence.txt"
QUESTIONS = [  # (question, accepted answers)
    ("On what date was the declaration made?", ["July 4, 1776"]),
    ("Whose history is called a history of repeated injuries and usurpations?",
     ["George III", "the present King of Great Britain"]),
    ("Which unalienable rights does the declaration name?", ["Life, Liberty, and the pursuit of Happiness"]),
    ("From what do governments derive their just powers?", ["the consent of the governed"]),
    ("What did the king send hither to harass the people?", ["swarms of Officers"]),
    ("What do the signers pledge to each other?", ["our Lives, our Fortunes, and our sacred Honor"]),
    ("What do the signers declare the united Colonies to be?", ["Free and Independent States"]),
    ("Which signers represented New Hampshire?", ["Josiah Bartlett, William Whipple, Matthew Thornton"]),
]


def main(folder: str) -> None:
    data = Path(folder) / "data"
    data.mkdir(parents=True, exist_ok=True)
    context = DOCUMENT.read_text()
    with open(data / "multifieldqa_en.jsonl", "w") as out:
        for index, (question, answers) in enumerate(QUESTIONS):
            out.write(json.dumps({"context": context, "input": question, "answers": answers, "all_classes": None,
                                  "_id": f"declaration-{index}"}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
