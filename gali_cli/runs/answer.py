"""gali summarize, ask and chat on one document: the answer streams to stdout, everything else goes to stderr."""

import sys

from .. import display
from ..conversation import Conversation
from ..display import print_json, say
from ..documents import Document
from ..generate import Finished, Sampler, TextPiece, make_sampler
from ..loading import LoadedModel
from ..prompts import ask_instruction
from .choices import Answering, ModelChoice, Reading
from .common import (
    announcing,
    conversation,
    entry_point,
    facts,
    finished_facts,
    load,
    prompt_limit,
    say_input,
    say_threads,
    store,
)


@entry_point
def answer(document: Document, instruction: str, choice: ModelChoice, reading: Reading, answering: Answering
           ) -> None:
    """Answer `instruction` about `document` (summarize, ask), read by the command line before torch loaded."""
    sampler, loaded, talk = _start(document, choice, reading, answering)
    say_input(loaded, choice.method, document, len(talk.prompt(instruction).ids), choice.settings.train_len)
    text, finished = _stream_answer(talk, instruction, sampler, answering)
    if answering.json_output:
        print_json({"answer": text.strip(), **facts(choice.model, choice.method, talk.resolved, document),
                    **finished_facts(finished)})
    if answering.verbose:
        _say_stats(finished)


@entry_point
def chat(document: Document, choice: ModelChoice, reading: Reading, answering: Answering) -> None:
    """Read `document` into the model once, then answer each question from stdin in turn, keeping the
    conversation."""
    sampler, loaded, talk = _start(document, choice, reading, answering)
    say_input(loaded, choice.method, document, talk.prompt(ask_instruction("?")).document_end,
              choice.settings.train_len)
    with display.progress_bar("Reading") as bar:  # the document first, then the prompt: the wait is not after asking
        reading = _Reading(talk, bar)
        talk.read(reading)
        reading.over()
    interactive = sys.stdin.isatty()
    if interactive:  # once, before the first bare "> " (issue 50: a newcomer was not told how to leave)
        say("Ask at the > prompt; Ctrl-C stops an answer, Ctrl-D leaves.", style="dim")
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # a stray byte in a piped question is not worth a crash
    while True:
        question = _read_question(interactive)
        if question is None:
            return
        if not question:
            continue
        instruction = question if talk.questions else ask_instruction(question)
        try:
            text, finished = _stream_answer(talk, instruction, sampler, answering, read_before=True)
        except KeyboardInterrupt:  # stops this answer; Ctrl-C at the prompt leaves
            say("(answer stopped; the question is forgotten)", style="dim")
            continue
        if answering.json_output:
            print_json({"question": question, "answer": text.strip(), "turn": len(talk.questions),
                        **finished_facts(finished)})
        if answering.verbose:
            _say_stats(finished)


def _start(document: Document, choice: ModelChoice, reading: Reading, answering: Answering
           ) -> tuple[Sampler, LoadedModel, Conversation]:
    """The sampler, model and conversation, checked in the order that fails soonest: settings and the cache
    directory before the model loads (the command line checked the settings and read the document already)."""
    sampler = make_sampler(answering.temperature, answering.top_p, answering.top_k, answering.seed)
    choice.check()
    cache = None if answering.no_cache else store(answering.cache_dir)
    loaded = load(choice)
    return sampler, loaded, conversation(loaded, choice, document, answering.system, cache,
                                         prompt_limit(loaded, reading))


def _read_question(interactive: bool) -> str | None:
    """The next question from stdin (when a person types: after a prompt they see but stdout's file never gets,
    with line editing and history where the readline module exists), stripped; None at end of input."""
    if not interactive:
        line = sys.stdin.readline()
        return line.strip() if line else None
    try:
        return display.read_line("> ").strip()
    except EOFError:
        display.err.print()
        return None


def _stream_answer(talk: Conversation, instruction: str, sampler: Sampler, answering: Answering,
                   read_before: bool = False) -> tuple[str, Finished]:
    """One answer, streamed to stdout unless --json or --no-stream; returns its text and what it cost.
    `read_before`: the document was read (and the document cache's part said) before the question."""
    stream = answering.stream and not answering.json_output
    pieces, finished = [], None
    with display.progress_bar("Reading") as bar:
        reading = _Reading(talk, bar, noted=read_before)
        events = talk.ask(instruction, sampler, answering.max_new_tokens, reading)
        try:
            for event in events:
                reading.over()
                if isinstance(event, TextPiece):
                    shown = event.text if any(piece.strip() for piece in pieces) else event.text.lstrip()
                    pieces.append(event.text)
                    if stream and shown:  # an answer starts at its first word, not at a blank line
                        display.write(shown)
                else:
                    finished = event
        except KeyboardInterrupt:
            events.close()  # the turn is rolled back now, whether Ctrl-C came inside the generator or out here
            if stream and pieces:
                display.write("\n")
            raise
    text = "".join(pieces).lstrip()
    if not answering.json_output:
        display.write(("" if text.endswith("\n") else "\n") if stream else text.strip() + "\n")
    if finished.reason == "length":
        say(f"(stopped at --max-new-tokens {answering.max_new_tokens})", style="dim")
    elif finished.reason == "repetition":
        say("(stopped: the answer was repeating itself)", style="dim")
    return text, finished


class _Reading:
    """The prefill's (done, total) callback: a note first when the document's state came from the document cache (known
    once the prefill starts), then the bar (and, for a long prefill, its estimate: common.announcing); `over()`
    takes the bar away before the answer is written (on a terminal that shows stdout too, a live bar would erase
    the answer's line)."""

    def __init__(self, talk: Conversation, bar: display.Bar, noted: bool = False) -> None:
        self.talk, self.bar, self.noted, self.done = talk, bar, noted, False
        self.progress = announcing(bar, talk.loaded)

    def __call__(self, done: int, total: int) -> None:
        self._note()
        self.progress(done, total)

    def within(self, done: int, total: int) -> None:
        """Progress inside a long forward (generate.prefill, layer by layer): the bar only, not the estimate."""
        self._note()
        self.bar(done, total)

    def over(self) -> None:
        if not self.done:
            self.done = True
            self._note()
            self.bar.stop()

    def _note(self) -> None:
        if not self.noted:
            self.noted = True
            if self.talk.from_store and not self.talk.questions:
                say(f"(document state from the cache: {self.talk.document_tokens} tokens not read again)",
                    style="dim")


def _say_stats(finished: Finished) -> None:
    say(stats_line(finished))
    say_threads()


def stats_line(finished: Finished) -> str:
    """-v's line: what of the prompt came from the cache and what was read (the prefill's rate is of the tokens read),
    and the decoding rate of the tokens after the first (which is sampled from the prefill's logits), with how they
    were decoded."""
    cached, read = finished.prompt_tokens - finished.prefilled_tokens, finished.prefilled_tokens
    source = f"{cached} from the cache, {read} read" if cached else f"{read} read"
    rate = finished.decode_tokens_per_second
    how = f": {finished.decode_path}" if finished.decode_path else ""
    generated = finished.generated_tokens
    return (f"prompt {finished.prompt_tokens} tokens: {source} in {finished.prefill_seconds:.2f} s "
            f"({finished.prefill_tokens_per_second:.0f} tokens/s); generated {generated} "
            f"token{'s' if generated != 1 else ''}{f' ({rate:.1f} tokens/s after the first{how})' if rate else ''}, "
            f"{finished.reason}; peak memory {finished.peak_memory_bytes / 2**30:.2f} GiB")
