"""The CLI's decoding against its own step: `gali ask`'s path and the static step alone, side by side on one model.

    python benchmarks/bench_cli_decode.py --model smollm2 --train-len 1024 --methods original,gali \
        --document examples/declaration-of-independence.txt --max-new-tokens 64 --rounds 4

Issue 46 saw `gali ask -v` report 3-5x fewer tokens/s after the first token than bench_graph_decode.py measured
for the same step. On a machine shared with other jobs two separate runs cannot say which is right (the load moves
the rates by 2x from one minute to the next), so this script times them side by side, in the same moments:

- the CLI's path: a `Conversation` as `gali ask` builds it, the document's state from a document cache in a
  temporary directory (as a second `gali ask` finds it: only the question is read), the answer streamed by
  `runs.answer._stream_answer` (detokenizing, the repetition guard, the display; stdout captured), greedy; its
  rate is the one -v prints (`Finished.decode_tokens_per_second`);
- the step alone: a `StaticDecoder` on a second cache holding the same prompt (the previous round's, cut back),
  its first step checked against the forward and not timed (as bench_graph_decode.py), fed the previous answer's
  tokens at the same indices. It runs from the CLI's sampler, one step after each token the CLI decodes, and its
  time is taken out of the CLI's;
- then `gali ask --json` as the first answer of a process of its own, as a user runs it (the same document
  cache): the rate -v prints, with every cost that a process pays once for its one answer, which the answers above,
  in a process that has answered before, no longer pay; held to the rate of its own static steps after the checked
  one, timed as they run (a process's first answer cannot have a step alone beside it without warming up for it).

Each method's answer is found once first (the document read and stored); then every round runs each method (their
order reversed every other round). Printed: the rates and ratios per round, then the median ratios per method and
whether every round's answer had the same tokens; with --json, the rows with the answers' token ids (the same
ids before and after a change show that it changed no token).
"""

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gali_cli.threads import prepare_openmp

prepare_openmp()  # before torch loads, as gali's entry point does (OpenMP threads sleep rather than spin)

import torch  # noqa: E402

from gali_cli.cli import main as main_command  # noqa: E402
from gali_cli.doc_cache import DocumentCache  # noqa: E402
from gali_cli.documents import read_document  # noqa: E402
from gali_cli.engine.seam.cache_argument import with_cache  # noqa: E402
from gali_cli.engine.seam.static_decode import StaticDecoder  # noqa: E402
from gali_cli.generate import make_sampler, truncate_cache  # noqa: E402
from gali_cli.prompts import ask_instruction  # noqa: E402
from gali_cli.runs.answer import _stream_answer  # noqa: E402
from gali_cli.runs.choices import Answering, ModelChoice  # noqa: E402
from gali_cli.runs.common import conversation, load  # noqa: E402
from gali_cli.threads import cpu_threads  # noqa: E402


def synchronize(device: torch.device) -> None:
    """Wait for a GPU's queued work (a step's kernels run after `step` returns), so that a clock reads its time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cli_answer(loaded, choice: ModelChoice, document, store: DocumentCache, question: str, tokens: int,
               sampler=None):
    """The CLI's path for one answer, greedy (`sampler`: a greedy one that also times the step alone): (the
    conversation, its Finished)."""
    answering = Answering(max_new_tokens=tokens, temperature=0.0, top_p=1.0, top_k=0, system=None, stream=True,
                          json_output=False, verbose=True)
    talk = conversation(loaded, choice, document, None, store, None)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        _, finished = _stream_answer(talk, ask_instruction(question), sampler or make_sampler(), answering)
    return talk, finished


class StepAlone:
    """The static step alone, on its own copy of the prompt's cache, fed an earlier answer's tokens; as a greedy
    sampler for the CLI's path, it runs one step of its own after each token the CLI decodes (from the second on),
    so that both are timed token by token in the same moments of a shared machine's load. Its time is taken out of
    the CLI's: `seconds` is what the steps took, `steps` how many ran."""

    @torch.inference_mode()
    def __init__(self, model, cache, prompt_tokens: int, answer: tuple[int, ...]) -> None:
        truncate_cache(cache, prompt_tokens)
        given = with_cache(model, cache)
        self.decoder = StaticDecoder(model, cache)
        first = torch.tensor([[answer[0]]], device=self.decoder.device)
        self.decoder.first_step(answer[0], prompt_tokens, lambda: model(input_ids=first, **given, use_cache=True
                                                                         ).logits[0, -1].float())
        if not self.decoder.checked:
            raise RuntimeError(f"the static step differs from the forward here ({self.decoder.difference})")
        self.prompt_tokens, self.answer = prompt_tokens, answer
        self.calls, self.steps, self.seconds = 0, 0, 0.0

    def __call__(self, logits: torch.Tensor) -> int:
        token = int(logits.argmax())  # make_sampler's greedy choice
        if 1 <= self.calls < len(self.answer) - 1:  # the step the CLI's decode has just made, on the other cache
            started = time.perf_counter()
            self.decoder.step(self.answer[self.calls], self.prompt_tokens + self.calls)
            synchronize(self.decoder.device)
            self.seconds += time.perf_counter() - started
            self.steps += 1
        self.calls += 1
        return token


def ask_command(args: argparse.Namespace, method: str, directory: str) -> list[str]:
    """`gali ask --json` as the benchmark's settings say, the document's state from the document cache `directory`."""
    return ["ask", args.document, args.question, "-m", args.model, "--device", args.device, "--train-len",
            str(args.train_len), "--method", method, "--max-new-tokens", str(args.max_new_tokens), "--json",
            "--cache-dir", directory, *(["--threads", str(args.threads)] if args.threads else [])]


def gali_ask(args: argparse.Namespace, method: str, directory: str) -> dict:
    """`gali ask --json` as the first answer of a process of its own (`child`), as a user runs it: its facts
    (`decode_tokens_per_second` is what -v prints, with every cost that a process pays once for its one answer, which
    the answers of `measure`'s process, which has answered before, no longer pay), and `step_tokens_per_second`, the
    rate of its own static steps after the checked one."""
    with tempfile.NamedTemporaryFile(suffix=".json") as steps:
        command = [sys.executable, __file__, "--child", steps.name, *ask_command(args, method, directory)]
        facts = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        times = json.loads(Path(steps.name).read_text())[1:]  # the first: the step checked against the forward
    return {**facts, "step_tokens_per_second": len(times) / sum(times)}


def child(steps: str, command: list[str]) -> None:
    """Run `gali` with `command` in this process, its static steps timed: their seconds, in order, go to `steps`."""
    times, step = [], StaticDecoder.step

    def timed(self: StaticDecoder, token: int, index: int) -> torch.Tensor:
        started = time.perf_counter()
        logits = step(self, token, index)
        synchronize(self.device)  # where the CLI's sampler waits for it anyway
        times.append(time.perf_counter() - started)
        return logits

    StaticDecoder.step = timed
    code = main_command(command)
    if code:
        raise SystemExit(code)
    Path(steps).write_text(json.dumps(times))


def measure(args: argparse.Namespace, loaded, choice: ModelChoice, document, store: DocumentCache, step: StepAlone,
            directory: str):
    """One round of one method: the CLI's path with the step alone interleaved, then `gali ask` in a process; the
    row, and the CLI's conversation and Finished (the next round's step alone starts from them)."""
    talk, finished = cli_answer(loaded, choice, document, store, args.question, args.max_new_tokens, step)
    # -v's figure, Finished.decode_tokens_per_second, less the step alone's time spent inside it
    cli = (finished.generated_tokens - 1) / (finished.decode_seconds - step.seconds)
    stepped = step.steps / step.seconds
    process = {} if args.no_process else gali_ask(args, choice.method, directory)
    rate, own = process.get("decode_tokens_per_second", float("nan")), process.get("step_tokens_per_second")
    row = {"method": choice.method, "cli_tokens_per_second": cli, "step_tokens_per_second": stepped,
           "ratio": stepped / cli, "process_tokens_per_second": rate, "process_step_tokens_per_second": own,
           "process_ratio": (own or float("nan")) / rate, "process_generated": process.get("generated_tokens"),
           "decode_path": finished.decode_path, "generated": finished.generated_tokens,
           "answer_ids": list(finished.answer_ids), "same_answer": finished.answer_ids == step.answer}
    return row, talk, finished


def arguments() -> argparse.Namespace:
    """The command line's settings; the model, document and answer length are `gali ask`'s own options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--document", default="examples/declaration-of-independence.txt")
    parser.add_argument("--question", default="What does the document say about taxes?")
    parser.add_argument("--device", default="auto", help="as gali's --device")
    parser.add_argument("--train-len", type=int, default=1024)
    parser.add_argument("--methods", default="original,gali")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="as gali's --threads (default: torch's)")
    parser.add_argument("--no-process", action="store_true", help="leave out `gali ask` in a process of its own "
                        "(most of the time a round takes: loading the model)")
    parser.add_argument("--json", default=None, help="write the rows and the answers' token ids here")
    return parser.parse_args()


def summary(rows: list[dict], methods: list[str]) -> None:
    """The median ratios per method, and whether every round answered with the same tokens."""
    print("\n| method | median step / CLI | median steps / -v of `gali ask` | answers |\n|---|---|---|---|")
    for method in methods:
        mine = [row for row in rows if row["method"] == method]
        same = "the same tokens" if all(row["same_answer"] for row in mine) else "tokens differ"
        print(f"| {method} | {statistics.median(row['ratio'] for row in mine):.3f} | "
              f"{statistics.median(row['process_ratio'] for row in mine):.3f} | {same} every round; "
              f"{mine[0]['decode_path']} |")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], sys.argv[3:])
    args = arguments()
    methods = args.methods.split(",")
    choices = {method: ModelChoice.parse(args.model, "none", args.device, "auto", method, train_len=args.train_len)
               for method in methods}
    document = read_document(args.document)
    rows, alone = [], {}
    with cpu_threads(args.threads), tempfile.TemporaryDirectory() as directory:
        loaded = load(choices[methods[0]])
        store = DocumentCache(Path(directory), 1 << 40, lambda message: None)
        for method in methods:  # the document read and stored, the answer found: the step alone's tokens
            talk, finished = cli_answer(loaded, choices[method], document, store, args.question, args.max_new_tokens)
            if len(finished.answer_ids) < 3:
                raise SystemExit(f"{method}: an answer of {len(finished.answer_ids)} tokens is too short to time")
            alone[method] = StepAlone(loaded.model, talk.cache, finished.prompt_tokens, finished.answer_ids)
        print("| round | method | CLI's path tokens/s | step alone tokens/s | step / CLI | `gali ask` tokens/s (-v) | "
              "its steps' tokens/s | steps / -v |\n|---|---|---|---|---|---|---|---|", flush=True)
        for number in range(args.rounds):
            for method in methods if number % 2 == 0 else methods[::-1]:
                row, talk, finished = measure(args, loaded, choices[method], document, store, alone[method],
                                              directory)
                alone[method] = StepAlone(loaded.model, talk.cache, finished.prompt_tokens, finished.answer_ids)
                rows.append({"round": number, **row})
                print(f"| {number} | {method} | {row['cli_tokens_per_second']:.2f} | "
                      f"{row['step_tokens_per_second']:.2f} | {row['ratio']:.3f} | "
                      f"{row['process_tokens_per_second']:.2f} | {row['process_step_tokens_per_second'] or 0:.2f} | "
                      f"{row['process_ratio']:.3f} |", flush=True)
    summary(rows, methods)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
