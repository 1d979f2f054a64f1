"""Which tasks `gali eval` knows: a name, and the builder that makes its samples for a request.

A builder takes the task's name and a `Request` (lengths, samples per length, seed, the runner's token count of a
prompt, the user's haystack) and returns `Sample`s. Adding a benchmark is one entry in TASKS; a builder that does not
generate by length (LongBench reads the user's data) may ignore `lengths`.
"""

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..errors import ConfigError
from . import longbench, ruler
from .sample import Request, Sample

Builder = Callable[[str, Request], list[Sample]]
LONGBENCH = "longbench"  # all 16 English datasets of the GALI paper's table; "longbench/NAME" for one dataset
LONGEST = 2**24  # tokens: the longest prompt gali eval builds (its text, tokenized a few times, stays within a few GB)


def build_longbench(task: str, request: Request) -> list[Sample]:
    """A LongBench dataset's first `request.samples` records at each length, truncated for it (the length is
    pred.py's max_length with --truncation official, the paper's max_pe with paper)."""
    if request.longbench_data is None:
        raise ConfigError(f"{task} reads your copy of LongBench: give its folder with --longbench-data DIR")
    name = task.removeprefix(f"{LONGBENCH}/")
    return [replace(sample, id=f"{length}-{sample.id}", length=length)
            for length in request.lengths
            for sample in longbench.samples(Path(request.longbench_data), name, request.tokenizer, length,
                                            request.truncation, limit=request.samples)]


TASKS: dict[str, Builder] = dict.fromkeys([*ruler.NIAH_TASKS, "vt", "cwe", "fwe"], ruler.build)


def builder(name: str) -> Builder | None:
    """The builder of task `name`: a RULER task, or longbench/DATASET for a LongBench dataset gali can score."""
    if name.startswith(f"{LONGBENCH}/"):
        longbench.dataset_spec(name.removeprefix(f"{LONGBENCH}/"))  # ConfigError: unknown, or not scorable here
        return build_longbench
    return TASKS.get(name)


def check_tasks(names: list[str]) -> list[str]:
    """The task names, each once, in order ("longbench" stands for its 16 English datasets); ConfigError for one
    gali does not know."""
    expanded = [task for name in names
                for task in ([f"{LONGBENCH}/{dataset}" for dataset in longbench.PAPER_DATASETS]
                             if name == LONGBENCH else [name])]
    unknown = [name for name in expanded if builder(name) is None]
    if unknown:
        raise ConfigError(f"unknown task {', '.join(unknown)}: gali eval knows {', '.join(TASKS)}, {LONGBENCH} and "
                          f"{LONGBENCH}/DATASET")
    if not names:
        raise ConfigError("name at least one task, e.g. niah_single_1")
    return list(dict.fromkeys(expanded))


def build_samples(names: list[str], request: Request) -> list[Sample]:
    """Every sample of the tasks `names`; ConfigError for a sample that cannot be scored (no reference answer)."""
    samples = [sample for name in names for sample in builder(name)(name, request)]
    for sample in samples:
        if not sample.references or not callable(sample.score):
            raise ConfigError(f"{sample.task} sample {sample.id} has no reference answer: it cannot be scored")
    return samples
