"""What the command line checks, and reads, before a run imports torch and transformers: those imports take seconds
(8 to 14 on a small machine), and a usage error or an unreadable document should cost none of them.

Issue 50 met these after the imports: several documents without --out, an --out that is not a results file,
--device cuda without a GPU, an image-only PDF (while `--method foo` failed in half a second). So a command checks
its options against the model's config (ModelChoice.check), a batch its documents and results file, and a single
document is read here, its pages' bar and warnings on stderr, and handed to the run.

Nothing here imports torch; the document readers (pypdf) and the batch's books are imported when a command needs
them, not with the command line (`gali --help` stays quick).
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .. import display
from ..display import warn
from ..errors import ConfigError, InputError
from ..methods.registry import UNPATCHED
from .choices import ModelChoice, Reading

if TYPE_CHECKING:
    from ..documents import Document
    from .results_file import ResultsFile


# Below this many tokens (or a quarter of the model's own window, for the tests' tiny models) a --train-len keeps
# positions within about a sentence: the run goes on, with a warning that its answers lose their sense.
MIN_TRAIN_LEN = 64


def checked(choice: ModelChoice) -> None:
    """`choice.check()`, and a warning for a --train-len too narrow to read with (issue 50: --train-len 8 was taken
    without a word), said once: the run checks again, silently."""
    window = choice.check()
    train_len = choice.settings.train_len
    if train_len is not None and train_len < min(MIN_TRAIN_LEN, window // 4) and choice.methods != (UNPATCHED,):
        warn(f"--train-len {train_len} keeps positions within {train_len} tokens, about a sentence: answers lose "
             f"their sense that narrow (the model's window is {window}; the README's try-out narrows SmolLM2's "
             "8192 to 1024)")


def check_first(choice: ModelChoice, source: str) -> None:
    """The settings against the model's window, then the document's path: a typo costs no wait."""
    from ..documents import check_source

    checked(choice)
    check_source(source)


def read_first(choice: ModelChoice, source: str, reading: Reading) -> "Document":
    """The settings checked, then the document read (an image-only PDF, a binary file or an empty one refused),
    all before the run imports torch; the run takes the document as read."""
    checked(choice)
    return read(source, reading)


def read(source: str, reading: Reading) -> "Document":
    """The document, with a bar over its pages and its warnings on stderr (pypdf's own notes on a damaged file kept
    off it: the warnings say what matters)."""
    from ..documents import read_document

    with _quiet_pdf_reader(), display.progress_bar("Pages") as bar:
        document = read_document(source, password=reading.password, progress=bar, max_bytes=reading.max_bytes,
                                 allow_partial=reading.allow_partial)
    for warning in document.warnings:
        warn(warning)
    return document


@contextmanager
def _quiet_pdf_reader() -> Iterator[None]:
    """pypdf's logger at ERROR while the block runs (it notes every repair it makes to a damaged PDF)."""
    logger = logging.getLogger("pypdf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def batch_documents(specs: list[str], out: str | None, choice: ModelChoice) -> tuple[list[Path], "ResultsFile"]:
    """A batch's documents and results file (this process's part of it under a launcher), after the checks that
    need no model: --out given, the settings, the documents found. The results file is not yet looked into."""
    from .batch_inputs import expand_documents
    from .launcher import Rank
    from .results_file import ResultsFile

    if not out:
        raise ConfigError("several documents need --out FILE.jsonl for their results")
    choice.check()
    results = ResultsFile(Path(out), Rank.from_environment())
    documents = [document for document in expand_documents(specs) if not results.is_output(document)]
    if not documents:
        raise InputError(f"no documents in {' '.join(specs)} besides --out")
    return documents, results


def check_batch(specs: list[str], out: str | None, choice: ModelChoice) -> None:
    """Everything `batch_documents` checks, and that --out is a gali results file (or new) and can be written: a
    file of something else is refused untouched, before torch loads."""
    if out:
        checked(choice)  # its warning here, once; the run checks again
    batch_documents(specs, out, choice)[1].prepare()


def check_serving(choice: ModelChoice) -> None:
    """gali serve's extra installed (one line saying what to install), then the settings, before anything loads."""
    from ..server import require_extra

    require_extra()
    checked(choice)
