"""Second question about a document against the first: what the document cache saves.

    python benchmarks/bench_cache.py                 # demo model, a 4096-token document (16x its window)
    python benchmarks/bench_cache.py --tokens 2048 --rounds 5
    python benchmarks/bench_cache.py --model /path/to/llama --big-tokens 32768

Each round asks two questions about the same document with an empty cache directory: the first prefills the
document and stores its state, the second loads it and prefills only the question. Times are to the first answer
token (what a user waits for) and for the whole answer, in process, with the model loaded once; `gali chat` does
the same without the disk. The figures are medians over rounds.

Then the cost of the entries' checksums (CRC-32 of every tensor, computed when an entry is written and checked when
it is read): on this document's state, against its prefill, and on a random state of Llama-3-8B's shape (32 layers,
8 key/value heads of dim 128, bf16) of --big-tokens tokens, against reading that state from a file.
"""

import argparse
import os
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
from gali_cli.config import MethodSettings
from gali_cli.conversation import Conversation
from gali_cli.doc_cache import DocumentCache, checksums
from gali_cli.generate import TextPiece, make_sampler
from gali_cli.loading import DEMO, load_model
from gali_cli.prompts import ask_instruction


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
    parser.add_argument("--model", default=DEMO, help="a local Llama directory (default: the demo model)")
    parser.add_argument("--big-tokens", type=int, default=8192, help="tokens of the Llama-3-8B-shaped state")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(args.model, device="cpu")
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
    print(f"# {args.model} (window {loaded.train_len}), GALI defaults, a {args.tokens}-token document, answers of "
          f"{args.max_new_tokens} tokens, median of {args.rounds} rounds\n")
    print("| question | tokens prefilled | s to first token | s for the answer |")
    print("|---|---|---|---|")
    for name, (to_first, whole, prefilled) in (("first (prefill, store)", first), ("second (load)", second)):
        print(f"| {name} | {prefilled:.0f} | {to_first:.3f} | {whole:.3f} |")
    print(f"\nSecond question: {first[0] / second[0]:.1f}x sooner to the first token, "
          f"{first[1] / second[1]:.1f}x faster for the whole answer.")
    print_checksum_costs(loaded, document, first[0], second[0], args.big_tokens, args.rounds)


def seconds(action, rounds: int) -> float:
    """The median time of `action()` over `rounds` calls."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def print_checksum_costs(loaded, document: str, prefill: float, reuse: float, big_tokens: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        store = DocumentCache(Path(directory), 2**34, print)
        conversation = Conversation(loaded, "gali", MethodSettings(), document, "difflib.py", store=store)
        timed_answer(conversation, "What does SequenceMatcher do?", 1)
        entry, = Path(directory).glob("*.safetensors")
        from safetensors.torch import load_file

        tensors = load_file(entry)
    size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    own = seconds(lambda: checksums(tensors), rounds)
    print(f"\nChecksums of this document's state ({size / 2**20:.1f} MiB, {len(tensors)} tensors): {own * 1e3:.1f} ms, "
          f"{100 * own / prefill:.2f}% of the first question's time to its first token, "
          f"{100 * own / reuse:.1f}% of the second's.")
    big_cache_seconds(big_tokens, rounds)


def big_cache_seconds(tokens: int, rounds: int) -> None:
    """Write and read a random Llama-3-8B state of `tokens` tokens through DocumentCache; time the checksums alone
    on the same tensors in memory."""
    from types import SimpleNamespace

    from transformers import DynamicCache, LlamaConfig

    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    cache = DynamicCache(config=config)
    for layer in range(32):  # 128 KiB a token in bf16
        cache.update(*(torch.randn(1, 8, tokens, 128).to(torch.bfloat16) for _ in range(2)), layer)
    layers = [SimpleNamespace(self_attn=SimpleNamespace(k_proj=SimpleNamespace(weight=torch.empty(0))))] * 32
    model = SimpleNamespace(config=config, model=SimpleNamespace(layers=layers))  # all DocumentCache.load reads
    ids = list(range(tokens))
    with tempfile.TemporaryDirectory() as directory:
        store = DocumentCache(Path(directory), 2**40, print)
        started = time.perf_counter()
        store.save("k", ids, cache, {})
        save = time.perf_counter() - started
        load = seconds(lambda: store.load("k", ids, model), rounds)  # from the page cache: the fastest disk
    tensors = {f"{kind}.{layer}": getattr(state, kind) for layer, state in enumerate(cache.layers)
               for kind in ("keys", "values")}
    size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    sums = seconds(lambda: checksums(tensors), rounds)
    finite = seconds(lambda: [torch.isfinite(tensor).all() for tensor in tensors.values()], rounds)
    print(f"A Llama-3-8B state of {tokens} tokens ({size / 2**30:.2f} GiB, {os.cpu_count()} CPUs): written in "
          f"{save:.2f} s, loaded in {load:.2f} s (from the page cache, checksums included); the checksums alone "
          f"{sums:.2f} s ({size / 2**30 / sums:.2f} GiB/s); an isfinite pass over every value, which the load "
          f"check did before, {finite:.2f} s.")


if __name__ == "__main__":
    main()
