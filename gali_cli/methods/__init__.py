"""The length-extrapolation methods gali can run a Llama with, behind one interface.

A method patches a loaded model in place and says where a forward may be cut without changing the results
(GALI: only at its chunk boundaries, since every forward is cut into chunks at its own end too).
"""

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedModel

from ..config import GaliConfig
from ..errors import ConfigError
from ..patch import apply_gali, gali_settings
from ..positions import chunk_plan


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    apply: Callable[[PreTrainedModel, GaliConfig], None]
    # Token indices in (start, stop] where a forward over [start, stop) may end; None: anywhere.
    boundaries: Callable[[PreTrainedModel, int, int], list[int]] | None = None


def _gali_boundaries(model: PreTrainedModel, start: int, stop: int) -> list[int]:
    settings = gali_settings(model)
    return [last for _, last in chunk_plan(start, stop, settings.train_len, settings.chunk_size)]


METHODS = {
    "gali": Method("gali", "Greedy Attention Logit Interpolation", lambda model, config: apply_gali(model, config),
                   _gali_boundaries),
    "original": Method("original", "the unpatched model: positions simply run past train_len",
                       lambda model, config: None),
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ConfigError(f"--method must be one of {', '.join(METHODS)}; got {name!r}")
    return METHODS[name]
