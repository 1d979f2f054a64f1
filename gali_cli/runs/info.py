"""gali info: the model, the machine and the settings, without loading weights, and without importing torch or
transformers where they are not needed to tell (model/machine.py, model/config.py): it answers at once. With
--check, the engine's self-check on the device (which needs torch)."""

import itertools
import os
import time

from .. import display, tables
from ..compat import TESTED_TRANSFORMERS, installed_transformers
from ..display import print_json, say
from ..engine.attention.plan import decide
from ..errors import GaliError
from ..methods.registry import PREVIEWED, REGISTRY
from ..model.config import ModelConfig, read_model_config
from ..model.machine import environment_facts, kv_storage
from .choices import ModelChoice


def show_info(choice: ModelChoice, json_output: bool, check: bool = False, verbose: bool = False) -> None:
    """What is known without the model, then its architecture and the settings GALI (and the other methods chosen,
    where they are known before the input) would use; with `check`, the engine's self-check on the device (no model
    needed: it runs even when the model cannot load). `verbose`: every attention route, and the path noise would
    take when it is off, and how a decoded token runs (which asks torch and the kernels)."""
    noise = bool(choice.settings.gali().noise)
    facts = {"model": choice.model, **environment_facts(choice.device, choice.dtype, _noisy_words),
             "quantization": choice.quantize, "method": ",".join(choice.methods)}
    facts["kv_dtype"] = kv_storage(choice.kv_dtype, facts["dtype"])
    if not noise and not verbose:
        del facts["noisy_attention"]  # which kernel noise would take: not a fact of this run
    # The routes a forward takes here, from the plan the engine decides by (engine/attention/plan.py), not restated.
    plan = decide(facts["device"], facts["dtype"], forward_only=True, noise=noise)
    facts["attention"] = plan.summary()
    if verbose:
        facts["attention_routes"] = plan.describe()
    try:
        config = read_model_config(choice.model)
    except GaliError:
        if not check:
            tables.print_facts(facts, json_output)  # what is known without the model, then the error
            raise
        config = None
    if config is not None:
        facts |= {**config.facts(), "kv_mib_per_1k_tokens": round(1000 * _token_bytes(config, facts) / 2**20, 1),
                  **_previews(choice, config.train_len),
                  "max_prompt_tokens": _holdable(config, facts)}
        if verbose:
            facts["decoding"] = _decoding(choice, config, facts)
    if not check:
        tables.print_facts(facts, json_output)
        return
    from ..loading import resolve_device

    device = resolve_device(choice.device)
    if not json_output:
        tables.print_facts(facts, json_output)
    checks = run_self_check(device, json_output)
    if json_output:
        print_json({**facts, "check": {"device": str(device), "checks": [
            {"name": item.name, "seam": item.seam, "ok": item.ok, "max_error": item.error, "tolerance": item.tolerance,
             "seconds": item.seconds} for item in checks]}})
    failed = [item for item in checks if not item.ok]
    if failed and all(item.seam for item in failed):  # the attention paths hold: transformers hands them wrong input
        raise GaliError(f"self-check: {len(failed)} of {len(checks)} checks failed; the transformers seam fails "
                        f"(see above): gali's answers would be wrong with transformers {installed_transformers()}; "
                        f"pip install 'transformers{TESTED_TRANSFORMERS}'")
    if failed:
        raise GaliError(f"self-check: {len(failed)} of {len(checks)} checks failed on {device} (see above); "
                        f"GALI_KERNEL=torch runs the PyTorch path")


def run_self_check(device, json_output: bool) -> list:
    """The transformers seam (seam_check.py, on the CPU: it checks transformers' plumbing, not a device), then
    engine/checks/self_check.py on `device`; each check shown as it completes (unless the output is JSON)."""
    from ..engine.checks.self_check import self_check
    from ..seam_check import seam_checks

    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    started = time.perf_counter()
    if not json_output:
        if device.type != "cpu":
            say(f"self-check: checking the GPU paths on {device}")
        elif interpreted:
            say("self-check: no GPU here: checking the CPU paths, and the Triton kernels under TRITON_INTERPRET=1 "
                "(slow)")
        else:
            say("self-check: no GPU here: checking the CPU paths")
            say("(TRITON_INTERPRET=1 adds the Triton kernels, interpreted)", style="dim")
    checks = []
    for item in itertools.chain(seam_checks(), self_check(device, triton_interpreted=interpreted)):
        checks.append(item)
        if not json_output:
            tables.print_check(item)
    if not json_output:
        passed = sum(item.ok for item in checks)
        say(f"self-check: {passed} of {len(checks)} passed in {display.elapsed(time.perf_counter() - started)}")
    return checks


def _token_bytes(config: ModelConfig, facts: dict) -> int:
    """One token's keys and values in every layer, in the dtype the KV cache stores them in here (--kv-dtype)."""
    from ..estimate import kv_bytes

    return kv_bytes(config.layers, config.kv_heads, config.head_dim, 4 if facts["kv_dtype"] == "float32" else 2)


def _holdable(config: ModelConfig, facts: dict) -> int | None:
    """The prompt length the answering commands read at most by default here (runs/common.prompt_limit, which
    measures the free memory with the model loaded: here its weights, where known, are taken from it), or None on a
    GPU, whose free memory only torch can tell (gali info answers without it)."""
    from types import SimpleNamespace

    from ..estimate import free_memory, holdable_tokens

    if facts["device"] != "cpu":
        return None
    free = free_memory(SimpleNamespace(type="cpu")) - (config.weights_bytes or 0)
    return holdable_tokens(_token_bytes(config, facts), config.train_len, max(free, 0))


def _previews(choice: ModelChoice, window: int) -> dict:
    """The settings of the chosen methods that say theirs before an input: from the model's window alone, or from
    its config (torch and transformers are imported for those only)."""
    previews = {method: REGISTRY[method].window_preview(choice.settings, window) for method in choice.methods
                if REGISTRY[method].window_preview}
    previewed = [method for method in choice.methods if method in PREVIEWED]
    if not previewed:
        return previews
    from ..loading import load_config
    from ..methods.resolving import preview_method

    config = load_config(choice.model)
    return previews | {method: preview_method(config, method, choice.settings) for method in previewed}


def _decoding(choice: ModelChoice, config: ModelConfig, facts: dict) -> str:
    """How a decoded token runs here for each chosen method (`gali info -v`): the static step with its attention's
    route (and the projections multiplied as bytes on a GGUF's grids, on the native route), or eager and why, as
    engine/attention/decode_route.py decides. What only the loaded model and its KV cache can tell
    (static_decode.why_not_static: a model spread over devices, a cache not gali's) is left to the run."""
    import torch

    from ..engine.attention import decode_route
    from ..model.config import resolve_source

    device, asked = torch.device(facts["device"]), decode_route.decode_choice()
    route = decode_route.attention_route(device, getattr(torch, facts["dtype"]), config.head_dim,
                                         config.heads // config.kv_heads)
    gguf = resolve_source(choice.model).gguf is not None
    rope_type = str(config.rope.get("rope_type", "default"))
    words = {}
    for method in choice.methods:
        remaps = _places_keys(method)
        if asked == "eager":
            why = "GALI_DECODE=eager"
        elif config.no_static_step:
            why = config.no_static_step
        elif not remaps and (not REGISTRY[method].static_step or "dynamic" in rope_type):
            why = decode_route.DYNAMIC_ROPE  # a rope-scaling method without the step: its frequencies follow the length
        elif not REGISTRY[method].static_step:
            why = decode_route.no_static_step(method)
        elif asked == "auto" and not decode_route.static_pays(device.type, route, remaps):
            why = decode_route.NOT_PAYING
        else:
            why = None
        words[method] = f"eager ({why})" if why else ", ".join(
            ["static step" + (" as a CUDA graph" if device.type == "cuda" else ""), decode_route.ROUTE_WORDS[route],
             *(["the projections as bytes on the GGUF's grids"] if route == "native" and gguf else [])])
    if len(set(words.values())) == 1:
        return next(iter(words.values()))
    return "; ".join(f"{method}: {said}" for method, said in words.items())


def _places_keys(method: str) -> bool:
    """Whether `method` installs an attention of its own (the unpatched model and the rope-scaling methods do not)."""
    from ..methods.registry import get_method

    return get_method(method).attention is not None


def _noisy_words(device: str, dtype: str) -> str:
    """The path noisy attention takes on `device` in `dtype`, in the words of the engine's plan."""
    return decide(device, dtype, forward_only=True, noise=True).noisy_words()
