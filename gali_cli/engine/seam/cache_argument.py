"""The seam with transformers: how a Llama's forward takes its KV cache, in whichever release is installed.

transformers 5.24 renamed the forward's `past_key_values` to `cache` (keeping the old keyword as a deprecated alias),
and LlamaForCausalLM hands the cache to LlamaModel under the new name. A hook that read only the old name saw no
cache, took every forward to start at token 0, and computed wrong answers without a word. So nothing here assumes a
name: the cache is looked up under each name gali knows (by keyword, or by position through the forward's declared
signature), gali's own calls pass it under the name the installed release declares, and a release that declares
none of them is refused (`SeamError`, naming the release) instead of computed on. hooks.py adds the second guard:
the keys each attention receives must match the forward's extent.
"""

import functools
import inspect
from typing import Any

import transformers
from torch import nn

from ...compat import TESTED_TRANSFORMERS
from ...errors import GaliError

CACHE_NAMES = ("cache", "past_key_values")  # newest first: 5.24 renamed past_key_values to cache


class SeamError(GaliError):
    """transformers does not hand the hooks what they rely on: computing anyway would give wrong answers."""


def seam_error(problem: str) -> SeamError:
    """A SeamError that names the installed release and the tested range."""
    return SeamError(f"transformers {transformers.__version__}: {problem}; gali is tested with transformers "
                     f"{TESTED_TRANSFORMERS}")


@functools.cache
def forward_parameters(module_type: type[nn.Module]) -> tuple[str, ...]:
    """The names of `module_type.forward`'s parameters after `self`, as declared (through decorators that wrap it)."""
    return tuple(inspect.signature(module_type.forward).parameters)[1:]


def cache_parameter(module_type: type[nn.Module]) -> str:
    """The name `module_type.forward` takes its KV cache under in the installed release, or a SeamError."""
    declared = forward_parameters(module_type)
    for name in CACHE_NAMES:
        if name in declared:
            return name
    raise seam_error(f"{module_type.__name__}.forward takes its KV cache under none of the names gali knows "
                     f"({', '.join(CACHE_NAMES)})")


def with_cache(model: nn.Module, cache: Any) -> dict[str, Any]:
    """`cache` as the keyword argument `model`'s forward takes it under: `model(ids, **with_cache(model, cache))`."""
    return {cache_parameter(type(model)): cache}


def forward_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Every argument a forward pre-hook of `module` sees, by name (positional ones named from the declared
    signature), with the KV cache under "cache" whichever name it was given by (None when there is none)."""
    declared = forward_parameters(type(module))
    cache_parameter(type(module))  # the release must take a cache under a name gali knows
    given = {**dict(zip(declared, args)), **kwargs}
    caches = [given[name] for name in CACHE_NAMES if given.get(name) is not None]
    if len(caches) > 1:
        raise GaliError(f"the KV cache was given twice ({' and '.join(CACHE_NAMES)}): give it once")
    given["cache"] = caches[0] if caches else None
    return given


def cached_tokens(cache: Any) -> int:
    """How many tokens `cache` holds (a StaticCache answers with a live tensor), or a SeamError when it cannot say."""
    if cache is None:
        return 0
    length = getattr(cache, "get_seq_length", None)
    if length is None:
        raise seam_error(f"the KV cache ({type(cache).__name__}) has no get_seq_length()")
    return int(length())
