"""Putting a method into a loaded model and taking it out: the one module between the methods' registry
(methods/registry.py) and the seam with transformers (engine/seam/hooks.py).

A method patches a loaded model in place; `apply_method` first removes whatever was applied before, so one loaded
model can run them all in turn. Each method also says where a forward may be cut without changing the results, and
`prefill_spans` turns that into the forwards every prefill runs (conversation, server, ppl, batch, benchmarks).
`apply_gali`, `remove_gali` and `gali_settings` are the library's GALI-only calls.
"""

from bisect import bisect_right
from collections.abc import Iterable

from transformers import PreTrainedModel

from .compat import warn_if_untested
from .config import GaliConfig, MethodSettings
from .engine.seam.hooks import install, installed_method, llama_model, uninstall
from .errors import GaliError
from .generate import forward_spans
from .methods.gali import Gali
from .methods.registry import REGISTRY, get_method
from .methods.resolving import train_len_of
from .methods.rope_scaling import rescale, restore
from .model.families import default_train_len


def apply_method(model: PreTrainedModel, name: str, settings: MethodSettings, input_tokens: int) -> dict:
    """Run `model` with method `name` from now on (replacing any other); returns the settings it resolved."""
    method = get_method(name)
    train_len = train_len_of(model.config, settings)
    warn_if_untested()
    remove_method(model)
    resolved = method.resolve(model.config, settings, train_len, input_tokens)  # before touching the model
    if method.rope is not None:
        return {"train_len": train_len, **rescale(llama_model(model), method.rope, resolved["factor"], train_len)}
    if method.attention is not None:
        install(model, method.attention(model.config, settings, resolved))
    return resolved


def remove_method(model: PreTrainedModel) -> None:
    """Back to the unpatched model, whichever method was applied."""
    if installed_method(model) is not None:
        uninstall(model)
    restore(llama_model(model))


def prefill_spans(model: PreTrainedModel, name: str, start: int, stop: int, cuts: Iterable[int] = (),
                  step: int | None = None) -> list[tuple[int, int]]:
    """The forwards a prefill of tokens [start, stop) runs with method `name` as applied to `model`: about `step`
    tokens each (default: the method's own `step`, e.g. 8 GALI chunks, else the model's window; at least 256),
    ending only where the method allows, and at each of `cuts` (unless the method needs the whole input in one
    forward). A method with a `plan` (GALI) keeps it for its forwards.
    """
    method, installed = get_method(name), installed_method(model)
    cuts = sorted({cut for cut in cuts if start < cut < stop}) if REGISTRY[name].prefix_reusable else []
    planned = method.plan or method.boundaries  # planned once, here: GALI's forwards take their chunks from it
    ends = planned(installed, start, stop, cuts) if planned else None
    step = step or max(256, method.step(installed) if method.step else 8 * (model.config.max_position_embeddings // 8))
    spans, ends = [], None if ends is None else sorted(ends)
    for first, last in zip([start, *cuts], [*cuts, stop]):  # the ends within each stretch by bisection: many cuts
        spans += forward_spans(first, last, step,  # (a prompt of many messages) stay linear
                               None if ends is None else ends[bisect_right(ends, first):bisect_right(ends, last)])
    return spans


def forward_ends(model: PreTrainedModel, name: str, start: int, stop: int) -> list[int] | None:
    """Token indices in (start, stop] where a forward of method `name` (as applied to `model`) may end without
    changing the results; None: anywhere."""
    boundaries = get_method(name).boundaries
    return boundaries(installed_method(model), start, stop, []) if boundaries else None


def apply_gali(model: PreTrainedModel, config: GaliConfig | None = None) -> PreTrainedModel:
    """Patch a transformers model of a supported family in place so that it reads inputs longer than its training
    window with GALI.

    Inputs up to `train_len` tokens run exactly as before. Applying again replaces the settings.

    Returns:
        The same model, for chaining.
    """
    llama_model(model)
    resolved = (config or GaliConfig()).resolved(default_train_len(model.config))  # before touching the model
    install(model, Gali(resolved))
    return model


def remove_gali(model: PreTrainedModel) -> PreTrainedModel:
    """Undo `apply_gali`: the original rotary module, attention implementation and no hook."""
    if not isinstance(installed_method(model), Gali):
        raise GaliError("remove_gali: GALI is not applied to this model")
    uninstall(model)
    return model


def gali_settings(model: PreTrainedModel) -> GaliConfig | None:
    """The resolved settings GALI runs with on `model`, or None when it is not applied."""
    method = installed_method(model)
    return method.config if isinstance(method, Gali) else None
