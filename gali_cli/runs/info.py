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
from ..methods.registry import PREVIEWED
from ..model.config import ModelConfig, read_model_config
from ..model.machine import environment_facts
from . import ModelChoice


def show_info(choice: ModelChoice, json_output: bool, check: bool = False, verbose: bool = False) -> None:
    """What is known without the model, then its architecture and the settings GALI (and the other methods chosen,
    where they are known before the input) would use; with `check`, the engine's self-check on the device (no model
    needed: it runs even when the model cannot load). `verbose`: every attention route, and the path noise would
    take when it is off."""
    noise = bool(choice.settings.gali().noise)
    facts = {"model": choice.model, **environment_facts(choice.device, choice.dtype, _noisy_words),
             "quantization": choice.quantize, "method": ",".join(choice.methods)}
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
                  "gali": choice.settings.gali().resolved(config.train_len).facts(), **_previews(choice),
                  "max_prompt_tokens": _holdable(config, facts)}
    if not check:
        tables.print_facts(facts, json_output)
        return
    from ..model.loading import resolve_device

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
    """One token's keys and values in every layer, in the dtype the model computes in here."""
    from ..estimate import kv_bytes

    return kv_bytes(config.layers, config.kv_heads, config.head_dim, 4 if facts["dtype"] == "float32" else 2)


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


def _previews(choice: ModelChoice) -> dict:
    """The settings of the chosen methods whose settings follow the model's config (torch and transformers are
    imported for them only)."""
    previewed = [method for method in choice.methods if method in PREVIEWED]
    if not previewed:
        return {}
    from ..methods.resolving import preview_method
    from ..model.loading import load_config

    config = load_config(choice.model)
    return {method: preview_method(config, method, choice.settings) for method in previewed}


def _noisy_words(device: str, dtype: str) -> str:
    """The path noisy attention takes on `device` in `dtype`, in the words of the engine's plan."""
    return decide(device, dtype, forward_only=True, noise=True).noisy_words()
