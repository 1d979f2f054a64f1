"""How close the prefill time estimate comes: the estimate after the first forward (from the FLOPs' shape), after
the second (the first fitted one: when gali says it, for a long prefill) and after a tenth of the tokens, against
the time the prefill then took.

    python benchmarks/bench_estimate.py                                # demo model, 4k, 16k and 32k tokens
    python benchmarks/bench_estimate.py --model DIR --tokens 4096 --train-len 1024

The document is the start of Python's difflib.py and its other modules, repeated as needed (the demo never saw them);
the prefill is the CLI's: GALI with its defaults, forwards of about 8 chunks (patching.prefill_spans).
"""

import argparse
import platform
import sys
import sysconfig
import time
from datetime import date
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gali_cli.config import MethodSettings
from gali_cli.estimate import PrefillClock
from gali_cli.generate import prefill
from gali_cli.loading import DEMO, load_model
from gali_cli.patching import apply_method, prefill_spans


def text_of(tokens: int, tokenizer) -> list[int]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in ("difflib.py", "textwrap.py", "argparse.py", "pathlib.py", "typing.py", "inspect.py"):
        ids += tokenizer((stdlib / name).read_text(), add_special_tokens=False).input_ids
        if len(ids) >= tokens:
            break
    while len(ids) < tokens:
        ids += ids
    return ids[:tokens]


def measure(loaded, tokens: int, settings: MethodSettings) -> tuple[dict[str, float], float, int]:
    """({"first", "second", "tenth": the total time expected then}, the actual seconds, the first two forwards'
    tokens)."""
    ids = torch.tensor([text_of(tokens, loaded.tokenizer)])
    apply_method(loaded.model, "gali", settings, tokens)
    spans = prefill_spans(loaded.model, "gali", 0, tokens)
    clock = PrefillClock(loaded.model.config)
    estimates: dict[str, float] = {}

    def progress(done: int, total: int) -> None:
        left = clock.seconds_left(done, total)
        if left is not None:
            expected = time.perf_counter() - clock.started + left
            estimates.setdefault("second" if "first" in estimates else "first", expected)
            if done >= total / 10:
                estimates.setdefault("tenth", expected)

    started = time.perf_counter()
    with torch.inference_mode():
        prefill(loaded.model, ids, DynamicCache(config=loaded.model.config), spans, progress)
    return estimates, time.perf_counter() - started, spans[1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEMO)
    parser.add_argument("--tokens", default="4096,16384,32768", help="comma-separated prompt lengths")
    parser.add_argument("--train-len", type=int, default=None)
    parser.add_argument("--noise", action="store_true", help="GALI's logit noise (off by default, as in the CLI)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(args.model, device="cpu")
    settings = MethodSettings(train_len=args.train_len, noise=args.noise)
    print(f"# {date.today()} - {platform.machine()} - torch {torch.__version__} - {torch.get_num_threads()} threads")
    print(f"# python {' '.join(sys.argv)}")
    print(f"# {args.model}, GALI (noise {'on' if args.noise else 'off'}), train_len "
          f"{args.train_len or loaded.train_len}\n")
    print("| tokens | first 2 forwards | actual s | expected after 1 forward | after 2 (said) | after 1/10 |")
    print("|---|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        estimates, actual, timed = measure(loaded, tokens, settings)
        print(f"| {tokens} | {timed} tokens | {actual:.1f} | " + " | ".join(
            f"{estimates[when]:.1f} s ({estimates[when] / actual:.2f}x)" for when in ("first", "second", "tenth"))
            + " |", flush=True)


if __name__ == "__main__":
    main()
