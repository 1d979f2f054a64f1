"""Train gali's bundled demo model: a few-million-parameter Llama with a 256-token window, from scratch, on the
local CPython standard library, on a CPU, with a fixed seed.

    python benchmarks/train_demo_model.py                 # about 40 minutes on 2 cores with AMX bf16
    python benchmarks/train_demo_model.py --steps 20 --out /tmp/demo   # a quick smoke run

What it learns: Python source code (plain language modelling), plus a share of chat-formatted examples in gali's
own prompt format (`gali_cli/prompts.py`): "summarize" answered with the module's docstring, "what does X do?"
answered with X's docstring. So `gali summarize` and `gali ask` get short, on-format answers that end with
<|eot_id|> - code-flavoured, not good summaries. Files are split deterministically: about 1 in 20 is held out
(listed in heldout.txt next to the model) for the length-extrapolation benchmarks.
"""

import argparse
import ast
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gali_cli.prompts import SUMMARIZE, ask_instruction, chat_messages

WINDOW = 256
VOCAB = 4096
BOS, EOS, EOT, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|pad|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SKIPPED_DIRS = {"site-packages", "test", "tests", "idlelib", "turtledemo", "__pycache__", "lib2to3", "ensurepip"}


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """Standard-library sources, split into (train, held out) by a hash of the relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts[:-1]))
    held_out = [p for p in files if int(hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest(), 16) % 20 == 0]
    return [p for p in files if p not in held_out], held_out


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS, EOT, HEADER_START, HEADER_END, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def docstring_examples(text: str) -> list[tuple[str, str]]:
    """(source excerpt, instruction, answer) triples: module docstrings answer "summarize", function and class
    docstrings answer "what does X do?". Answers are the docstring's first line."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    examples = []
    module_doc = ast.get_docstring(tree)
    if module_doc and module_doc.strip():
        examples.append(("\n".join(lines[:60]), SUMMARIZE, module_doc.strip().splitlines()[0]))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and doc.strip() and node.end_lineno:
                source = "\n".join(lines[node.lineno - 1 : node.end_lineno][:40])
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                examples.append((source, ask_instruction(f"What does the {kind} {node.name} do?"),
                                 doc.strip().splitlines()[0]))
    return examples


def encode_chat(tokenizer, document: str, instruction: str, answer: str) -> tuple[list[int], list[int]] | None:
    """Token ids and labels (the answer and <|eot_id|> only) of one chat example that fits the window."""
    answer_ids = tokenizer(answer + EOT, add_special_tokens=False).input_ids[:48]
    prompt_ids = tokenizer.apply_chat_template(
        chat_messages(document, instruction), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    overflow = len(prompt_ids) + len(answer_ids) - WINDOW
    if overflow > 0:  # shorten the document from its end, keep the instruction
        doc_ids = tokenizer(document, add_special_tokens=False).input_ids
        if overflow >= len(doc_ids) - 16:
            return None
        document = tokenizer.decode(doc_ids[: len(doc_ids) - overflow - 4])
        prompt_ids = tokenizer.apply_chat_template(
            chat_messages(document, instruction), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if len(prompt_ids) + len(answer_ids) > WINDOW:
            return None
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "gali_cli" / "model" / "demo"))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chat-share", type=float, default=0.25, help="fraction of each batch that is chat")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    started = time.time()

    train_files, held_out = stdlib_files()
    texts = [read(p) for p in train_files]
    tokenizer = train_tokenizer(texts)
    stream = []
    for text in texts:
        stream.extend([*tokenizer(text).input_ids, tokenizer.convert_tokens_to_ids(EOS)])
    stream = torch.tensor(stream)
    chats = [encoded for text in texts for example in docstring_examples(text)
             if (encoded := encode_chat(tokenizer, *example)) is not None]
    held_stream = torch.tensor([t for p in held_out for t in tokenizer(read(p)).input_ids])
    print(f"{len(train_files)} training files, {len(stream)} tokens, {len(chats)} chat examples; "
          f"{len(held_out)} held-out files, {len(held_stream)} tokens", file=sys.stderr)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(EOT)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", file=sys.stderr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1, step / args.steps)))),
    )
    chat_rows = round(args.batch * args.chat_share)
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(stream) - WINDOW, (args.batch - chat_rows,))
        ids = torch.full((args.batch, WINDOW), tokenizer.pad_token_id)
        labels = torch.full((args.batch, WINDOW), -100)
        for row, start in enumerate(starts.tolist()):
            ids[row] = labels[row] = stream[start : start + WINDOW]
        for row in range(args.batch - chat_rows, args.batch):
            chat_ids, chat_labels = random.choice(chats)
            ids[row, : len(chat_ids)] = torch.tensor(chat_ids)
            labels[row, : len(chat_labels)] = torch.tensor(chat_labels)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - started:.0f}s)", file=sys.stderr)

    model.eval()
    with torch.no_grad():
        windows = held_stream[: len(held_stream) // WINDOW * WINDOW].view(-1, WINDOW)[:64]
        held_loss = model(input_ids=windows, labels=windows).loss.item()
    print(f"held-out loss {held_loss:.3f}, perplexity {math.exp(held_loss):.1f}", file=sys.stderr)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    root = Path(sysconfig.get_paths()["stdlib"])
    (out / "heldout.txt").write_text("".join(f"{p.relative_to(root)}\n" for p in held_out))
    (out / "training.json").write_text(json.dumps({
        "command": " ".join(sys.argv), "python": sys.version.split()[0], "stdlib": str(root),
        "train_files": len(train_files), "train_tokens": len(stream), "chat_examples": len(chats),
        "held_out_files": len(held_out), "held_out_loss": round(held_loss, 4), "steps": args.steps,
        "batch": args.batch, "window": WINDOW, "seconds": round(time.time() - started),
    }, indent=1) + "\n")
    print(f"saved to {out} in {time.time() - started:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
