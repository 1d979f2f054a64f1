"""gali ppl on one document: each method's perplexity at each length, in one pass per method."""

import os
import time
from collections.abc import Callable

import torch

from .. import display, plots, tables
from ..display import print_json, say
from ..documents import Document
from ..engine.seam.packed_modules import model_device
from ..errors import InputError
from ..estimate import JobClock
from ..generate import peak_memory_bytes, reset_peak_memory
from ..loading import LoadedModel
from ..methods.registry import DEFAULT
from ..methods.resolving import kept_window
from ..patching import apply_method, forward_ends, prefill_spans
from ..perplexity import Perplexity, perplexities
from ..prompts import check_prompt_characters, check_prompt_length, text_ids
from .choices import ModelChoice, Reading
from .common import (
    announcing,
    entry_point,
    facts,
    load,
    own_window,
    prompt_limit,
    say_input,
    say_threads,
    with_windows,
)


@entry_point
def perplexity(document: Document, choice: ModelChoice, reading: Reading, max_tokens: int | None,
               lengths: list[int], json_output: bool, csv: bool, plot: str | None, verbose: bool) -> None:
    """Print the perplexity of `document` (a number, a table, CSV or JSON), and plot it against length if asked;
    the command line read the document before torch loaded."""
    choice.check()
    loaded = load(choice)
    limit = lengths[-1] if lengths else max_tokens
    ids, total = ppl_ids(loaded, document, limit, prompt_limit(loaded, reading))
    if total > len(ids):
        say(f"Evaluating the first {limit} of {total} tokens ({'--lengths' if lengths else '--max-tokens'}).")
    if verbose:
        say_threads()
    rows, settings = [], {}
    clock = JobClock([(method, len(ids)) for method in choice.methods]) if len(choice.methods) > 1 else None
    for method in choice.methods:
        say_input(loaded, method, document, len(ids), choice.settings.train_len)
        settings[method], results = method_perplexities(loaded, ids, method, choice, lengths or [len(ids)], verbose,
                                                        clock=clock)
        rows += [{"method": method, "length": result.length, "ppl": result.ppl} for result in results]
    rows = with_windows(rows, choice.settings.train_len, loaded.train_len)
    single = len(rows) == 1 and not lengths
    if json_output:
        about = facts(choice.model, ",".join(choice.methods), settings, document)
        own = {"window": rows[0]["window"]} if "window" in rows[0] else {}
        print_json({"ppl": rows[0]["ppl"], "tokens": len(ids), **about, **own} if single else
                   {"results": rows, "tokens": len(ids), **about})
    else:
        print_rows(rows, csv, single)
    if plot:
        window = kept_window(DEFAULT, choice.settings.train_len, loaded.train_len)
        title = plots.plot_title(f"Perplexity of {os.path.basename(document.name)}", choice.model,
                                 choice.settings.train_len, loaded.train_len)
        plots.plot_ppl(rows, plot, title, window)
        say(f"Saved {plot}.")


def ppl_ids(loaded: LoadedModel, document: Document, limit: int | None, bound: int | None = None
            ) -> tuple[list[int], int]:
    """The document's first `limit` tokens (the tokenizer's default special tokens), and how many it has; an
    InputError when those passes `bound` (--max-prompt-tokens): before tokenizing, where the text's characters alone
    pass it and no --max-tokens below the bound keeps fewer."""
    if limit is None or (bound is not None and limit > bound):
        check_prompt_characters(loaded.tokenizer, len(document.text), bound, document.name)
    ids = text_ids(loaded.tokenizer, document.text, add_special_tokens=True)
    if len(ids) < 2:
        raise InputError(f"{document.name} has {len(ids)} token(s); perplexity needs at least 2")
    kept = ids[:limit] if limit else ids
    check_prompt_length(len(kept), bound, document.name)
    return kept, len(ids)


def method_perplexities(loaded: LoadedModel, ids: list[int], method: str, choice: ModelChoice, lengths: list[int],
                        verbose: bool, show_progress: bool = True, clock: JobClock | None = None,
                        progress: Callable[[int, int, float], None] | None = None) -> tuple[dict, list[Perplexity]]:
    """Apply `method` for these tokens and measure PPL at `lengths` in one pass; returns its settings and results.
    `clock`: the run's methods, this one the next of them: the bar and a line when it is done say "k/N" and how
    long the rest should take. Without `show_progress`, `progress` hears (done, total, ppl) instead of a bar of its
    own (batch mode's bar shows the document's)."""
    device = model_device(loaded.model)
    settings = apply_method(loaded.model, method, choice.settings, len(ids))
    spans = prefill_spans(loaded.model, method, 0, len(ids))
    boundaries = forward_ends(loaded.model, method, 0, len(ids))
    reset_peak_memory(device)
    started = time.perf_counter()
    label = display.method_label(method, own_window(method, choice.settings.train_len, loaded.train_len))
    step = f"[{clock.done + 1}/{clock.total}] " if clock else ""
    left = (lambda done, total: clock.seconds_left(done / total)) if clock else None
    with display.progress_bar(step + label) as bar:
        results = perplexities(loaded.model, torch.tensor([ids], device=device), lengths, spans,
                               announcing(bar.with_figure("ppl", left), loaded) if show_progress else progress,
                               boundaries, loaded.kv_dtype)
    seconds = time.perf_counter() - started
    if clock:
        clock.finish()
        rest = clock.seconds_left()
        say(f"{step}{label}: done in {display.elapsed(seconds)}"
            + (f"; {clock.total - clock.done} more, {display.time_left(rest)}" if clock.done < clock.total
               and rest is not None else ""), style="dim")
    if verbose:
        say(f"{method}: {len(ids)} tokens in {seconds:.2f} s ({len(ids) / seconds:.0f} tokens/s); "
            f"peak memory {peak_memory_bytes(device) / 2**30:.2f} GiB")
    return settings, results


def print_rows(rows: list[dict], csv: bool, single: bool) -> None:
    """PPL rows on stdout: the number alone for one, else a table (or CSV)."""
    if csv:
        tables.print_ppl_csv(rows)
    elif single:
        display.print_number(rows[0]["ppl"])
    else:
        tables.print_ppl_table(rows)
