"""One question of a task, as the runner sees it: whatever the task (synthetic or LongBench), a sample is a prompt,
how to feed it and when to stop, and a scorer that turns the model's answer into a number in [0, 1]."""

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    """A prompt with its references; `score(prediction)` is the task's metric for one answer, in [0, 1].

    `context` is the long part (the haystack, the LongBench document) and `question` what follows it, so the runner
    can report lengths and a document state can be reused between questions about one context. With `chat` the two
    are one user message through the model's chat template; without it (LongBench's trec, triviaqa, samsum, lsht,
    lcc, repobench-p) `context + question` is the raw prompt. `answer_prefix` is text the runner appends after the
    template's assistant turn (RULER's "Answer: The special magic number is"); `stop` ends generation early (LongBench
    samsum stops at a newline). `query` is the question without the task's wording around it, which `gali eval
    --prompt-style` asks in one of `gali ask`'s wrappers instead.
    """

    task: str  # "niah_single_1", "longbench/qasper"
    id: str  # stable across runs: with the task and the settings, the key a resumed run skips by
    context: str
    question: str
    references: tuple[str, ...]
    score: Callable[[str], float] = field(compare=False, repr=False)
    max_new_tokens: int = 32
    chat: bool = True
    answer_prefix: str = ""
    stop: tuple[str, ...] = ()
    length: int | None = None  # the target prompt length in tokens the sample was built for (RULER), else None
    query: str = ""  # the question alone, as a user would ask it (`gali eval --prompt-style`); "" where there is none


@dataclass(frozen=True)
class Request:
    """What a task builds its samples for: target lengths in tokens, samples per length, the seed, how many tokens
    the runner's prompt for a sample takes (chat template and answer prefix included), and the user's haystack
    (None: the shipped text); for LongBench, the model's tokenizer (its truncation counts tokens), the folder of the
    user's copy of the data and the truncation rule."""

    lengths: tuple[int, ...]
    samples: int
    seed: int
    prompt_tokens: Callable[[Sample], int]
    haystack: str | None = None
    tokenizer: object = None
    longbench_data: str | None = None
    truncation: str = "official"
