"""Pass-key retrieval: a five-digit key stated once, early or late in a long filler text, asked for at the end.

    python benchmarks/passkey.py train        # a tiny Llama that retrieves within its 256-token window (~10 min)
    python benchmarks/passkey.py evaluate     # every method, 1x-16x the window, key at 0%..100% depth

The model is trained only on inputs up to 256 tokens; evaluation asks how well each method lets it find the key in
inputs up to 16 times longer. It uses the demo model's tokenizer; the filler is random sentences from small word
lists, seeded, so that texts are reproducible and never repeat exactly.
"""

import argparse
import json
import platform
import random
import sys
import time
from datetime import date
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gali_cli.config import MethodSettings
from gali_cli.generate import decode, make_sampler, prefill
from gali_cli.loading import demo_model_path
from gali_cli.methods.registry import NAMES
from gali_cli.patching import apply_method, prefill_spans

WINDOW = 256
MODEL_DIR = Path(__file__).resolve().parent / "passkey_model"
SUBJECTS = ["The river", "A small bird", "The old road", "Every window", "The garden", "A quiet town", "The market",
            "The north wind", "A wooden boat", "The library"]
VERBS = ["is calm", "looks grey", "stays open", "turns left", "feels warm", "grows slowly", "seems empty",
         "waits outside", "shines today", "sounds far away"]
QUESTION = " What is the pass key? The pass key is"


class Texts:
    """Pass-key texts as token ids, from the tokenized filler sentences (100 of them, tokenized once)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sentences = [self.ids(f" {subject} {verb}.") for subject in SUBJECTS for verb in VERBS]
        self.question = self.ids(QUESTION)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def example(self, rng: random.Random, length: int, depth: float) -> tuple[list[int], list[int]]:
        """About `length` tokens with the key stated at `depth` (0: first sentence, 1: last), and the key's ids."""
        key = f"{rng.randrange(10000, 100000)}"
        statement = self.ids(f" The pass key is {key}. Remember it, {key} is the pass key.")
        budget, parts, used = length - len(statement) - len(self.question) - 1, [], 0
        while True:  # whole sentences, as many as fit
            sentence = rng.choice(self.sentences)
            used += len(sentence)
            if used > budget:
                break
            parts.append(sentence)
        parts.insert(round(depth * len(parts)), statement)
        ids = [self.tokenizer.bos_token_id] + [token for part in parts for token in part] + self.question
        return ids, self.ids(f" {key}")


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    texts = Texts(tokenizer)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=WINDOW,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    started = time.time()
    for step in range(args.steps):
        # Lengths leave room for the key's tokens: the whole example stays inside the window.
        batch = [texts.example(rng, rng.randrange(48, WINDOW - 7), rng.random()) for _ in range(args.batch)]
        width = max(len(ids) + len(key) - 1 for ids, key in batch)
        input_ids = torch.full((args.batch, width), tokenizer.pad_token_id)
        rows, positions, targets = [], [], []
        for row, (ids, key) in enumerate(batch):
            sequence = (ids + key)[:-1]
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
            for offset, token in enumerate(key):  # the answer is all it learns: predict each key token
                rows.append(row)
                positions.append(len(ids) - 1 + offset)
                targets.append(token)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = model.model(input_ids=input_ids).last_hidden_state[rows, positions]  # only where it answers
            loss = torch.nn.functional.cross_entropy(model.lm_head(hidden).float(), torch.tensor(targets))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - started:.0f}s)", file=sys.stderr)
    model.eval()
    accuracy = evaluate_one(model, texts, "original", WINDOW, [0.0, 0.5, 1.0], 20, args.seed + 1)
    print(f"accuracy within the window: {accuracy:.2f} ({time.time() - started:.0f}s)", file=sys.stderr)
    model.save_pretrained(MODEL_DIR)
    (MODEL_DIR / "training.json").write_text(json.dumps({
        "command": " ".join(sys.argv), "steps": args.steps, "batch": args.batch, "seed": args.seed,
        "accuracy_within_window": accuracy, "seconds": round(time.time() - started)}, indent=1) + "\n")


def evaluate_one(model, texts: Texts, method: str, length: int, depths: list[float], trials: int, seed: int) -> float:
    """Share of exactly retrieved keys over depths x trials."""
    rng, correct, sampler = random.Random(seed), 0, make_sampler()
    for depth in depths:
        for _ in range(trials):
            ids, key = texts.example(rng, length, depth)
            apply_method(model, method, MethodSettings(), len(ids))
            spans = prefill_spans(model, method, 0, len(ids), step=1024)
            with torch.inference_mode():
                cache = DynamicCache(config=model.config)
                logits = prefill(model, torch.tensor([ids]), cache, spans)
                answer = list(decode(model, cache, logits, sampler, len(key), set()))
            correct += answer == key
    return correct / (len(depths) * trials)


def evaluate(args: argparse.Namespace) -> None:
    model = LlamaForCausalLM.from_pretrained(MODEL_DIR).eval()
    texts = Texts(AutoTokenizer.from_pretrained(demo_model_path()))
    lengths, depths = [256, 512, 1024, 2048, 4096], [0.0, 0.25, 0.5, 0.75, 1.0]
    started = time.perf_counter()
    results = {}
    for method in NAMES:
        for length in lengths:
            for depth in depths:
                results[(method, length, depth)] = evaluate_one(model, texts, method, length, [depth],
                                                                args.trials, seed=length * 10 + int(depth * 4))
    print(f"# {date.today()} - {platform.machine()} - torch {torch.__version__} - "
          f"{time.perf_counter() - started:.0f} s")
    print(f"# python {' '.join(sys.argv)}\n")
    print("Retrieval accuracy by input length (mean over depths):\n")
    print("| method | " + " | ".join(map(str, lengths)) + " |\n" + "|---" * (len(lengths) + 1) + "|")
    for method in NAMES:
        cells = [sum(results[(method, n, d)] for d in depths) / len(depths) for n in lengths]
        print(f"| {method} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    print(f"\nAt {lengths[-1]} tokens, by depth of the key (0 = start, 1 = end):\n")
    print("| method | " + " | ".join(f"{d:.0%}" for d in depths) + " |\n" + "|---" * (len(depths) + 1) + "|")
    for method in NAMES:
        print(f"| {method} | " + " | ".join(f"{results[(method, lengths[-1], d)]:.2f}" for d in depths) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{m}@{n}@{d}": v for (m, n, d), v in results.items()}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["train", "evaluate"])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=8, help="keys per method, length and depth")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    train(args) if args.action == "train" else evaluate(args)


if __name__ == "__main__":
    main()
