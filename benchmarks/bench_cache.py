"""Second question about a document against the first: what the document cache saves.

    python benchmarks/bench_cache.py                 # demo model, a 4096-token document (16x its window)
    python benchmarks/bench_cache.py --tokens 2048 --rounds 5

Each round asks two questions about the same document with an empty cache directory: the first prefills the
document and stores its state, the second loads it and prefills only the question. Times are to the first answer
token (what a user waits for) and for the whole answer, in process, with the model loaded once; `gali chat` does
the same without the disk. The figures are medians over rounds.
"""

import argparse
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gali_cli.config import MethodSettings  # noqa: E402
from gali_cli.conversation import Conversation  # noqa: E402
from gali_cli.doc_cache import DocumentCache  # noqa: E402
from gali_cli.generate import TextPiece, make_sampler  # noqa: E402
from gali_cli.loading import DEMO, load_model  # noqa: E402
from gali_cli.prompts import ask_instruction  # noqa: E402


def timed_answer(conversation: Conversation, question: str, max_new_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first answer token, seconds for the whole answer, prompt tokens prefilled)."""
    started, first = time.perf_counter(), None
    for event in conversation.ask(ask_instruction(question), make_sampler(), max_new_tokens):
        if first is None:
            first = time.perf_counter() - started
        if not isinstance(event, TextPiece):
            return first, time.perf_counter() - started, event.prefilled_tokens
    raise AssertionError("no Finished event")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="document length in tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(DEMO, device="cpu")
    source = (Path(sysconfig.get_paths()["stdlib"]) / "difflib.py").read_text()  # held out from the demo's training
    document = loaded.tokenizer.decode(loaded.tokenizer(source, add_special_tokens=False).input_ids[: args.tokens])
    results = {"first": [], "second": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as directory:
            store = DocumentCache(Path(directory), 2**34, print)
            for turn, question in (("first", "What does SequenceMatcher do?"), ("second", "What is a junk element?")):
                conversation = Conversation(loaded, "gali", MethodSettings(), document, "difflib.py", store=store)
                results[turn].append(timed_answer(conversation, question, args.max_new_tokens))
    first, second = ([statistics.median(values) for values in zip(*results[turn])] for turn in ("first", "second"))
    print(f"# {date.today()} - {platform.machine()} - torch {torch.__version__} - {torch.get_num_threads()} threads")
    print(f"# python {' '.join(sys.argv)}")
    print(f"# demo model (window 256), GALI defaults, a {args.tokens}-token document, answers of "
          f"{args.max_new_tokens} tokens, median of {args.rounds} rounds\n")
    print("| question | tokens prefilled | s to first token | s for the answer |")
    print("|---|---|---|---|")
    for name, (to_first, whole, prefilled) in (("first (prefill, store)", first), ("second (load)", second)):
        print(f"| {name} | {prefilled:.0f} | {to_first:.3f} | {whole:.3f} |")
    print(f"\nSecond question: {first[0] / second[0]:.1f}x sooner to the first token, "
          f"{first[1] / second[1]:.1f}x faster for the whole answer.")


if __name__ == "__main__":
    main()
