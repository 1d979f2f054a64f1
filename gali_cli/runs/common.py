"""What the runs share: the checks before anything is read, reading, loading, the document cache, and the lines and
facts every answer reports."""

import contextlib
import dataclasses
import functools
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch
import transformers

from .. import display
from ..config import expand_home
from ..conversation import Conversation
from ..display import say, warn
from ..doc_cache import DocumentCache, default_directory, default_limit
from ..documents import Document
from ..engine.kernels.kernel_choice import kernel_choice
from ..errors import ConfigError, GaliWarning, ModelLoadError
from ..estimate import PrefillClock, duration, free_memory, holdable_tokens, kv_bytes_per_token
from ..generate import Finished
from ..loading import DTYPES, LoadedModel, load_model
from ..methods.resolving import kept_window
from ..model.machine import kv_override
from ..threads import cpu_threads, in_use
from .choices import ModelChoice, Reading
from .launcher import Rank

Params, Result = ParamSpec("Params"), TypeVar("Result")


def entry_point(run: Callable[Params, Result]) -> Callable[Params, Result]:
    """A run the command line calls: library chatter kept off stderr while it runs, on the CPU threads its
    ModelChoice asks for (gali_cli.threads), and CUDA running out of memory reported as what it is, with what to
    change."""

    @functools.wraps(run)
    def quietly(*args: Params.args, **kwargs: Params.kwargs) -> Result:
        choice = next((value for value in (*args, *kwargs.values()) if isinstance(value, ModelChoice)), None)
        with _quiet_libraries(), cpu_threads(choice.threads) if choice else contextlib.nullcontext():
            try:
                return run(*args, **kwargs)
            except torch.cuda.OutOfMemoryError:
                raise ModelLoadError("CUDA ran out of memory: try --quantize 4bit or a smaller --chunk-size") from None
            except (MemoryError, RuntimeError) as error:  # the CPU's: exit 4 as documented, not "unexpected" (1)
                if not out_of_memory(error):
                    raise
                raise ModelLoadError("ran out of memory (RAM): try a smaller --chunk-size, or a shorter input "
                                     "(--max-prompt-tokens bounds it before reading)") from None

    return quietly


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the CPU running out of memory: Python's MemoryError, or the RuntimeError torch's CPU
    allocator raises ("DefaultCPUAllocator: can't allocate memory", "... not enough memory" on Windows)."""
    said = str(error)
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and "DefaultCPUAllocator" in said
                                              and ("allocate memory" in said or "not enough memory" in said))


@contextmanager
def _quiet_libraries() -> Iterator[None]:
    """Keep library chatter (retries, repaired PDFs, per-call quantization notes) off the user's stderr, and show
    gali's own warnings (GaliWarning) as one "warning:" line; all as it was afterwards."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "pypdf", "bitsandbytes")]
    levels = [logger.level for logger in loggers]
    verbosity, progress_bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    with warnings.catch_warnings():  # restores the filters and warnings.showwarning
        show_other = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            if issubclass(category, GaliWarning):
                warn(str(message))
            else:
                show_other(message, category, filename, lineno, file, line)

        warnings.filterwarnings("ignore", module="bitsandbytes")
        warnings.showwarning = show
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            transformers.logging.set_verbosity(verbosity)
            if progress_bars:
                transformers.logging.enable_progress_bar()
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def load(choice: ModelChoice, rank: Rank | None = None) -> LoadedModel:
    """The model, its KV caches to store keys and values as --kv-dtype says; under a launcher, on this process's own
    GPU (local rank, modulo the GPUs it can see)."""
    gpu = rank.local_rank % max(1, torch.cuda.device_count()) if rank and rank.distributed else None
    kernel_choice()  # a mistyped GALI_KERNEL fails now, not after the model has loaded
    with display.status(f"Loading {choice.model}"):
        loaded = load_model(choice.model, choice.quantize, choice.device, choice.dtype, gpu=gpu,
                            notice=lambda message: say(message, style="dim"))
    stored = kv_override(choice.kv_dtype)
    return loaded if stored is None else dataclasses.replace(loaded, kv_dtype=DTYPES[stored])


def store(directory: str | None) -> DocumentCache:
    """The document cache in `directory` (--cache-dir), or in the user cache directory."""
    setting = "GALI_CACHE_DIR" if directory == os.environ.get("GALI_CACHE_DIR") else "--cache-dir"  # its envvar
    path = expand_home(directory, setting) if directory else default_directory()
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{setting} {path}: not a directory")
        above = next((folder for folder in path.parents if folder.exists()), None)  # where it would be made
        if above is not None and not above.is_dir():
            raise ConfigError(f"{setting} {path}: {above} is not a directory")
    except OSError as error:  # e.g. a folder on the way that gali may not enter
        raise ConfigError(f"{setting} {path}: {error.strerror or error}") from None
    return DocumentCache(path, default_limit(), warn)


def prompt_limit(loaded: LoadedModel, reading: Reading) -> int:
    """The longest prompt a command reads: --max-prompt-tokens, else what half the free memory holds for its keys
    and values (estimate.holdable_tokens; `gali serve` also bounds the reading time, which a local run shows and
    Ctrl-C stops)."""
    if reading.max_prompt_tokens is not None:
        return reading.max_prompt_tokens
    config = loaded.model.config
    return holdable_tokens(kv_bytes_per_token(config, loaded.stored_dtype.itemsize), config.max_position_embeddings,
                           free_memory(loaded.device))


def conversation(loaded: LoadedModel, choice: ModelChoice, document: Document, system: str | None,
                 cache: DocumentCache | None, max_prompt_tokens: int | None) -> Conversation:
    """A conversation about `document`, its notices (e.g. a document read again) dim on stderr."""
    return Conversation(loaded, choice.method, choice.settings, document.text, cache_name(document), system, cache,
                        notice=lambda message: say(message, style="dim"), max_prompt_tokens=max_prompt_tokens)


def cache_name(document: Document) -> str:
    """The name a document's cached state is listed under: its absolute path (symbolic links resolved, as batch
    mode names documents), whatever directory gali ran in; `gali cache list` shows it short."""
    return document.name if document.name == "<stdin>" else str(Path(document.name).resolve())


LONG_PREFILL = 300.0  # seconds: a prefill expected to take longer is announced with its estimate


def announcing(progress: Callable[..., None], loaded: LoadedModel) -> Callable[..., None]:
    """`progress` (a bar's (done, total, ...) callback), which also says once on stderr how long a prefill still
    needs when that is more than LONG_PREFILL: after two forwards (the first fit of gali_cli.estimate: "about"), or
    after a minute if the first forward alone takes that long (a lower bound: "at least")."""
    clock = PrefillClock(loaded.model.config)
    said = False

    def update(done: int, total: int, *figures: float) -> None:
        nonlocal said
        progress(done, total, *figures)
        left = clock.seconds_left(done, total)
        fitted = len(clock.forwards) >= 2 or time.perf_counter() - clock.started >= 60
        if left is not None and fitted and left >= LONG_PREFILL and not said:
            say(f"Reading {total:,} tokens: {'about' if clock.fitted else 'at least'} {duration(left)} to go at "
                f"this pace (measured on the first {done:,}; Ctrl-C stops)")
            said = True

    return update


def say_input(loaded: LoadedModel, method: str, document: Document, tokens: int, train_len: int | None = None) -> None:
    """One dim line on stderr: the document, its length, and how far past the window the method stays within that
    is: the model's, or a narrower --train-len (which the original model does not use, and the line says so)."""
    pages = f"{document.pages} page{'s' if document.pages != 1 else ''}, " if document.pages else ""
    window = kept_window(method, train_len, loaded.train_len)
    about = (f"the model's {window}-token window" if window == loaded.train_len else
             f"the {window}-token window of --train-len (the model's: {loaded.train_len})")
    own = own_window(method, train_len, loaded.train_len)
    label = f"{method}, unrestricted: --train-len {train_len} does not apply to it" if own else method
    say(f"{document.name}: {pages}{tokens} tokens, {tokens / window:.1f}x {about} ({label})", style="dim")


def own_window(method: str, train_len: int | None, model_window: int) -> int | None:
    """The model's own window where `method` reads with it although --train-len narrows the others' (the original
    model, which --train-len does not restrict), else None: what its label in tables and plots says."""
    return model_window if train_len is not None and train_len != model_window and kept_window(
        method, train_len, model_window) == model_window else None


def with_windows(rows: list[dict], train_len: int | None, model_window: int) -> list[dict]:
    """Result rows, those of a method that --train-len does not narrow (own_window) with its "window" in tokens."""
    return [{**row, "window": own} if (own := own_window(row["method"], train_len, model_window)) else row
            for row in rows]


def say_threads() -> None:
    """-v's line on the CPU threads the run uses and how OpenMP's wait (gali_cli.threads)."""
    chosen = in_use()
    if chosen is not None:
        say(chosen.describe(), style="dim")


def facts(model: str, method: str, settings: dict, document: Document) -> dict:
    """What a --json answer says about its input."""
    return {"model": model, "method": method, "settings": settings,
            "document": {"name": document.name, "kind": document.kind, "pages": document.pages}}


def finished_facts(finished: Finished) -> dict:
    """What a --json answer (or a batch record) says about its cost."""
    return {"finish_reason": finished.reason, "prompt_tokens": finished.prompt_tokens,
            "cached_tokens": finished.prompt_tokens - finished.prefilled_tokens,
            "generated_tokens": finished.generated_tokens,
            "prefill_tokens_per_second": round(finished.prefill_tokens_per_second, 2),
            "decode_tokens_per_second": (None if finished.decode_tokens_per_second is None
                                         else round(finished.decode_tokens_per_second, 2)),
            "decode_path": finished.decode_path or None,
            "peak_memory_mib": round(finished.peak_memory_bytes / 2**20, 1)}
