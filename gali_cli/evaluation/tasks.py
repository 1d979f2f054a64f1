"""Which tasks `gali eval` knows: a name, and the builder that makes its samples for a request.

A builder takes the task's name and a `Request` (lengths, samples per length, seed, the runner's token count of a
prompt, the user's haystack) and returns `Sample`s. Adding a benchmark is one entry in TASKS; a builder that does not
generate by length (LongBench reads the user's data) may ignore `lengths`.
"""

from collections.abc import Callable

from ..errors import ConfigError
from . import ruler
from .sample import Request, Sample

Builder = Callable[[str, Request], list[Sample]]

TASKS: dict[str, Builder] = dict.fromkeys([*ruler.NIAH_TASKS, "vt", "cwe", "fwe"], ruler.build)


def check_tasks(names: list[str]) -> list[str]:
    """The task names, each once, in order; ConfigError for one gali does not know."""
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise ConfigError(f"unknown task {', '.join(unknown)}: gali eval knows {', '.join(TASKS)}")
    if not names:
        raise ConfigError("name at least one task, e.g. niah_single_1")
    return list(dict.fromkeys(names))


def build_samples(names: list[str], request: Request) -> list[Sample]:
    """Every sample of the tasks `names`; ConfigError for a sample that cannot be scored (no reference answer)."""
    samples = [sample for name in names for sample in TASKS[name](name, request)]
    for sample in samples:
        if not sample.references or not callable(sample.score):
            raise ConfigError(f"{sample.task} sample {sample.id} has no reference answer: it cannot be scored")
    return samples
