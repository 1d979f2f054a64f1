"""Length extrapolation on the demo model: perplexity of every method, and GALI's ablations.

The texts are the standard-library modules the demo model never saw (gali_cli/model/demo/heldout.txt) that are at least
16 windows long, generated codec tables (encodings/*) left out. Each length is evaluated on its own, as the first
N tokens of every file, with every method's default settings for an input of N tokens (e.g. YaRN's factor N / 256);
a figure is exp(mean over files of the mean NLL), the geometric mean of the files' perplexities.

    python benchmarks/bench_ppl.py methods        # every method at 1x-16x the window (the paper's PG19 table)
    python benchmarks/bench_ppl.py chunk-window   # GALI's chunk size x local window (the paper's Figure 4)
    python benchmarks/bench_ppl.py noise          # GALI with and without noise (Table 4)
    python benchmarks/bench_ppl.py train-len      # GALI told a narrower window than the model's
"""

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from datetime import date
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gali_cli.config import MethodSettings
from gali_cli.loading import demo_model_path
from gali_cli.methods.registry import NAMES
from gali_cli.patching import apply_method, forward_ends, prefill_spans
from gali_cli.perplexity import perplexities

WINDOW = 256
LENGTHS = [256, 512, 1024, 2048, 4096]


def texts(tokenizer, min_tokens: int) -> dict[str, list[int]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    names = (demo_model_path() / "heldout.txt").read_text().split()
    ids = {name: tokenizer((root / name).read_text()).input_ids for name in names if not name.startswith("encodings/")}
    return {name: tokens for name, tokens in ids.items() if len(tokens) >= min_tokens}


def mean_nll(model, ids: list[int], method: str, settings: MethodSettings) -> float:
    """Mean NLL of tokens 2..N of `ids` under `method`, applied for an input of N tokens."""
    apply_method(model, method, settings, len(ids))
    spans, cuts = prefill_spans(model, method, 0, len(ids)), forward_ends(model, method, 0, len(ids))
    return perplexities(model, torch.tensor([ids]), [len(ids)], spans, boundaries=cuts)[0].mean_nll


def corpus_ppl(model, files: dict[str, list[int]], length: int, method: str, settings: MethodSettings) -> float:
    return math.exp(sum(mean_nll(model, ids[:length], method, settings) for ids in files.values()) / len(files))


def table(title: str, rows: list[str], columns: list, cell) -> tuple[str, dict]:
    """A markdown table, the best (lowest) value of each column in bold."""
    values = {(row, column): cell(row, column) for row in rows for column in columns}
    best = {column: min(values[(row, column)] for row in rows) for column in columns}
    lines = [f"| {title} | " + " | ".join(map(str, columns)) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in rows:
        cells = [f"**{values[(row, c)]:.2f}**" if values[(row, c)] == best[c] else f"{values[(row, c)]:.2f}"
                 for c in columns]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines), {f"{row}@{column}": value for (row, column), value in values.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=["methods", "chunk-window", "noise", "train-len"])
    parser.add_argument("--files", type=int, default=None, help="use only the first N files (faster)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = LlamaForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    files = texts(tokenizer, max(LENGTHS))
    files = dict(list(files.items())[: args.files or len(files)])
    started = time.perf_counter()

    if args.experiment == "methods":
        markdown, figures = table("method", list(NAMES), LENGTHS,
                                  lambda method, n: corpus_ppl(model, files, n, method, MethodSettings()))
    elif args.experiment == "chunk-window":
        configurations = [(chunk, window) for chunk in (16, 32, 64, 128) for window in (0, 4, 16, 64, 128, 192)]
        markdown, figures = table(
            "chunk / window", [f"{c} / {w}" for c, w in configurations], LENGTHS[1:],
            lambda row, n: corpus_ppl(model, files, n, "gali", MethodSettings(
                chunk_size=int(row.split(" / ")[0]), local_window=int(row.split(" / ")[1]))))
    elif args.experiment == "noise":
        markdown, figures = table("gali", ["noise", "no noise"], LENGTHS,
                                  lambda row, n: corpus_ppl(model, files, n, "gali",
                                                            MethodSettings(noise=row == "noise")))
    else:
        markdown, figures = table("train_len", ["256 (the model's)", "192", "128", "64"], LENGTHS,
                                  lambda row, n: corpus_ppl(model, files, n, "gali",
                                                            MethodSettings(train_len=int(row.split()[0]))))

    print(f"# {date.today()} - {platform.machine()} - torch {torch.__version__} - {torch.get_num_threads()} threads "
          f"- {time.perf_counter() - started:.0f} s")
    print(f"# python {' '.join(sys.argv)}")
    print(f"# {len(files)} held-out files: {', '.join(files)}\n")
    print(markdown)
    if args.json:
        Path(args.json).write_text(json.dumps({"experiment": args.experiment, "files": list(files),
                                               "figures": figures}, indent=1) + "\n")


if __name__ == "__main__":
    main()
