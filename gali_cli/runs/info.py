"""gali info (the model, the machine and the settings, without loading weights; with --check, the engine's
self-check) and gali cache list / clear."""

import os

from .. import display
from ..display import print_json, say
from ..errors import GaliError
from ..loading import environment_facts, load_config, model_facts, resolve_device
from . import ModelChoice
from .common import entry_point, store


@entry_point
def show_info(choice: ModelChoice, json_output: bool, check: bool = False) -> None:
    """What is known without the model, then its architecture and the GALI settings that would be used; with
    `check`, the engine's self-check on the device (no model needed: it runs even when the model cannot load)."""
    facts = {"model": choice.model, **environment_facts(choice.device, choice.dtype),
             "quantization": choice.quantize, "method": ",".join(choice.methods)}
    try:
        config = load_config(choice.model)
    except GaliError:
        if not check:
            display.print_facts(facts, json_output)  # what is known without the model, then the error
            raise
        config = None
    if config is not None:
        facts |= {**model_facts(config), "gali": choice.settings.gali().resolved(config.max_position_embeddings).facts()}
    if not check:
        display.print_facts(facts, json_output)
        return
    device = resolve_device(choice.device)
    if not json_output:
        display.print_facts(facts, json_output)
    checks = run_self_check(device, json_output)
    if json_output:
        print_json({**facts, "check": {"device": str(device), "checks": [
            {"name": item.name, "ok": item.ok, "max_error": item.error, "tolerance": item.tolerance,
             "seconds": item.seconds} for item in checks]}})
    failed = [item for item in checks if not item.ok]
    if failed:
        raise GaliError(f"self-check: {len(failed)} of {len(checks)} checks failed on {device} (see above); "
                        f"GALI_KERNEL=torch runs the PyTorch path")


def run_self_check(device, json_output: bool) -> list:
    """engine/self_check.py on `device`, each check shown as it completes (unless the output is JSON)."""
    from ..engine.self_check import self_check

    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if not json_output:
        where = ("no GPU here: checking the CPU paths" + (", and the Triton kernel under TRITON_INTERPRET=1 (slow)"
                 if interpreted else " (TRITON_INTERPRET=1 adds the Triton kernel, interpreted)")
                 if device.type == "cpu" else f"checking the GPU paths on {device}")
        say(f"self-check: {where}")
    checks = []
    for item in self_check(device, triton_interpreted=interpreted):
        checks.append(item)
        if not json_output:
            display.print_check(item)
    if not json_output:
        passed = sum(item.ok for item in checks)
        say(f"self-check: {passed} of {len(checks)} passed")
    return checks


@entry_point
def list_cache(cache_dir: str | None, json_output: bool) -> None:
    """The cached document states, most recently used first."""
    cache = store(cache_dir)
    entries = cache.entries()
    if json_output:
        print_json({"directory": str(cache.directory), "limit_bytes": cache.limit,
                    "entries": [{"document": entry.document, "model": entry.model, "method": entry.method,
                                 "tokens": entry.tokens, "bytes": entry.size, "last_used": entry.last_used,
                                 "path": str(entry.path)} for entry in entries]})
    else:
        display.print_cache_entries(entries, cache.directory, cache.limit)


@entry_point
def clear_cache(cache_dir: str | None) -> None:
    """Delete every cached document state, and say how much that freed; GaliError if some could not be deleted."""
    cache = store(cache_dir)
    cleared = cache.clear()
    removed = (f"{len(cleared.removed)} cached document state{'s' if len(cleared.removed) != 1 else ''} "
               f"({cleared.removed_bytes / 2**20:.1f} MiB)")
    if not cleared.kept:
        say(f"Removed {removed} from {cache.directory}.")
        return
    path, _, reason = cleared.kept[0]
    if path == cache.directory:
        raise GaliError(f"cannot clear the document cache: {cache.directory}: {reason}")
    raise GaliError(f"removed {removed} from {cache.directory}, but not the other {len(cleared.kept)} "
                    f"({cleared.kept_bytes / 2**20:.1f} MiB): {reason} ({path})")
